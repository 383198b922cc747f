"""Asynchronous checkpoints: ``save`` blocks only to copy tensors into staging memory.

A background thread makes the staged copy durable under ``<dir>/step_<N>/``: each rank
writes ``rank_<r>.bin`` (raw tensor bytes, no pickle) and then ``rank_<r>.meta`` (msgpack:
the state's structure, each tensor's dtype/shape/offset, a SHA-256 of the bytes), each
under a temporary name, fsynced, renamed, directory fsynced. A step is *committed* once
all ranks' metas exist, so a crash at any instant leaves the newest committed step whole;
``load_latest`` verifies checksums and falls back to an older step when one is damaged.

First slice of issue #5: POSIX paths, staging in process memory-mapped files under
/dev/shm, double-buffered. Agent-owned staging, S3 and coordinated commits come next.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import re
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import torch

log = logging.getLogger("trainer_shim.checkpoint")

STEP_DIR = re.compile(r"^step_(\d{9})$")
FORMAT = 1


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read; the message says which and why."""


@dataclass
class _Staged:
    """One staging slot: shared memory holding one save's tensor bytes, reused across saves.

    The file is unlinked as soon as it is mapped, so nothing is left in /dev/shm even if
    the process is killed (agent-owned staging that outlives a crash is the next slice)."""

    directory: str | None
    buffer: mmap.mmap | None = None
    size: int = 0
    busy: threading.Event | None = None  # set once the writer is done with this slot

    def ensure(self, nbytes: int) -> None:
        if self.buffer is not None and self.size >= nbytes:
            return
        if self.buffer is not None:
            self.buffer.close()
        with tempfile.TemporaryFile(prefix="ftlaunch-stage-", dir=self.directory) as f:
            f.truncate(max(nbytes, 1))
            self.buffer = mmap.mmap(f.fileno(), max(nbytes, 1))
        self.size = nbytes

    def stage(self, tensors: list[torch.Tensor]) -> list[dict[str, Any]]:
        """Copy the tensors in, one after another (64-byte aligned, same dtype: a plain
        vectorised copy); returns where each one went."""
        sizes = [t.numel() * t.element_size() for t in tensors]
        self.ensure(sum(_aligned(n) for n in sizes))
        entries, offset = [], 0
        for t, size in zip(tensors, sizes, strict=True):
            if size:
                target = torch.frombuffer(self.buffer, dtype=t.dtype, count=t.numel(),
                                          offset=offset)
                target.copy_(t.detach().reshape(-1))
            entries.append({"dtype": str(t.dtype).removeprefix("torch."),
                            "shape": list(t.shape), "offset": offset, "nbytes": size})
            offset += _aligned(size)
        return entries


class AsyncCheckpointer:
    def __init__(self, directory: str | os.PathLike, *, rank: int | None = None,
                 world_size: int | None = None, keep_last: int = 3,
                 staging_dir: str = "/dev/shm"):
        self.directory = Path(directory)
        self.rank = int(os.environ.get("RANK", 0)) if rank is None else rank
        self.world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
        self.keep_last = keep_last
        staging = staging_dir if os.path.isdir(staging_dir) else None
        self._slots = [_Staged(staging), _Staged(staging)]  # double-buffered
        self._next_slot = 0
        self._writer: threading.Thread | None = None
        self._error: BaseException | None = None

    # --- saving --------------------------------------------------------------------------

    def save(self, step: int, **state: Any) -> None:
        """Stage a copy of ``state`` (returns then) and persist it in the background."""
        self._raise_writer_error()
        tensors: list[torch.Tensor] = []
        tree = _encode({k: _state_of(v) for k, v in state.items()}, tensors)
        slot = self._slots[self._next_slot]
        self._next_slot ^= 1
        if slot.busy is not None:
            slot.busy.wait()  # the writer still persists this slot's previous save
        entries = slot.stage(tensors)
        nbytes = entries[-1]["offset"] + entries[-1]["nbytes"] if entries else 0
        slot.busy = threading.Event()
        previous = self._writer
        self._writer = threading.Thread(target=self._persist,
                                        args=(step, tree, entries, nbytes, slot, previous),
                                        name="ftlaunch-ckpt-writer", daemon=True)
        self._writer.start()

    def wait(self) -> None:
        """Block until every save so far is durable; raises the writer's error if any."""
        if self._writer is not None:
            self._writer.join()
        self._raise_writer_error()

    def close(self) -> None:
        self.wait()
        for slot in self._slots:
            if slot.buffer is not None:
                slot.buffer.close()
                slot.buffer = None

    def _persist(self, step, tree, entries, nbytes, slot, previous) -> None:
        try:
            if previous is not None:
                previous.join()  # steps become durable in order
            step_dir = self.directory / f"step_{step:09d}"
            step_dir.mkdir(parents=True, exist_ok=True)
            data = memoryview(slot.buffer)[:nbytes]
            digest = _Digest(data)  # hash and write at once: both release the GIL
            try:
                _write_atomic(step_dir / f"rank_{self.rank}.bin", data)
            finally:
                sha256 = digest.result()
                data.release()
            meta = {"format": FORMAT, "step": step, "rank": self.rank,
                    "world_size": self.world_size, "tree": tree, "tensors": entries,
                    "nbytes": nbytes, "sha256": sha256}
            _write_atomic(step_dir / f"rank_{self.rank}.meta", msgpack.packb(meta))
            _fsync_dir(step_dir)
            _fsync_dir(self.directory)
            if self.rank == 0:
                self._retire_old_steps()
        except BaseException as e:  # surfaced by the next save() or wait()
            self._error = e
        finally:
            slot.busy.set()

    def _retire_old_steps(self) -> None:
        committed = self.committed_steps()
        for step in committed[:-self.keep_last] if self.keep_last > 0 else []:
            shutil.rmtree(self.directory / f"step_{step:09d}", ignore_errors=True)

    def _raise_writer_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointError(f"saving a checkpoint to {self.directory} failed: {error}; "
                                  "training went on, the previous committed step stands") \
                from error

    # --- loading -------------------------------------------------------------------------

    def committed_steps(self) -> list[int]:
        """Steps whose every rank's metadata is durable, oldest first."""
        if not self.directory.is_dir():
            return []
        steps = []
        for entry in self.directory.iterdir():
            m = STEP_DIR.match(entry.name)
            if m and all((entry / f"rank_{r}.meta").exists() for r in range(self.world_size)):
                steps.append(int(m.group(1)))
        return sorted(steps)

    def latest_step(self) -> int | None:
        steps = self.committed_steps()
        return steps[-1] if steps else None

    def load_latest(self, **state: Any) -> int:
        """Load the newest intact committed step into ``state``'s objects; returns the step
        (0 when there is none). Every rank's shard is verified, so all ranks agree."""
        for step in reversed(self.committed_steps()):
            try:
                loaded = self._read(step)
            except CheckpointError as e:
                log.warning("%s; falling back to the previous committed step", e)
                continue
            for name, target in state.items():
                _restore(target, loaded[name])
            return step
        return 0

    def _read(self, step: int) -> dict[str, Any]:
        step_dir = self.directory / f"step_{step:09d}"
        mine = None
        for r in range(self.world_size):
            try:
                meta = msgpack.unpackb((step_dir / f"rank_{r}.meta").read_bytes(),
                                       raw=False, strict_map_key=False)
                data = (step_dir / f"rank_{r}.bin").read_bytes()
            except (OSError, ValueError) as e:
                raise CheckpointError(f"step {step}: rank {r}'s shard unreadable: {e}") from None
            if len(data) != meta.get("nbytes") or hashlib.sha256(data).hexdigest() != meta.get(
                    "sha256"):
                raise CheckpointError(f"step {step}: rank {r}'s shard fails its checksum")
            if r == self.rank:
                mine = (meta, data)
        meta, data = mine
        tensors = [_tensor(data, e) for e in meta["tensors"]]
        return _decode(meta["tree"], tensors)


class _Digest(threading.Thread):
    """SHA-256 of a buffer, computed beside the write."""

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


def _aligned(n: int) -> int:
    return (n + 63) // 64 * 64


# --- state trees: nested dicts/lists of tensors and plain values, never pickle -----------------

_PLAIN = (int, float, bool, str, bytes, type(None))


def _state_of(value: Any) -> Any:
    return value.state_dict() if hasattr(value, "state_dict") else value


def _encode(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return {"__t__": len(tensors) - 1}
    if isinstance(value, dict):
        return {"__d__": [[_encode(k, tensors), _encode(v, tensors)] for k, v in value.items()]}
    if isinstance(value, (list, tuple)):
        return {"__l__": [_encode(v, tensors) for v in value], "tuple": isinstance(value, tuple)}
    if isinstance(value, _PLAIN):
        return value
    raise CheckpointError(f"cannot checkpoint a {type(value).__name__}: use tensors, dicts, "
                          "lists and plain values (or an object with state_dict())")


def _decode(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, dict):
        if "__t__" in value:
            return tensors[value["__t__"]]
        if "__d__" in value:
            return {_decode(k, tensors): _decode(v, tensors) for k, v in value["__d__"]}
        items = [_decode(v, tensors) for v in value["__l__"]]
        return tuple(items) if value["tuple"] else items
    return value


def _tensor(data: bytes, entry: dict) -> torch.Tensor:
    dtype = getattr(torch, entry["dtype"])
    raw = torch.frombuffer(bytearray(data[entry["offset"]:entry["offset"] + entry["nbytes"]]),
                           dtype=torch.uint8) if entry["nbytes"] else torch.empty(0, dtype=torch.uint8)
    return raw.view(dtype).reshape(entry["shape"])


def _restore(target: Any, value: Any) -> None:
    if hasattr(target, "load_state_dict"):
        target.load_state_dict(value)
    elif isinstance(target, dict):
        target.clear()
        target.update(value)
    else:
        raise CheckpointError(f"cannot load into a {type(target).__name__}: pass an object with "
                              "load_state_dict() or a dict")


def _write_atomic(path: Path, data) -> None:
    """Temporary name, fsync, rename: the final name only ever holds whole contents."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
