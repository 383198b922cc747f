"""Which parts of which saved shards make up a tensor chunk that a rank wants now: pure.

A sharded tensor (a DTensor: FSDP2, tensor parallel) is saved as each rank's local chunk,
with where that chunk sits in the global tensor (``Box``: offset and shape per dimension).
Restored on another world size or layout, a rank wants a different chunk; ``plan`` says
which rectangle of which saved chunk fills which rectangle of the wanted one, so that each
rank reads only what it needs (as torch.distributed.checkpoint's planner does). Torch-free:
the agent can serve byte ranges of staged shards from the same plan.
"""

from __future__ import annotations

import math
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
        return math.prod(self.shape)

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
    return [_split(length, parts, i) for i in range(parts)]


@dataclass(frozen=True)
class Layout:
    """How a DTensor was split over a device mesh whose ranks are the world's in order (as
    ``init_device_mesh`` makes them): every saved rank's box follows from it, so a restore
    on another world size need not gather them (at 131,072 ranks and a few hundred sharded
    tensors, every rank would hold tens of millions)."""

    shape: tuple[int, ...]  # the global tensor's
    mesh: tuple[int, ...]  # the mesh's shape: rank r sits at r's row-major coordinate
    splits: tuple[int, ...]  # per mesh dimension, the tensor dimension it shards; -1: none
    order: tuple[int, ...] = ()
    """The mesh dimensions in the order they cut (empty: the mesh's). FSDP2 over tensor
    parallelism cuts by the TP dimension first and then each TP part by the FSDP one (torch
    marks the FSDP dimension a _StridedShard)."""

    @property
    def ranks(self) -> int:
        return math.prod(self.mesh)

    @property
    def cuts(self) -> tuple[int, ...]:
        return self.order or tuple(range(len(self.mesh)))

    def coordinate(self, rank: int) -> tuple[int, ...]:
        coord = []
        for n in reversed(self.mesh):
            rank, c = divmod(rank, n)
            coord.append(c)
        return tuple(reversed(coord))

    def rank(self, coordinate: Sequence[int]) -> int:
        rank = 0
        for c, n in zip(coordinate, self.mesh, strict=True):
            rank = rank * n + c
        return rank


def _split(length: int, parts: int, index: int) -> tuple[int, int]:
    """(offset, size) of part ``index`` (see even_chunks)."""
    chunk = -(-length // parts)
    start = min(index * chunk, length)
    return start, min(chunk, length - start)


def box_at(layout: Layout, coordinate: Sequence[int]) -> Box:
    """The box of the part at ``coordinate`` of the mesh: the mesh dimensions cut in their
    order, each what the earlier ones left, as torch.chunk does; an empty part sits at the
    end."""
    offset, shape = [0] * len(layout.shape), list(layout.shape)
    for level in layout.cuts:
        dim = layout.splits[level]
        if dim < 0:
            continue
        start, shape[dim] = _split(shape[dim], layout.mesh[level], coordinate[level])
        offset[dim] = offset[dim] + start if shape[dim] else layout.shape[dim]
    return Box(tuple(offset), tuple(shape))


def box_of(layout: Layout, rank: int) -> Box:
    """Saved rank ``rank``'s box (see box_at): for plain shards what torch's DTensor
    computes; for FSDP2 over TP, where the rows are."""
    return box_at(layout, layout.coordinate(rank))


def ranks_over(layout: Layout, wanted: Box, prefer: int = 0) -> list[int]:
    """The saved ranks whose parts overlap ``wanted``, one for each distinct part: along a
    mesh dimension that replicates, ``prefer``'s coordinate (a rank's own old part is
    the one it may hold in memory). The work is in the parts found, not the mesh's size."""
    if wanted.empty:
        return []
    mine = layout.coordinate(prefer % layout.ranks) if layout.ranks else ()
    cuts, coordinate = layout.cuts, list(mine)
    found: list[int] = []

    def walk(at: int, offset: list[int], shape: list[int]) -> None:
        if at == len(cuts):
            found.append(layout.rank(coordinate))
            return
        level = cuts[at]
        parts, dim = layout.mesh[level], layout.splits[level]
        if dim < 0:
            walk(at + 1, offset, shape)
            return
        size, chunk = shape[dim], -(-shape[dim] // parts)
        if not chunk:
            return
        low = max(0, (wanted.offset[dim] - offset[dim]) // chunk)
        high = min(parts - 1, (wanted.offset[dim] + wanted.shape[dim] - 1 - offset[dim]) // chunk)
        for c in range(low, high + 1):
            start, n = _split(size, parts, c)
            if n:
                coordinate[level] = c
                walk(at + 1, offset[:dim] + [offset[dim] + start] + offset[dim + 1:],
                     shape[:dim] + [n] + shape[dim + 1:])
    walk(0, [0] * len(layout.shape), list(layout.shape))
    return found
