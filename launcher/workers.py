"""The worker supervisor: start this node's ranks, notice each exit at once, stop them cleanly.

Each rank runs in its own process group (so stopping a rank stops its children too), dies
with the agent (PR_SET_PDEATHSIG, plus the orphan guard for its children), and has a pidfd
the agent polls beside its sockets, so an exit is seen the moment it happens.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import select
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from launcher import failures
from launcher.config import StreamMode
from launcher.orphan_guard import OrphanGuard
from launcher.rank_env import Attempt, rank_env
from launcher.rank_output import Pump, RankStreams

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


def _become_rank(agent_pid: int) -> None:
    """Runs in the child between fork and exec: own process group, die with the agent."""
    os.setpgid(0, 0)
    _die_with(agent_pid)


def _die_with(agent_pid: int) -> None:
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != agent_pid:  # the agent died before prctl took effect
        os._exit(1)


def die_with_agent(agent_pid: int) -> Callable[[], None]:
    """A ``preexec_fn`` for helper processes of the agent: killed when the agent dies."""
    return functools.partial(_die_with, agent_pid)


@dataclass
class Rank:
    local_rank: int
    rank: int
    proc: subprocess.Popen
    pidfd: int
    error_file: str
    returncode: int | None = None


@dataclass(frozen=True)
class RankExit:
    rank: int
    local_rank: int
    returncode: int
    failure: failures.RankFailure | None  # None for a clean exit


@dataclass
class OutputPlan:
    """Where rank output goes: log directory, per-local-rank modes, console filter."""

    log_dir: Path
    modes: dict[int, tuple[StreamMode, StreamMode]]  # local rank -> (stdout, stderr)
    console: set[int] = field(default_factory=set)


class WorkerGroup:
    """This node's ranks for one attempt."""

    def __init__(self, attempt: Attempt, command: list[str], output: OutputPlan,
                 guard: OrphanGuard):
        self.attempt = attempt
        self._command = command
        self._output = output
        self._guard = guard
        self.ranks: dict[int, Rank] = {}  # by pidfd
        self._pumps: dict[int, Pump] = {}  # by fd
        self.attempt_dir = output.log_dir / f"attempt_{attempt.restart_count}"

    # --- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        for local_rank in range(self.attempt.local_world_size):
            rank = self.attempt.rank_offset + local_rank
            rank_dir = self.attempt_dir / str(local_rank)
            rank_dir.mkdir(parents=True, exist_ok=True)
            error_file = str(rank_dir / "error.json")
            streams = RankStreams(rank, rank_dir, self._output.modes[local_rank],
                                  local_rank in self._output.console)
            proc = subprocess.Popen(
                self._command, env=rank_env(self.attempt, local_rank, error_file),
                stdin=subprocess.DEVNULL, close_fds=True,
                preexec_fn=functools.partial(_become_rank, os.getpid()), **streams.popen_kwargs)
            streams.after_spawn()
            self._guard.watch(proc.pid)
            pidfd = os.pidfd_open(proc.pid)
            self.ranks[pidfd] = Rank(local_rank, rank, proc, pidfd, error_file)
            self._pumps.update((p.fd, p) for p in streams.pumps)

    def fds(self) -> list[int]:
        """Everything the agent should poll for this group: exits and output."""
        return [r.pidfd for r in self.alive()] + list(self._pumps)

    def alive(self) -> list[Rank]:
        return [r for r in self.ranks.values() if r.returncode is None]

    def on_readable(self, fd: int) -> RankExit | None:
        """Service one readable fd; returns the exit it reports, if it was a pidfd."""
        pump = self._pumps.get(fd)
        if pump is not None:
            if not pump.pump():
                del self._pumps[fd]
            return None
        rank = self.ranks.get(fd)
        if rank is None or rank.returncode is not None:
            return None
        return self._reap(rank)

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` to every live rank's whole process group."""
        for rank in self.alive():
            _killpg(rank.proc.pid, sig)

    def stop(self, timeout: float, tick: Callable[[], None] = lambda: None) -> None:
        """SIGTERM every rank, SIGKILL what is left after ``timeout``, reap all, drain output.

        ``tick`` runs at least every 0.2 s meanwhile (the agent keeps heartbeating)."""
        self.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while self.alive() and time.monotonic() < deadline:
            self.wait(min(0.2, deadline - time.monotonic()))
            tick()
        self.send_signal(signal.SIGKILL)
        while self.alive():
            self.wait(0.2)
            tick()
        self.close()

    def wait(self, timeout: float) -> list[RankExit]:
        """Block until something is readable (or ``timeout``) and service it."""
        readable, _, _ = select.select(self.fds(), [], [], max(0.0, timeout))
        exits = [self.on_readable(fd) for fd in readable]
        return [e for e in exits if e is not None]

    def close(self) -> None:
        """Drain and release output pipes and pidfds (ranks must already be reaped)."""
        deadline = time.monotonic() + 2.0  # bounded: an escaped grandchild may hold a pipe
        while self._pumps and time.monotonic() < deadline:
            readable, _, _ = select.select(list(self._pumps), [], [], deadline - time.monotonic())
            for fd in readable:
                if not self._pumps[fd].pump():
                    del self._pumps[fd]
        for fd in self._pumps:
            os.close(fd)
        self._pumps.clear()
        for rank in self.ranks.values():
            if rank.pidfd >= 0:
                os.close(rank.pidfd)
                rank.pidfd = -1

    def _reap(self, rank: Rank) -> RankExit:
        rank.returncode = rank.proc.wait()
        _killpg(rank.proc.pid, signal.SIGKILL)  # the rank is gone: so are its children
        self._guard.forget(rank.proc.pid)
        failure = None
        if rank.returncode != 0:
            failure = failures.from_returncode(rank.rank, rank.local_rank, rank.proc.pid,
                                               rank.returncode, rank.error_file)
        return RankExit(rank.rank, rank.local_rank, rank.returncode, failure)


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
