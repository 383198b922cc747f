"""Where checkpoint replicas go, and where a node restores from: pure functions, no sockets.

Every node keeps its ranks' staged shards in its own shared memory and a copy on ``k``
peers (``holders``). When a round forms, the coordinator knows from the nodes' joins which
node holds which shard in memory (``Held``), and tells each node what to pull from which
peer before its ranks start (``fetch_plan``): a replacement node its ranks' shards, every
node of a resized world the saved world's shards it lacks. Storage is read only for
shards no memory holds.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import NamedTuple

from ftlaunch_contract.messages import Held

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


def newest_in_memory(held: Mapping[str, Iterable[Held]]) -> tuple[int, int] | None:
    """(world size, step) of the newest step whose every rank some node holds in memory."""
    ranks: dict[tuple[int, int], set[int]] = {}  # (a loop: a 16,384-node round's in 0.07 s)
    for copies in held.values():
        for world, rank, step in copies:
            if 0 <= rank < world:
                have = ranks.get((world, step))
                if have is None:
                    ranks[world, step] = have = set()
                have.add(rank)
    whole = [(step, world) for (world, step), have in ranks.items() if len(have) == world]
    if not whole:
        return None
    step, world = max(whole)
    return world, step


def fetch_plan(held: Mapping[str, Iterable[Held]], seats: list[Seat], committed: int = -1,
               newest: tuple[int, int] | None = None) -> dict[str, list[tuple[Held, str]]]:
    """What each seated node pulls, and from which node, so that its ranks can restore the
    newest step held in memory without storage: on the same world size its own ranks'
    shards; on another, every saved rank's (each new rank cuts its part from them).
    Sources are spread over the holders; a node never pulls what it holds. Nothing when
    storage has a newer step (``committed``): the ranks restore that one, so a pull of an
    older step would only delay them; nothing when the world is resized to more than
    RESHARD_FROM_MEMORY_NODES nodes (``too_wide_to_reshard``). ``newest``: what
    newest_in_memory(held) says, if the caller has it (0.07 s at 16,384 nodes)."""
    newest = newest or newest_in_memory(held)
    if newest is None or newest[1] < committed or too_wide_to_reshard(newest[0], seats):
        return {}
    world, step = newest
    where: dict[int, list[str]] = {}
    for node, copies in sorted(held.items()):
        for h in copies:
            if (h.world_size, h.step) == newest:
                where.setdefault(h.rank, []).append(node)
    plan: dict[str, list[tuple[Held, str]]] = {}
    for seat in seats:
        same = seat.world_size == world
        ranks = range(seat.rank_offset, seat.rank_offset + seat.local_world_size) if same \
            else range(world)
        pulls = []
        for rank in ranks:
            sources = [n for n in where.get(rank, []) if n != seat.node_id]
            if len(sources) == len(where.get(rank, [])):  # not held here
                pulls.append((Held(world, rank, step), sources[rank % len(sources)]))
        if pulls:
            plan[seat.node_id] = pulls
    return plan


def too_wide_to_reshard(saved_world: int, seats: list[Seat]) -> bool:
    """Whether a round of ``seats`` restoring a step of ``saved_world`` ranks is resized and
    too wide to pull every saved shard to each node (see RESHARD_FROM_MEMORY_NODES)."""
    return bool(seats) and seats[0].world_size != saved_world \
        and len(seats) > RESHARD_FROM_MEMORY_NODES
