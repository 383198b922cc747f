"""Checkpoint replicas: copies of staged shards kept in peer nodes' shared memory.

One service per agent, beside its staging directory. It serves the shards whole in this
node's memory (its ranks' staging slots, and ``replicas/``: the copies it keeps for peers
or pulled for a restore) to authenticated peers, in ranged chunks; and it *pulls*: a
peer's offer ("rank 4 staged step 40") or the coordinator's fetch list makes it read the
shard from its source in chunks and keep it in a ``replicas/`` slot, sealed only once whole.
A save that is overwritten mid-transfer fails the transfer (the source re-checks the
save's id after every chunk it reads), so a replica is never torn.

Wire: one ZeroMQ frame a message, ``len(header) | header | data | mac``: ``header`` a
msgpack map, ``mac`` an HMAC-SHA256 of what precedes it under a key derived from the job
secret. Nothing is unpickled; anything unsigned or malformed is dropped. Two threads do the
work, off the agent's loop: the server answers requests, the puller moves bytes (bounded by
``--replica-bandwidth`` for replicas; restores go at full speed). The agent hears of
finished transfers through ``news()`` (its poll loop watches ``fd``).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import itertools
import logging
import os
import queue
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import zmq

from ftlaunch_contract.messages import Held, Peer
from ftlaunch_contract.protocol import ProtocolError, unpack_map
from ftlaunch_contract.staging import SLOTS, Slot, StagingFull, read_meta

log = logging.getLogger("ftlaunch.replicas")

CHUNK = 4 << 20
WINDOW = 4  # chunks in flight per transfer
REPLY_TIMEOUT = 10.0  # seconds without a reply before a transfer is given up
MAX_HEADER = 64 << 20  # a meta lists every tensor of a shard
MAC_BYTES = 32
_LENGTH = struct.Struct("<I")


class TransferError(RuntimeError):
    """A transfer that failed; the text says why."""


class _GivenWay(Exception):
    """A replica copy stopped for a restore queued behind it: the recovery waits on that
    (chaos seed 1354: a copy from a node just lost held a restore up for its 10 s timeout)."""


@dataclass(frozen=True)
class Transferred:
    """A shard now whole in this node's memory (``purpose``: replica or restore)."""

    held: Held
    source: str
    purpose: str
    nbytes: int
    seconds: float


@dataclass(frozen=True)
class NotTransferred:
    held: Held
    source: str
    purpose: str
    reason: str


@dataclass(frozen=True)
class FetchDone:
    """Every shard of the coordinator's fetch list has been pulled, or given up."""

    pulled: int
    failed: int
    seconds: float


News = Transferred | NotTransferred | FetchDone


class Wire:
    """Signs and checks messages of one frame, ``len(header) | header | data | mac``, with a
    key derived from the secret.

    One frame, never several: libzmq 4.3 aborts the whole process (``session_base.cpp``,
    errno_assert in ``clean_pipes``; zeromq/libzmq#3442) when a connection drops while its
    socket, closing, is part-way through sending a message of several frames. A service
    closing while it streamed a chunk to a peer that gave up did exactly that."""

    def __init__(self, secret: bytes):
        self._key = hashlib.sha256(b"ftlaunch replicas\0" + secret).digest()

    def pack(self, header: dict[str, Any], data: bytes | memoryview = b"",
             fill: Callable[[memoryview], None] | None = None, nbytes: int = 0) -> bytearray:
        """The signed message; ``fill``, given instead of ``data``, writes its ``nbytes``
        in place (a shard read straight into the message: no copy of the chunk)."""
        head = msgpack.packb(header)
        size = nbytes if fill is not None else len(data)
        start = _LENGTH.size + len(head)
        message = bytearray(start + size + MAC_BYTES)
        _LENGTH.pack_into(message, 0, len(head))
        message[_LENGTH.size:start] = head
        view = memoryview(message)
        if fill is not None:
            fill(view[start:start + size])
        else:
            view[start:start + size] = data
        view[start + size:] = hmac.digest(self._key, view[:start + size], "sha256")
        return message

    def unpack(self, message: zmq.Frame | bytes | bytearray) -> tuple[dict[str, Any], memoryview]:
        view = message.buffer if isinstance(message, zmq.Frame) else memoryview(message)
        if len(view) < _LENGTH.size + MAC_BYTES:
            raise TransferError("message too short")
        (head_len,) = _LENGTH.unpack_from(view)
        start, end = _LENGTH.size + head_len, len(view) - MAC_BYTES
        if head_len > MAX_HEADER or start > end:
            raise TransferError("bad header length")
        expected = hmac.digest(self._key, view[:end], "sha256")
        if not hmac.compare_digest(expected, bytes(view[end:])):
            raise TransferError("bad signature (wrong job secret, forged or corrupted)")
        try:
            return unpack_map(bytes(view[_LENGTH.size:start])), view[start:end]
        except ProtocolError as e:
            raise TransferError(str(e)) from None


class MemoryShards:
    """The shards whole in this node's shared memory: staging slots and replicas."""

    def __init__(self, staging_dir: Path):
        self.staging_dir = Path(staging_dir)
        self.replicas_dir = self.staging_dir / "replicas"
        self.replicas_dir.mkdir(exist_ok=True)

    def metas(self) -> list[tuple[Path, dict[str, Any]]]:
        found = []
        for directory in (self.staging_dir, self.replicas_dir):
            for path in sorted(directory.glob("rank_*.*.meta")):
                meta = read_meta(path)
                if meta is not None:
                    found.append((path, meta))
        return found

    def inventory(self) -> tuple[Held, ...]:
        return tuple(sorted({_held(meta) for _, meta in self.metas()}))

    def find(self, held: Held) -> tuple[Path, dict[str, Any]] | None:
        return next(((p, m) for p, m in self.metas() if _held(m) == held), None)

    def read_into(self, held: Held, save_id: str, offset: int, into: memoryview) -> None:
        """Fill ``into`` with a shard's bytes from ``offset``, consistent with save
        ``save_id`` (checked after the read: a slot's meta is removed before its data is
        overwritten)."""
        found = self.find(held)
        if found is None or found[1].get("save_id") != save_id:
            raise TransferError(f"{_name(held)} is no longer held")
        meta_path, meta = found
        if not 0 <= offset <= offset + len(into) <= meta["nbytes"]:
            raise TransferError("range outside the shard")
        fd = os.open(meta_path.with_suffix(".data"), os.O_RDONLY)
        try:
            got = os.preadv(fd, [into], offset)
        finally:
            os.close(fd)
        again = read_meta(meta_path)
        if again is None or again.get("save_id") != save_id or got != len(into):
            raise TransferError(f"{_name(held)} was overwritten during the transfer")

    def forget_other_worlds(self, world_size: int) -> None:
        """Delete the copies kept in ``replicas/`` that another world size saved."""
        for meta_path in self.replicas_dir.glob("rank_*.*.meta"):
            meta = read_meta(meta_path)
            if meta is not None and meta["world_size"] != world_size:
                meta_path.unlink(missing_ok=True)  # the meta first: never a meta without data
                meta_path.with_suffix(".data").unlink(missing_ok=True)

    def replica_slot(self, held: Held, save_id: str) -> Slot | None:
        """The slot to pull ``held`` into (None: held already): the free one, else the one
        with the older step of that rank."""
        slots = [Slot(str(self.replicas_dir), held.rank, k) for k in range(SLOTS)]
        metas = [s.meta() for s in slots]
        if any(m is not None and m.get("save_id") == save_id for m in metas):
            return None
        free = [k for k, m in enumerate(metas) if m is None]
        k = free[0] if free else min(range(SLOTS), key=lambda i: metas[i]["step"])  # type: ignore[index]
        return slots[k]


@dataclass(order=True)
class _Job:
    priority: int  # restores first
    seq: int
    held: Held = field(compare=False)
    source: Peer = field(compare=False)
    purpose: str = field(compare=False)
    batch: int = field(compare=False, default=0)


class ReplicaService:
    def __init__(self, context: zmq.Context, secret: bytes, node_id: str, addr: str,
                 staging_dir: Path, bandwidth: float = 0.0,
                 reply_timeout: float = REPLY_TIMEOUT):
        """``bandwidth``: bytes/s cap on pulling replicas (0: none)."""
        self.reply_timeout = reply_timeout
        self.node_id, self._addr = node_id, addr
        self.shards = MemoryShards(staging_dir)
        self._context, self._wire, self._bandwidth = context, Wire(secret), bandwidth
        self._router = context.socket(zmq.ROUTER)
        self._router.linger = 0
        self.port = self._router.bind_to_random_port(f"tcp://{addr}")
        self._offers: dict[tuple[str, int], zmq.Socket] = {}  # the agent thread's sockets
        self._jobs: queue.PriorityQueue[_Job] = queue.PriorityQueue()
        self._seq = itertools.count()
        self._newest_offer: dict[tuple[int, int], int] = {}  # (world, rank) -> step
        self._batches: dict[int, list[float]] = {}  # batch -> [left, pulled, failed, t0]
        self._lock = threading.Lock()
        self._closing = threading.Event()  # a transfer under way gives up at once
        self._news: queue.SimpleQueue[News] = queue.SimpleQueue()
        self.fd, self._wake_fd = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._wake_fd, False)
        self._stop_endpoint = f"inproc://replicas-stop-{id(self)}"
        self._stop = context.socket(zmq.PAIR)
        self._stop.bind(self._stop_endpoint)
        self._threads = [threading.Thread(target=self._serve, name="ftlaunch-replica-server",
                                          daemon=True),
                         threading.Thread(target=self._pull_loop, name="ftlaunch-replica-pull",
                                          daemon=True)]
        for t in self._threads:
            t.start()

    # --- the agent's side (its own thread) ---------------------------------------------

    def inventory(self) -> tuple[Held, ...]:
        return self.shards.inventory()

    def offer(self, held: Held, to: tuple[Peer, ...]) -> None:
        """Tell ``to`` that this node holds ``held`` in memory: each pulls a copy."""
        wanted = {(p.addr, p.port) for p in to}
        for gone in [key for key in self._offers if key not in wanted]:  # holders of old rounds
            self._offers.pop(gone).close()
        for peer in to:
            sock = self._offers.get((peer.addr, peer.port))
            if sock is None:
                sock = self._offers[(peer.addr, peer.port)] = self._context.socket(zmq.DEALER)
                sock.linger = 0
                sock.sndhwm = 64
                sock.connect(f"tcp://{peer.addr}:{peer.port}")
            header = {"type": "offer", "world": held.world_size, "rank": held.rank,
                      "step": held.step, "node_id": self.node_id, "addr": self._addr,
                      "port": self.port}
            try:
                sock.send(self._wire.pack(header), zmq.NOBLOCK)
            except zmq.Again:
                log.warning("replica holder %s unreachable: %s not offered", peer.node_id,
                            _name(held))

    def fetch(self, wanted: list[tuple[Held, Peer]]) -> None:
        """Pull these shards, at full speed, before the ranks restore; ``FetchDone`` once
        all are in or given up."""
        if not wanted:
            self._tell(FetchDone(0, 0, 0.0))
            return
        with self._lock:
            batch = next(self._seq) + 1
            self._batches[batch] = [len(wanted), 0, 0, time.monotonic()]
        for held, peer in wanted:
            self._jobs.put(_Job(0, next(self._seq), held, peer, "restore", batch))

    def forget_other_worlds(self, world_size: int) -> None:
        """A step of a ``world_size`` world is committed: copies saved by other world sizes
        can no longer be the newest restorable step; free their memory (on the puller's
        thread, which is the one writing copies)."""
        self._jobs.put(_Job(1, next(self._seq), Held(world_size, 0, 0), Peer("", "", 0),
                            "forget"))

    def news(self) -> list[News]:
        with contextlib.suppress(BlockingIOError):
            os.read(self.fd, 4096)
        out = []
        while True:
            try:
                out.append(self._news.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        self._closing.set()
        self._stop.send(b"")
        self._jobs.put(_Job(-1, -1, Held(0, 0, 0), Peer("", "", 0), "stop"))
        for t in self._threads:
            t.join(timeout=self.reply_timeout + 1)
        for sock in (*self._offers.values(), self._stop, self._router):
            sock.close()
        os.close(self.fd)
        os.close(self._wake_fd)

    def _tell(self, news: News) -> None:
        self._news.put(news)
        with contextlib.suppress(BlockingIOError):  # the pipe is full of wake-ups already
            os.write(self._wake_fd, b"!")

    # --- the server thread -------------------------------------------------------------

    def _serve(self) -> None:
        stop = self._context.socket(zmq.PAIR)
        stop.connect(self._stop_endpoint)
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(stop, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if stop in ready:
                    return
                frames = self._router.recv_multipart(copy=False)
                try:
                    if len(frames) != 2:
                        raise TransferError(f"expected one frame, got {len(frames) - 1}")
                    header, _ = self._wire.unpack(frames[1])
                    reply = self._answer(header)
                except TransferError as e:
                    log.warning("replica request dropped: %s", e)
                    continue
                if reply is not None:
                    self._router.send_multipart([frames[0], reply], copy=False)
        finally:
            stop.close()

    def _answer(self, h: dict[str, Any]) -> bytearray | None:
        kind = h.get("type")
        held = Held(_int(h, "world"), _int(h, "rank"), _int(h, "step"))
        if kind == "offer":
            peer = Peer(_str(h, "node_id"), _str(h, "addr"), _int(h, "port"))
            key = (held.world_size, held.rank)
            with self._lock:
                if self._newest_offer.get(key, -1) >= held.step:
                    return None
                self._newest_offer[key] = held.step
            self._jobs.put(_Job(1, next(self._seq), held, peer, "replica"))
            return None
        nonce = _str(h, "nonce")
        try:
            if kind == "meta":
                found = self.shards.find(held)
                if found is None:
                    raise TransferError(f"{_name(held)} is not held here")
                return self._wire.pack({"nonce": nonce, "error": "", "meta": found[1]})
            if kind == "get":
                save_id, offset, nbytes = _str(h, "save_id"), _int(h, "offset"), _int(h, "nbytes")
                if not 0 <= nbytes <= CHUNK:
                    raise TransferError(f"a chunk of {nbytes} bytes asked for")
                return self._wire.pack(
                    {"nonce": nonce, "error": ""}, nbytes=nbytes,
                    fill=lambda into: self.shards.read_into(held, save_id, offset, into))
        except (TransferError, OSError) as e:
            return self._wire.pack({"nonce": nonce, "error": str(e)})
        raise TransferError(f"unknown request {kind!r}")

    # --- the puller thread -------------------------------------------------------------

    def _pull_loop(self) -> None:
        sockets: dict[tuple[str, int], zmq.Socket] = {}
        try:
            while (job := self._jobs.get()).purpose != "stop":
                if job.purpose == "forget":
                    self.shards.forget_other_worlds(job.held.world_size)
                    continue
                if job.purpose == "replica" and \
                        self._newest_offer.get((job.held.world_size, job.held.rank), -1) > job.held.step:
                    continue  # a newer save of that rank was offered: copy that one
                started = time.monotonic()
                try:
                    nbytes = self._pull(job, sockets)
                    news: News = Transferred(job.held, job.source.node_id, job.purpose,
                                             nbytes, time.monotonic() - started)
                except _GivenWay:
                    _close(sockets, job.source)
                    self._jobs.put(job)  # taken up again after the restore
                    continue
                except (TransferError, StagingFull, OSError, zmq.ZMQError) as e:
                    _close(sockets, job.source)
                    news = NotTransferred(job.held, job.source.node_id, job.purpose, str(e))
                self._tell(news)
                if job.batch:
                    self._batch_progress(job.batch, isinstance(news, Transferred))
        finally:
            for sock in sockets.values():
                sock.close()

    def _restore_waiting(self) -> bool:
        with self._jobs.mutex:
            return bool(self._jobs.queue) and self._jobs.queue[0].priority < 1

    def _batch_progress(self, batch: int, ok: bool) -> None:
        with self._lock:
            counts = self._batches[batch]
            counts[0] -= 1
            counts[1 if ok else 2] += 1
            if counts[0] > 0:
                return
            del self._batches[batch]
        self._tell(FetchDone(int(counts[1]), int(counts[2]), time.monotonic() - counts[3]))

    def _pull(self, job: _Job, sockets: dict[tuple[str, int], zmq.Socket]) -> int:
        """Copy one shard from its source into a replica slot; returns its size."""
        key = (job.source.addr, job.source.port)
        sock = sockets.get(key)
        if sock is None:
            sock = sockets[key] = self._context.socket(zmq.DEALER)
            sock.linger = 0
            sock.connect(f"tcp://{job.source.addr}:{job.source.port}")
        held = job.held
        base = {"world": held.world_size, "rank": held.rank, "step": held.step}
        nonce = os.urandom(8).hex()
        sock.send(self._wire.pack({**base, "type": "meta", "nonce": nonce}))
        meta = _checked_meta(self._reply(sock, {nonce}, job)[0].get("meta"), held)
        slot = self.shards.replica_slot(held, meta["save_id"])
        if slot is None:
            return int(meta["nbytes"])  # holds it already
        slot.invalidate()
        try:
            slot.ensure(meta["nbytes"], populate=False)  # memory allocated as chunks arrive
            assert slot.buffer is not None
            offsets = list(range(0, meta["nbytes"], CHUNK))
            pending: dict[str, int] = {}
            send_at = time.monotonic()
            while offsets or pending:
                while offsets and len(pending) < WINDOW:
                    if job.purpose == "replica" and self._bandwidth > 0:
                        self._closing.wait(max(0.0, send_at - time.monotonic()))
                    if self._closing.is_set():
                        raise TransferError("the agent is shutting down")
                    offset = offsets.pop(0)
                    size = min(CHUNK, meta["nbytes"] - offset)
                    send_at = max(send_at, time.monotonic()) + size / (self._bandwidth or 1e18)
                    nonce = os.urandom(8).hex()
                    pending[nonce] = offset
                    sock.send(self._wire.pack(
                        {**base, "type": "get", "nonce": nonce, "save_id": meta["save_id"],
                         "offset": offset, "nbytes": size}))
                header, data = self._reply(sock, set(pending), job)
                offset = pending.pop(header["nonce"])
                if len(data) != min(CHUNK, meta["nbytes"] - offset):
                    raise TransferError("a chunk of the wrong size")
                slot.reserve(offset, len(data))  # full /dev/shm: StagingFull, never SIGBUS
                slot.buffer[offset:offset + len(data)] = data
            slot.seal({**meta, "replica_from": job.source.node_id})
            return int(meta["nbytes"])
        finally:
            slot.close()

    def _reply(self, sock: zmq.Socket, nonces: set[str],
               job: _Job) -> tuple[dict[str, Any], memoryview]:
        """The next signed reply to one of ``nonces`` (others are stale: dropped)."""
        deadline = time.monotonic() + self.reply_timeout
        while True:
            left = deadline - time.monotonic()
            if self._closing.is_set():
                raise TransferError("the agent is shutting down")
            if job.purpose == "replica" and self._restore_waiting():
                raise _GivenWay
            if left <= 0:
                raise TransferError(f"no reply within {self.reply_timeout:g}s")
            if not sock.poll(int(min(left, 0.1) * 1000) + 1):
                continue
            try:
                frames = sock.recv_multipart(copy=False)
                if len(frames) != 1:
                    raise TransferError(f"expected one frame, got {len(frames)}")
                header, data = self._wire.unpack(frames[0])
            except TransferError as e:
                raise TransferError(f"reply rejected: {e}") from None
            if header.get("nonce") not in nonces:
                continue
            if header.get("error"):
                raise TransferError(str(header["error"]))
            return header, data


def _close(sockets: dict[tuple[str, int], zmq.Socket], peer: Peer) -> None:
    """Drop the connection to ``peer`` with the replies still in flight on it."""
    stale = sockets.pop((peer.addr, peer.port), None)
    if stale is not None:
        stale.close()


def _held(meta: dict[str, Any]) -> Held:
    return Held(int(meta["world_size"]), int(meta["rank"]), int(meta["step"]))


def _checked_meta(meta: Any, held: Held) -> dict[str, Any]:
    """A peer's meta, as far as this side relies on it (the shim checks the rest)."""
    if not isinstance(meta, dict) or type(meta.get("nbytes")) is not int \
            or meta["nbytes"] < 0 or not isinstance(meta.get("save_id"), str):
        raise TransferError("malformed meta")
    try:
        if _held(meta) != held:
            raise TransferError(f"the peer sent another shard than {_name(held)}")
    except (KeyError, TypeError, ValueError):
        raise TransferError("malformed meta") from None
    return meta


def _int(h: dict[str, Any], key: str) -> int:
    value = h.get(key)
    if type(value) is not int:
        raise TransferError(f"{key}: not an int")
    return value


def _str(h: dict[str, Any], key: str) -> str:
    value = h.get(key)
    if not isinstance(value, str):
        raise TransferError(f"{key}: not a string")
    return value


def _name(held: Held) -> str:
    return f"rank {held.rank}'s step {held.step} (world {held.world_size})"
