"""The coordinator: holds membership, the job epoch and the restart budget; decides recoveries.

It is a role of an agent (a thread with its own ROUTER socket), never of a trainer, so no
rank's crash can take it down. Agents talk to it only through signed messages.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import zmq

from launcher import exit_codes, membership, recovery
from launcher.protocol import Codec, Message, ProtocolError

log = logging.getLogger("ftlaunch.coordinator")


@dataclass
class JobState:
    """Everything the coordinator knows; the next round is computed from it."""

    min_nodes: int
    max_nodes: int
    max_restarts: int
    policy: str
    backoff: float
    backoff_max: float
    exit_barrier_timeout: float
    epoch: int = 0
    restart_count: int = 0
    phase: str = "joining"  # joining -> waiting_store -> running -> (joining | done)
    members: dict[str, membership.Member] = field(default_factory=dict)
    joined: dict[str, bytes] = field(default_factory=dict)  # node_id -> socket identity
    group_ranks: dict[str, int] = field(default_factory=dict)
    finished: set[str] = field(default_factory=set)
    first_finished_at: float | None = None


class Coordinator:
    """Serves one job on a ROUTER socket from a background thread."""

    def __init__(self, context: zmq.Context, secret: bytes, bind_addr: str, port: int,
                 state: JobState):
        self._codec = Codec(secret)
        self._state = state
        self._socket = context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, 128 * 1024)
        if port:
            self._socket.bind(f"tcp://{bind_addr}:{port}")
            self.port = port
        else:
            self.port = self._socket.bind_to_random_port(f"tcp://{bind_addr}")
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="ftlaunch-coordinator",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=5)
        self._socket.close()

    # --- loop ----------------------------------------------------------------------------

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stopping.is_set():
            if poller.poll(100):
                frames = self._socket.recv_multipart()
                if len(frames) < 2:
                    continue
                try:
                    self._handle(frames[0], self._codec.decode(frames[1:]))
                except ProtocolError as e:
                    log.warning("dropped control message: %s", e)
                except Exception:  # a bug must not silently stop the job's only decider
                    log.exception("coordinator failed to handle a message")
            self._tick(time.monotonic())

    def _send(self, identity: bytes, kind: str, **fields) -> None:
        self._socket.send_multipart([identity, *self._codec.encode(kind, self._state.epoch, **fields)])

    def _broadcast(self, kind: str, **fields) -> None:
        for identity in self._state.joined.values():
            self._send(identity, kind, **fields)

    # --- messages ------------------------------------------------------------------------

    def _handle(self, identity: bytes, msg: Message) -> None:
        s = self._state
        if msg.type == "join":
            s.members[msg["node_id"]] = membership.Member(msg["node_id"], msg["local_world_size"],
                                                          msg["addr"])
            s.joined[msg["node_id"]] = identity
            if s.phase == "joining" and len(s.joined) >= s.max_nodes:
                self._complete_round()
            return
        if msg.epoch != s.epoch:
            log.info("ignored stale %s (epoch %d, now %d)", msg.type, msg.epoch, s.epoch)
            return
        if msg.type == "store_ready" and s.phase == "waiting_store":
            s.phase = "running"
            self._broadcast("start", master_addr=msg["master_addr"],
                            master_port=msg["master_port"], restart_count=s.restart_count)
        elif msg.type == "failure" and s.phase == "running":
            self._on_failure(msg)
        elif msg.type == "finished" and s.phase == "running":
            s.finished.add(msg["node_id"])
            s.first_finished_at = s.first_finished_at or time.monotonic()
            if s.finished >= set(s.joined):
                self._finish(exit_codes.OK, "all ranks finished")
        elif msg.type == "leave":
            self._finish(msg["exit_code"], f"node {msg['node_id']} left: {msg['reason']}")

    def _complete_round(self) -> None:
        s = self._state
        s.epoch += 1
        s.finished.clear()
        s.first_finished_at = None
        members = [s.members[n] for n in s.joined]
        assignments = membership.assign_ranks(members, s.group_ranks)
        s.group_ranks = {a.node_id: a.group_rank for a in assignments}
        s.phase = "waiting_store"
        for a in assignments:
            self._send(s.joined[a.node_id], "assign", group_rank=a.group_rank,
                       group_world_size=a.group_world_size, rank_offset=a.rank_offset,
                       world_size=a.world_size, restart_count=s.restart_count,
                       max_restarts=s.max_restarts)

    def _on_failure(self, msg: Message) -> None:
        s = self._state
        cause = f"rank {msg['rank']} (node {msg['node_id']}) {msg['cause']}"
        decision = recovery.decide(s.restart_count, s.max_restarts, s.policy, cause,
                                   s.backoff, s.backoff_max)
        if decision.action == "fail":
            self._finish(exit_codes.JOB_FAILED, decision.reason)
            return
        s.restart_count = decision.restart_count
        s.phase = "joining"
        self._broadcast("recover", policy=decision.policy, restart_count=decision.restart_count,
                        delay=decision.delay, cause=cause)
        s.joined.clear()  # every agent re-joins for the next round once its ranks are stopped

    def _finish(self, exit_code: int, reason: str) -> None:
        self._state.phase = "done"
        self._broadcast("stop", exit_code=exit_code, reason=reason)

    def _tick(self, now: float) -> None:
        s = self._state
        if (s.phase == "running" and s.first_finished_at is not None
                and now - s.first_finished_at > s.exit_barrier_timeout):
            missing = sorted(set(s.joined) - s.finished)
            self._finish(exit_codes.JOB_FAILED, f"exit barrier timed out waiting for {missing}")
