"""trainer_shim: what a training script imports to unlock ftlaunch's fast recovery paths.

    import trainer_shim as ft

    @ft.restartable                      # re-entered in place when the job recovers
    def train(ctx: ft.RestartContext):
        ...                              # build, load the latest checkpoint, train
        for step in range(start, total):
            with ft.section("step"):     # a section may have its own timeout
                ...
            ft.heartbeat(step)           # one-way, throttled: < 1% at 10 ms steps

Every call is a cheap no-op when the script runs without an ftlaunch agent (plain python,
or under torchrun), so one script runs everywhere.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from ftlaunch_contract import environment
from trainer_shim import shutdown
from trainer_shim.restart import RestartRequested

__all__ = ["AsyncCheckpointer", "CheckpointError", "DistributedState", "RestartContext", "RestartRequested",
           "heartbeat", "is_managed",
           "load_state_dict", "restartable", "section", "state_dict"]

T = TypeVar("T")
MIN_BEAT_INTERVAL = 0.05
"""Heartbeats closer together than this are not sent: the agent's clock needs no finer grain."""


def is_managed() -> bool:
    """True when this process is a rank started by an ftlaunch agent."""
    return environment.RUN_ID in os.environ


def _connect():
    if not is_managed() or environment.HUB not in os.environ:
        return None
    from trainer_shim.agent_link import AgentLink

    link = AgentLink(os.environ[environment.HUB])
    shutdown.at_exit(_disconnect)
    return link


def _disconnect() -> None:
    """At exit: stop talking to the agent (later heartbeats are no-ops)."""
    global _link
    link, _link = _link, None
    if link is not None:
        link.close()


_link = _connect()
_last_beat = 0.0  # last heartbeat sent
_last_call = 0.0  # last heartbeat() call
_last_step = -1  # the highest step heartbeat() was given, sent or throttled away
_longest_interval = 0.0  # between calls: what --hang-timeout-factor learns from
_step_interval = 0.0  # the median of _intervals: about a step
_intervals: deque[float] = deque(maxlen=8)  # between the last calls
"""A step's length, as told by its heartbeats: the median of the last few, so that one slow
step (a save, a retransmit under packet loss) does not stretch the window in which an aborted
rank idle in native code is found stuck past --stop-timeout (chaos seed 4501: a 1.5 s step
before a partition, a 3 s window, a survivor killed late at the 2 s timeout)."""


def heartbeat(step: int | None = None) -> None:
    """Tell the agent this rank is alive (and at ``step``, which measures progress)."""
    global _last_beat, _last_call, _longest_interval, _last_step, _step_interval
    if _link is None:
        return
    if step is not None:
        _last_step = max(_last_step, int(step))
    now = time.monotonic()
    if _last_call:
        _intervals.append(now - _last_call)
        _longest_interval = max(_longest_interval, _intervals[-1])
        _link.pace = _step_interval = sorted(_intervals)[(len(_intervals) - 1) // 2]
    _last_call = now
    if now - _last_beat >= MIN_BEAT_INTERVAL:
        _last_beat = now
        _link.beat(-1 if step is None else int(step))


_preempted = False
_preemption_armed = False
_parked = False  # waiting in restartable() for the agent's word to re-enter


def preempted() -> bool:
    """True once the job is asked to stop (SIGTERM: a Kubernetes eviction, a SLURM
    preemption, ``ftlaunch`` forwarding one): save a checkpoint and return, within the
    launcher's grace period. With torch.distributed initialized the ranks agree (one tiny
    all-reduce, so call it at the same steps on every rank): all stop at the same step even
    when the signal reaches them a step apart. The first call arms a SIGTERM handler, only
    if SIGTERM still has its default action, so a script that never asks is stopped as
    before. Works under torchrun and plain python too."""
    global _preemption_armed
    if not _preemption_armed:
        _preemption_armed = True
        with contextlib.suppress(ValueError):  # not the main thread: the flag stays False
            if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
                signal.signal(signal.SIGTERM, _on_sigterm)
    from trainer_shim import collective

    if not collective.initialized():
        return _preempted
    return bool(collective.all_reduce_int(int(_preempted), "max"))


def _on_sigterm(signum, frame) -> None:
    global _preempted
    _preempted = True
    if _parked:  # out of training, its state saved: a stopping job sends no resume
        raise SystemExit(128 + signum)


def state_dict() -> dict[str, float]:
    """What the shim learned about this job's pace; save it with your checkpoint."""
    return {"longest_heartbeat_interval": _longest_interval, "step_interval": _step_interval}


def load_state_dict(state: dict[str, float]) -> None:
    """Restore it after a restart: a learned hang timeout (--hang-timeout-factor) then holds
    from the first step instead of after 20 new heartbeats, and a rank told to leave in its
    first steps is found stuck in a collective within two steps, not the unpaced second."""
    global _longest_interval, _step_interval
    _longest_interval = max(_longest_interval, float(state.get("longest_heartbeat_interval", 0)))
    if not _step_interval:  # this process's own steps, once it has two, are newer
        _step_interval = float(state.get("step_interval", 0))
    if _link is not None and _longest_interval > 0:
        _link.learned(_longest_interval)
    if _link is not None and not _link.pace:
        _link.pace = _step_interval


@contextlib.contextmanager
def section(name: str) -> Iterator[None]:
    """Mark a phase; ``--section-timeouts NAME=SECONDS`` bounds it instead of the heartbeat."""
    if _link is None:
        yield
        return
    _link.section(name, True)
    try:
        yield
    finally:
        _link.section(name, False)


@dataclass(frozen=True)
class RestartContext:
    """Where this entry into the training function stands."""

    rank: int
    local_rank: int
    world_size: int
    attempt: int  # TORCHELASTIC_RESTART_COUNT: 0 first, then one more per recovery
    resume_step: int | None  # newest checkpoint step every rank had made durable (the agents'
    # record) when this attempt started; load_latest may find a newer one staged everywhere

    @classmethod
    def from_env(cls) -> RestartContext:
        env = os.environ
        resume = env.get(environment.RESUME_STEP)
        return cls(int(env.get("RANK", "0")), int(env.get("LOCAL_RANK", "0")),
                   int(env.get("WORLD_SIZE", "1")), int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
                   int(resume) if resume else None)


def restartable(fn: Callable[..., T]) -> Callable[..., T]:
    """Run ``fn(ctx, ...)``; when the job recovers, leave it and re-enter in this process.

    On a recovery (the agent's "abort", or a collective failing because a peer died) the
    shim releases torch.distributed's process group, tells the agent it is parked, and
    re-enters ``fn`` with the next attempt's environment (a fresh store, maybe a new rank).
    Imports, caches and the interpreter survive. Without an agent it is a plain call.
    """

    @functools.wraps(fn)
    def run(*args, **kwargs) -> T:
        global _last_call, _last_step
        if _link is None:
            return fn(RestartContext.from_env(), *args, **kwargs)
        _link.hello_restartable()
        while True:
            error = ""
            try:
                _link.enter_training()
                try:
                    return fn(RestartContext.from_env(), *args, **kwargs)
                except (SystemExit, KeyboardInterrupt):
                    raise
                except RestartRequested:
                    pass
                except BaseException:  # this rank's own failure, or a peer's echo
                    error = traceback.format_exc()
                finally:
                    _link.leave_training()
            except RestartRequested:  # an abort that landed while we were leaving anyway
                _link.leave_training()
            _last_call = 0.0  # the pause until resume is not a step
            # Parked (with this rank's own error) before the process group goes: releasing
            # it closes the peers' connections, and their echo of it must not reach the
            # agent first and be taken for the job's first failure.
            _link.parked(error[-4000:], _last_step)
            _last_step = -1  # the next entry's progress is its own
            _release_process_group()
            os.environ.update(_wait_resume())

    return run


def _wait_resume() -> dict[str, str]:
    """The agent's word to re-enter; a stop signal meanwhile (or before) ends the rank."""
    global _parked
    assert _link is not None
    _parked = True  # then the flag: a signal between the two is seen by one or the other
    try:
        if _preempted:
            raise SystemExit(128 + signal.SIGTERM)
        return _link.wait_resume()
    finally:
        _parked = False


def _release_process_group() -> None:
    """Drop torch.distributed's state so the next entry can init_process_group again,
    without waiting on the old groups: destroy_process_group first waits for their pending
    work, and even after an abort gloo's destructor joins a group's threads. With a peer
    lost in the middle of a collective, a survivor's pending work can wait on another
    survivor waiting the same way (torchtitan met that deadlock at exit): the rank would
    have said it parked and never resume. So the registry is cleared by an abort, here,
    and the groups' last references are dropped in a daemon thread: a work that can never
    finish keeps that thread, not the rank (it ends when its peers' connections close)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available():
        return
    c10d = dist.distributed_c10d
    if not dist.is_initialized():
        # An init_process_group cut short by the abort had already named its group ("0")
        # and counted it: the next would be "1", its keys in the store under that name,
        # while every fresh peer's are under "0", and all would wait for each other's
        # forever (chaos seed 6906). No group exists: the count starts again.
        c10d._world.group_count = 0
        return
    abort = getattr(c10d, "_abort_process_group", None)  # torch >= 2.5
    groups = list(c10d._world.pg_names)  # held until the thread below lets go of them
    with contextlib.suppress(Exception):
        (abort or dist.destroy_process_group)()
    if dist.is_initialized():  # the abort failed
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    threading.Thread(target=groups.clear, name="ftlaunch-release-groups", daemon=True).start()


def __getattr__(name: str):
    """``ft.AsyncCheckpointer`` without importing torch when the shim itself is imported."""
    if name in ("AsyncCheckpointer", "CheckpointError", "DistributedState"):
        from trainer_shim import checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(f"module 'trainer_shim' has no attribute {name!r}")
