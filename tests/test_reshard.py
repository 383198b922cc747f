"""Resharding plans (pure): any saved layout restores any wanted chunk exactly."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftlaunch_contract.reshard import (
    Box,
    Layout,
    box_at,
    box_of,
    even_chunks,
    intersect,
    plan,
    ranks_over,
)


def grid(shape: tuple[int, ...], parts: tuple[int, ...]) -> list[Box]:
    """The chunks of a tensor sharded ``parts[d]`` ways along each dimension d."""
    per_dim = [even_chunks(n, p) for n, p in zip(shape, parts, strict=True)]
    return [Box(tuple(o for o, _ in combo), tuple(s for _, s in combo))
            for combo in itertools.product(*per_dim)]


def cut(whole: np.ndarray, box: Box) -> np.ndarray:
    return whole[tuple(slice(o, o + n) for o, n in zip(box.offset, box.shape, strict=True))]


@st.composite
def layouts(draw):
    dims = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=dims, max_size=dims)))
    before = tuple(draw(st.lists(st.integers(1, 4), min_size=dims, max_size=dims)))
    after = tuple(draw(st.lists(st.integers(1, 4), min_size=dims, max_size=dims)))
    return shape, before, after


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_every_wanted_chunk_is_rebuilt_exactly_from_the_saved_ones(layout):
    shape, before, after = layout
    whole = np.arange(int(np.prod(shape))).reshape(shape)
    saved = list(enumerate(grid(shape, before)))
    chunks = {source: cut(whole, box) for source, box in saved}
    for wanted in grid(shape, after):
        rebuilt = np.full(wanted.shape, -1)
        for piece in plan(saved, wanted):
            cut(rebuilt, piece.dst)[...] = cut(chunks[piece.source], piece.src)
        assert (rebuilt == cut(whole, wanted)).all()


def test_a_chunk_is_read_only_from_the_saved_chunks_it_overlaps():
    saved = list(enumerate(grid((8, 4), (4, 1))))  # rows 0-1, 2-3, 4-5, 6-7
    pieces = plan(saved, Box((3, 0), (2, 4)))  # rows 3-4 on a 2-way re-shard of 3 rows each
    assert [(p.source, p.src, p.dst) for p in pieces] == [
        (1, Box((1, 0), (1, 4)), Box((0, 0), (1, 4))),
        (2, Box((0, 0), (1, 4)), Box((1, 0), (1, 4)))]


def test_a_missing_or_doubled_saved_chunk_is_refused():
    saved = list(enumerate(grid((6,), (3,))))
    with pytest.raises(ValueError, match="cover 4 of the 6"):
        plan(saved[:2], Box((0,), (6,)))
    with pytest.raises(ValueError, match="overlap|cover"):
        plan([*saved, (9, Box((0,), (2,)))], Box((0,), (6,)))


@pytest.mark.parametrize("length, parts, expected", [
    (10, 4, [(0, 3), (3, 3), (6, 3), (9, 1)]),
    (3, 4, [(0, 1), (1, 1), (2, 1), (3, 0)]),
    (0, 2, [(0, 0), (0, 0)]),
    (8, 2, [(0, 4), (4, 4)]),
])
def test_even_chunks_split_like_torch_chunk(length, parts, expected):
    assert even_chunks(length, parts) == expected


def test_even_chunks_match_dtensor_shard_layout():
    torch = pytest.importorskip("torch")
    for length, parts in [(10, 4), (3, 4), (7, 3), (16, 5)]:
        sizes = [c.shape[0] for c in torch.arange(length).chunk(parts)]
        sizes += [0] * (parts - len(sizes))
        assert [n for _, n in even_chunks(length, parts)] == sizes


def test_intersect():
    assert intersect(Box((0, 0), (2, 2)), Box((1, 1), (2, 2))) == Box((1, 1), (1, 1))
    assert intersect(Box((0,), (2,)), Box((2,), (2,))) is None


@st.composite
def meshes(draw):
    """A DTensor's layout: a tensor of up to 3 dimensions over a mesh of up to 3, each mesh
    dimension replicating or sharding any tensor dimension (several may shard one)."""
    shape = tuple(draw(st.lists(st.integers(0, 11), min_size=1, max_size=3)))
    mesh = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    splits = tuple(draw(st.lists(st.integers(-1, len(shape) - 1), min_size=len(mesh),
                                 max_size=len(mesh))))
    order = tuple(draw(st.permutations(range(len(mesh))))) if draw(st.booleans()) else ()
    return Layout(shape, mesh, splits, order)


@settings(max_examples=300, deadline=None)
@given(meshes())
def test_a_layouts_boxes_are_torchs(layout):
    """Each saved rank's box, computed from the layout, is the one torch's DTensor gives
    that rank (what a save records beside each part, and a restore checks)."""
    torch = pytest.importorskip("torch")
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    layout = Layout(layout.shape, layout.mesh, layout.splits)  # in the mesh's order
    placements = [Replicate() if d < 0 else Shard(d) for d in layout.splits]
    for rank in range(layout.ranks):
        shape, offset = _compute_local_shape_and_global_offset(
            layout.shape, layout.mesh, list(layout.coordinate(rank)), placements)
        assert box_of(layout, rank) == Box(tuple(offset), tuple(shape)), rank
    assert torch  # (imported for its DTensor)


@settings(max_examples=300, deadline=None)
@given(meshes(), st.data())
def test_the_parts_over_a_wanted_box_are_every_distinct_part_that_overlaps_it(layout, data):
    """ranks_over names, without walking the mesh, the saved parts a new chunk overlaps:
    one rank per distinct part (along a replicating mesh dimension, the preferred rank's
    coordinate), and together they fill it exactly."""
    shape, offset = [], []
    for n in layout.shape:
        start = data.draw(st.integers(0, n))
        offset.append(start)
        shape.append(data.draw(st.integers(0, n - start)))
    wanted = Box(tuple(offset), tuple(shape))
    prefer = data.draw(st.integers(0, layout.ranks - 1))
    found = ranks_over(layout, wanted, prefer)
    overlapping = {box_of(layout, r) for r in range(layout.ranks)
                   if not box_of(layout, r).empty and intersect(box_of(layout, r), wanted)}
    assert {box_of(layout, r) for r in found} == overlapping
    assert len(found) == len(overlapping)
    mine = layout.coordinate(prefer)
    for r in found:
        assert all(c == m for c, m, d in zip(layout.coordinate(r), mine, layout.splits,
                                             strict=True) if d < 0)
    if not wanted.empty:
        assert sum(p.dst.numel for p in plan([(r, box_of(layout, r)) for r in found],
                                             wanted)) == wanted.numel


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 40), st.integers(1, 4), st.integers(1, 4))
def test_fsdp2_over_tensor_parallelism_cuts_each_tp_part(rows, dp, tp):
    """FSDP2 over TP on a (dp, tp) mesh: a rank holds its TP part's dp-th chunk (as
    torch.chunk cuts, empty ones last), which the layout that cuts by "tp" first says. (Not
    torch's offsets for the _StridedShard it marks: see _cuts in trainer_shim/checkpoint.py.)"""
    torch = pytest.importorskip("torch")

    def chunks(t, parts):
        got = list(t.chunk(parts)) if t.numel() else []
        return got + [t[len(t):]] * (parts - len(got))

    weight = torch.arange(rows)
    layout = Layout((rows,), (dp, tp), (0, 0), order=(1, 0))
    for i in range(dp):
        for j in range(tp):
            held = chunks(chunks(weight, tp)[j], dp)[i].tolist()
            box = box_at(layout, (i, j))
            assert box == box_of(layout, layout.rank((i, j)))
            assert held == list(range(box.offset[0], box.offset[0] + box.shape[0])), (i, j)


def test_a_new_rank_of_a_large_world_reads_the_two_parts_it_straddles():
    """131,072 saved ranks of 8 rows, 131,064 after a node is lost (9 rows each, the last
    ones empty): new rank 70,000's rows 630,000-630,008 straddle saved parts 78,750 and
    78,751, found at once (not by looking at 131,072 boxes)."""
    saved = Layout((1 << 20, 64), (131072,), (0,))
    wanted = box_of(Layout((1 << 20, 64), (131064,), (0,)), 70000)
    assert wanted == Box((630000, 0), (9, 64))
    assert ranks_over(saved, wanted) == [78750, 78751]
