"""The agent's node-local hub: what its ranks tell it through trainer_shim, and its commands.

One ROUTER socket on ``ipc://<the agent's staging dir>/hub``. Ranks send hello, heartbeats, section
boundaries and "parked" (left the training function, waiting to resume); the agent sends
"abort" (leave the training function) and "resume" (re-enter with this environment).
Heartbeats are one-way: a rank never waits on the agent to train.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from ftlaunch_contract.messages import (
    Beat,
    Body,
    Entered,
    Hello,
    Learned,
    Leaving,
    Parked,
    Restartable,
    Section,
    ShardDurable,
    ShardStaged,
    Stuck,
    Tick,
)
from ftlaunch_contract.protocol import ProtocolError, pack_local, unpack_local
from launcher.hang_detection import HangTimeouts, RankActivity, hung_ranks

log = logging.getLogger("ftlaunch.hub")


@dataclass
class RankLink:
    """One rank process as the hub knows it."""

    activity: RankActivity
    identity: bytes | None = None  # the shim's command socket
    restartable: bool = False
    stacks: bool = False  # registered the stack-dump signal
    parked: bool = False
    stuck: str = ""  # told to leave, blocked here instead (see trainer_shim's STUCK_AFTER)
    leaving: bool = False  # its training is over: the process is exiting
    error: str = ""
    pending: list[bytes] = field(default_factory=list)  # commands before its hello


@dataclass(frozen=True)
class HubNews:
    """What the ranks said that the agent must act on."""

    parked: list[int]  # pids that just left their training function
    durable: list[tuple[int, int]]  # (rank, step): checkpoint shards to relay
    staged: list[tuple[int, int]] = field(default_factory=list)  # (rank, step): to replicate
    # (kind, rank, step, seconds since the save began): "staged" (the stall), "durable"
    save_times: list[tuple[str, int, int, float]] = field(default_factory=list)


class RankHub:
    def __init__(self, context: zmq.Context, directory: Path):
        """``directory``: private (0700); the agent's staging directory, so that the socket
        of an agent that was SIGKILLed goes with it when the next agent sweeps it."""
        self._path = Path(directory) / "hub"
        self.endpoint = f"ipc://{self._path}"
        self.socket = context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, 2 << 20)
        self.socket.bind(self.endpoint)
        self.links: dict[int, RankLink] = {}  # by pid
        self.best_step = -1  # the highest step any rank reported since reset_steps()
        self.best_step_at = 0.0  # when (Unix time) it was first reported

    def track(self, pid: int, now: float, stacks: bool = False, resumed: bool = False) -> None:
        """A rank process started (or resumed): watch it from now on. ``stacks``: it
        already armed the stack-dump signal (a warm-pool process does before its hello)."""
        link = self.links.setdefault(pid, RankLink(RankActivity(now)))
        # The process's last tick stands: frozen right after a resume, before its next tick,
        # it must still be found frozen (else its peers, blocked on it, are blamed instead).
        link.activity = RankActivity(now, awaiting_entry=resumed,
                                     last_tick=link.activity.last_tick)
        link.parked, link.stuck = False, ""
        link.stacks = link.stacks or stacks

    def restartable(self, pid: int) -> bool:
        link = self.links.get(pid)
        return link is not None and link.restartable

    def parked(self, pid: int) -> bool:
        link = self.links.get(pid)
        return link is not None and link.parked

    def stuck(self, pid: int, now: float) -> str:
        """Where a rank told to leave its training function is blocked ("": it is not).
        A frozen one (SIGSTOPped, or holding the GIL) cannot even say so, nor leave."""
        link = self.links.get(pid)
        if link is None:
            return ""
        if not link.stuck and link.activity.frozen(now):
            assert link.activity.last_tick is not None
            return f"a frozen process (no tick for {now - link.activity.last_tick:.1f}s)"
        return link.stuck

    def error(self, pid: int) -> str:
        """The traceback a rank parked with after raising on its own ("" after an abort)."""
        link = self.links.get(pid)
        return link.error if link is not None else ""

    def stacks_armed(self, pid: int) -> bool:
        link = self.links.get(pid)
        return link is not None and link.stacks

    def all_beating(self, pids: list[int]) -> bool:
        """Every one of ``pids`` sent a heartbeat: past its start-up."""
        return all((link := self.links.get(pid)) is not None and link.activity.beats
                   for pid in pids)

    def forget(self, pid: int) -> None:
        self.links.pop(pid, None)

    def receive(self, now: float) -> HubNews:
        """Handle every queued message; returns what the agent must act on."""
        news, parked = HubNews([], []), list[tuple[float, int]]()
        while True:
            try:
                identity, data = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                news.parked.extend(first_to_leave(parked))
                return news
            except ValueError:
                continue  # not two frames: not from a shim
            try:
                msg = unpack_local(data)
            except ProtocolError as e:
                log.warning("dropped rank message: %s", e)
                continue
            link = self.links.get(getattr(msg, "pid", -1))
            if link is None:
                continue  # not one of ours (or already gone), or not a rank's message
            match msg:
                case Hello():
                    link.identity, link.stacks = identity, link.stacks or msg.stacks
                    for command in link.pending:
                        self.socket.send_multipart([identity, command])
                    link.pending.clear()
                case Restartable():
                    link.restartable = True
                case Entered():
                    link.activity.awaiting_entry = False
                case Learned():
                    link.activity.restore(msg.interval)
                case Leaving():
                    link.leaving = True
                case Tick():
                    # When it was sent, not read: ticks queued while the agent was starved
                    # of CPU must not make a frozen rank look alive.
                    link.activity.last_tick = min(now, msg.sent)
                case Beat():
                    link.activity.beat(now, msg.step)
                    self._reached(msg.step)
                case Section():
                    link.activity.section(now, msg.name, msg.open)
                case ShardDurable():
                    news.durable.append((msg.rank, msg.step))
                    news.save_times.append(("durable", msg.rank, msg.step, msg.seconds))
                case ShardStaged():
                    news.staged.append((msg.rank, msg.step))
                    news.save_times.append(("staged", msg.rank, msg.step, msg.seconds))
                case Stuck():
                    link.stuck = msg.where or "native code"
                case Parked():
                    link.parked, link.error = True, msg.error
                    link.activity.step = max(link.activity.step, msg.step)
                    self._reached(msg.step)
                    parked.append((msg.sent, msg.pid))

    def send(self, pid: int, msg: Body) -> None:
        link = self.links.get(pid)
        if link is None:
            return
        data = pack_local(msg)
        if link.identity is None:
            link.pending.append(data)
        else:
            self.socket.send_multipart([link.identity, data])

    def hung(self, now: float, timeouts: HangTimeouts,
             other_nodes: bool = False) -> list[tuple[int, str]]:
        """(pid, reason) of the hung ranks among those using the shim and not parked."""
        return hung_ranks({pid: link.activity for pid, link in self.links.items()
                           if link.identity is not None and not link.parked
                           and not link.leaving}, timeouts, now, other_nodes)

    def beat_age(self, pid: int, now: float) -> float | None:
        """Seconds since the rank's last heartbeat (None: it never sent one)."""
        link = self.links.get(pid)
        last = link.activity.last_beat if link is not None else None
        return None if last is None else now - last

    def step(self, pid: int) -> int:
        """The highest step the rank reported (-1: none)."""
        link = self.links.get(pid)
        return link.activity.step if link is not None else -1

    def _reached(self, step: int) -> None:
        if step > self.best_step:
            self.best_step, self.best_step_at = step, time.time()

    def reset_steps(self) -> None:
        self.best_step = -1

    def close(self) -> None:
        self.socket.close()
        self._path.unlink(missing_ok=True)


def first_to_leave(parked: list[tuple[float, int]]) -> list[int]:
    """The pids of ranks that parked, read in one batch, in the order they left (their
    ``sent`` clock): the first is the failure, the others its echoes in their collectives."""
    return [pid for _, pid in sorted(parked)]
