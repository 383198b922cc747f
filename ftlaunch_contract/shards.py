"""The checkpoint format on storage. Torch-free: the agent writes shards too.

``step_<N>/rank_<r>.bin`` holds one rank's tensor bytes, raw; ``step_<N>/rank_<r>.meta``
(msgpack) says what they are: the state's structure, each tensor's dtype/shape/offset, the
byte count and a SHA-256. The meta is written after the bytes, so its presence means that
rank's shard is durable, and a step is *committed* once every rank's meta exists. Nothing
in a checkpoint is ever executed or unpickled.
"""

from __future__ import annotations

import hashlib
import re
import threading
from typing import Any

import msgpack

from ftlaunch_contract.storage import Storage

FORMAT = 1
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
        sha256 = digest.result()
    storage.write(meta_name(meta["step"], meta["rank"]),
                  msgpack.packb({**meta, "format": FORMAT, "sha256": sha256}))


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
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ShardError(f"step {step}: rank {rank}'s shard has an unknown format")
    return meta


def read(storage: Storage, step: int, rank: int) -> tuple[dict[str, Any], bytearray]:
    """One rank's shard, verified against its meta."""
    try:
        meta = msgpack.unpackb(storage.read(meta_name(step, rank)), raw=False,
                               strict_map_key=False)
        data = bytearray(storage.read(data_name(step, rank)))
    except (OSError, ValueError) as e:
        raise ShardError(f"step {step}: rank {rank}'s shard unreadable: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ShardError(f"step {step}: rank {rank}'s shard has an unknown format")
    if len(data) != meta.get("nbytes") or hashlib.sha256(data).hexdigest() != meta.get("sha256"):
        raise ShardError(f"step {step}: rank {rank}'s shard fails its checksum")
    return meta, data


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


class _Digest(threading.Thread):
    """SHA-256 of a buffer, computed beside the write (both release the GIL)."""

    def __init__(self, data: memoryview):
        super().__init__(name="ftlaunch-ckpt-hash", daemon=True)
        self._data, self._hex = data, ""
        self.start()

    def run(self) -> None:
        h = hashlib.sha256()
        for i in range(0, len(self._data), 64 << 20):
            h.update(self._data[i:i + (64 << 20)])
        self._hex = h.hexdigest()

    def result(self) -> str:
        self.join()
        return self._hex
