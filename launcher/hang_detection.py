"""Is a rank hung? A pure function of what the rank last said and when, and the timeouts.

The agent feeds it from the ranks' trainer_shim messages and acts on its answer; the hung
rank's cooperation is never needed (a SIGSTOPped rank or one spinning with the GIL held
simply stops talking).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ftlaunch_contract.protocol import TICK_INTERVAL

SAME_MOMENT = 0.25
"""Ranks that fell silent within this of each other count as silent together (> the shim's
50 ms heartbeat throttle plus the agent's 100 ms check interval)."""
LEARN_AFTER_BEATS = 20
LEARNED_FLOOR = 1.0
"""The shim's own thread ticks this often; silent for FROZEN_AFTER, the process is frozen."""
FROZEN_AFTER = 4 * TICK_INTERVAL
ELSEWHERE_SKEW = 0.5
"""Seconds by which another node's agent may see the same silence later than we do (its
checks, the messages between): room for it to blame a frozen culprit of its own first."""
RESUME_WITHIN = 10.0
"""Seconds a parked rank told to resume has to re-enter its training function (it takes
milliseconds: the order is only read): one that does not never left the park (its old
process group's release hanging, say), and nothing else would find it."""


@dataclass(frozen=True)
class HangTimeouts:
    heartbeat: float  # 0 = never
    startup: float  # 0 = never
    sections: dict[str, float] = field(default_factory=dict)
    factor: float = 0.0  # > 0: learn the heartbeat timeout from observed intervals


@dataclass
class RankActivity:
    """What one rank (one process) has told the agent since it started or resumed."""

    started_at: float
    last_seen: float | None = None  # any message
    last_beat: float | None = None
    beats: int = 0
    longest_interval: float = 0.0
    step: int = -1
    open_sections: dict[str, float] = field(default_factory=dict)
    last_tick: float | None = None  # the shim's thread, not the training thread
    awaiting_entry: bool = False  # resumed: the training function not entered again yet

    def frozen(self, now: float) -> bool:
        """Not even the shim's thread runs: SIGSTOPped, or spinning with the GIL held.

        A rank merely blocked in a collective (on a hung peer) still ticks; so this tells
        the culprit from the ranks that wait for it."""
        return self.last_tick is not None and now - self.last_tick > FROZEN_AFTER

    def beat(self, now: float, step: int) -> None:
        if self.last_beat is not None:
            self.longest_interval = max(self.longest_interval, now - self.last_beat)
        self.beats += 1
        self.last_beat = self.last_seen = now
        self.step = max(self.step, step)

    def restore(self, longest_interval: float) -> None:
        """What an earlier incarnation learned (saved with a checkpoint): use it at once."""
        self.longest_interval = max(self.longest_interval, longest_interval)
        self.beats = max(self.beats, LEARN_AFTER_BEATS)

    def section(self, now: float, name: str, is_open: bool) -> None:
        self.last_seen = now
        if is_open:
            self.open_sections[name] = now
        else:
            self.open_sections.pop(name, None)


def heartbeat_timeout(activity: RankActivity, timeouts: HangTimeouts) -> float:
    """The configured timeout, or the learned one once enough beats were seen."""
    if timeouts.factor <= 0 or activity.beats < LEARN_AFTER_BEATS:
        return timeouts.heartbeat
    learned = max(LEARNED_FLOOR, timeouts.factor * activity.longest_interval)
    return min(learned, timeouts.heartbeat) if timeouts.heartbeat > 0 else learned


def hang_reason(activity: RankActivity, timeouts: HangTimeouts, now: float) -> str | None:
    """Why this rank counts as hung at ``now``, or None while it is fine.

    An open section with its own timeout replaces the heartbeat timeout (a long checkpoint
    is not a hang); before the first message only the startup timeout applies.
    """
    if activity.awaiting_entry and now - activity.started_at > RESUME_WITHIN:
        return f"not back in its training function {RESUME_WITHIN:g}s after the resume"
    timed = {n: t for n, t in activity.open_sections.items() if n in timeouts.sections}
    if timed:
        for name, opened in timed.items():
            if now - opened > timeouts.sections[name]:
                return (f"section {name!r} open for {now - opened:.1f}s "
                        f"(timeout {timeouts.sections[name]:g}s)")
        return None
    if activity.last_seen is None and not activity.frozen(now):
        if timeouts.startup > 0 and now - activity.started_at > timeouts.startup:
            return f"no heartbeat within the startup timeout ({timeouts.startup:g}s)"
        return None
    # Frozen before its first word (SIGSTOPped as it resumed, say), a rank is not starting up.
    silent_since = activity.started_at if activity.last_seen is None else activity.last_seen
    limit = heartbeat_timeout(activity, timeouts)
    if limit > 0 and now - silent_since > limit:
        return f"no heartbeat for {now - silent_since:.1f}s (timeout {limit:g}s)"
    return None


def hung_ranks(watched: Mapping[int, RankActivity], timeouts: HangTimeouts,
               now: float, other_nodes: bool = False) -> list[tuple[int, str]]:
    """(pid, reason) of the hung ranks among ``watched`` (those that use the shim and are
    not parked), blaming the culprit rather than the peers blocked on it.

    A frozen rank (not even the shim's thread runs) is the culprit: the others are most
    likely blocked in a collective on it, and are released when it is killed. A peer
    blocked on it may cross the timeout first (its last heartbeat was throttled away),
    so while any rank is frozen only frozen ranks are ever blamed. With ``other_nodes``
    the culprit may be frozen on another node, found frozen there once its ticks are
    FROZEN_AFTER old: ranks here that still tick are blamed only once that had time to
    happen (else a SIGSTOPped rank's peers are replaced, and it, unable to park, is
    waited for until --stop-timeout)."""
    if not any(hang_reason(a, timeouts, now) for a in watched.values()):
        return []
    # Asleep rather than frozen, the culprit looks just like the peers blocked on it,
    # which fell silent at the same moment (give or take the heartbeat throttle).
    later = now + SAME_MOMENT
    hung = [(pid, reason) for pid, activity in watched.items()
            if (reason := hang_reason(activity, timeouts, later)) is not None]
    frozen = {pid for pid, activity in watched.items() if activity.frozen(now)}
    if frozen:
        return [(pid, reason + " (frozen)") for pid, reason in hung if pid in frozen]
    if other_nodes:
        settled = now - FROZEN_AFTER - TICK_INTERVAL - ELSEWHERE_SKEW
        if not any(hang_reason(watched[pid], timeouts, now - ELSEWHERE_SKEW) and
                   (watched[pid].last_seen or watched[pid].started_at) < settled
                   for pid, _ in hung):
            return []
    return hung
