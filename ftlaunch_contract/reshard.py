"""Which parts of which saved shards make up a tensor chunk that a rank wants now: pure.

A sharded tensor (a DTensor: FSDP2, tensor parallel) is saved as each rank's local chunk,
with where that chunk sits in the global tensor (``Box``: offset and shape per dimension).
Restored on another world size or layout, a rank wants a different chunk; ``plan`` says
which rectangle of which saved chunk fills which rectangle of the wanted one, so that each
rank reads only what it needs (as torch.distributed.checkpoint's planner does). Torch-free:
the agent can serve byte ranges of staged shards from the same plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Box:
    """A rectangle of a global tensor: ``offset`` and ``shape`` per dimension."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def empty(self) -> bool:
        return any(n == 0 for n in self.shape)

    @property
    def numel(self) -> int:
        count = 1
        for n in self.shape:
            count *= n
        return count

    def relative_to(self, outer: Box) -> Box:
        """This box in the coordinates of ``outer`` (which contains it)."""
        return Box(tuple(o - p for o, p in zip(self.offset, outer.offset, strict=True)),
                   self.shape)


def intersect(a: Box, b: Box) -> Box | None:
    """The common rectangle of two boxes of one tensor, or None."""
    if len(a.offset) != len(b.offset):
        raise ValueError(f"boxes of different ranks: {a} and {b}")
    start = tuple(max(x, y) for x, y in zip(a.offset, b.offset, strict=True))
    end = tuple(min(x + m, y + n) for x, m, y, n in
                zip(a.offset, a.shape, b.offset, b.shape, strict=True))
    shape = tuple(e - s for s, e in zip(start, end, strict=True))
    if any(n <= 0 for n in shape):
        return None
    return Box(start, shape)


@dataclass(frozen=True)
class Piece:
    """Copy ``source``'s saved chunk, rectangle ``src`` (relative to that chunk), into the
    wanted chunk's rectangle ``dst`` (relative to it); both have the same shape."""

    source: int
    src: Box
    dst: Box


def plan(saved: Sequence[tuple[int, Box]], wanted: Box) -> list[Piece]:
    """The pieces of ``saved`` chunks (source id, box) that fill ``wanted``, each saved
    chunk read only where it overlaps. Raises if the saved chunks leave part of ``wanted``
    uncovered (the save was not whole) or cover part twice (overlapping saves: a
    replicated dimension must be saved by one rank only)."""
    pieces = []
    for source, box in saved:
        if box.empty:
            continue
        common = intersect(box, wanted)
        if common is not None:
            pieces.append(Piece(source, common.relative_to(box), common.relative_to(wanted)))
    covered = sum(p.dst.numel for p in pieces)
    if covered != wanted.numel:
        raise ValueError(f"saved chunks cover {covered} of the {wanted.numel} elements of "
                         f"{wanted}: the save is incomplete or its chunks overlap")
    for i, p in enumerate(pieces):  # equal counts could still hide a gap plus an overlap
        for q in pieces[i + 1:]:
            if intersect(p.dst, q.dst) is not None:
                raise ValueError(f"saved chunks of sources {p.source} and {q.source} overlap")
    return pieces


def even_chunks(length: int, parts: int) -> list[tuple[int, int]]:
    """(offset, size) of each part when ``length`` rows are split the way torch.chunk and
    DTensor's Shard(dim) split them: ceil-sized parts, the last ones shorter or empty."""
    size = -(-length // parts) if parts else 0
    return [(min(i * size, length), max(0, min(size, length - i * size))) for i in range(parts)]
