"""Small integers agreed by every rank: how ranks settle a checkpoint step or a stop, and
hear what rank 0 alone read (the committed steps on storage)."""

from __future__ import annotations

import sys
from typing import Any


def initialized() -> bool:
    """Whether torch.distributed is up (without importing torch when nothing did)."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def all_reduce_int(value: int, op: str) -> int:
    """``value`` reduced over all ranks with ``op`` ("min" or "max")."""
    import torch.distributed as dist

    t = _ints([value])
    dist.all_reduce(t, op=dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.MAX)
    return int(t.item())


def broadcast_ints(values: list[int]) -> list[int]:
    """Rank 0's ``values`` on every rank (the others' are ignored): its count, then them."""
    import torch.distributed as dist

    count = _ints([len(values)])
    dist.broadcast(count, 0)
    if not count.item():
        return []
    data = _ints(values if dist.get_rank() == 0 else [0] * int(count.item()))
    dist.broadcast(data, 0)
    return [int(v) for v in data.tolist()]


def all_gather_ints(values: list[int]) -> list[list[int]]:
    """Every rank's ``values`` (of any length), in rank order."""
    import torch
    import torch.distributed as dist

    longest = all_reduce_int(len(values), "max")
    mine = _ints([*values, *[0] * (longest - len(values)), len(values)])  # its length last
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return [row[:row[-1]] for row in (t.tolist() for t in gathered)]


def _ints(values: list[int]) -> Any:
    """An int64 tensor on the device the process group's backend needs (NCCL only reduces
    GPU tensors)."""
    import torch
    import torch.distributed as dist

    device = (torch.device("cuda", torch.cuda.current_device())
              if "nccl" in str(dist.get_backend()) else torch.device("cpu"))
    return torch.tensor(values, dtype=torch.int64, device=device)
