"""The worker supervisor: start this node's ranks, notice each exit at once, stop them cleanly.

Each rank runs in its own process group (so stopping a rank stops its children too), dies
with the agent (PR_SET_PDEATHSIG, plus the orphan guard for its children), and has a pidfd
the agent polls beside its sockets, so an exit is seen the moment it happens.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import select
import shlex
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from launcher import failures
from launcher.config import StreamMode
from launcher.orphan_guard import OrphanGuard
from launcher.rank_env import Attempt, rank_command, rank_env
from launcher.rank_output import Pump, RankStreams
from launcher.rank_template import ForkedRank, RankTemplate

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


def _become_rank(agent_pid: int) -> None:
    """Runs in the child between fork and exec: own process group, die with the agent."""
    os.setpgid(0, 0)
    _die_with(agent_pid)


def _die_with(agent_pid: int) -> None:
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != agent_pid:  # the agent died before prctl took effect
        os._exit(1)


def rank_preexec_fn() -> Callable[[], None]:
    """A ``preexec_fn`` for rank processes (and warm ones): own group, die with this agent."""
    return functools.partial(_become_rank, os.getpid())


def die_with_agent(agent_pid: int) -> Callable[[], None]:
    """A ``preexec_fn`` for helper processes of the agent: killed when the agent dies."""
    return functools.partial(_die_with, agent_pid)


@dataclass
class Rank:
    local_rank: int
    rank: int
    proc: subprocess.Popen | ForkedRank
    pidfd: int
    error_file: str
    pumps: list[Pump] = field(default_factory=list)
    cause: str | None = None  # set when the agent kills it (a hang), else read from the exit
    returncode: int | None = None
    forked: bool = False  # from the rank template (else a fresh interpreter)


@dataclass(frozen=True)
class Program:
    """What every rank runs: ``python -u SCRIPT ARGS`` (or ``-m``, or an executable)."""

    script: str
    args: list[str]
    module: bool = False
    no_python: bool = False

    def command(self) -> list[str]:
        return rank_command(self.script, self.args, module=self.module, no_python=self.no_python)


@dataclass(frozen=True)
class RankExit:
    pid: int
    rank: int
    local_rank: int
    returncode: int
    failure: failures.RankFailure | None  # None for a clean exit


@dataclass
class OutputPlan:
    """Where rank output goes: log directory, per-local-rank modes, console filter."""

    log_dir: Path
    modes: dict[int, tuple[StreamMode, StreamMode]]  # local rank -> (stdout, stderr)
    console: set[int] = field(default_factory=set)


class WorkerGroup:
    """This node's rank processes, across attempts (a rank resumed in place carries over)."""

    def __init__(self, program: Program, output: OutputPlan, guard: OrphanGuard,
                 extra_env: Callable[[Path], dict[str, str]]):
        self._program = program
        self._output = output
        self._guard = guard
        self._extra_env = extra_env  # rank dir -> the agent's own variables for that rank
        self.ranks: dict[int, Rank] = {}  # by pidfd
        self._pumps: dict[int, Pump] = {}  # by fd

    # --- lifecycle -----------------------------------------------------------------------

    def env(self, attempt: Attempt, local_rank: int) -> tuple[dict[str, str], Path]:
        rank_dir = self._output.log_dir / f"attempt_{attempt.restart_count}" / str(local_rank)
        rank_dir.mkdir(parents=True, exist_ok=True)
        env = rank_env(attempt, local_rank, str(rank_dir / "error.json"))
        env.update(self._extra_env(rank_dir))
        return env, rank_dir

    def spawn(self, attempt: Attempt, local_rank: int, template: RankTemplate | None) -> Rank:
        """Start ``local_rank``: forked from the rank ``template`` when it can, else a fresh
        interpreter."""
        rank = attempt.rank_offset + local_rank
        env, rank_dir = self.env(attempt, local_rank)
        streams = RankStreams(rank, rank_dir, self._output.modes[local_rank],
                              local_rank in self._output.console)
        proc: subprocess.Popen | ForkedRank | None = None
        if template is not None:
            command = self._program.command()
            proc = template.fork([self._program.script, *self._program.args], env, os.getcwd(),
                                 self._program.module, *streams.child_fds(),
                                 title=f"ftlaunch rank {rank}: {shlex.join(command)}",
                                 name=f"rank{rank}-{Path(self._program.script).name}")
        if proc is None:
            proc = subprocess.Popen(
                self._program.command(), env=env, stdin=subprocess.DEVNULL, close_fds=True,
                preexec_fn=rank_preexec_fn(), **streams.popen_kwargs)
            self._guard.watch(proc.pid)
        streams.after_spawn()
        pidfd = _pidfd(proc.pid)
        self.ranks[pidfd] = Rank(local_rank, rank, proc, pidfd, env["TORCHELASTIC_ERROR_FILE"],
                                 streams.pumps, forked=isinstance(proc, ForkedRank))
        self._pumps.update((p.fd, p) for p in streams.pumps)
        return self.ranks[pidfd]

    def resume(self, kept: Rank, attempt: Attempt) -> dict[str, str]:
        """A parked rank re-enters in place: its new identity; returns its new environment."""
        env, _ = self.env(attempt, kept.local_rank)
        kept.rank = attempt.rank_offset + kept.local_rank
        kept.error_file = env["TORCHELASTIC_ERROR_FILE"]
        for pump in kept.pumps:
            pump.relabel(kept.rank)
        return env

    def by_pid(self, pid: int) -> Rank | None:
        return next((r for r in self.ranks.values() if r.proc.pid == pid), None)

    def fds(self) -> list[int]:
        """Everything the agent should poll for this group: exits and output."""
        return [r.pidfd for r in self.alive()] + list(self._pumps)

    def alive(self) -> list[Rank]:
        return [r for r in self.ranks.values() if r.returncode is None]

    def on_readable(self, fd: int) -> RankExit | None:
        """Service one readable fd; returns the exit it reports, if it was a pidfd."""
        pump = self._pumps.get(fd)
        if pump is not None:
            if not pump.pump():
                del self._pumps[fd]
            return None
        rank = self.ranks.get(fd)
        if rank is None or rank.returncode is not None:
            return None
        return self._reap(rank)

    def send_signal(self, sig: int, ranks: list[Rank] | None = None) -> None:
        """Send ``sig`` to each live rank's whole process group (default: every rank)."""
        for rank in self.alive() if ranks is None else ranks:
            if rank.returncode is None:
                _killpg(rank.proc.pid, sig)

    def kill_hung(self, rank: Rank, cause: str) -> None:
        """Kill a rank found hung; ``cause`` becomes its failure's (the exit cannot tell)."""
        rank.cause = cause
        self.send_signal(signal.SIGCONT, [rank])  # a stopped process dies only when resumed
        self.send_signal(signal.SIGKILL, [rank])

    def killing(self) -> bool:
        """A rank killed for a hang is not reaped yet (its peers may still wait on it)."""
        return any(r.cause and r.returncode is None for r in self.ranks.values())

    def stop(self, timeout: float) -> list[RankExit]:
        """Blocking: SIGTERM every rank, SIGKILL what is left after ``timeout``, reap them.
        Only for the agent's teardown; while it runs, its loop stops ranks as a phase."""
        targets = self.alive()
        exits: list[RankExit] = []
        self.send_signal(signal.SIGTERM, targets)
        deadline = time.monotonic() + timeout
        while any(r.returncode is None for r in targets) and time.monotonic() < deadline:
            exits += self.wait(min(0.2, deadline - time.monotonic()))
        self.send_signal(signal.SIGKILL, targets)
        while any(r.returncode is None for r in targets):
            exits += self.wait(0.2)
        self.release_reaped()
        return exits

    def wait(self, timeout: float) -> list[RankExit]:
        """Block until something is readable (or ``timeout``) and service it."""
        readable, _, _ = select.select(self.fds(), [], [], max(0.0, timeout))
        exits = [self.on_readable(fd) for fd in readable]
        return [e for e in exits if e is not None]

    def release_reaped(self) -> None:
        """Forget reaped ranks: drain and close their output pipes and their pidfds."""
        ranks = [r for r in self.ranks.values() if r.returncode is not None]
        # By identity, not number: a pipe closed at its end frees its number for a rank
        # started since (a replaced rank's), whose pipe must not be read or closed here.
        pumps = {p.fd: p for r in ranks for p in r.pumps if self._pumps.get(p.fd) is p}
        deadline = time.monotonic() + 2.0  # bounded: an escaped grandchild may hold a pipe
        while pumps and time.monotonic() < deadline:
            readable, _, _ = select.select(list(pumps), [], [], deadline - time.monotonic())
            for fd in readable:
                if not pumps[fd].pump():
                    del pumps[fd], self._pumps[fd]
        for fd, pump in pumps.items():
            pump.close()
            del self._pumps[fd]
        for rank in ranks:
            self.ranks.pop(rank.pidfd, None)
            os.close(rank.pidfd)

    def _reap(self, rank: Rank) -> RankExit:
        rank.returncode = rank.proc.wait()
        _killpg(rank.proc.pid, signal.SIGKILL)  # the rank is gone: so are its children
        self._guard.forget(rank.proc.pid)
        failure = None
        if rank.returncode != 0:
            failure = failures.from_returncode(rank.rank, rank.local_rank, rank.proc.pid,
                                               rank.returncode, rank.error_file, rank.cause)
        return RankExit(rank.proc.pid, rank.rank, rank.local_rank, rank.returncode, failure)


def _pidfd(pid: int) -> int:
    """A descriptor readable once ``pid`` has exited. A forked rank can exit and be reaped
    by its template before we open one: then a pipe already at its end stands in."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        gone, writer = os.pipe()
        os.close(writer)
        return gone


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
