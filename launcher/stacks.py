"""Capture a hung rank's stacks before it is killed: py-spy if installed, else faulthandler.

py-spy reads the process from outside, so it works on a rank spinning with the GIL held;
faulthandler is the fallback every rank started by ftlaunch has armed (trainer_shim or the
rank template registers it on ``STACK_SIGNAL``), and it too runs without the GIL.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

STACK_SIGNAL = signal.SIGRTMIN + 6
"""Real-time signal the agent sends for a faulthandler dump; never sent to a rank that did
not register it (its default action would kill the rank)."""

PY_SPY_TIMEOUT = 10.0
FAULTHANDLER_WAIT = 1.0


def capture(pid: int, path: Path, method: str, armed: bool) -> str:
    """Write all threads' stacks of ``pid`` to ``path``; returns how (or why not)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)  # neither py-spy nor a signal handler reaches a stopped rank
    py_spy = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
    if method in ("auto", "py-spy") and py_spy:
        try:
            result = subprocess.run([py_spy, "dump", "--pid", str(pid)], capture_output=True,
                                    text=True, timeout=PY_SPY_TIMEOUT)
        except subprocess.TimeoutExpired:
            result = None
        if result is not None and result.returncode == 0:
            path.write_text(result.stdout)
            return f"py-spy dump in {path}"
    if method in ("auto", "faulthandler") and armed:
        size = path.stat().st_size if path.exists() else 0
        try:
            os.kill(pid, STACK_SIGNAL)
        except ProcessLookupError:
            return "not captured: the rank is gone"
        deadline = time.monotonic() + FAULTHANDLER_WAIT
        while time.monotonic() < deadline:
            time.sleep(0.02)  # faulthandler writes from its signal handler: nothing to wait on
            if path.exists() and path.stat().st_size > size:
                time.sleep(0.05)  # let it finish the other threads
                return f"faulthandler dump in {path}"
        return f"faulthandler did not answer within {FAULTHANDLER_WAIT:g}s"
    return "not captured" + ("" if method == "off" else " (no py-spy; rank did not arm faulthandler)")
