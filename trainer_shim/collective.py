"""One small integer agreed by every rank: how ranks settle a checkpoint step or a stop."""

from __future__ import annotations

import sys


def initialized() -> bool:
    """Whether torch.distributed is up (without importing torch when nothing did)."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def all_reduce_int(value: int, op: str) -> int:
    """``value`` reduced over all ranks with ``op`` ("min" or "max"); on the device the
    process group's backend needs (NCCL only reduces GPU tensors)."""
    import torch
    import torch.distributed as dist

    device = (torch.device("cuda", torch.cuda.current_device())
              if "nccl" in str(dist.get_backend()) else torch.device("cpu"))
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.MAX)
    return int(t.item())
