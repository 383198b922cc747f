"""What this node does next: the agent's phases, the moves allowed between them, and its
decisions as pure functions of what it knows.

The agent (``launcher/agent.py``) does the I/O; what it decides comes from here, and each
answer carries the reason that goes into the agent's log line and event. Drawn in
docs/protocol.md ("Agent state machine").
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

log = logging.getLogger("ftlaunch.agent")


class Phase(StrEnum):
    JOINING = "joining"  # a join is out: waiting for this round's assignment
    STARTING = "starting"  # assigned (the store served if it is ours): waiting for "start"
    PREPARING = "preparing"  # "start" came; GPU memory held by dead ranks, shards being pulled
    RUNNING = "running"  # the ranks train; hangs are watched
    FAILED = "failed"  # a local rank failed and was reported: waiting for the order
    FINISHED = "finished"  # every local rank exited 0: waiting for the job's end
    PARKING = "parking"  # a recovery: restartable survivors leave their training function
    STOPPING = "stopping"  # ranks got SIGTERM, SIGKILL at the deadline: waiting to reap them
    BACKING_OFF = "backing_off"  # what had to go is gone: re-join at the deadline
    LEAVING = "leaving"  # a signal: forwarded to the ranks, SIGKILL after the grace period
    DONE = "done"  # the exit code is set: the loop ends


_P = Phase
_ABORT = {_P.STOPPING, _P.LEAVING}  # a stop order, an unhealthy GPU, a lost coordinator; a signal
TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    _P.JOINING: frozenset({_P.STARTING, _P.PARKING, *_ABORT}),
    _P.STARTING: frozenset({_P.PREPARING, _P.RUNNING, _P.PARKING, *_ABORT}),
    _P.PREPARING: frozenset({_P.RUNNING, _P.PARKING, *_ABORT}),
    _P.RUNNING: frozenset({_P.FAILED, _P.FINISHED, _P.PARKING, *_ABORT}),
    _P.FAILED: frozenset({_P.PARKING, *_ABORT}),
    _P.FINISHED: frozenset({_P.PARKING, *_ABORT}),
    _P.PARKING: frozenset({*_ABORT}),
    _P.STOPPING: frozenset({_P.BACKING_OFF, _P.PARKING, _P.DONE, _P.LEAVING}),
    _P.BACKING_OFF: frozenset({_P.JOINING, _P.PARKING, *_ABORT}),
    _P.LEAVING: frozenset({_P.DONE}),
    _P.DONE: frozenset(),
}
"""Every move the agent may make; anything else is a bug."""


class IllegalTransition(RuntimeError):
    """The agent tried a move its table does not allow."""


def check_transition(old: Phase, new: Phase, strict: bool) -> bool:
    """Whether ``old -> new`` is allowed. A bug otherwise: raised when ``strict`` (tests),
    logged in production, where the move is made all the same (stopping a job over a
    wrong name would be worse)."""
    if new in TRANSITIONS[old]:
        return True
    if strict:
        raise IllegalTransition(f"agent phase {old} -> {new} is not allowed")
    log.error("bug: agent phase %s -> %s is not in the transition table", old, new)
    return False


@dataclass(frozen=True)
class Survivor:
    """A live rank during a recovery, as the hub knows it."""

    pid: int
    rank: int
    restartable: bool  # runs inside trainer_shim.restartable: can re-enter in place
    parked: bool  # left its training function and waits to resume
    stuck: str = ""  # where it is blocked instead of leaving ("": not known to be)


def to_abort(survivors: Sequence[Survivor]) -> list[int]:
    """The pids told to leave their training function: those that can re-enter in place
    and have not parked yet. A ``rank`` recovery keeps them; any other stops them once
    they left, where a SIGTERM can end them (a handler the script armed, ft.preempted()'s,
    cannot run while the rank waits in native code: a gloo collective whose peer is cut
    off), or once their shims say where they are stuck, to be killed at once."""
    return [s.pid for s in survivors if s.restartable and not s.parked]


@dataclass(frozen=True)
class ParkVerdict:
    keep: tuple[int, ...]  # pids parked: they resume in place at the next start
    stop: tuple[int, ...]  # pids to stop
    late: tuple[int, ...]  # global ranks that could have parked but did not in time: killed
    reason: str
    blocked_in: tuple[str, ...] = ()  # per late rank: where it was stuck ("": timed out)


def park_or_stop(survivors: Sequence[Survivor], policy: str, now: float,
                 deadline: float) -> ParkVerdict | None:
    """Once every re-enterable survivor parked, or is stuck (blocked where an abort cannot
    reach it), or ``deadline`` passed: which to keep (a ``rank`` recovery's parked ones),
    which to stop. None while one may still park. Those that could have parked and did not
    are late: stopped at once (SIGKILL: a rank blocked in native code would not run a
    SIGTERM handler either)."""
    keep, stop, late, blocked_in = [], [], [], []
    for s in survivors:
        if s.parked and policy == "rank":
            keep.append(s.pid)
        elif s.restartable and not s.parked and not s.stuck and now < deadline:
            return None  # still leaving its training function
        else:
            stop.append(s.pid)
            if s.restartable and not s.parked:
                late.append(s.rank)
                blocked_in.append(s.stuck)
    if any(blocked_in):
        reason = f"ranks {late} did not leave their training function (blocked in " + \
            ", ".join(f"{where} on rank {rank}" for rank, where in zip(late, blocked_in,
                                                                       strict=True) if where) + \
            "): replacing them"
    elif late:
        reason = f"ranks {late} did not leave their training function in time: replacing them"
    elif keep:
        reason = f"{len(keep)} rank(s) parked to resume in place, {len(stop)} to stop"
    else:
        reason = f"{policy} restart: stopping all {len(stop)} live rank(s)"
    return ParkVerdict(tuple(keep), tuple(stop), tuple(late), reason, tuple(blocked_in))


class GpuAction(StrEnum):
    WARN = "warn"  # an event, nothing else
    DRAIN = "drain"  # leave at the next recovery (or the job's end): costs no restart
    LEAVE = "leave"  # stop this node's ranks and leave the job now, exit 3


@dataclass(frozen=True)
class GpuVerdict:
    action: GpuAction
    reason: str


def gpu_finding_action(severity: str, finding: str, draining: bool) -> GpuVerdict:
    """What a GPU health finding (its severity: warn, drain, fatal) makes this node do."""
    if severity == "fatal":
        return GpuVerdict(GpuAction.LEAVE, f"{finding}: leaving the job now")
    if severity == "drain" and not draining:
        return GpuVerdict(GpuAction.DRAIN, f"{finding}: leaving the job at its next recovery")
    return GpuVerdict(GpuAction.WARN, f"{finding}")


class OrderAction(StrEnum):
    RECOVER = "recover"  # park or stop the ranks, back off, re-join
    REJOIN = "rejoin"  # no ranks: only join again
    LEAVE = "leave"  # a drain was pending: this recovery is the moment to leave
    DEFER = "defer"  # ranks are being stopped: take the order when they are gone
    IGNORE = "ignore"


@dataclass(frozen=True)
class OrderVerdict:
    action: OrderAction
    reason: str


def recover_action(phase: Phase, draining: str, seated: bool = True) -> OrderVerdict:
    """What a coordinator's ``recover`` order makes this node do, in ``phase``; ``seated``:
    it was ever assigned ranks."""
    if phase in (Phase.LEAVING, Phase.DONE):
        return OrderVerdict(OrderAction.IGNORE, f"leaving already ({phase})")
    if not seated and phase == Phase.JOINING:
        # A spare that followed a coordinator which stood down: its heartbeat reached the
        # job's coordinator before its join and was answered "dropped, re-join" (chaos seed
        # 5709). Nothing of the job's is recovered here: a recovery logged would be one more
        # than the fault's, "-> rank restart" on a node with no rank.
        return OrderVerdict(OrderAction.REJOIN, "a spare: it joins again, nothing to recover")
    if draining:
        return OrderVerdict(OrderAction.LEAVE, f"{draining}: leaving at this recovery")
    if phase == Phase.STOPPING:
        return OrderVerdict(OrderAction.DEFER, "taken once the ranks being stopped are gone")
    return OrderVerdict(OrderAction.RECOVER, "the ranks park or stop, then the node re-joins")
