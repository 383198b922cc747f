"""ftlaunch as a container's PID 1: a minimal init in front of the agent.

In a container ftlaunch is the entrypoint, so it is PID 1: every orphan in the container
(a rank's daemonized helper, a dataloader's grandchild) becomes its child, and the kernel
gives PID 1 no default signal actions. Without an init those orphans stay zombies. So PID 1
forks: the child goes on as the agent; PID 1 only forwards signals to it and reaps every
child that exits, and leaves with the agent's exit status, as tini would, without shipping
tini.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
"""The agent's default --signals-to-handle: another signal sent to PID 1 (USR1, say) is
not forwarded, as the agent would die of it."""


def become_init_if_pid1() -> None:
    """In PID 1: fork; the child returns and runs the agent, PID 1 never returns."""
    if os.getpid() != 1:
        return
    agent = os.fork()
    if agent == 0:
        return
    for sig in FORWARDED:  # kubelet's and scancel's SIGTERM go to PID 1: pass them on
        signal.signal(sig, lambda signum, _frame: _forward(agent, signum))
    sys.exit(reap_until(agent))


def reap_until(agent: int) -> int:
    """Reap every child, ours or re-parented, until ``agent`` exits; its exit code."""
    while True:
        try:
            pid, status = os.wait()  # a forwarded signal interrupts it; it is then retried
        except ChildProcessError:
            return 1  # the agent is gone without a status: cannot happen to a child
        if pid == agent:
            code = os.waitstatus_to_exitcode(status)
            return code if code >= 0 else 128 - code  # killed by signal N: 128 + N


def _forward(agent: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # exited already: its status is coming
        os.kill(agent, signum)
