"""How a rank answers the agent's request for its stacks (a hung rank, before it is killed)."""

from __future__ import annotations

import faulthandler
import os

from ftlaunch_contract import environment


def register_stack_dump() -> bool:
    """Let the agent ask for all threads' stacks with a signal, even while we hold the GIL
    (the agent's env names the signal and the file); True if armed."""
    path = os.environ.get(environment.STACKS_FILE)
    signum = os.environ.get(environment.STACK_SIGNAL)
    if not (path and signum):
        return False
    stacks = open(path, "a")  # noqa: SIM115 - must stay open for the signal handler
    faulthandler.register(int(signum), file=stacks, all_threads=True)
    return True
