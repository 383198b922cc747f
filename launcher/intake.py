"""Intake processes: one coordinator port served by several processes.

A takeover at 16,384 nodes costs the coordinator's one thread ~35 µs a node in ZeroMQ
calls, signatures and msgpack (docs/scale.md), 0.6 s and more where the budget is 0.2. An
intake process binds the coordinator's port beside it (SO_REUSEPORT: the kernel spreads new
connections over the processes, so agents still see one port and nothing on the wire
changes), verifies what its connections send and forwards it in batches over a local
socket; the coordinator, still the one decider, sends its answers back in batches, which
the intake writes. An intake that dies is the coordinator's failure (Coordinator.failure):
its connections are gone, and the job fails over as from any coordinator loss.

Between the coordinator (the hub, a ROUTER on an ipc:// path in a 0700 directory: the agent's
staging directory, which the next agent on the host sweeps should this one be killed) and an
intake (a DEALER whose routing id is its index, 1-255), msgpack lists:

    intake -> hub   ["up"]  ["in", [fd, ...], [[id, fd, kind, epoch, sid, seq, fields], ...]]
                    (connections closed, read first, then messages: see _forward)
                    ["probed", token, [id, ...]]
    hub -> intake   ["out", [[0, [frame, ...], [id, ...]] | [1, head, kind, own,
                                                             [[id, seq, values], ...]], ...]]
                    (frames to send, to each id; messages to sign first: Codec.sign)
                    ["probe", token, [id, ...], [frame, ...]]  ["stop"]

In the coordinator a connection's identity is the intake's index byte before its ZeroMQ
routing id (ZeroMQ's own start with 0), and its descriptor the index << 32 | the intake's.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import msgpack
import zmq
from zmq.utils.monitor import recv_monitor_message

from ftlaunch_contract.protocol import Codec, ProtocolError, Verified
from launcher.coordinator import (
    IntakeLost,
    bind_router,
    bound_to_share,
    connection_monitor,
    pace,
    unroutable,
)

log = logging.getLogger("ftlaunch.intake")

BATCH = 1024  # messages an intake forwards in one, at most
FRAMES, SIGN = 0, 1  # what an "out" entry holds
STARTUP_TIMEOUT = 30.0  # seconds for every intake to bind and say it is up


def _pack(value: object) -> bytes:
    packed: bytes = msgpack.packb(value)
    return packed


def _unpack(data: bytes) -> list:
    value = msgpack.unpackb(data, raw=False, strict_map_key=True)
    if not isinstance(value, list) or not value:
        raise ProtocolError("malformed intake message")
    return value


class Intakes:
    """The coordinator's side: the hub socket, what its intakes forwarded, their answers."""

    def __init__(self, hub: zmq.Socket, procs: dict[int, subprocess.Popen],
                 answer_within: float):
        """``answer_within``: an intake that does not answer a question in that long (the
        node timeout: its agents would take the coordinator for lost by then) is lost."""
        self.hub = hub
        self._answer_within = answer_within
        self._procs = procs
        self._out: dict[int, list[list]] = collections.defaultdict(list)  # in order: see send
        self._held: collections.deque[tuple[int, list]] = collections.deque()  # while probing
        self._token = 0

    def send(self, identity: bytes, frames: list[bytes]) -> None:
        """Queue ``frames`` to an intake's connection; sent at the next flush(). The same
        frames (the same list: a shared encoding, as heartbeat acks and broadcasts are)
        queued for several in a row are packed once."""
        out = self._out[identity[0]]
        if not out or out[-1][0] != FRAMES or out[-1][1] is not frames:
            out.append([FRAMES, frames, []])
        out[-1][2].append(identity[1:])

    def send_signed(self, identity: bytes, head: bytes, kind: str, own: tuple[str, ...],
                    values: tuple, seq: int) -> None:
        """Queue one of Codec.reserve()'s messages for the intake to sign (Codec.sign) and
        send: what a round's assign costs the coordinator's thread is then ~1 µs."""
        out = self._out[identity[0]]
        if not out or out[-1][0] != SIGN or out[-1][1] is not head:
            out.append([SIGN, head, kind, own, []])
        out[-1][4].append([identity[1:], seq, values])

    def flush(self) -> None:
        for index, out in self._out.items():
            if out:
                self.hub.send_multipart([bytes([index]), _pack(["out", out])])
        self._out.clear()

    def receive(self, limit: int) -> Iterator[tuple[int, bytes, Verified | None]]:
        """What the intakes forwarded, up to ``limit`` messages from them: (fd, identity,
        the message) for a message, (fd, b"", None) for a closed connection."""
        for _ in range(limit):
            if self._held:
                index, msg = self._held.popleft()
            elif not _readable(self.hub):  # asked: a zmq.Again costs more than a message
                return
            else:
                try:
                    index, msg = self._read(zmq.NOBLOCK)
                except zmq.Again:  # what there was was dropped (_read)
                    return
            yield from self._events(index, msg)

    def pending(self) -> bool:
        """Whether something forwarded waits to be received."""
        return bool(self._held) or _readable(self.hub)

    def _read(self, flags: int = 0) -> tuple[int, list]:
        while True:
            frames = self.hub.recv_multipart(flags)
            try:
                if len(frames) != 2 or len(frames[0]) != 1:
                    raise ProtocolError("not an intake's")
                return frames[0][0], _unpack(frames[1])
            except (ProtocolError, ValueError) as e:
                log.warning("dropped a message on the intakes' hub: %s", e)

    @staticmethod
    def _events(index: int, msg: list) -> Iterator[tuple[int, bytes, Verified | None]]:
        prefix, high = bytes([index]), index << 32
        if msg[0] == "in":
            for fd in msg[1]:
                yield high | fd, b"", None
            for local, fd, *verified in msg[2]:
                yield high | fd, prefix + local, verified

    def unroutable(self, identities: list[bytes], frames: list[bytes]) -> set[bytes]:
        """Those of ``identities`` (all of intakes) whose connection closed, as
        Coordinator._unroutable asks its own socket: each open one gets ``frames``."""
        self.flush()  # what was sent before the probe goes first
        asked: dict[int, list[bytes]] = collections.defaultdict(list)
        for identity in identities:
            asked[identity[0]].append(identity[1:])
        self._token += 1
        for index, local in asked.items():
            self.hub.send_multipart([bytes([index]), _pack(["probe", self._token, local,
                                                            frames])])
        closed: set[bytes] = set()
        until = time.monotonic() + self._answer_within
        while asked:
            if not self.hub.poll(max(1, int((until - time.monotonic()) * 1000))):
                raise IntakeLost(f"intake(s) {sorted(asked)} did not answer a probe within "
                                 f"{self._answer_within:g} s")
            index, msg = self._read()
            if msg[0] == "probed" and msg[1] == self._token and index in asked:
                del asked[index]
                closed.update(bytes([index]) + local for local in msg[2])
            elif msg[0] != "probed":  # handled in order, after the probe (receive)
                self._held.append((index, msg))
        return closed

    def lost(self) -> str | None:
        """Which intake process died, if one did."""
        for index, proc in self._procs.items():
            if proc.poll() is not None:
                return f"intake {index} (pid {proc.pid}) exited with {proc.returncode}"
        return None


class Port:
    """A coordinator's port: served by its own ROUTER (``count`` 0, as a small job needs),
    or by ``count`` intake processes alone. Then the ROUTER is bound nowhere, and the port is
    held by a socket bound to it that does not listen (so the kernel gives it no
    connection), from before the intakes start to after they stop: no other job takes it
    meanwhile, and a standby's port stays its own while its coordinators come and go. Such
    a port is claimed too (_claim): no other Port of ours shares it."""

    def __init__(self, context: zmq.Context, addr: str, port: int, node_timeout: float,
                 secret: bytes, count: int = 0, small: bool = False, max_nodes: int = 1,
                 directory: str | None = None):
        """``directory``: private (0700), for the hub's socket (default: one of its own,
        removed at close())."""
        if not 0 <= count <= 255:
            raise ValueError(f"intakes: {count} (0-255)")
        self.intakes: Intakes | None = None
        self._dir = ""
        self._held: socket.socket | None = None
        self._claim: socket.socket | None = None
        if not count:
            self.router, self.port = bind_router(context, addr, port, node_timeout, small)
            return
        self._held = bound_to_share(addr, port)  # not listening: see the docstring
        self.port = self._held.getsockname()[1]
        self.router = context.socket(zmq.ROUTER)
        try:
            self._claim = _claim(self.port)
            if directory is None:
                directory = self._dir = tempfile.mkdtemp(prefix="ftlaunch-intake-")  # 0700
            hub = context.socket(zmq.ROUTER)
            for option in (zmq.SNDHWM, zmq.RCVHWM):
                hub.setsockopt(option, 0)  # a takeover's batches queue, never dropped
            hub.setsockopt(zmq.LINGER, 0)
            link = f"ipc://{directory}/intakes-{self.port}"
            hub.bind(link)
            config = {"parent": os.getpid(), "addr": addr, "port": self.port,
                      "node_timeout": node_timeout,
                      "small": small, "link": link, "secret": secret.hex(),
                      "pace": pace(max_nodes)}
            procs = {i: _spawn({**config, "index": i}) for i in range(1, count + 1)}
            self.intakes = Intakes(hub, procs, node_timeout)
            self._wait_up(hub, set(procs))
        except BaseException:
            self.close()
            raise

    def _wait_up(self, hub: zmq.Socket, waiting: set[int]) -> None:
        until = time.monotonic() + STARTUP_TIMEOUT
        while waiting:
            assert self.intakes is not None
            if lost := self.intakes.lost():
                raise IntakeLost(f"{lost} before it was up")
            if hub.poll(100):
                index, msg = self.intakes._read()
                if msg == ["up"]:
                    waiting.discard(index)
            elif time.monotonic() > until:
                raise IntakeLost(f"intakes {sorted(waiting)} not up in {STARTUP_TIMEOUT} s")

    def close(self, linger: int | None = None) -> None:
        if self.intakes is not None:
            for index in self.intakes._procs:
                with contextlib.suppress(zmq.ZMQError):
                    self.intakes.hub.send_multipart([bytes([index]), _pack(["stop"])])
            for proc in self.intakes._procs.values():
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            self.intakes.hub.close(linger=0)
            self.intakes = None
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = ""
        self.router.close(linger=linger)
        if self._held is not None:
            self._held.close()
            self._held = None
        if self._claim is not None:
            self._claim.close()
            self._claim = None


def _claim(port: int) -> socket.socket:
    """The port's one Port of ours. Sockets that set SO_REUSEPORT under one user may all bind
    a port, so two agents of a user on one host could both take the rendezvous endpoint: the
    first to bind this abstract Unix socket (of the network namespace, as the port is; gone
    with its process) holds the port, and another fails as a taken port does (EADDRINUSE).
    A binding that lost never listened: the kernel gave it no connection."""
    claim = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        claim.bind(f"\0ftlaunch-port-{port}")
    except OSError:
        claim.close()
        raise
    return claim


def _spawn(config: dict) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "launcher.intake"], stdin=subprocess.PIPE,
                            close_fds=True, cwd=os.getcwd())
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(config).encode() + b"\n")
    proc.stdin.close()
    return proc


# --- the intake process ---------------------------------------------------------------------


def _die_with_parent(parent: int) -> None:
    """PR_SET_PDEATHSIG: the agent's death (even SIGKILL) ends its intakes."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before the call
        os._exit(0)


def serve(config: dict) -> None:
    """Serve one share of the port's connections until told to stop."""
    index = config["index"]
    context = zmq.Context()
    router, _ = bind_router(context, config["addr"], config["port"], config["node_timeout"],
                            config["small"], shared=True)
    monitor = connection_monitor(router, zmq.EVENT_DISCONNECTED)
    link = context.socket(zmq.DEALER)
    link.setsockopt(zmq.ROUTING_ID, bytes([index]))
    for option in (zmq.SNDHWM, zmq.RCVHWM):
        link.setsockopt(option, 0)
    link.setsockopt(zmq.LINGER, 1000)
    link.connect(config["link"])
    codec = Codec(bytes.fromhex(config["secret"]))
    link.send(_pack(["up"]))
    poller = zmq.Poller()
    for sock in (router, monitor, link):
        poller.register(sock, zmq.POLLIN)
    try:
        while True:
            ready = dict(poller.poll(1000))
            woke = time.monotonic()
            if monitor in ready or router in ready:
                _forward(monitor if monitor in ready else None, router, link, codec)
            if link in ready and not _answer(link, router, codec):
                return
            if ready and (rest := woke + config["pace"] - time.monotonic()) > 0:
                time.sleep(rest)  # see coordinator.pace: a stream served many at a wake-up
    finally:
        router.disable_monitor()
        for sock in (monitor, router, link):
            sock.close(linger=0)
        context.term()


def _forward(monitor: zmq.Socket | None, router: zmq.Socket, link: zmq.Socket,
             codec: Codec) -> None:
    """The closes reported (``monitor``: when it has some), then the messages queued, in
    one: as the coordinator reads its own socket (a closed descriptor may be reused; a close
    may come before the last words on it, which are queued by then), so that what it takes
    for an emptied queue is one. Whether a socket has more is asked, not found by a
    zmq.Again: an exception costs more than a message here."""
    fds = []
    while monitor is not None and _readable(monitor):
        fds.append(recv_monitor_message(monitor)["value"])
    while True:
        batch = []
        for _ in range(BATCH):
            if not _readable(router):
                break
            parts = [router.recv(copy=False)]
            while parts[-1].more:
                parts.append(router.recv(copy=False))
            try:
                if len(parts) < 2:
                    raise ProtocolError("no identity frame")
                verified = codec.verify([p.bytes for p in parts[1:]])
            except ProtocolError as e:
                log.warning("dropped control message: %s", e)
                continue
            batch.append([parts[0].bytes, parts[1].get(zmq.SRCFD), *verified])
        if batch or fds:
            link.send(_pack(["in", fds, batch]))
            fds = []
        if len(batch) < BATCH:
            return


def _readable(sock: zmq.Socket) -> bool:
    return bool(int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)


def _send(router: zmq.Socket, identity: bytes, frames: list[bytes]) -> None:
    router.send(identity, zmq.SNDMORE)
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        router.send(frame, zmq.SNDMORE if i < last else 0)


def _answer(link: zmq.Socket, router: zmq.Socket, codec: Codec) -> bool:
    """What the coordinator asked; False once told to stop."""
    while _readable(link):
        msg = _unpack(link.recv())
        if msg[0] == "stop":
            return False
        if msg[0] == "out":
            for entry in msg[1]:
                if entry[0] == FRAMES:
                    for identity in entry[2]:
                        _send(router, identity, entry[1])
                    continue
                _, head, kind, own, rows = entry
                for identity, seq, values in rows:
                    try:
                        frames = codec.sign(head, kind, own, values, seq)
                    except ProtocolError as e:  # the coordinator's bug: said, not sent
                        log.error("not sent: %s", e)
                        continue
                    _send(router, identity, frames)
        elif msg[0] == "probe":
            _, token, identities, frames = msg
            link.send(_pack(["probed", token, sorted(unroutable(router, identities, frames))]))
    return True


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the agent stops it (or its death does)
    config = json.loads(sys.stdin.readline())  # (an agent dead before it wrote: EOF, an error)
    _die_with_parent(config["parent"])
    logging.basicConfig(level=logging.WARNING,
                        format=f"[intake {config['index']}] %(levelname)s %(message)s")
    serve(config)


if __name__ == "__main__":
    main()
