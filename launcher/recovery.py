"""What to do about a failure: a pure function of the failure and the job's budget."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Decision:
    action: str  # "restart" or "fail"
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


def decide(restart_count: int, max_restarts: int, policy: str, cause: str,
           backoff: float = 1.0, backoff_max: float = 30.0) -> Decision:
    """Restart under ``policy`` while the budget lasts, else fail the job."""
    if restart_count >= max_restarts:
        reason = f"{cause}; restart budget spent ({restart_count}/{max_restarts})"
        return Decision("fail", policy, restart_count, 0.0, reason)
    n = restart_count + 1
    return Decision("restart", policy, n, backoff_delay(n, backoff, backoff_max), cause)
