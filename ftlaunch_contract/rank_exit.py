"""What a rank does just before its interpreter finalizes: let torch.distributed's gloo
worker threads finish, then freeze the heap so finalization does not traverse it.

Since torch 2.13 every c10d Work issued inside ``backward()`` (DDP's and FSDP's gradient
reductions) holds the autograd engine's ``contextvars.Context`` in its thread-local state,
and the gloo worker that drops the last reference to a finished Work takes the GIL to
release it. If that happens only after finalization began, CPython ends the thread with
pthread_exit, whose unwinding through torch's noexcept destructor is ``std::terminate``:
the rank, its work done, dies of SIGABRT ("terminate called without an active exception")
and is counted as failed. Before finalization, the main thread releases the GIL until no
gloo worker is runnable, so any such release is done.

Then ``gc.freeze()``: finalization's cyclic collections traverse every object alive, and
torch's import alone leaves hundreds of thousands; a finished rank spent 1.0-1.5 s of CPU in
them on a loaded 2-core node (0.3 s frozen, 0.03 s for the bare process exit;
scripts/bench_rank_exit.py, BENCHMARKS "Rank exit"). That time sits on the stop path of every
recovery that stops a rank and at the end of every job. Cyclic garbage left at exit is then
not collected: Python never promised ``__del__`` for objects alive at exit, and module
teardown still frees everything not in a cycle. Used by the shim at exit and by warm-pool
processes (unmodified scripts). Torch-free and launcher-free: it runs in every rank.
"""

from __future__ import annotations

import gc
import os
import sys
import time

SETTLE_TIMEOUT = 1.0
"""Longest wait for gloo's workers at exit; they need microseconds unless starved of CPU."""

GLOO_WORKER = "pt_gloo_runloop"  # the name torch gives ProcessGroupGloo's worker threads


def before_finalize() -> None:
    """The last thing a rank runs before its interpreter finalizes (see the module's doc)."""
    settle_gloo_workers()
    gc.freeze()


def settle_gloo_workers(timeout: float = SETTLE_TIMEOUT) -> bool:
    """Release the GIL until no gloo worker thread is runnable, seen twice in a row (a
    worker waiting for the GIL takes it as soon as we sleep, so it shows as runnable until it
    is done). True once settled; also True when torch.distributed is not in use."""
    if "torch.distributed" not in sys.modules:
        return True
    deadline = time.monotonic() + timeout
    quiet = 0
    while quiet < 2:
        workers = _threads_named(GLOO_WORKER)
        if not workers:
            return True
        time.sleep(0.002)
        quiet = 0 if any(_runnable(tid) for tid in workers) else quiet + 1
        if time.monotonic() > deadline:
            return False
    return True


def _threads_named(name: str) -> list[str]:
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:  # no procfs (macOS): nothing to look at
        return []
    found = []
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == name:
                    found.append(tid)
        except OSError:
            continue  # the thread ended meanwhile
    return found


def _runnable(tid: str) -> bool:
    return thread_state(tid) in ("R", "D")


def thread_state(tid: int | str) -> str:
    """A thread of this process, by kernel id: R running or runnable, S sleeping (waiting
    for something), D in uninterruptible I/O...; "?" if it is gone (or no procfs)."""
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return "?"

