"""Who is in the job and which ranks each node gets: pure functions, no sockets."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Member:
    node_id: str
    local_world_size: int
    addr: str


@dataclass(frozen=True)
class Assignment:
    node_id: str
    group_rank: int
    group_world_size: int
    rank_offset: int
    world_size: int


def assign_ranks(members: list[Member], previous: dict[str, int] | None = None) -> list[Assignment]:
    """Give each member a group rank and a contiguous block of global ranks.

    Nodes keep their previous group rank where they had one (stable across rounds);
    newcomers follow in node-id order, so every node computes the same answer.
    """
    previous = previous or {}
    ordered = sorted(members, key=lambda m: (previous.get(m.node_id, len(previous)), m.node_id))
    world_size = sum(m.local_world_size for m in ordered)
    assignments, offset = [], 0
    for group_rank, m in enumerate(ordered):
        assignments.append(Assignment(m.node_id, group_rank, len(ordered), offset, world_size))
        offset += m.local_world_size
    return assignments
