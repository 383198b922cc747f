"""The agent's edges to the world, and the one wait of its loop.

``NodeIO`` owns every socket, pipe, process and thread the agent talks to: the control
plane, the ranks' hub, the rank processes, the rank template, the GPU health monitor,
signals.
``poll`` waits on all of them at once and turns what is readable into events for the
agent's state machine (``launcher/agent.py``), which never touches a file descriptor.
"""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq

from ftlaunch_contract import environment, staging
from ftlaunch_contract.protocol import Envelope
from launcher import UsageError, replica_service, stacks
from launcher.events import EventLog
from launcher.gpu_health import Finding
from launcher.health_monitor import HealthMonitor
from launcher.live_status import LiveStatus
from launcher.node_plan import NodePlan
from launcher.orphan_guard import OrphanGuard
from launcher.rank_env import pre_import_env
from launcher.rank_hub import RankHub
from launcher.rank_template import RankTemplate, TemplateNews
from launcher.status import RuntimeRecord
from launcher.store import AgentStore
from launcher.workers import RankExit, WorkerGroup, rank_preexec_fn

if TYPE_CHECKING:
    from launcher.metrics import Metrics


@dataclass(frozen=True)
class RanksSpoke:
    """Messages from ranks are queued at the hub."""


@dataclass(frozen=True)
class SignalArrived:
    signum: int


@dataclass(frozen=True)
class GpuFound:
    findings: list[Finding]


@dataclass(frozen=True)
class ReplicaNews:
    news: list[replica_service.News]  # transfers of checkpoint shards that ended


Event = (Envelope | RankExit | RanksSpoke | SignalArrived | GpuFound | TemplateNews
         | ReplicaNews)


def _start_metrics(port: int) -> Metrics | None:
    """``--metrics-port``: this node's Prometheus endpoint, or None."""
    if not port:
        return None
    try:
        from launcher.metrics import Metrics

        return Metrics(port)
    except ImportError:
        raise UsageError("--metrics-port needs prometheus-client: pip install "
                         "'ftlaunch[metrics]'") from None
    except OSError as e:
        raise UsageError(f"--metrics-port {port}: {e.strerror}; pick a free port") from None


class NodeIO:
    def __init__(self, plan: NodePlan, attempt_env: Callable[[], dict[str, str]]):
        config = plan.config
        self.metrics = _start_metrics(config.metrics_port)
        self.live = LiveStatus.start_if_terminal()
        self.events = EventLog(plan.log_dir / "events.jsonl",
                               self.metrics.on_event if self.metrics else None)
        self.guard = OrphanGuard()  # (it kills the template too, should we die)
        # First: its imports (seconds) run while the rest starts, NVML and all, and while
        # the node joins the job.
        self.template = RankTemplate(config.preload_modules(),
                                     pre_import_env(plan.local_world_size), self.guard,
                                     rank_preexec_fn()) if config.forks_ranks() else None
        if self.template is not None:
            self.template.start()
        self.context = zmq.Context()
        self._job_key = plan.job_key
        self.staging_dir = staging.create_dir(plan.job_key)  # staging that outlives ranks
        self.control = plan.control_plane(self.context, str(self.staging_dir))
        self.runtime = RuntimeRecord(plan.run_id, plan.node_id, plan.secret,  # ftlaunch status
                                     plan.log_dir / "events.jsonl")
        self._attempt_env = attempt_env  # the agent's variables of the attempt starting
        self._signal_fd, self._signal_write_fd = os.pipe()
        os.set_blocking(self._signal_fd, False)
        os.set_blocking(self._signal_write_fd, False)
        signal.set_wakeup_fd(self._signal_write_fd)
        self._previous_handlers = {sig: signal.signal(sig, lambda *_: None)
                                   for sig in config.signals()}
        self.health, why = HealthMonitor.start(config.health_interval)
        self.events.emit("gpu_health_monitor", why, active=self.health is not None)
        self.hub = RankHub(self.context, self.staging_dir)
        self.replicas = replica_service.ReplicaService(
            self.context, plan.secret, plan.node_id, plan.addr, self.staging_dir,
            bandwidth=config.replica_bandwidth * 1e6)
        self.workers = WorkerGroup(plan.program, plan.output, self.guard, self._rank_env)
        self.new_store = lambda addr, port: AgentStore(addr, port, self.template)
        self.capture_stacks = stacks.capture
        self._poller = zmq.Poller()
        for fd in (self.hub.socket, self._signal_fd, self.replicas.fd,
                   *([self.health.fd] if self.health is not None else [])):
            self._poller.register(fd, zmq.POLLIN)
        self._polled: set[Any] = set()

    def poll(self, timeout_ms: int) -> Iterator[Event]:
        """Wait up to ``timeout_ms`` for anything; yield what happened, in order."""
        self.runtime.publish(self.control.endpoint)  # the coordinator may have moved
        self._sync_poller()
        for fd, _ in self._poller.poll(timeout_ms):
            if fd is self.control.socket:
                msg = self.control.receive()
                if msg is not None:
                    yield msg
            elif any(fd is monitor for monitor in self.control.monitors):
                self.control.on_monitor()  # coordinator_lost() says what it means, at once
            elif fd == self.control.probe_fd:
                self.control.on_probe()  # likewise
            elif fd is self.hub.socket:
                yield RanksSpoke()
            elif fd == self.replicas.fd:
                yield ReplicaNews(self.replicas.news())
            elif fd == self._signal_fd:
                for signum in os.read(self._signal_fd, 64):
                    yield SignalArrived(signum)
            elif self.health is not None and fd == self.health.fd:
                yield GpuFound(self.health.findings())
            elif self.template is not None and fd == self.template.fd:
                yield from self.template.on_readable()
            else:
                exit_ = self.workers.on_readable(fd)
                if exit_ is not None:
                    yield exit_

    def _sync_poller(self) -> None:
        """Poll exactly the live ranks' pidfds and output pipes, the rank template, and the
        control plane's sockets (a failover moves it to another) and probe, if any."""
        wanted: set[Any] = {*self.workers.fds(), self.control.socket, *self.control.monitors}
        if self.control.probe_fd >= 0:
            wanted.add(self.control.probe_fd)
        if self.template is not None and self.template.fd is not None:
            wanted.add(self.template.fd)
        for fd in self._polled - wanted:
            self._poller.unregister(fd)
        for fd in wanted - self._polled:
            self._poller.register(fd, zmq.POLLIN)
        self._polled = wanted

    def _rank_env(self, rank_dir: Path) -> dict[str, str]:
        """ftlaunch's own variables for a rank: the hub, where its stacks go on a hang."""
        env = {environment.HUB: self.hub.endpoint,
               environment.STACKS_FILE: str(rank_dir / "stacks.txt"),
               environment.STACK_SIGNAL: str(int(stacks.STACK_SIGNAL)),
               environment.STAGING: str(self.staging_dir)}
        return {**env, **self._attempt_env()}

    def _persist_staged(self) -> None:
        """The ranks are gone: make durable what they staged but did not write (a rank
        killed mid-write, a preempted job, saves staged only), then free the memory. With
        ours, what agents of the job SIGKILLed on this host since we started left (no agent
        started here after them to adopt it: it would outlive the job)."""
        staging.adopt_stale(self.staging_dir, self._job_key)
        written = staging.flush(self.staging_dir)
        if written:
            steps = sorted({step for _, step in written})
            self.events.emit("checkpoint_persisted", f"persisted {len(written)} staged "
                             f"checkpoint shard(s) the ranks left, steps {steps}",
                             shards=[list(w) for w in written])
        shutil.rmtree(self.staging_dir, ignore_errors=True)

    def close(self) -> None:
        """Once the ranks are gone: persist staged checkpoints, release everything."""
        self.runtime.remove()
        if self.live is not None:
            self.live.show("ftlaunch ▸ persisting staged checkpoints, shutting down")
        self.replicas.close()
        self._persist_staged()
        if self.health is not None:
            self.health.close()
        if self.template is not None:
            self.template.close()
        self.hub.close()
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(-1)
        os.close(self._signal_fd)
        os.close(self._signal_write_fd)
        self.control.close()
        self.context.term()
        self.guard.close()
        self.events.close()
        if self.live is not None:
            self.live.stop()
        if self.metrics is not None:
            self.metrics.close()

