"""Who is in the job and which ranks each node gets: pure functions, no sockets."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from operator import attrgetter
from typing import NamedTuple


@dataclass(frozen=True)
class Member:
    node_id: str
    local_world_size: int
    addr: str
    rank_hint: int = -1  # --node-rank of torchrun's static form; -1 when not given


class Assignment(NamedTuple):  # (a tuple: a 16,384-node round builds as many)
    node_id: str
    group_rank: int
    group_world_size: int
    rank_offset: int
    world_size: int


def assign_ranks(members: list[Member], previous: dict[str, int] | None = None) -> list[Assignment]:
    """Give each member a group rank and a contiguous block of global ranks.

    Nodes keep their previous group rank (stable across rounds). Newcomers, by
    ``--node-rank`` where given, then in node-id order (so every node computes the same
    answer), first fill the seats the departed left, lowest first: a spare takes the lost
    node's ranks and every survivor keeps its own, which it restores from its own memory.
    Seats still empty close up (a smaller world; survivors keep their order); the other
    newcomers follow. Two members claiming one seat: the lower node id keeps it.
    """
    previous = previous or {}
    # By node id first: strings alone sort 3x faster than tuples, and most of a large round
    # (a takeover's survivors, a fresh job) goes by it alone.
    by_id = sorted(members, key=attrgetter("node_id"))
    seated: list[Member | None] = [None] * (max(previous.values(), default=-1) + 1)
    newcomers = [] if previous else by_id  # (a fresh job: everyone)
    if previous:
        for m in by_id:
            seat = previous.get(m.node_id, -1)
            if seat >= 0 and seated[seat] is None:
                seated[seat] = m
            else:
                newcomers.append(m)
    if any(m.rank_hint >= 0 for m in newcomers):
        unhinted = 1 << 30
        newcomers.sort(key=lambda m: m.rank_hint if m.rank_hint >= 0 else unhinted)  # (stable)
    arriving = iter(newcomers)
    ordered = [m for m in (s if s is not None else next(arriving, None) for s in seated)
               if m is not None]
    ordered += arriving
    world_size = sum(m.local_world_size for m in ordered)
    assignments, offset = [], 0
    for group_rank, m in enumerate(ordered):
        assignments.append(Assignment(m.node_id, group_rank, len(ordered), offset, world_size))
        offset += m.local_world_size
    return assignments


def takes_seat(node: str, joined: set[str], expected: set[str], expected_count: int,
               max_nodes: int) -> bool:
    """Whether a node joining a forming round is seated in it now. The last round's nodes
    keep their seats, those known by name (``expected``) and those only counted
    (``expected_count``: a takeover's survivors that no assign named): a spare that joins
    first, having noticed a lost coordinator before the survivors did, takes only a seat
    none of them will fill. (A seat a survivor leaves empty goes to a spare at the close.)
    Counted without building the union: a forming job's 16,384 joins made it O(N²)."""
    if node in joined or node in expected:
        return True
    unnamed = max(0, expected_count - len(expected))
    held = len(joined) + len(expected) - len(joined & expected)  # (walks the smaller set)
    return held + unnamed < max_nodes


def round_complete(joined: set[str], expected: set[str], min_nodes: int, max_nodes: int,
                   min_reached_at: float | None, now: float, last_call: float,
                   expected_count: int = 0) -> str | None:
    """Why a rendezvous round closes now, or None while it stays open. It closes at MAX
    nodes; once every ``expected`` node (the survivors of the last round, plus a scale-up's
    newcomer) is back, and at least ``expected_count`` nodes (a new coordinator knows only
    how many survived, not all of their ids); or ``last_call`` seconds after MIN."""
    if len(joined) >= max_nodes:
        return f"{len(joined)} nodes joined: the maximum"
    if len(joined) < min_nodes:
        return None
    if expected and len(joined) >= max(expected_count, len(expected)) and expected <= joined:
        return f"every node the round waited for is back ({len(joined)})"
    if min_reached_at is not None and now - min_reached_at >= last_call:
        return f"last call: {len(joined)} nodes, {last_call:g}s after the minimum ({min_nodes})"
    return None


def has_quorum(electorate: int, here: int, gone: int, wins_tie: bool) -> bool:
    """Whether a round may close with ``here`` of the last round's ``electorate`` nodes back
    in it. The rest may be alive behind a partition, their side forming a round of its own,
    unless known ``gone`` (their connections closed while they were still heard from, or
    excluded): the side with more of the last round than may be on the other goes on, a tie
    to the side that holds it (the coordinator that ran the round; its successor only if that
    one died). Two sides of one partition never both close a round, and one failure at a time
    never stops the side that ran it. No electorate (no round closed yet), or every node of
    it gone (an earlier round whose nodes all died: none counts by it anywhere): any round."""
    away = electorate - here - gone
    return not electorate or here > away or (here == away and (wins_tie or not away))


@dataclass(frozen=True)
class Electorate:
    """Who votes on the rounds after the one of ``epoch`` (see has_quorum): its nodes and
    the spares idle when it closed, ``size`` of them, ``voters`` those known by name (a
    successor knows 16 of a large job's), ``gone`` those of them known to train nowhere."""

    epoch: int
    size: int
    voters: frozenset[str]
    gone: frozenset[str] = frozenset()


def settled(electorate: Electorate, learnt: Mapping[str, int]) -> bool:
    """Whether most of an earlier ``electorate``'s voters have learnt a later one
    (``learnt``: node -> the newest electorate epoch it reported). Until then a round needs
    a quorum of it too, not only of the last (joint consensus, as Raft changes membership):
    a node cut off between a round's close and its assign counts by the one before, and
    where the electorate changed (a node lost, a scale-up, new spares) both sides could
    count a majority. Once settled, those that may still count by it are no majority of it,
    and a coordinator that does counts none of those that learnt better (they are ahead)."""
    told = sum(learnt.get(voter, -1) > electorate.epoch for voter in electorate.voters)
    return 2 * told > electorate.size


def named(electorates: Iterable[Electorate], limit: int) -> list[tuple[int, int, str, bool]]:
    """What tells a successor the earlier ``electorates`` it must count too, as rows
    (epoch, size, voter, gone): each voter of one of ``limit`` voters at most, all known by
    name; of a larger one (an assign goes to every node) one row with no voter: its voters
    are then those that say in their join they held a seat in its round (see Join)."""
    return [(e.epoch, e.size, voter, voter in e.gone) for e in electorates
            for voter in (sorted(e.voters) if len(e.voters) == e.size <= limit else [""])]


def from_named(rows: Iterable[tuple[int, int, str, bool]]) -> list[Electorate]:
    """The electorates of ``named``'s rows, oldest first."""
    voters: dict[tuple[int, int], tuple[set[str], set[str]]] = {}
    for epoch, size, voter, gone in rows:
        names, gone_ones = voters.setdefault((epoch, size), (set(), set()))
        names.update([voter] if voter else [])
        if gone and voter:
            gone_ones.add(voter)
    return [Electorate(epoch, size, frozenset(names), frozenset(gone_ones))
            for (epoch, size), (names, gone_ones) in sorted(voters.items())]


def seats_to_report(seats: Iterable[int], settled_below: int) -> list[int]:
    """Of the rounds a node held seats in (oldest first), those its join reports: the last
    (survivor or spare?) and each before it whose electorate may not be settled (a large
    job's successor counts those voters by them). However often the electorate changed
    before most heard of it, every voter of each one not settled says so."""
    seats = list(seats)
    return [e for e in seats[:-1] if e >= settled_below] + seats[-1:]


HEARTBEATS_PER_SECOND = 1024
"""What a coordinator hears at most from a large job's heartbeats: beyond that many nodes
per configured interval, each node heartbeats less often (see beat_interval)."""
MAX_BEAT_INTERVAL = 30.0


def beat_interval(configured: float, nodes: int) -> float:
    """Seconds between a node's heartbeats in a job of up to ``nodes`` (its MAX: what both
    ends know from the start, and 16,384 agents joining must not bury their joins under
    heartbeats): the configured interval, or longer once the coordinator would hear more
    than HEARTBEATS_PER_SECOND (at most MAX_BEAT_INTERVAL). A machine that goes silent is
    found by TCP within the node timeout whatever this is (coordinator.keep_alive);
    heartbeats find a frozen agent process, whose kernel still answers TCP, and carry its
    status."""
    return max(configured, min(MAX_BEAT_INTERVAL, nodes / HEARTBEATS_PER_SECOND))


def liveness_timeout(node_timeout: float, nodes: int) -> float:
    """Seconds without a heartbeat after which a node of a job of up to ``nodes`` is lost (and,
    to its agents, the coordinator): the node timeout, or three of a large job's slower
    beats (none is lost on the way: they go over TCP)."""
    return max(node_timeout, 3 * min(MAX_BEAT_INTERVAL, nodes / HEARTBEATS_PER_SECOND))


KNOCK = 1 / 16
"""Knocks' spacing, as a share of the liveness timeout: a peer silent for half of it is
knocked at eight times before it is judged (see lost_by_silence). Each needs its SYN and
its last ACK through, and is answered within a round trip or, once TCP resends, a second
later: at 30 % loss about half are answered in time, and eight all go unanswered once in
two hundred."""


def lost_by_silence(silence: float, unanswered: float, liveness: float) -> bool:
    """Whether a peer (an agent's coordinator, a coordinator's member) not heard from for
    ``silence`` seconds is lost, its machine having last answered a knock on its port
    ``unanswered`` seconds ago (see ControlPlane._silent). Gone, cut off, frozen (not
    even its ZeroMQ I/O thread answers): lost at the liveness timeout, as ever. Answering: its
    words are held back by TCP, which retries a lost segment after 0.2, 0.4, 0.8 s... (at 30 %
    loss a second or more late every few dozen: chaos seed 3423 failed over from a live
    coordinator), or its agent's Python stalls; it gets the timeout once more. Knocks come
    one after another once it is silent for half the timeout: half tells the two apart."""
    return silence > liveness and (unanswered > liveness / 2 or silence > 2 * liveness)


def silent_members(last_seen: dict[str, float], now: float, timeout: float,
                   exempt: str = "") -> list[str]:
    """Members not heard from for more than ``timeout`` seconds: declared lost. ``last_seen``
    is in the order they were heard (oldest first): reading stops at the first one heard
    since, so a tick costs the silent ones, not the job's size. ``exempt``: alive anyway."""
    silent = []
    for node, seen in last_seen.items():
        if now - seen <= timeout and node != exempt:
            break
        if node != exempt:
            silent.append(node)
    return sorted(silent)


def successor(members_by_rank: list[str], lost: set[str]) -> str | None:
    """Who takes over a lost coordinator: the lowest group rank still alive (same on every node)."""
    return next((node for node in members_by_rank if node not in lost), None)
