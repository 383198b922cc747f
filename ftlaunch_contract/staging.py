"""Staging memory: where ``save`` copies tensors before they are persisted. Torch-free.

Under an agent, staging lives in a directory the agent owns (``FTLAUNCH_STAGING``, in
/dev/shm): two slots per global rank, ``rank_<r>.<k>.data`` (the tensor bytes) and
``rank_<r>.<k>.meta`` (what the bytes are: step, structure, destination). A slot's meta is
removed before its data is overwritten and written (atomically) once the copy is whole, so
a meta always describes complete data. The files outlive the rank: a replacement on the
same node restores from them in milliseconds, and the agent persists what a dead rank
staged but never wrote (``flush``). The agent deletes the directory when it exits.

Without an agent the slots are anonymous (unlinked at once): nothing can leak.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack

from ftlaunch_contract import shards
from ftlaunch_contract.storage import Storage, open_storage

log = logging.getLogger("ftlaunch.staging")

SLOTS = 2  # double-buffered: a new save never overwrites the copy being persisted
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14+


class StagingFull(OSError):
    """The staging file system cannot hold the copy."""


class Slot:
    """One reusable staging buffer (and, when named, its meta beside it)."""

    def __init__(self, directory: str | None, rank: int, index: int):
        self.index = index
        self._named = directory is not None
        self._data_path = Path(directory or ".", f"rank_{rank}.{index}.data")
        self.meta_path = self._data_path.with_suffix(".meta")
        self._anonymous_dir = None if self._named else _shm_or_none()
        self.buffer: mmap.mmap | None = None
        self._fd = -1
        self._anonymous_meta: dict[str, Any] | None = None
        self.before_unmap: Callable[[mmap.mmap], None] | None = None  # e.g. un-pin from CUDA

    def ensure(self, nbytes: int, populate: bool = True) -> None:
        """Map at least ``nbytes``; the space is reserved up front (posix_fallocate), so a
        full /dev/shm is a clear error here, never a SIGBUS in the middle of a copy.
        ``populate=False``: only sized and mapped; the caller reserves each part with
        ``reserve`` before writing it (a copy arriving over the network then allocates
        memory as it arrives, instead of before)."""
        nbytes = max(nbytes, 1)
        if self._fd < 0:
            if self._named:
                self._fd = os.open(self._data_path, os.O_RDWR | os.O_CREAT, 0o600)
            else:
                with tempfile.TemporaryFile(prefix="ftlaunch-stage-", dir=self._anonymous_dir) as f:
                    self._fd = os.dup(f.fileno())  # unlinked already: gone with the process
        if self.buffer is not None and len(self.buffer) >= nbytes:
            return  # (every save after the first: no system call)
        size = os.fstat(self._fd).st_size
        if size < nbytes:
            self.close_buffer()
            if populate:
                self.reserve(0, nbytes)
            else:
                os.ftruncate(self._fd, nbytes)
            size = nbytes
        self.close_buffer()
        self.buffer = _map(self._fd, size, populate)

    def reserve(self, offset: int, nbytes: int) -> None:
        """Allocate this part of the slot (StagingFull when the file system is full) and,
        once mapped, map its pages in one call rather than a fault per page."""
        try:
            os.posix_fallocate(self._fd, offset, nbytes)
            if self.buffer is not None and offset % mmap.PAGESIZE == 0:
                with contextlib.suppress(OSError, ValueError):  # Linux < 5.14: faults then
                    self.buffer.madvise(MADV_POPULATE_WRITE, offset, nbytes)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                free = _free_bytes(self._fd)
                raise StagingFull(e.errno, f"staging a checkpoint needs {_gib(nbytes)} more "
                                  f"in {self._data_path.parent if self._named else self._anonymous_dir}"
                                  f" but {_gib(free)} is free: enlarge /dev/shm (docker "
                                  "--shm-size, a Kubernetes emptyDir with medium Memory) or "
                                  "save less state per rank") from None
            raise

    def meta(self) -> dict[str, Any] | None:
        """What this slot holds, if it holds a whole save (named slots only)."""
        if not self._named:
            return self._anonymous_meta
        try:
            meta: dict[str, Any] = msgpack.unpackb(self.meta_path.read_bytes(), raw=False,
                                                   strict_map_key=False)
            return meta
        except (OSError, ValueError):
            return None

    def invalidate(self) -> None:
        """About to be overwritten: from now on it holds nothing."""
        self._anonymous_meta = None
        if self._named:
            self.meta_path.unlink(missing_ok=True)

    def seal(self, meta: dict[str, Any]) -> None:
        """The copy is whole: record what it is."""
        self._anonymous_meta = meta
        if self._named:
            tmp = self.meta_path.with_name(self.meta_path.name + ".tmp")
            tmp.write_bytes(msgpack.packb(meta))
            os.replace(tmp, self.meta_path)

    def open_existing(self) -> bool:
        """Map a slot a previous process of this rank left (a replacement restoring)."""
        if not self._named or not self._data_path.exists():
            return False
        self._fd = os.open(self._data_path, os.O_RDWR)
        size = os.fstat(self._fd).st_size
        if size:
            self.buffer = _map(self._fd, size)
        return True

    def close_buffer(self) -> None:
        if self.buffer is not None:
            if self.before_unmap is not None:
                self.before_unmap(self.buffer)
            self.buffer.close()
            self.buffer = None

    def close(self) -> None:
        self.close_buffer()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def read_meta(path: Path) -> dict[str, Any] | None:
    """A sealed slot's meta (what its data is), or None: gone, being rewritten, malformed."""
    try:
        meta = msgpack.unpackb(path.read_bytes(), raw=False, strict_map_key=False)
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or not all(
            type(meta.get(k)) is int for k in ("world_size", "rank", "step", "nbytes")):
        return None
    return meta


def _map(fd: int, size: int, populate: bool = True) -> mmap.mmap:
    """Shared, with every page mapped up front (MAP_POPULATE): no page fault mid-copy."""
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | (
        getattr(mmap, "MAP_POPULATE", 0) if populate else 0))


OWNER_LOCK = ".owner"  # flock'ed by the owning agent for as long as it lives
JOB_FILE = ".job"  # which job the agent served: only an agent of the same job adopts
_held_locks: list[int] = []


def create_dir(job: str) -> Path:
    """The agent's staging directory (0700), in /dev/shm when there is one, locked for as
    long as this process lives. What agents of the same ``job`` that are gone (SIGKILLed: a
    pod killed after its grace period, a node requeued) staged on this host is adopted:
    moved in here, so this node holds it in memory for its ranks' restore and persists what
    was not durable yet (``flush``). Another job's is removed: its shards would be counted
    as held by this node under the same (world, rank, step), and could never be restored."""
    root = _shm_or_none() or tempfile.gettempdir()
    fresh = Path(tempfile.mkdtemp(prefix=".ftlaunch-new-", dir=root))
    fd = os.open(fresh / OWNER_LOCK, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    _held_locks.append(fd)  # released by the kernel when this process is gone, however
    (fresh / JOB_FILE).write_text(job)
    path = Path(root, f"ftlaunch-staging-{os.getpid()}-{fresh.name.rsplit('-', 1)[1]}")
    fresh.rename(path)  # named only once locked: a sweep never takes it for a dead one's
    adopt_stale(path, job)
    return path


def adopt_stale(into: Path, job: str) -> list[str]:
    """Move the staged shards of ``job``'s agents that are gone into ``into`` (newest first;
    a name taken already keeps its newer shard), delete the rest of their directories and
    those of other jobs' agents that are gone; returns the shard files adopted. Ownership is
    the directory's lock, so an agent in another PID namespace (a container sharing this
    /dev/shm) is never taken for a dead one."""
    adopted, foreign = [], 0
    stale = [entry for entry in Path(into.parent).glob("ftlaunch-staging-*-*")
             if entry != into and _owner_gone(entry)]
    for entry in sorted(stale, key=_newest_meta, reverse=True):
        if _job_of(entry) != job:
            foreign += 1
            shutil.rmtree(entry, ignore_errors=True)
            continue
        for sub in ("", "replicas"):
            (into / sub).mkdir(exist_ok=True)
            for meta in _listed(Path(entry, sub).glob("rank_*.*.meta")):
                data, target = meta.with_suffix(".data"), into / sub / meta.name
                if target.exists() or not data.exists():
                    continue
                with contextlib.suppress(OSError):  # data first: never a meta without data
                    data.rename(target.with_suffix(".data"))
                    meta.rename(target)
                    adopted.append(str(Path(sub, meta.stem)))
        shutil.rmtree(entry, ignore_errors=True)
    if adopted:
        log.warning("adopted %d staged checkpoint shard(s) of agents gone from this host: %s",
                    len(adopted), ", ".join(adopted))
    if foreign:
        log.info("removed the staging of %d agent(s) of other jobs gone from this host", foreign)
    return adopted


def _job_of(entry: Path) -> str | None:
    try:
        return (entry / JOB_FILE).read_text()
    except OSError:
        return None  # made before jobs were recorded: another job's, for all we know


def _owner_gone(entry: Path) -> bool:
    """Whether the agent that made ``entry`` is gone: its lock is free (or, for a directory
    made before locks, its pid is)."""
    try:
        if entry.stat().st_uid != os.getuid():
            return False
        fd = os.open(entry / OWNER_LOCK, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        try:
            return not _alive(int(entry.name.split("-")[2]))
        except (IndexError, ValueError):
            return False
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def _newest_meta(entry: Path) -> float:
    newest = 0.0
    for meta in _listed(entry.rglob("rank_*.*.meta")):
        with contextlib.suppress(OSError):  # taken meanwhile by another new agent
            newest = max(newest, meta.stat().st_mtime)
    return newest


def _listed(paths: Iterator[Path]) -> list[Path]:
    """What a walk of a gone agent's staging finds, sorted, until the directory is gone: agents
    that leave or start at once on a host each adopt what the gone ones left, and one deletes
    a directory another is walking (a three-node job's two survivors exiting together)."""
    found: list[Path] = []
    with contextlib.suppress(FileNotFoundError):
        found.extend(paths)
    return sorted(found)


def flush(directory: str | Path) -> list[tuple[int, int]]:
    """Persist every staged save that is not durable yet (oldest first); returns the
    (rank, step) written. The agent calls it once its ranks are gone, so a step a dead or
    preempted rank staged but never wrote is not lost."""
    pending = []
    for meta_path in Path(directory).glob("rank_*.*.meta"):
        try:
            meta = msgpack.unpackb(meta_path.read_bytes(), raw=False, strict_map_key=False)
            pending.append((meta["step"], meta["rank"], meta, meta_path.with_suffix(".data")))
        except (OSError, ValueError, KeyError) as e:
            log.warning("staged checkpoint %s unreadable: %s", meta_path, e)
    written = []
    for step, rank, meta, data_path in sorted(pending, key=lambda p: (p[0], p[1])):
        try:
            storage = open_storage(meta["dest"])
            if storage.exists(shards.meta_name(step, rank)):
                continue
            _persist_mapped(storage, meta, data_path)
            written.append((rank, step))
        except (OSError, ValueError) as e:
            log.warning("could not persist rank %d's staged step %d: %s", rank, step, e)
    return written


def _persist_mapped(storage: Storage, meta: dict[str, Any], data_path: Path) -> None:
    """Persist a staged shard from its mapping. A failure is raised once the mapping is
    closed: its traceback holds the writer's views of it, which would make the close
    fail instead (BufferError, masking the error and ending the agent: chaos seed 1806)."""
    failure: BaseException | None = None
    with open(data_path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        view = memoryview(m)[:meta["nbytes"]]
        try:
            shards.persist(storage, meta, view)
        except (OSError, ValueError) as e:
            failure = e.with_traceback(None)  # without the frames that hold the views
        finally:
            view.release()
    if failure is not None:
        raise failure


def _shm_or_none() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _free_bytes(fd: int) -> int:
    st = os.fstatvfs(fd)
    return st.f_bavail * st.f_frsize


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"
