"""A resized world's restore, at scale: what one rank spends learning where every saved
part sits, by gathering every saved part's box (checkpoints without a layout) or from the
layout saved with each sharded tensor.

A job of W ranks (8 a node) loses a node and restores on W - 8. Its state has --tensors
sharded 2-D tensors (FSDP2: dimension 0 over a 1-D mesh of the world). A rank's work, from
trainer_shim.checkpoint's own functions, no process group:

    gathered    the integers every rank receives (W rows of every saved part's box), their
                decoding into boxes (_decoded_boxes) and each tensor's list of W parts
                (what _read_resharded built before 2026-12-06)
    layout      each tensor's saved parts over this rank's new box (reshard.ranks_over)
                and their boxes (reshard.box_of)

    python scripts/bench_reshard.py --ranks 4096,16384,131072
"""

from __future__ import annotations

import argparse
import resource
import time

from ftlaunch_contract.reshard import Box, Layout, box_of, ranks_over
from trainer_shim.checkpoint import _decoded_boxes, _encoded_boxes

ROWS, COLS = 1 << 20, 64


def gathered(world: int, tensors: int, rank: int) -> tuple[float, int]:
    """Seconds and integers received for one rank's picture of every saved part."""
    layout = Layout((ROWS, COLS), (world,), (0,))
    rows = [[r, *_encoded_boxes([box_of(layout, r)] * tensors)] for r in range(world)]
    ints = sum(map(len, rows))
    new = box_of(Layout((ROWS, COLS), (world - 8,), (0,)), rank)
    began = time.perf_counter()
    boxes = _decoded_boxes(rows, world)
    for k in range(tensors):
        parts = [(boxes[r][k], r) for r in range(world)]
        [r for box, r in parts if not box.empty and _overlaps(box, new)]
    return time.perf_counter() - began, ints


def from_layout(world: int, tensors: int, rank: int) -> float:
    layout = Layout((ROWS, COLS), (world,), (0,))
    new = box_of(Layout((ROWS, COLS), (world - 8,), (0,)), rank)
    began = time.perf_counter()
    for _ in range(tensors):
        [box_of(layout, r) for r in ranks_over(layout, new)]
    return time.perf_counter() - began


def _overlaps(a: Box, b: Box) -> bool:
    return all(x < y + m and y < x + n
               for x, n, y, m in zip(a.offset, a.shape, b.offset, b.shape, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="4096,16384,131072")
    parser.add_argument("--tensors", type=int, default=200)
    parser.add_argument("--gather-up-to", type=int, default=16384,
                        help="the gathered path only up to this many ranks (memory)")
    args = parser.parse_args()
    print("| saved ranks | gathered: ints a rank receives | gathered: s a rank | "
          "layout: s a rank | layout: parts a rank |")
    print("|---|---|---|---|---|")
    for world in map(int, args.ranks.split(",")):
        rank = (world - 8) // 2 + 3
        layout_s = from_layout(world, args.tensors, rank)
        parts = len(ranks_over(Layout((ROWS, COLS), (world,), (0,)),
                               box_of(Layout((ROWS, COLS), (world - 8,), (0,)), rank)))
        if world <= args.gather_up_to:
            seconds, ints = gathered(world, args.tensors, rank)
            cells = f"{ints:,} | {seconds:.2f}"
        else:
            cells = f"{world * (2 + 5 * args.tensors):,} (not run) | -"
        print(f"| {world:,} | {cells} | {layout_s * 1e3:.2f} ms | {parts} a tensor |",
              flush=True)
    print(f"\npeak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
