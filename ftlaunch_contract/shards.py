"""The checkpoint format on storage. Torch-free: the agent writes shards too.

``step_<N>/rank_<r>.bin`` holds one rank's tensor bytes, raw; ``step_<N>/rank_<r>.meta``
(msgpack) says what they are: the state's structure, each tensor's dtype/shape/offset, the
byte count and a SHA-256 of every 4 MiB block (format 2; format 1 had one of the whole
shard), so that a reader of a byte range (a rank resharding) verifies just the blocks it
read. The meta is written after the bytes, so its presence means that rank's shard is
durable, and a step is *committed* once every rank's meta exists. Nothing in a checkpoint
is ever executed or unpickled.
"""

from __future__ import annotations

import hashlib
import os
import re
from typing import Any

import msgpack

from ftlaunch_contract.parallel import Parallel
from ftlaunch_contract.storage import Storage

FORMAT = 2
FORMATS = (1, 2)  # readable
BLOCK = 4 << 20  # bytes per checksummed block
HASH_THREADS = 4  # at most, and no more than the cores this process may use
_STEP = re.compile(r"^step_(\d{9})/rank_(\d+)\.meta$")


class ShardError(ValueError):
    """A shard that is missing, unreadable or fails its checksum."""


def step_dir(step: int) -> str:
    return f"step_{step:09d}"


def meta_name(step: int, rank: int) -> str:
    return f"{step_dir(step)}/rank_{rank}.meta"


def data_name(step: int, rank: int) -> str:
    return f"{step_dir(step)}/rank_{rank}.bin"


def persist(storage: Storage, meta: dict[str, Any], data: memoryview) -> None:
    """Make one rank's shard durable: bytes first (hashed beside the write), then its meta."""
    digest = _Digest(data)
    try:
        storage.write(data_name(meta["step"], meta["rank"]), data)
    finally:
        blocks = digest.result()
    storage.write(meta_name(meta["step"], meta["rank"]), msgpack.packb(
        {**meta, "format": FORMAT, "block": BLOCK, "block_sha256": blocks}))


def listing(storage: Storage) -> dict[int, set[int]]:
    """Step -> the ranks whose shard of it is durable (one listing of storage)."""
    ranks: dict[int, set[int]] = {}
    for name in storage.list():
        m = _STEP.match(name)
        if m:
            ranks.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
    return ranks


def committed_steps(storage: Storage, world_size: int) -> list[int]:
    """Steps whose every rank's shard is durable, oldest first."""
    return sorted(s for s, have in listing(storage).items() if have >= set(range(world_size)))


def saved_world_sizes(storage: Storage, ranks: dict[int, set[int]] | None = None) -> dict[int, int]:
    """Every committed step, whatever world size saved it -> that world size (read from
    its rank 0 meta; a step is committed once every rank of that world has its meta).
    ``ranks``: the storage's ``listing`` if the caller has it."""
    ranks = listing(storage) if ranks is None else ranks
    worlds = {}
    for step, have in ranks.items():
        if 0 not in have:
            continue
        try:
            meta = msgpack.unpackb(storage.read(meta_name(step, 0)), raw=False,
                                   strict_map_key=False)
        except (OSError, ValueError):
            continue
        world = meta.get("world_size") if isinstance(meta, dict) else None
        if type(world) is int and world > 0 and have >= set(range(world)):
            worlds[step] = world
    return worlds


def read_meta(storage: Storage, step: int, rank: int) -> dict[str, Any]:
    """One rank's shard meta (what its bytes are), or ShardError."""
    try:
        meta = msgpack.unpackb(storage.read(meta_name(step, rank)), raw=False,
                               strict_map_key=False)
    except (OSError, ValueError) as e:
        raise ShardError(f"step {step}: rank {rank}'s meta unreadable: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") not in FORMATS \
            or type(meta.get("nbytes")) is not int:
        raise ShardError(f"step {step}: rank {rank}'s shard has an unknown format")
    return meta


def read(storage: Storage, step: int, rank: int) -> tuple[dict[str, Any], bytearray]:
    """One rank's shard, verified against its meta."""
    meta = read_meta(storage, step, rank)
    try:
        data = bytearray(storage.read(data_name(step, rank)))
    except OSError as e:
        raise ShardError(f"step {step}: rank {rank}'s shard unreadable: {e}") from None
    if len(data) != meta["nbytes"] or not _verified(meta, memoryview(data), 0):
        raise ShardError(f"step {step}: rank {rank}'s shard fails its checksum")
    return meta, data


def block_size(meta: dict[str, Any]) -> int:
    """The unit a shard is verified in: its blocks, or (format 1) the whole shard."""
    if meta.get("format") == 2 and type(meta.get("block")) is int and meta["block"] > 0:
        return int(meta["block"])
    return max(1, int(meta["nbytes"]))


def read_blocks(storage: Storage, meta: dict[str, Any], first: int,
                count: int) -> bytes | bytearray:
    """Blocks ``first`` .. ``first + count - 1`` of a shard (one ranged read), verified."""
    step, rank, size, block = meta["step"], meta["rank"], meta["nbytes"], block_size(meta)
    start, end = first * block, min(size, (first + count) * block)
    if not 0 <= start < end or count <= 0:
        raise ShardError(f"step {step}: rank {rank}'s shard has no blocks {first}+{count}")
    try:
        data = storage.read_range(data_name(step, rank), start, end - start)
    except OSError as e:
        raise ShardError(f"step {step}: rank {rank}'s shard unreadable: {e}") from None
    if len(data) != end - start or not _verified(meta, memoryview(data), start):
        raise ShardError(f"step {step}: rank {rank}'s shard fails its checksum")
    return data


def _verified(meta: dict[str, Any], data: memoryview, start: int) -> bool:
    """Whether ``data`` (the shard's bytes from ``start``, on a block boundary) matches."""
    if meta.get("format") == 1:
        return start == 0 and hashlib.sha256(data).hexdigest() == meta.get("sha256")
    block, digests = meta.get("block"), meta.get("block_sha256")
    if type(block) is not int or block <= 0 or not isinstance(digests, list) \
            or len(digests) != -(-meta["nbytes"] // block):
        return False
    first = start // block
    return all(hashlib.sha256(data[i:i + block]).digest() == digests[first + i // block]
               for i in range(0, len(data), block))


def retire(storage: Storage, world_size: int, keep_last: int, keep_every: int = 0) -> None:
    """Delete all but the newest ``keep_last`` committed steps (and anything older), except
    multiples of ``keep_every``."""
    committed = committed_steps(storage, world_size)
    if keep_last <= 0 or len(committed) <= keep_last:
        return
    oldest_kept = committed[-keep_last]
    steps = {int(m.group(1)) for name in storage.list() if (m := _STEP.match(name))}
    for step in sorted(s for s in steps if s < oldest_kept):
        if not (keep_every and step % keep_every == 0 and step in committed):
            storage.remove_prefix(step_dir(step))


class _Digest:
    """SHA-256 of every block of a buffer, computed on a few threads beside the write
    (hashlib and the writes release the GIL): hashing is then off the critical path
    wherever there are cores for it, instead of one core's 1.4 GB/s bounding a shard."""

    def __init__(self, data: memoryview):
        threads = min(HASH_THREADS, len(os.sched_getaffinity(0)))
        self._blocks = Parallel(_sha256, [data[i:i + BLOCK] for i in range(0, len(data), BLOCK)],
                                threads, name="ftlaunch-ckpt-hash")

    def result(self) -> list[bytes]:
        return self._blocks.result()


def _sha256(data: memoryview) -> bytes:
    return hashlib.sha256(data).digest()
