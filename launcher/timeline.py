"""A run's night across its nodes: ``ftlaunch report LOGDIR --events`` in words (every
node's events in one time order: what a post-mortem reads first), ``--plot timeline.png``
in one picture: steps over time for each node's log (from its ``progress`` events), failures
as red lines, recoveries as shaded spans (failure to ranks back), committed checkpoints as
ticks. The picture needs matplotlib (the optional extra ``ftlaunch[plot]``), drawn off-screen.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from launcher import UsageError

ROUTINE = frozenset({"progress", "checkpoint_shard", "shard_copied", "checkpoint_in_memory"})
"""Kinds logged for every step or save: left out of the merged list unless asked for."""


def merged(logs: Mapping[str, Sequence[Mapping[str, Any]]], routine: bool = False) -> list[str]:
    """One line per event of every log (a name -> its events), in time order, timed from
    the first: ``SECONDS  NAME  EVENT  field=value ...``."""
    rows = sorted(((e["ts"], name, e) for name, events in logs.items() for e in events
                   if routine or e["event"] not in ROUTINE), key=lambda row: row[0])
    t0 = rows[0][0] if rows else 0.0
    width = max((len(name) for name in logs), default=0)
    return [f"{ts - t0:9.3f}  {name:<{width}}  {e['event']}  " + " ".join(
        f"{k}={_shown(v)}" for k, v in e.items() if k not in ("v", "ts", "event"))
        for ts, name, e in rows]


def _shown(value: Any) -> str:
    if isinstance(value, str):
        return value
    return f"{value:.4g}" if isinstance(value, float) else json.dumps(value)


def plot(logs: Mapping[str, Sequence[Mapping[str, Any]]], out: Path) -> None:
    """``logs``: a name (a node's log directory) -> its events; the PNG goes to ``out``."""
    try:
        import matplotlib
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'ftlaunch[plot]'") from None
    matplotlib.use("Agg")
    from matplotlib import pyplot

    starts = [e["ts"] for events in logs.values() for e in events]
    t0 = min(starts) if starts else 0.0
    fig, ax = pyplot.subplots(figsize=(11, 4.5), dpi=100)
    for i, (name, events) in enumerate(logs.items()):
        color = f"C{i % 10}"
        for j, attempt in enumerate(_attempts(events)):  # a line per attempt: no line drawn
            ax.plot(*zip(*((t - t0, step) for t, step in attempt), strict=True),  # across
                    marker=".", linewidth=1, color=color,  # a failure
                    label=(Path(name).name or name) if j == 0 else None)
        failed_at = None
        for e in sorted(events, key=lambda e: e["ts"]):
            t = e["ts"] - t0
            if e["event"] in ("rank_failed", "rank_hung") or (
                    e["event"] == "recovering" and failed_at is None):
                ax.axvline(t, color="tab:red", linewidth=1, alpha=0.8)
                failed_at = t if failed_at is None else failed_at
            elif e["event"] == "recovered" and failed_at is not None:
                ax.axvspan(failed_at, t, color="tab:orange", alpha=0.25)
                failed_at = None
            elif e["event"] == "checkpoint_committed":
                ax.plot(t, e["step"], marker="|", color="tab:green", markersize=12)
    ax.set_xlim(left=0)
    ax.set_xlabel("seconds since the first event")
    ax.set_ylabel("step")
    ax.set_title("ftlaunch: steps, failures (red), recoveries (orange), commits (green)")
    if any(e["event"] == "progress" for events in logs.values() for e in events):
        ax.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    pyplot.close(fig)


def _attempts(events: Sequence[Mapping[str, Any]]) -> list[list[tuple[float, int]]]:
    """(time the step was first reported, step) of each attempt, cut at failures."""
    attempts: list[list[tuple[float, int]]] = [[]]
    for e in sorted(events, key=lambda e: e["ts"]):
        if e["event"] in ("rank_failed", "rank_hung", "recovering") and attempts[-1]:
            attempts.append([])
        elif e["event"] == "progress":
            attempts[-1].append((e.get("at", e["ts"]), e["step"]))
    return [a for a in attempts if a]
