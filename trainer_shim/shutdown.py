"""What must be done before the interpreter finalizes, so that a rank that finished its work
exits 0 (a finished rank that dies at exit is counted as failed and restarted).

``at_exit`` callbacks run first, newest first: checkpoint writers finish their writes and
join, then the agent link stops its listener. A daemon thread still running when
finalization starts is cut off wherever it next needs the GIL (CPython calls pthread_exit
there): a checkpoint half written, or native frames unwound. Then torch's gloo workers are
let finish and the heap is frozen (ftlaunch_contract/rank_exit.py says why).
"""

from __future__ import annotations

import atexit
import sys
from collections.abc import Callable

from ftlaunch_contract import rank_exit

_callbacks: list[Callable[[], None]] = []


def at_exit(callback: Callable[[], None]) -> None:
    """Run ``callback`` before the interpreter finalizes (newest first), then settle gloo."""
    _callbacks.append(callback)


def _run() -> None:
    while _callbacks:
        callback = _callbacks.pop()
        try:
            callback()
        except Exception as e:  # one failing closer must not keep the others from running
            print(f"trainer_shim: at exit: {e}", file=sys.stderr)
    rank_exit.before_finalize()


atexit.register(_run)
