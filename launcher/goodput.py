"""Goodput: how much of a job's wall time trained the model, and where the rest went.

Pure: one node's event log (``events.jsonl``, docs/events.md) in, an account out. The
timeline from the first event to the last is cut into consecutive pieces, each of one kind,
so the pieces add up to the wall time exactly:

- start-up: the first event until the first step is reported;
- productive: between two step reports of an attempt, for the steps no later attempt
  trains again;
- re-computed: the same for steps a later attempt trains again (it resumed from an older
  checkpoint); a piece whose steps straddle the resume point is split by steps;
- detection: the last step report of an attempt until its failure is known (a hang's
  whole length; for a crash, the steps the throttled reports did not show);
- recovery: the failure until the next attempt's first step report (the ``recovered``
  event's phases say where it went);
- shutdown: the last step report until the end (persisting checkpoints, the exit);
- checkpoint stalls: taken out of productive time, how long saves blocked training (per
  save, its slowest rank here: ``checkpoint_shard`` events of stage ``staged``).

Steps come from ``progress`` events (when each step was first reported), i.e. from
``trainer_shim.heartbeat``. Without them nothing is known of the training itself: the
account then says so and has no goodput.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

CAUSES = ("start-up", "detection", "recovery", "re-computed", "checkpoint stalls", "shutdown")
FAILURES = ("rank_failed", "rank_hung", "recovering", "coordinator_lost")  # an attempt ends
STARTS = ("started", "recovered")  # an attempt's ranks are up


@dataclass
class Account:
    wall: float = 0.0
    productive: float = 0.0
    lost: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CAUSES, 0.0))
    restarts: int = 0  # attempts that ended in a recovery (failures, departures, scale-ups)
    recovery_phases: dict[str, float] = field(default_factory=dict)
    steps: int = 0  # the highest step reported
    known: bool = True  # False without step reports: productive time cannot be told
    notes: list[str] = field(default_factory=list)

    @property
    def goodput(self) -> float | None:
        return self.productive / self.wall if self.known and self.wall > 0 else None

    def as_dict(self) -> dict[str, Any]:
        return {"wall_s": round(self.wall, 3), "productive_s": round(self.productive, 3),
                "goodput": None if self.goodput is None else round(self.goodput, 4),
                "lost_s": {k: round(v, 3) for k, v in self.lost.items()},
                "restarts": self.restarts,
                "recovery_phases_s": {k: round(v, 3) for k, v in self.recovery_phases.items()},
                "steps": self.steps, "known": self.known, "notes": self.notes}


@dataclass
class _Attempt:
    samples: list[tuple[float, int]] = field(default_factory=list)  # (ts, highest step)
    failed_at: float | None = None  # when its failure was known

    @property
    def resumed_from(self) -> int:
        """The step it restarted after (its first report is the step after it, or a few)."""
        return self.samples[0][1] - 1 if self.samples else -1


def account(events: Iterable[Mapping[str, Any]]) -> Account:
    """The goodput account of one node's events (in any order)."""
    log = sorted(events, key=lambda e: e["ts"])
    acc = Account()
    if not log:
        acc.known, acc.notes = False, ["no events"]
        return acc
    start, end = log[0]["ts"], log[-1]["ts"]
    acc.wall = end - start
    attempts = _attempts(log)
    acc.restarts = len(attempts) - 1
    for e in log:
        if e["event"] == "recovered":
            for phase, seconds in e.get("phases", {}).items():
                acc.recovery_phases[phase] = acc.recovery_phases.get(phase, 0.0) + seconds
    reported = [a for a in attempts if a.samples]
    if not reported:
        acc.known = False
        acc.notes.append("no step reports (the script does not call trainer_shim.heartbeat): "
                         "productive and re-computed time are unknown")
        acc.lost["start-up"] = next((e["ts"] for e in log if e["event"] == "started"), end) \
            - start
        acc.lost["recovery"] = sum(e.get("seconds", 0.0) for e in log
                                   if e["event"] == "recovered")
        return acc
    acc.steps = max(step for a in reported for _, step in a.samples)
    acc.lost["start-up"] = reported[0].samples[0][0] - start
    for k, attempt in enumerate(reported):
        later = [a.resumed_from for a in reported[k + 1:]]
        keep_up_to = min(later) if later else acc.steps  # steps past it are trained again
        for (t0, s0), (t1, s1) in zip(attempt.samples, attempt.samples[1:], strict=False):
            kept = _share_kept(s0, s1, keep_up_to)
            acc.productive += (t1 - t0) * kept
            acc.lost["re-computed"] += (t1 - t0) * (1 - kept)
        last = attempt.samples[-1][0]
        if k + 1 < len(reported):
            failed = attempt.failed_at if attempt.failed_at is not None else last
            failed = min(max(failed, last), reported[k + 1].samples[0][0])
            acc.lost["detection"] += failed - last
            acc.lost["recovery"] += reported[k + 1].samples[0][0] - failed
        else:
            acc.lost["shutdown"] += end - last
    stalls: dict[int, float] = {}  # a save's stall on this node: its slowest rank's
    for e in log:
        if e["event"] == "checkpoint_shard" and e.get("stage") == "staged" \
                and e.get("seconds", -1) >= 0:
            stalls[e["step"]] = max(stalls.get(e["step"], 0.0), e["seconds"])
    stalled = min(sum(stalls.values()), acc.productive)
    acc.productive -= stalled
    acc.lost["checkpoint stalls"] = stalled
    return acc


def _attempts(log: list[Mapping[str, Any]]) -> list[_Attempt]:
    """The log cut at each failure: each attempt's step reports and when it failed."""
    attempts = [_Attempt()]
    for e in log:
        kind = e["event"]
        if kind in FAILURES:
            current = attempts[-1]
            if current.failed_at is None:
                current.failed_at = e["ts"]
        elif kind in STARTS and attempts[-1].failed_at is not None:
            attempts.append(_Attempt())
        elif kind == "progress":
            if attempts[-1].failed_at is not None:  # reported before the order to stop
                continue
            attempts[-1].samples.append((e.get("at", e["ts"]), e["step"]))
    return attempts


def _share_kept(s0: int, s1: int, keep_up_to: int) -> float:
    """Of the steps s0+1..s1, the share at or below ``keep_up_to``."""
    if s1 <= s0:
        return 1.0 if s1 <= keep_up_to else 0.0
    return max(0.0, min(1.0, (keep_up_to - s0) / (s1 - s0)))


def table(acc: Account) -> str:
    """The account as a few lines for a person."""
    lines = [f"goodput: {'unknown' if acc.goodput is None else f'{acc.goodput:.3f}'} "
             f"(productive {acc.productive:.1f}s of {acc.wall:.1f}s wall; "
             f"{acc.restarts} restart(s), {acc.steps} steps)"]
    lines += [f"  lost to {cause:<17} {seconds:8.2f}s" for cause, seconds in acc.lost.items()
              if seconds > 0]
    if acc.recovery_phases:
        lines.append("  recovery phases: " + ", ".join(
            f"{k} {v:.2f}s" for k, v in acc.recovery_phases.items()))
    lines += [f"  note: {n}" for n in acc.notes]
    return "\n".join(lines)
