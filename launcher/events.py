"""Job events: one JSON line each in ``<log-dir>/<run>/events.jsonl`` and one line on stderr.

Every line is ``{"v": SCHEMA_VERSION, "ts": <unix time>, "event": <kind>, <fields>...}``;
``EVENTS`` lists every kind with the fields it may carry, and docs/events.md says what each
means (a test holds the three together: the code's emits, this table, the document).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.text import Text

_CONSOLE = Console(stderr=True, highlight=False, soft_wrap=True, emoji=False)
log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
EVENTS: dict[str, frozenset[str]] = {kind: frozenset(fields.split()) for kind, fields in {
    # the node and its ranks
    "gpu_health_monitor": "active",
    "rank_template_ready": "seconds",
    "rank_template_unsafe": "why",
    "rank_template_died": "returncode",
    "assigned": "epoch group_rank group_world_size world_size restart_count",
    "spare": "coordinator",
    "started": "world_size run_id",
    "progress": "step at",
    "rank_failed": "rank local_rank exit_code signal cause",
    "rank_hung": "rank reason stacks",
    "gpu_health": "gpu finding severity detail action",
    "gpu_memory_held": "pids",
    "node_unhealthy": "reason",
    # recoveries
    "recovering": "cause policy restart_count delay",
    "escalated": "ranks blocked_in stacks",
    "coordinator_lost": "lost successor",
    "coordinator_failed": "failure",
    "restore_pulled": "pulled failed seconds",
    "recovered": "restart_count seconds policy phases resumed forked fresh",
    # checkpoints
    "shard_copied": "purpose rank step source nbytes seconds",
    "shard_not_copied": "purpose rank step source reason",
    "checkpoint_shard": "rank step stage seconds",
    "checkpoint_committed": "step",
    "checkpoint_in_memory": "step",
    "checkpoint_persisted": "shards",
    # the end
    "signal": "signal",
    "grace_expired": "",
    "job_finished": "exit_code",
    "job_failed": "exit_code reason",
}.items()}
"""Every event kind and the fields it may carry (beyond v, ts and event)."""


def use_console(console: Console) -> None:
    """Print to ``console`` (the live status line's: every line goes above it)."""
    global _CONSOLE
    _CONSOLE = console


class EventLog:
    def __init__(self, path: Path, sink: Callable[[dict], None] | None = None):
        """``sink``: also gets every record (the node's metrics)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._sink = sink
        self._file = path.open("a", buffering=1)
        self._strict = bool(os.environ.get("FTLAUNCH_STRICT"))  # the test suite sets it

    def emit(self, kind: str, text: str, console: bool = True, **fields) -> None:
        """Record ``kind`` with ``fields``; show ``text`` to the person watching (unless it
        is routine, like every checkpoint commit)."""
        unknown = set(fields) - EVENTS[kind] if kind in EVENTS else {kind}
        if unknown:  # a bug: the event or field is not in the schema (EVENTS, docs/events.md)
            if self._strict:
                raise ValueError(f"event {kind}: {sorted(unknown)} not in the schema")
            log.error("event %s: %s not in the schema", kind, sorted(unknown))
        record = {"v": SCHEMA_VERSION, "ts": time.time(), "event": kind, **fields}
        self._file.write(json.dumps(record) + "\n")
        if self._sink is not None:
            self._sink(record)
        if not console:
            return
        style = "bold red" if kind in ("rank_failed", "job_failed") else "bold"
        _CONSOLE.print(Text.assemble(("ftlaunch: ", style), text))

    def close(self) -> None:
        self._file.close()


def load(path: Path) -> list[dict]:
    """The events of one log, skipping a torn last line (an agent killed mid-write)."""
    found = []
    for line in path.read_text().splitlines():
        try:
            found.append(json.loads(line))
        except ValueError:
            continue
    return found


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
