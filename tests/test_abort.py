"""The shim's abort: an exception raised in the training thread by its listener, and its
withdrawal, leave the interpreter as they found it."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT

AFTER_AN_ABORT = """\
import cProfile, threading
from trainer_shim.agent_link import raise_in, withdraw_abort
from trainer_shim.restart import RestartRequested

def call():
    return 1

try:
    raise_in(threading.get_ident(), RestartRequested)
    call()
except RestartRequested:
    print("delivered", flush=True)
withdraw_abort()  # as the shim leaves the training function: nothing is pending now
withdraw_abort()
profiler = cProfile.Profile()
profiler.enable()
call()
profiler.disable()
print("profiled call returned", flush=True)
"""


def test_withdrawing_an_abort_leaves_no_pending_flag_behind():
    """PyThreadState_SetAsyncExc(NULL), the obvious withdrawal, leaves CPython 3.11's flag
    for a pending exception set with nothing to deliver: the next call under a profiler
    spins for ever (this script then hangs at ``call()``)."""
    done = subprocess.run([sys.executable, "-c", AFTER_AN_ABORT], cwd=ROOT, timeout=60,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["delivered", "profiled call returned"], done.stdout
