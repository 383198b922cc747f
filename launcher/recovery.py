"""What to do about a failure: pure functions of the failure, the job's progress and budget."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Policy(StrEnum):
    """The rungs of the recovery ladder, cheapest first."""

    RANK = "rank"  # replace only the failed rank; survivors re-enter in place
    JOB = "job"  # replace every rank, by forks of the rank template
    COLD = "cold"  # replace every rank with a fresh interpreter


RESTART_POLICIES = tuple(p.value for p in Policy)  # as the CLI spells them


class Action(StrEnum):
    RESTART = "restart"
    FAIL = "fail"  # the restart budget is spent
    STALLED = "stalled"  # no progress: do not requeue


@dataclass(frozen=True)
class Decision:
    action: Action
    policy: Policy
    restart_count: int
    delay: float
    reason: str


def backoff_delay(failing: int, base: float, cap: float) -> float:
    """Seconds to wait before the restart that answers the ``failing``-th failure in a row
    without the job getting healthy in between (see ``Progress.after_failure``).

    A backoff stops a crash loop; it must not punish a job for a failure hours after the
    last one. So the first failure after healthy training is recovered at once, and only
    failures that follow each other without health wait ``base``, doubling up to ``cap``.
    """
    if failing <= 1:
        return 0.0
    return float(min(cap, base * 2 ** (failing - 2)))


def escalate(first: str, stalled: int) -> Policy:
    """The ladder's rung after ``stalled`` recoveries in a row that made no progress."""
    ladder = list(Policy)[list(Policy).index(Policy(first)):]
    return ladder[min(stalled, len(ladder) - 1)]


@dataclass(frozen=True)
class Progress:
    """The best step the job reached, recoveries since it last got further (``stalled``: the
    ladder's measure), and failures in a row without the job being healthy in between
    (``failing``: the backoff's)."""

    best_step: int = -1
    stalled: int = 0
    failing: int = 0

    def after_failure(self, step: int, uptime: float | None = None,
                      healthy_after: float = 0.0) -> Progress:
        """``step``: the highest step the failed attempt reported (-1: it never said, as
        without the shim or when a node is lost); ``uptime``: how long its ranks had run
        (None: unknown). The attempt was healthy if it got past the best step, or, when its
        step is unknown, if it ran ``healthy_after`` seconds; a healthy attempt's failure is
        the first of a new run of failures."""
        if step > self.best_step:
            return Progress(step, 0, 1)
        healthy = step < 0 and (uptime is None or uptime >= healthy_after)
        stalled = self.stalled if step < 0 else self.stalled + 1
        return Progress(self.best_step, stalled, 1 if healthy else self.failing + 1)


def decide(restart_count: int, max_restarts: int, policy: str, cause: str,
           backoff: float = 1.0, backoff_max: float = 30.0, progress: Progress = Progress(),
           max_stalled: int = 0) -> Decision:
    """Restart on the right rung while the budget lasts and the job progresses, else stop."""
    if max_stalled and progress.stalled >= max_stalled:
        reason = (f"{cause}; no progress: {progress.stalled} recoveries in a row without a "
                  f"step beyond {progress.best_step}")
        return Decision(Action.STALLED, Policy(policy), restart_count, 0.0, reason)
    if restart_count >= max_restarts:
        reason = f"{cause}; restart budget spent ({restart_count}/{max_restarts})"
        return Decision(Action.FAIL, Policy(policy), restart_count, 0.0, reason)
    return Decision(Action.RESTART, escalate(policy, progress.stalled), restart_count + 1,
                    backoff_delay(progress.failing, backoff, backoff_max), cause)
