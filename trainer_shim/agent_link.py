"""The rank's end of the agent's node-local hub (see launcher/rank_hub.py).

Two ZeroMQ sockets, because a socket belongs to one thread: the training thread sends
heartbeats and section boundaries on its own (non-blocking, dropped if the agent is slow,
never waited on), and a daemon thread listens for the agent's commands: "abort" raises
``RestartRequested`` in the training thread, "resume" hands it the next attempt's env,
"committed" records the newest checkpoint step every rank made durable. (A third socket,
behind a lock, carries checkpoint writers' reports.)
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import signal
import sys
import threading
import time

import zmq

from ftlaunch_contract import environment
from ftlaunch_contract.messages import (
    Abort,
    Beat,
    Body,
    Committed,
    Entered,
    Hello,
    Learned,
    Leaving,
    Parked,
    Restartable,
    Resume,
    Section,
    Stuck,
    Tick,
)
from ftlaunch_contract.protocol import TICK_INTERVAL, pack_local, unpack_local
from ftlaunch_contract.rank_exit import thread_state
from ftlaunch_contract.stack_dump import register_stack_dump
from trainer_shim.restart import RestartRequested

STUCK_AFTER = 0.1
"""Seconds (or two of the rank's steps, if longer) a training thread told to leave may stay
in native code burning (almost) no CPU before it is reported stuck: an abort is raised only
between two Python instructions, and a gloo collective waiting for a rank that failed never
returns (its peer's process lives on, parked, and gloo has no abort). A GPU step's host thread
also waits idle, but not for longer than the step."""
STUCK_AFTER_UNPACED = 1.0  # without heartbeats the step's length is unknown
INTERRUPT_SIGNAL = signal.SIGRTMIN + 7
"""Sent to the main thread with an abort when it trains: a wait there in Python (sleep, a
lock, a queue, a socket) is cut short by it, our empty handler runs, and the abort pending
in the thread is raised from the handler: the rank leaves at once, not at the wait's end
(a survivor otherwise finished the step it was in, device time included, before parking)."""


class AgentLink:
    def __init__(self, endpoint: str):
        self.pid = os.getpid()
        self._context = zmq.Context(io_threads=1)
        self._beats = self._connect()
        self._resume: queue.Queue[dict[str, str]] = queue.Queue()
        self._training_thread: int | None = None  # the thread in the training function
        self._training_tid = 0  # and its kernel id
        self._interruptible = False  # the main thread trains and our signal handler is set
        self._in_training = False
        self._aborted = False  # an abort was raised in it since it entered
        self._abort_lock = threading.Lock()
        self._watch: tuple[float, float] | None = None  # see _check_stuck
        self.pace = 0.0  # seconds between the last two heartbeat() calls: about a step
        self.restartable = False
        self.stacks = register_stack_dump()
        self._commands = self._connect()
        self._reports = self._connect()  # from any thread (checkpoint writers), one at a time
        self._reports_lock = threading.Lock()
        self.committed_step = int(os.environ.get(environment.RESUME_STEP, -1))
        self._next_tick = 0.0
        self._wake_r, self._wake_w = os.pipe()  # close() wakes the listener through it
        self._commands.send(pack_local(Hello(pid=self.pid, stacks=self.stacks)))
        self._listener = threading.Thread(target=self._listen, name="ftlaunch-shim", daemon=True)
        self._listener.start()

    def _connect(self) -> zmq.Socket:
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 200)
        sock.setsockopt(zmq.SNDHWM, 1000)
        sock.connect(os.environ[environment.HUB])
        return sock

    def send(self, msg: Body) -> None:
        """Fire and forget, from the training thread."""
        try:  # noqa: SIM105 - the hot path: no context manager object per call
            self._beats.send(pack_local(msg), zmq.NOBLOCK)
        except zmq.Again:
            pass  # the agent is behind: a heartbeat is worthless late anyway

    def report(self, msg: Body) -> None:
        """Fire and forget, from any thread (its own socket, behind a lock)."""
        with self._reports_lock, contextlib.suppress(zmq.Again):
            self._reports.send(pack_local(msg), zmq.NOBLOCK)

    def beat(self, step: int) -> None:
        self.send(Beat(pid=self.pid, step=step))

    def section(self, name: str, is_open: bool) -> None:
        self.send(Section(pid=self.pid, name=name, open=is_open))

    def learned(self, interval: float) -> None:
        self.send(Learned(pid=self.pid, interval=interval))

    def parked(self, error: str, step: int) -> None:
        self.send(Parked(pid=self.pid, error=error, step=step, sent=time.monotonic()))

    def hello_restartable(self) -> None:
        self.restartable = True
        self.send(Restartable(pid=self.pid))

    def enter_training(self) -> None:
        """From the thread that runs the training function: an abort is raised in it."""
        main = threading.current_thread() is threading.main_thread()
        if main and signal.getsignal(INTERRUPT_SIGNAL) in (signal.SIG_DFL, _interrupted):
            signal.signal(INTERRUPT_SIGNAL, _interrupted)  # never replaces a script's own
        with self._abort_lock:
            self._training_thread, self._in_training = threading.get_ident(), True
            self._training_tid = threading.get_native_id()
            self._interruptible = main and signal.getsignal(INTERRUPT_SIGNAL) is _interrupted
        self.send(Entered(pid=self.pid))

    def leave_training(self) -> None:
        """From the training thread: from now on an abort is ignored, and one already
        raised but not yet delivered is withdrawn."""
        with self._abort_lock:
            self._in_training = False
            aborted, self._aborted = self._aborted, False
        if aborted:
            withdraw_abort()

    def wait_resume(self) -> dict[str, str]:
        """Block until the agent says how to re-enter (it kills us if we are not needed)."""
        return self._resume.get()

    def close(self) -> None:
        """Stop and join the listener, then close the sockets (at exit: a thread cut off
        mid-poll by finalization could die inside native code). Pending reports get the
        sockets' linger to reach the agent."""
        if self._listener.is_alive():
            with contextlib.suppress(zmq.Again):  # our ticks end here: no hang, an exit
                self._commands.send(pack_local(Leaving(pid=self.pid)), zmq.NOBLOCK)
            os.write(self._wake_w, b"x")
            self._listener.join(timeout=2 * TICK_INTERVAL + 1)
        if not self._listener.is_alive():  # never close what its thread still polls
            self._context.destroy(linger=200)
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _listen(self) -> None:
        """Obey the agent's commands; tick meanwhile, so the agent can tell a rank blocked in
        a collective (this thread still runs) from a frozen one (it does not)."""
        poller = zmq.Poller()
        poller.register(self._commands, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        while True:  # ticks first: a rank frozen in its first half second is still seen
            now = time.monotonic()
            if now >= self._next_tick:
                self._next_tick = now + TICK_INTERVAL
                with contextlib.suppress(zmq.Again):
                    self._commands.send(pack_local(Tick(pid=self.pid, sent=now)), zmq.NOBLOCK)
            wait = TICK_INTERVAL if self._watch is None else max(0.0, self._watch[0] - now)
            ready = dict(poller.poll(int(min(wait, TICK_INTERVAL) * 1000)))
            if self._wake_r in ready:
                return
            if self._watch is not None and time.monotonic() >= self._watch[0]:
                self._check_stuck()
            if ready:
                try:
                    msg = unpack_local(self._commands.recv())
                except Exception:
                    continue
                if isinstance(msg, Resume):
                    self._resume.put(msg.env)
                elif isinstance(msg, Committed):
                    self.committed_step = max(self.committed_step, msg.step)
                elif isinstance(msg, Abort):
                    with self._abort_lock:
                        if self._in_training:
                            self._aborted = True
                            raise_in(self._training_thread, RestartRequested)
                            if self._interruptible:
                                signal.pthread_kill(self._training_thread or 0,
                                                    INTERRUPT_SIGNAL)
                            self._watch = self._next_watch()

    def _window(self) -> float:
        return max(STUCK_AFTER, 2 * self.pace) if self.pace else STUCK_AFTER_UNPACED

    def _next_watch(self) -> tuple[float, float] | None:
        """(when to look again, the training thread's CPU seconds now)."""
        try:
            cpu = time.clock_gettime(time.pthread_getcpuclockid(self._training_thread or 0))
        except OSError:  # the thread is gone
            return None
        return time.monotonic() + self._window(), cpu

    def _check_stuck(self) -> None:
        """The training thread was told to leave a window ago: if it has neither left nor
        used a tenth of the window's CPU since, and sleeps (not merely starved of CPU), it
        waits in native code for something that will not come; the agent replaces the rank
        instead of waiting out --stop-timeout."""
        with self._abort_lock:
            assert self._watch is not None
            _, cpu = self._watch
            if not (self._in_training and self._aborted):
                self._watch = None
                return
            self._watch = self._next_watch()
            if self._watch is None or self._watch[1] - cpu > self._window() / 10 \
                    or thread_state(self._training_tid) != "S":
                return  # busy (a long native step) or runnable: it leaves at its end
            self._watch = None
            frame = sys._current_frames().get(self._training_thread or 0)
            where = "" if frame is None else f"{frame.f_code.co_name} (" \
                f"{'/'.join(frame.f_code.co_filename.split('/')[-2:])}:{frame.f_lineno})"
        with contextlib.suppress(zmq.Again):
            self._commands.send(pack_local(Stuck(pid=self.pid, where=where)), zmq.NOBLOCK)


def _interrupted(signum: int, frame: object) -> None:
    """Nothing: running it is what delivers the pending abort, out of the wait."""


def raise_in(thread_id: int | None, exc: type[BaseException]) -> None:
    """Raise ``exc`` in that thread when it next checks for one (a call, a loop's turn)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id or 0),
                                               ctypes.py_object(exc))


class _Withdrawn(BaseException):
    """Takes the place of an abort that is no longer wanted, and is caught at once."""


def withdraw_abort() -> None:
    """In the thread an abort was raised in: drop it if it is still pending. Not by
    PyThreadState_SetAsyncExc(NULL): on CPython 3.11 and 3.12 that leaves the interpreter's
    flag for a pending exception set with nothing to deliver, and the next function call
    made under a profiler or tracer (cProfile, coverage, a debugger) spins for ever. The
    flag is reset only by delivering one: ours, replacing the abort, caught here."""
    try:
        raise_in(threading.get_ident(), _Withdrawn)
        _deliver()  # a Python function's entry delivers it, if the return above did not
    except _Withdrawn:
        pass


def _deliver() -> None:
    pass
