"""The agent's side of the rank template (launcher/template_process.py): start it, fork
ranks from it, learn their exits.

A rank is one ``fork()`` of an interpreter that imported torch once, at launch and for every
replacement, at any moment of the job: no pool to fill, nothing to refill. A template that
reports it is unsafe to fork (a ``--preload`` module started a thread or touched CUDA) is
closed for good: ranks start as fresh interpreters. One that dies is started again.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgpack

from launcher.orphan_guard import OrphanGuard

DEFAULT_PRELOAD = ("torch,torch.distributed,torch.nn.parallel,torch.optim,torch._dynamo,"
                   "torch.distributed.elastic.multiprocessing.errors")
"""torch._dynamo is what the first ``optimizer.step()`` imports lazily (most of a second here)."""

REPLY_TIMEOUT = 10.0  # a ready template answers a fork order in milliseconds
EXIT_REPORT_TIMEOUT = 5.0  # between a rank's exit and the template's report of it


@dataclass(frozen=True)
class TemplateReady:
    seconds: float  # how long its imports took


@dataclass(frozen=True)
class TemplateUnsafe:
    why: str


@dataclass(frozen=True)
class TemplateDied:
    returncode: int | None


TemplateNews = TemplateReady | TemplateUnsafe | TemplateDied


class ForkedRank:
    """A rank forked by the template, with the part of ``subprocess.Popen`` the worker
    group uses. Its exit status comes from the template, its parent."""

    def __init__(self, pid: int, template: RankTemplate):
        self.pid = pid
        self.returncode: int | None = None
        self._template = template

    def wait(self) -> int:
        """Once the rank is gone (its pidfd said so): its exit status, as Popen's."""
        if self.returncode is None:
            self.returncode = self._template.exit_code(self.pid)
        return self.returncode


class RankTemplate:
    def __init__(self, preload: list[str], env: dict[str, str], guard: OrphanGuard,
                 preexec_fn: Callable[[], None]):
        self._preload = preload
        self._env = env  # settings read at import time, as every local rank has them
        self._guard = guard
        self._preexec_fn = preexec_fn  # own process group, dies with the agent
        self._proc: subprocess.Popen | None = None
        self._socket: socket.socket | None = None
        self._started_at = 0.0
        self.ready = False
        self.unsafe: str | None = None  # set once: then never again
        self._exits: dict[int, int] = {}  # pid -> exit status, reported, not yet collected
        self._ranks: set[int] = set()  # pids forked and not reported exited

    @property
    def usable(self) -> bool:
        return self.unsafe is None

    @property
    def starting(self) -> bool:
        return self.usable and not self.ready

    def start(self) -> None:
        """Start the template (its imports then run while the node joins the job)."""
        if self._proc is not None or not self.usable:
            return
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        python = os.environ.get("PYTHON_EXEC", sys.executable)
        with theirs:
            self._proc = subprocess.Popen(
                [python, "-u", "-m", "launcher.template_process", str(theirs.fileno()),
                 *self._preload],
                env=self._env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                close_fds=True, pass_fds=[theirs.fileno()], preexec_fn=self._preexec_fn)
        self._guard.watch(self._proc.pid)
        self._socket = ours
        self._started_at = time.monotonic()

    @property
    def fd(self) -> int | None:
        return self._socket.fileno() if self._socket is not None else None

    def on_readable(self) -> list[TemplateNews]:
        """Read what the template said (readiness, exits); notice its death."""
        news: list[TemplateNews] = []
        while (message := self._receive(block=False)) is not None:
            news += self._note(message)
        if self._proc is not None and self._proc.poll() is not None:
            news.append(TemplateDied(self._proc.returncode))
            self._forget()
        return news

    def fork(self, argv: list[str], env: dict[str, str], cwd: str, module: bool,
             stdout: int, stderr: int, title: str, name: str) -> ForkedRank | None:
        """A new rank, or None if the template cannot fork one now (the caller starts a
        fresh interpreter; the template's news say why)."""
        pid = self._order({"argv": argv, "env": env, "cwd": cwd, "module": module,
                           "title": title, "name": name}, [stdout, stderr])
        if pid is None:
            return None
        self._ranks.add(pid)
        self._guard.watch(pid)
        return ForkedRank(pid, self)

    def fork_store(self, addr: str, port: int, listening: int) -> int | None:
        """A torch TCPStore server on the ``listening`` socket, forked (torch is imported
        already: it serves at once); its pid, or None (the caller starts one itself)."""
        return self._order({"store": [addr, port]}, [listening])

    def _order(self, order: dict, fds: list[int]) -> int | None:
        if not self.ready or self._socket is None:
            return None
        try:
            socket.send_fds(self._socket, [msgpack.packb(order)], fds)
        except OSError:
            return None
        deadline = time.monotonic() + REPLY_TIMEOUT
        while time.monotonic() < deadline:
            message = self._receive(block=True, timeout=deadline - time.monotonic())
            if message is None:
                break
            if "forked" in message:
                return int(message["forked"])
            self._note(message)
            if not self.usable:
                return None
        return None

    def exit_code(self, pid: int) -> int:
        """A forked rank's exit status, waiting (boundedly) for the template's report. A rank
        whose template died, or never told, counts as SIGKILLed (it died with it)."""
        deadline = time.monotonic() + EXIT_REPORT_TIMEOUT
        while pid not in self._exits and pid in self._ranks:
            message = self._receive(block=True, timeout=max(0.0, deadline - time.monotonic()))
            if message is None:  # timed out, or the template is gone
                break
            self._note(message)
        self._ranks.discard(pid)
        return self._exits.pop(pid, -signal.SIGKILL)

    def close(self) -> None:
        """Stop the template (the agent's ranks are gone by now)."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
        self._forget()

    def _note(self, message: dict) -> list[TemplateNews]:
        if "ready" in message:
            self.ready = True
            return [TemplateReady(float(message["ready"]))]
        if "unsafe" in message:
            self.unsafe = str(message["unsafe"])
            self.close()
            return [TemplateUnsafe(self.unsafe)]
        if "exited" in message:
            pid = int(message["exited"])
            if pid in self._ranks:
                self._ranks.discard(pid)
                self._exits[pid] = int(message["code"])
        return []

    def _receive(self, block: bool, timeout: float = 0.0) -> dict | None:
        if self._socket is None:
            return None
        if block:
            readable, _, _ = select.select([self._socket], [], [], timeout)
            if not readable:
                return None
        try:
            data = self._socket.recv(1 << 16, 0 if block else socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            data = b""
        if not data:  # the template exited
            if self._proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._proc.wait(timeout=1.0)
            return None
        message = msgpack.unpackb(data, raw=False)
        return message if isinstance(message, dict) else None

    def _forget(self) -> None:
        if self._proc is not None:
            self._guard.forget(self._proc.pid)
        if self._socket is not None:
            self._socket.close()
        self._proc, self._socket, self.ready = None, None, False
        self._ranks.clear()  # they died with it (PDEATHSIG)
