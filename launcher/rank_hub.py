"""The agent's node-local hub: what its ranks tell it through trainer_shim, and its commands.

One ROUTER socket on ``ipc://<private 0700 dir>/hub``. Ranks send hello, heartbeats, section
boundaries and "parked" (left the training function, waiting to resume); the agent sends
"abort" (leave the training function) and "resume" (re-enter with this environment).
Heartbeats are one-way: a rank never waits on the agent to train.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from ftlaunch_contract.protocol import ProtocolError, pack_local, unpack_local
from launcher.hang_detection import HangTimeouts, RankActivity, hang_reason

log = logging.getLogger("ftlaunch.hub")

SAME_MOMENT = 0.25
"""Ranks that fell silent within this of each other count as silent together (> the shim's
50 ms heartbeat throttle plus the agent's 100 ms check interval)."""


@dataclass
class RankLink:
    """One rank process as the hub knows it."""

    activity: RankActivity
    identity: bytes | None = None  # the shim's command socket
    restartable: bool = False
    stacks: bool = False  # registered the stack-dump signal
    parked: bool = False
    error: str = ""
    pending: list[bytes] = field(default_factory=list)  # commands before its hello


class RankHub:
    def __init__(self, context: zmq.Context):
        self._dir = Path(tempfile.mkdtemp(prefix="ftlaunch-hub-"))  # mode 0700
        self.endpoint = f"ipc://{self._dir}/hub"
        self.socket = context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, 2 << 20)
        self.socket.bind(self.endpoint)
        self.links: dict[int, RankLink] = {}  # by pid
        self.best_step = -1  # the highest step any rank reported since reset_steps()
        self.durable: list[tuple[int, int]] = []  # (rank, step) checkpoint shards to relay

    def track(self, pid: int, now: float) -> None:
        """A rank process started (or resumed): watch it from now on."""
        link = self.links.setdefault(pid, RankLink(RankActivity(now)))
        link.activity = RankActivity(now)
        link.parked = False

    def forget(self, pid: int) -> None:
        self.links.pop(pid, None)

    def receive(self, now: float) -> list[int]:
        """Handle every queued message; returns the pids that just parked."""
        parked = []
        while True:
            try:
                identity, data = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return parked
            except ValueError:
                continue  # not two frames: not from a shim
            try:
                msg = unpack_local(data)
            except ProtocolError as e:
                log.warning("dropped rank message: %s", e)
                continue
            link = self.links.get(msg["pid"])
            if link is None:
                continue  # not one of ours (or already gone)
            if msg.type == "hello":
                link.identity, link.stacks = identity, link.stacks or msg["stacks"]
                for command in link.pending:
                    self.socket.send_multipart([identity, command])
                link.pending.clear()
            elif msg.type == "restartable":
                link.restartable = True
            elif msg.type == "learned":
                link.activity.restore(msg["interval"])
            elif msg.type == "tick":
                # When it was sent, not read: ticks queued while the agent was starved of
                # CPU must not make a frozen rank look alive.
                link.activity.last_tick = min(now, msg["sent"])
            elif msg.type == "beat":
                link.activity.beat(now, msg["step"])
                self.best_step = max(self.best_step, msg["step"])
            elif msg.type == "section":
                link.activity.section(now, msg["name"], msg["open"])
            elif msg.type == "durable":
                self.durable.append((msg["rank"], msg["step"]))
            elif msg.type == "parked":
                link.parked, link.error = True, msg["error"]
                parked.append(msg["pid"])

    def send(self, pid: int, kind: str, **fields) -> None:
        link = self.links.get(pid)
        if link is None:
            return
        data = pack_local(kind, **fields)
        if link.identity is None:
            link.pending.append(data)
        else:
            self.socket.send_multipart([link.identity, data])

    def hung(self, now: float, timeouts: HangTimeouts) -> list[tuple[int, str]]:
        """(pid, reason) of the hung ranks (of those using the shim, not parked).

        A frozen rank (not even the shim's thread runs) is the culprit: the others are most
        likely blocked in a collective on it, and are released when it is killed. A peer
        blocked on it may cross the timeout first (its last heartbeat was throttled away),
        so while any rank is frozen only frozen ranks are ever blamed."""
        watched = {pid: link.activity for pid, link in self.links.items()
                   if link.identity is not None and not link.parked}
        if not any(hang_reason(a, timeouts, now) for a in watched.values()):
            return []
        # Asleep rather than frozen, the culprit looks just like the peers blocked on it,
        # which fell silent at the same moment (give or take the heartbeat throttle).
        later = now + SAME_MOMENT
        hung = [(pid, reason) for pid, activity in watched.items()
                if (reason := hang_reason(activity, timeouts, later)) is not None]
        frozen = {pid for pid, activity in watched.items() if activity.frozen(now)}
        if frozen:
            return [(pid, reason + " (frozen)") for pid, reason in hung if pid in frozen]
        return hung

    def reset_steps(self) -> None:
        self.best_step = -1

    def close(self) -> None:
        self.socket.close()
        shutil.rmtree(self._dir, ignore_errors=True)
