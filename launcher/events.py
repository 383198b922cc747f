"""Job events: one JSON line each in ``<log-dir>/<run>/events.jsonl`` and one line on stderr."""

from __future__ import annotations

import json
import time
from pathlib import Path

from rich.console import Console
from rich.text import Text

_CONSOLE = Console(stderr=True, highlight=False, soft_wrap=True, emoji=False)


class EventLog:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = path.open("a", buffering=1)

    def emit(self, kind: str, text: str, console: bool = True, **fields) -> None:
        """Record ``kind`` with ``fields``; show ``text`` to the person watching (unless it
        is routine, like every checkpoint commit)."""
        self._file.write(json.dumps({"ts": time.time(), "event": kind, **fields}) + "\n")
        if not console:
            return
        style = "bold red" if kind in ("rank_failed", "job_failed") else "bold"
        _CONSOLE.print(Text.assemble(("ftlaunch: ", style), text))

    def close(self) -> None:
        self._file.close()


class PhaseClock:
    """Times the phases of one recovery: ``mark("stop")`` ends the phase named "stop"."""

    def __init__(self) -> None:
        self._start = self._last = time.monotonic()
        self.phases: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        now = time.monotonic()
        self.phases[phase] = round(now - self._last, 4)
        self._last = now

    @property
    def total(self) -> float:
        return self._last - self._start
