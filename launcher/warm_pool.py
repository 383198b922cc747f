"""The warm pool: one idle interpreter per local rank with torch already imported.

A replacement rank is a pool process told to become rank r, so a recovery does not pay the
seconds of importing torch and of the first optimizer step's lazy imports, even for an
unmodified torchrun script. A slot is refilled as soon as it is taken; the new process
imports in the background while training runs. Slots are per local rank because settings
read at import time (OMP_NUM_THREADS, CUDA_VISIBLE_DEVICES) differ between local ranks.
"""

from __future__ import annotations

import contextlib
import os
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
"""torch._dynamo is what the first ``optimizer.step()`` imports lazily (about 2 s here)."""


@dataclass
class PoolProcess:
    proc: subprocess.Popen
    order_socket: socket.socket
    ready: bool = False  # its preload finished

    def become(self, argv: list[str], env: dict[str, str], cwd: str, module: bool,
               stdout: int, stderr: int) -> None:
        """Send the order; the process turns into the rank once its preload is done."""
        order = msgpack.packb({"argv": argv, "env": env, "cwd": cwd, "module": module})
        socket.send_fds(self.order_socket, [order], [stdout, stderr])
        self.order_socket.close()


class WarmPool:
    def __init__(self, preload: list[str], env_for_slot: Callable[[int], dict[str, str]],
                 guard: OrphanGuard, preexec_fn: Callable[[], None]):
        self._preload = preload
        self._env_for_slot = env_for_slot  # local rank -> environment fixed at start
        self._guard = guard
        self._preexec_fn = preexec_fn  # own process group, dies with the agent: as ranks
        self._idle: dict[int, PoolProcess] = {}
        self._filled_at = 0.0

    def fds(self) -> list[int]:
        """Sockets of idle processes still importing: each says "R" when it is warm."""
        return [p.order_socket.fileno() for p in self._idle.values() if not p.ready]

    def on_readable(self, fd: int) -> float | None:
        """Note a ready (or dead) process; returns the fill's duration once all are warm."""
        for p in self._idle.values():
            if p.order_socket.fileno() == fd:
                p.ready = True  # "R", or EOF from a dead one: either way it is done importing
                with contextlib.suppress(OSError):
                    p.order_socket.recv(1, socket.MSG_DONTWAIT)
        if self._idle and all(p.ready for p in self._idle.values()):
            return time.monotonic() - self._filled_at
        return None

    def fill(self, slots: range) -> None:
        """Start an idle process in each empty slot (its imports then run in the background)."""
        self._filled_at = time.monotonic()
        for slot in slots:
            if slot not in self._idle:
                self._idle[slot] = self._spawn(slot)

    def take(self, slot: int) -> PoolProcess | None:
        """The idle process of ``slot``, or None (empty, or it died); ``fill`` refills."""
        pool_process = self._idle.pop(slot, None)
        if pool_process is not None and pool_process.proc.poll() is not None:
            self._guard.forget(pool_process.proc.pid)
            pool_process.order_socket.close()
            return None
        return pool_process

    def close(self) -> None:
        """Kill every idle process (their sockets closing would also end them)."""
        for p in self._idle.values():
            p.order_socket.close()
            p.proc.kill()
            p.proc.wait()
            self._guard.forget(p.proc.pid)
        self._idle.clear()

    def _spawn(self, slot: int) -> PoolProcess:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        python = os.environ.get("PYTHON_EXEC", sys.executable)
        with theirs:
            proc = subprocess.Popen(
                [python, "-u", "-m", "launcher.pool_process", str(theirs.fileno()),
                 *self._preload],
                env=self._env_for_slot(slot), stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True,
                pass_fds=[theirs.fileno()], preexec_fn=self._preexec_fn)
        self._guard.watch(proc.pid)
        return PoolProcess(proc, ours)
