"""Run one function over many items on a few plain threads. Torch-free.

Not ``concurrent.futures``: a checkpoint still being persisted when the interpreter exits
(the shim finishes it in an atexit handler) runs after concurrent.futures has shut down,
and its executors then refuse new work. Plain threads are still allowed there.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


class Parallel(Generic[Item, Result]):
    """``fn`` over ``items`` on ``threads`` threads, started at once; ``result()`` joins
    them and returns the results in order, or raises the first error (the remaining items
    are then skipped)."""

    def __init__(self, fn: Callable[[Item], Result], items: Sequence[Item], threads: int,
                 name: str = "ftlaunch-parallel"):
        self._fn, self._items = fn, items
        self._results: list[Result | None] = [None] * len(items)
        self._next, self._lock = 0, threading.Lock()
        self._error: BaseException | None = None
        self._threads = [threading.Thread(target=self._work, name=name, daemon=True)
                         for _ in range(max(1, min(threads, len(items))))]
        for thread in self._threads:
            thread.start()

    def _work(self) -> None:
        while True:
            with self._lock:
                index = self._next
                if index >= len(self._items) or self._error is not None:
                    return
                self._next += 1
            try:
                self._results[index] = self._fn(self._items[index])
            except BaseException as e:
                with self._lock:
                    self._error = self._error or e
                return

    def result(self) -> list[Result]:
        for thread in self._threads:
            thread.join()
        if self._error is not None:
            raise self._error
        return self._results  # type: ignore[return-value]  # every slot is filled
