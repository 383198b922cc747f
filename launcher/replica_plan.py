"""Where checkpoint replicas go, and where a node restores from: pure functions, no sockets.

Every node keeps its ranks' staged shards in its own shared memory and a copy on ``k``
peers (``holders``). When a round forms, the coordinator knows from the nodes' joins which
node holds which shard in memory (``HeldRun``: runs of ranks), and tells each node what to pull from which
peer before its ranks start (``fetch_plan``): a replacement node its ranks' shards, every
node of a resized world the saved world's shards it lacks. Storage is read only for
shards no memory holds.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from typing import NamedTuple

from ftlaunch_contract.messages import Held, HeldRun

# A resized world pulls every saved shard to every node (each new rank cuts its part from
# them): the whole saved state in each node's memory, as many times its share as the world
# has nodes, and an assign naming every saved shard. Past this many nodes its ranks restore
# from storage instead (at 512 nodes of 8 the plan took 6-13 s and named 2 M pulls; at 4,096
# the coordinator was killed for its memory).
RESHARD_FROM_MEMORY_NODES = 8


class Seat(NamedTuple):
    """A node's ranks in the round being formed."""

    node_id: str
    rank_offset: int
    local_world_size: int
    world_size: int


def holders(ring: list[tuple[str, str]], node: str, k: int) -> list[str]:
    """The ``k`` nodes that keep ``node``'s replicas. ``ring``: (node id, failure domain) in
    group-rank order. The nodes after ``node`` around the ring, those in another failure
    domain (another host) first, so that one lost host rarely takes both copies."""
    return every_holder(ring, k).get(node, []) if k > 0 else []


def every_holder(ring: list[tuple[str, str]], k: int) -> dict[str, list[str]]:
    """holders() of every node of the ring at once: O(N k) when each host is a domain of
    its own (a scan per node from scratch was O(N^2) a round: 11 s at 4,096 nodes)."""
    if k <= 0:
        return {}
    out, size = {}, len(ring)
    one_domain = len({d for _, d in ring}) == 1
    for at, (node, domain) in enumerate(ring):
        other: list[str] = []
        same: list[str] = []
        for i in range(1, size):
            n, d = ring[(at + i) % size]
            if d != domain:
                other.append(n)
                if len(other) == k:
                    break
            elif len(same) < k:
                same.append(n)
                if one_domain and len(same) == k:
                    break
        out[node] = (other + same)[:k]
    return out


def runs(shards: Iterable[Held]) -> tuple[HeldRun, ...]:
    """Shards as runs of consecutive ranks of one (world size, step), in order: what a
    join says its node holds."""
    out: list[HeldRun] = []
    for world, rank, step in sorted(set(shards), key=lambda h: (h.world_size, h.step, h.rank)):
        last = out[-1] if out else None
        if last and (last.world_size, last.step) == (world, step) \
                and last.first_rank + last.ranks == rank:
            out[-1] = last._replace(ranks=last.ranks + 1)
        else:
            out.append(HeldRun(world, step, rank, 1))
    return tuple(out)


def newest_in_memory(held: Mapping[str, Iterable[HeldRun]]) -> tuple[int, int] | None:
    """(world size, step) of the newest step whose every rank some node holds in memory."""
    spans: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (world, step) -> (first, end)
    for copies in held.values():
        for world, step, first, ranks in copies:
            spans.setdefault((world, step), []).append((first, first + ranks))
    whole = [(step, world) for (world, step), have in spans.items() if _covers(have, world)]
    if not whole:
        return None
    step, world = max(whole)
    return world, step


def _covers(spans: list[tuple[int, int]], world: int) -> bool:
    """Whether ranks [first, end) spans, together, hold every rank 0 .. world - 1."""
    reach = 0  # every rank below it is held
    for first, end in sorted(spans):
        if first > reach:
            return False
        reach = max(reach, end)
        if reach >= world:
            return True
    return reach >= world > 0


def fetch_plan(held: Mapping[str, Iterable[HeldRun]], seats: list[Seat], committed: int = -1,
               newest: tuple[int, int] | None = None) -> dict[str, list[tuple[Held, str]]]:
    """What each seated node pulls, and from which node, so that its ranks can restore the
    newest step held in memory without storage: on the same world size its own ranks'
    shards; on another, every saved rank's (each new rank cuts its part from them).
    Sources are spread over the holders; a node never pulls what it holds. Nothing when
    storage has a newer step (``committed``): the ranks restore that one, so a pull of an
    older step would only delay them; nothing when the world is resized to more than
    RESHARD_FROM_MEMORY_NODES nodes (``too_wide_to_reshard``). ``newest``: what
    newest_in_memory(held) says, if the caller has it.
    Runs, not shards, are walked for the nodes that hold what they need (every node of a
    round that lost none, a round's survivors beside a replacement): the shards of a
    16,384-node round are never enumerated unless someone pulls them."""
    newest = newest or newest_in_memory(held)
    if newest is None or newest[1] < committed or too_wide_to_reshard(newest[0], seats):
        return {}
    world, step = newest
    spans = {node: [(r.first_rank, r.first_rank + r.ranks) for r in copies
                    if (r.world_size, r.step) == newest] for node, copies in held.items()}
    wanted = {}  # seat -> the ranks it lacks
    for seat in seats:
        want = (seat.rank_offset, seat.rank_offset + seat.local_world_size) \
            if seat.world_size == world else (0, world)
        own = spans.get(seat.node_id, [])
        if not any(first <= want[0] and want[1] <= end for first, end in own):
            lacks = [r for r in range(*want) if not any(f <= r < e for f, e in own)]
            if lacks:
                wanted[seat.node_id] = lacks
    where = _holders_of(spans, {r for lacks in wanted.values() for r in lacks})
    plan: dict[str, list[tuple[Held, str]]] = {}
    for node, lacks in wanted.items():
        pulls = [(Held(world, rank, step), where[rank][rank % len(where[rank])])
                 for rank in lacks if where.get(rank)]
        if pulls:
            plan[node] = pulls
    return plan


def _holders_of(spans: Mapping[str, list[tuple[int, int]]], ranks: set[int]) -> dict[int, list[str]]:
    """Rank -> the nodes whose spans hold it, in node order, for ``ranks`` only."""
    wanted = sorted(ranks)
    where: dict[int, list[str]] = {}
    if not wanted:
        return where
    for node in sorted(spans):
        for first, end in spans[node]:
            for rank in wanted[bisect.bisect_left(wanted, first):bisect.bisect_left(wanted, end)]:
                where.setdefault(rank, []).append(node)
    return where


def too_wide_to_reshard(saved_world: int, seats: list[Seat]) -> bool:
    """Whether a round of ``seats`` restoring a step of ``saved_world`` ranks is resized and
    too wide to pull every saved shard to each node (see RESHARD_FROM_MEMORY_NODES)."""
    return bool(seats) and seats[0].world_size != saved_world \
        and len(seats) > RESHARD_FROM_MEMORY_NODES
