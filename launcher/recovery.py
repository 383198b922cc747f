"""What to do about a failure: pure functions of the failure, the job's progress and budget."""

from __future__ import annotations

from dataclasses import dataclass

from launcher.config import RESTART_POLICIES


@dataclass(frozen=True)
class Decision:
    action: str  # "restart", "fail" (budget spent) or "stalled" (no progress: do not requeue)
    policy: str
    restart_count: int
    delay: float
    reason: str


def backoff_delay(restart_count: int, base: float, cap: float) -> float:
    """Seconds to wait before restart number ``restart_count`` (1-based).

    The first restart is immediate (a one-off fault should cost nothing); from the second on
    the wait doubles from ``base`` up to ``cap``, so a crash loop does not spin.
    """
    if restart_count <= 1:
        return 0.0
    return min(cap, base * 2 ** (restart_count - 2))


def escalate(first: str, stalled: int) -> str:
    """The ladder's rung after ``stalled`` recoveries in a row that made no progress."""
    ladder = RESTART_POLICIES[RESTART_POLICIES.index(first):]
    return ladder[min(stalled, len(ladder) - 1)]


@dataclass(frozen=True)
class Progress:
    """The best step the job reached, and recoveries since it last got further."""

    best_step: int = -1
    stalled: int = 0

    def after_failure(self, step: int) -> Progress:
        """``step``: the highest step the failed attempt reported (-1: it never said)."""
        if step < 0:
            return self  # no shim heartbeats, or a lost node: progress unknown
        if step > self.best_step:
            return Progress(step, 0)
        return Progress(self.best_step, self.stalled + 1)


def decide(restart_count: int, max_restarts: int, policy: str, cause: str,
           backoff: float = 1.0, backoff_max: float = 30.0, progress: Progress = Progress(),
           max_stalled: int = 0) -> Decision:
    """Restart on the right rung while the budget lasts and the job progresses, else stop."""
    if max_stalled and progress.stalled >= max_stalled:
        reason = (f"{cause}; no progress: {progress.stalled} recoveries in a row without a "
                  f"step beyond {progress.best_step}")
        return Decision("stalled", policy, restart_count, 0.0, reason)
    if restart_count >= max_restarts:
        reason = f"{cause}; restart budget spent ({restart_count}/{max_restarts})"
        return Decision("fail", policy, restart_count, 0.0, reason)
    n = restart_count + 1
    return Decision("restart", escalate(policy, progress.stalled), n,
                    backoff_delay(n, backoff, backoff_max), cause)
