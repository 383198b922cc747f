"""The agent: one per node. Joins the job, runs this node's ranks, acts on the coordinator's word.

The whole agent is one poll loop over its control socket, the rank pidfds, the rank output
pipes and a signal wake-up pipe: nothing is polled on a timer, every event is handled the
moment it happens. The coordinator decides; the agent reports and obeys.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid
from pathlib import Path

import zmq

from ftlaunch_contract import environment, staging
from ftlaunch_contract.protocol import Message
from launcher import UsageError, exit_codes, failures, stacks
from launcher.config import LaunchConfig
from launcher.control_plane import ControlPlane, job_secret, outgoing_addr
from launcher.coordinator import JobState
from launcher.events import EventLog, PhaseClock
from launcher.hang_detection import HangTimeouts
from launcher.health_monitor import HealthMonitor
from launcher.orphan_guard import OrphanGuard
from launcher.rank_env import Attempt, pre_import_env
from launcher.rank_hub import RankHub
from launcher.store import AgentStore
from launcher.warm_pool import WarmPool
from launcher.workers import OutputPlan, Program, Rank, RankExit, WorkerGroup, rank_preexec_fn

HANG_CHECK_INTERVAL = 0.1

log = logging.getLogger("ftlaunch.agent")


class Agent:
    def __init__(self, config: LaunchConfig, script: str, script_args: list[str]):
        self.config = config
        self.local_world_size = config.local_world_size()
        self.min_nodes, self.max_nodes = config.node_range()
        self.single_node = self.max_nodes == 1 and not config.rdzv_endpoint
        self.run_id = str(uuid.uuid4()) if config.standalone or (
            self.single_node and config.rdzv_id == "none") else config.rdzv_id
        self.node_id = f"{socket.gethostname()}:{os.getpid()}"
        self.endpoint = None if self.single_node or config.standalone else (
            config.rdzv_endpoint_parts() or (config.master_addr, config.master_port or 29400))
        self.addr = config.local_addr or (
            config.master_addr if self.endpoint is None else outgoing_addr(self.endpoint[0]))
        static_form = config.rdzv_backend == "static" and not config.rdzv_endpoint
        self.rank_hint = config.node_rank if static_form and self.endpoint else -1
        self.last_call_timeout, self.join_timeout = config.rdzv_timeouts()
        self.secret = job_secret(config.secret_file, self.run_id, self.endpoint is None)
        self.program = Program(script, script_args, config.module, config.no_python)
        self.hang_timeouts = HangTimeouts(config.hang_timeout, config.startup_timeout,
                                          config.section_timeout_map(), config.hang_timeout_factor)
        log_root = Path(config.log_dir) if config.log_dir else Path(tempfile.mkdtemp(prefix="ftlaunch_"))
        self.log_dir = log_root / self.run_id
        self.output = OutputPlan(self.log_dir, config.stream_modes(self.local_world_size),
                                 config.console_ranks(self.local_world_size))

        self.epoch = 0
        self.assignment: Message | None = None
        self.store: AgentStore | None = None
        self.spare_store: AgentStore | None = None  # next attempt's, already importing torch
        self.first_failure: failures.RankFailure | None = None
        self.recovery: PhaseClock | None = None  # set from a failure until ranks are back
        self.policy = config.restart_policy  # of the recovery under way
        self.parked: dict[int, Rank] = {}  # local rank -> process waiting to resume in place
        self.parking_until: float | None = None  # survivors have until then to park
        self.rejoin_at: float | None = None
        self.pool_fill_at: float | None = None
        self.hang_check_at = 0.0
        self.shutdown_signal: int | None = None
        self.kill_at: float | None = None
        self.restart_count = 0
        self.committed_step = -1  # the newest checkpoint step every rank made durable
        self.draining = ""  # a GPU finding that wants this node out at the next safe point
        self.dead_pids: set[int] = set()  # whose GPU memory must be free before a restart
        self.started_at = self.last_loop = time.monotonic()
        self.exit_code: int | None = None

    def _job_state(self) -> JobState:
        """A fresh coordinator state from this node's config (every node has the same)."""
        c = self.config
        return JobState(self.min_nodes, self.max_nodes, c.max_restarts, c.restart_policy,
                        c.restart_backoff, c.restart_backoff_max, c.exit_barrier_timeout,
                        c.node_timeout, self.last_call_timeout, self.join_timeout,
                        host_node=self.node_id, max_stalled=c.max_stalled_recoveries,
                        healthy_after=c.healthy_interval)

    # --- the main loop: read top to bottom ---------------------------------------------------

    def run(self) -> int:
        self._open()
        try:
            self._join()
            while self.exit_code is None:
                for fd, _ in self.poller.poll(self._poll_timeout_ms()):
                    if fd is self.control.socket:
                        self._on_control_message()
                    elif fd is self.hub.socket:
                        self._on_rank_messages()
                    elif fd == self.signal_fd:
                        self._on_signals()
                    elif self.health is not None and fd == self.health.fd:
                        self._on_gpu_health()
                    elif self.pool is not None and fd in self.pool.fds():
                        self._on_pool_ready(fd)
                    else:
                        exit_ = self.workers.on_readable(fd)
                        if exit_ is not None:
                            self._on_rank_exit(exit_)
                self._sync_poller()
                self._on_timers(time.monotonic())
            return self.exit_code
        finally:
            self._close()

    # --- control messages ----------------------------------------------------------------

    def _on_control_message(self) -> None:
        msg = self.control.receive()
        if msg is None or msg.epoch < self.epoch:
            return
        self.epoch = msg.epoch
        if msg.type == "assign":
            self.assignment = msg
            if msg["group_rank"] == 0:  # the node holding torch's store for this attempt
                try:
                    self.store, self.spare_store = self.spare_store, None
                    if self.store is None:
                        self.store = AgentStore(self.addr, self._store_port())
                except OSError as e:
                    raise UsageError(f"cannot serve torch's store on {self.addr}:"
                                     f"{self.config.master_port}: {e.strerror}; pick another "
                                     "--master-port (0 = any free port) or --master-addr") from None
                self._send("store_ready", master_addr=self.addr, master_port=self.store.port)
        elif msg.type == "start" and self.shutdown_signal is None:
            if self.recovery is not None:
                self.recovery.mark("rendezvous")
            self._start_ranks(msg)
        elif msg.type == "recover":
            if self.draining:  # a recovery is the moment to leave without costing a restart
                self._exclude_node(self.draining)
            else:
                self._recover(msg)
        elif msg.type == "committed":
            self.committed_step = msg["step"]
            self.events.emit("checkpoint_committed", f"checkpoint step {msg['step']} committed "
                             "(every rank's shard durable)", console=False, step=msg["step"])
            for rank in self.workers.alive():
                self.hub.send(rank.proc.pid, "committed", step=msg["step"])
        elif msg.type == "stop":
            self._finish(msg["exit_code"], msg["reason"])

    def _start_ranks(self, msg: Message) -> None:
        """Each local rank: resume its parked process, or take a warm one, or start afresh."""
        a = self.assignment
        assert a is not None
        self.restart_count = msg["restart_count"]
        attempt = Attempt(self.run_id, self.config.role, a["group_rank"], a["group_world_size"],
                          a["rank_offset"], a["world_size"], self.local_world_size,
                          msg["master_addr"], msg["master_port"], msg["restart_count"],
                          a["max_restarts"], self.config.signals_to_handle)
        self._wait_gpu_memory_released()
        now = time.monotonic()
        self.hub.reset_steps()
        sources = {"resumed": [], "warm": [], "fresh": []}
        for local_rank in range(self.local_world_size):
            kept = self.parked.pop(local_rank, None)
            if kept is not None:
                env = self.workers.resume(kept, attempt)
                self.hub.track(kept.proc.pid, now)
                self.hub.send(kept.proc.pid, "resume", env=env)
                sources["resumed"].append(kept.rank)
                continue
            warm = self.pool.take(local_rank) if self.pool and self.policy != "cold" else None
            rank = self.workers.spawn(attempt, local_rank, warm)
            self.hub.track(rank.proc.pid, now)
            self.hub.links[rank.proc.pid].stacks = warm is not None  # armed by the pool
            sources["warm" if warm else "fresh"].append(rank.rank)
        self.first_failure = None
        self.pool_fill_at = now + self.config.warm_pool_after  # or at every rank's first beat
        if self.recovery is not None:
            self.recovery.mark("spawn")
            phases = ", ".join(f"{k} {v:.3f}s" for k, v in self.recovery.phases.items())
            how = "; ".join(f"{k} {v}" for k, v in sources.items() if v)
            self.events.emit("recovered", f"restart {attempt.restart_count} ({self.policy}): "
                             f"ranks back {self.recovery.total:.3f}s after the failure "
                             f"({phases}; ranks {how})",
                             restart_count=attempt.restart_count, seconds=self.recovery.total,
                             policy=self.policy, phases=self.recovery.phases, **sources)
            self.recovery = None
        else:
            self.events.emit("started", f"started {self.local_world_size} ranks "
                             f"(world size {attempt.world_size}, run {self.run_id}, logs "
                             f"{self.log_dir})", world_size=attempt.world_size, run_id=self.run_id)

    def _recover(self, msg: Message) -> None:
        """Stop what must go, let survivors that can re-enter in place park, then re-join."""
        self.recovery = self.recovery or PhaseClock()
        self.recovery.mark("decide")
        self.policy = msg["policy"]
        self.events.emit("recovering", f"{msg['cause']} -> {msg['policy']} restart "
                         f"{msg['restart_count']}/{self.config.max_restarts}",
                         cause=msg["cause"], policy=msg["policy"],
                         restart_count=msg["restart_count"], delay=msg["delay"])
        self.rejoin_delay = msg["delay"]
        self.parking_until = time.monotonic()
        if self.policy == "rank":
            self.parking_until += self.config.stop_timeout
            for rank in self.workers.alive():
                link = self.hub.links.get(rank.proc.pid)
                if link is not None and link.restartable and not link.parked:
                    self.hub.send(rank.proc.pid, "abort")
        self._park_or_stop(time.monotonic())

    def _park_or_stop(self, now: float) -> None:
        """Once every re-enterable survivor parked (or time is up), stop all the others."""
        if self.parking_until is None:
            return
        parked, others = [], []
        for rank in self.workers.alive():
            link = self.hub.links.get(rank.proc.pid)
            if link is not None and link.parked and self.policy == "rank":
                parked.append(rank)
            elif link is not None and link.restartable and now < self.parking_until:
                return  # still leaving its training function
            else:
                others.append(rank)
        late = [r.rank for r in others if (link := self.hub.links.get(r.proc.pid)) and link.restartable]
        if late:
            self.events.emit("escalated", f"ranks {late} did not leave their training function "
                             f"within {self.config.stop_timeout:g}s: replacing them", ranks=late)
        self.parking_until = None
        self._stop_ranks(self.config.stop_timeout, others)
        self.parked = {r.local_rank: r for r in parked}
        self.recovery.mark("stop")
        self.rejoin_at = time.monotonic() + self.rejoin_delay

    def _finish(self, exit_code: int, reason: str) -> None:
        if self.shutdown_signal is not None:
            return  # our own signal shutdown ends the job, honouring the grace period
        self._stop_ranks(self.config.stop_timeout)
        if exit_code == exit_codes.OK:
            self.events.emit("job_finished", "all ranks finished", exit_code=exit_code)
        else:
            self.events.emit("job_failed", f"job failed: {reason}", exit_code=exit_code,
                             reason=reason)
            if self.first_failure is not None:
                print(failures.summary(self.first_failure), flush=True, file=sys.stderr)
        self.exit_code = exit_code

    # --- rank exits and signals ----------------------------------------------------------

    def _on_rank_exit(self, exit_: RankExit) -> None:
        self.hub.forget(exit_.pid)
        self.dead_pids.add(exit_.pid)
        if self.shutdown_signal is not None:
            if not self.workers.alive():
                self.exit_code = exit_codes.SIGNAL_BASE + self.shutdown_signal
            return
        if exit_.failure is None:
            if not self.workers.alive():
                self._send("finished", node_id=self.node_id)
            return
        self._report_failure(exit_.failure)
        self._park_or_stop(time.monotonic())

    def _on_rank_messages(self) -> None:
        now = time.monotonic()
        parked = self.hub.receive(now)
        for rank, step in self.hub.durable:  # the coordinator tells when every rank's is
            self._send("durable", node_id=self.node_id, rank=rank, step=step)
        self.hub.durable.clear()
        if self.pool_fill_at is not None and self.recovery is None and all(
                (link := self.hub.links.get(r.proc.pid)) and link.activity.beats
                for r in self.workers.alive()):
            self.pool_fill_at = now  # every rank is past its start-up: warm up now
        for pid in parked:
            rank = self.workers.by_pid(pid)
            error = self.hub.links[pid].error
            if rank is not None and error and self.recovery is None:
                # It raised on its own and parked in restartable(): this rank's failure.
                last = error.strip().splitlines()[-1] if error.strip() else "an exception"
                self._report_failure(failures.RankFailure(
                    rank.rank, rank.local_rank, pid, None, "", rank.error_file, time.time(),
                    f"raised {last}", error))
        self._park_or_stop(now)

    def _report_failure(self, failure: failures.RankFailure) -> None:
        """The first failure of an attempt goes to the coordinator; the rest are its echoes."""
        if self.first_failure is not None:
            return
        self.first_failure = failure
        self.recovery = PhaseClock()
        self.events.emit("rank_failed", f"rank {failure.rank} {failure.cause}",
                         rank=failure.rank, local_rank=failure.local_rank,
                         exit_code=failure.exit_code, signal=failure.signal)
        self._send("failure", node_id=self.node_id, rank=failure.rank,
                   local_rank=failure.local_rank, exit_code=failure.exit_code,
                   signal=failure.signal, cause=failure.cause, step=self.hub.best_step)

    def _on_pool_ready(self, fd: int) -> None:
        seconds = self.pool.on_readable(fd)
        if seconds is not None:
            self.events.emit("warm_pool_ready", f"warm pool ready: {self.local_world_size} "
                             f"interpreters imported {self.config.preload} in {seconds:.2f}s",
                             seconds=seconds)

    def _on_gpu_health(self) -> None:
        """Warn; want out at the next recovery (drain); or leave the job now (fatal)."""
        for finding in self.health.findings():
            self.events.emit("gpu_health", str(finding), gpu=finding.gpu, finding=finding.kind,
                             severity=finding.severity, detail=finding.detail)
            if finding.severity == "drain" and not self.draining:
                self.draining = str(finding)
            elif finding.severity == "fatal":
                self._exclude_node(str(finding))

    def _exclude_node(self, reason: str) -> None:
        """Stop this node's ranks and leave the job, which goes on without us if it can;
        exit 3 so the scheduler puts no work on this node again."""
        if self.exit_code is not None:
            return
        self.events.emit("node_unhealthy", f"this node is unhealthy: {reason}; stopping its "
                         "ranks and leaving the job (exit 3: do not requeue on this node)",
                         reason=reason)
        self._stop_ranks(self.config.stop_timeout)
        if self.max_nodes > 1:  # the others recover without us
            self._send("unhealthy", node_id=self.node_id, reason=reason)
        else:
            self._send("leave", node_id=self.node_id, exit_code=exit_codes.DO_NOT_REQUEUE,
                       reason=f"unhealthy: {reason}")
        print(f"ftlaunch: node unhealthy: {reason}. Drain this node and have its GPUs checked "
              "(nvidia-smi -q, a GPU reset or a reboot); exit 3: do not requeue here.",
              file=sys.stderr, flush=True)
        self.exit_code = exit_codes.DO_NOT_REQUEUE

    def _wait_gpu_memory_released(self) -> None:
        """Replacements must not start on a GPU whose memory dead ranks still hold (their
        CUDA contexts tear down after the process is reaped); bounded."""
        if self.health is None:
            self.dead_pids.clear()  # nothing to wait for: do not let it grow
            return
        deadline = time.monotonic() + self.config.gpu_release_timeout
        while True:
            self.health.read_now()
            holding = self.dead_pids & self.health.processes()
            if not holding or time.monotonic() >= deadline:
                break
            self.control.heartbeat_if_due(time.monotonic())  # still alive to the coordinator
            time.sleep(0.05)
        if holding:
            self.events.emit("gpu_memory_held", f"dead ranks {sorted(holding)} still hold GPU "
                             f"memory after {self.config.gpu_release_timeout:g}s; starting anyway",
                             pids=sorted(holding))
        self.dead_pids.clear()

    def _check_hangs(self, now: float) -> None:
        """Capture a hung rank's stacks, then kill it: its exit is then a failure like any."""
        if any(r.cause and r.returncode is None for r in self.workers.ranks.values()):
            return  # one we killed is not reaped yet: its peers may be waiting on it
        for pid, reason in self.hub.hung(now, self.hang_timeouts):
            rank, link = self.workers.by_pid(pid), self.hub.links[pid]
            self.hub.forget(pid)
            if rank is None:
                continue
            path = Path(rank.error_file).with_name("stacks.txt")
            captured = stacks.capture(pid, path, self.config.stack_dump, link.stacks)
            rank.cause = f"hung: {reason}; {captured}"
            self.events.emit("rank_hung", f"rank {rank.rank} hung: {reason}; {captured}",
                             rank=rank.rank, reason=reason, stacks=str(path))
            self.workers.send_signal(signal.SIGCONT, [rank])
            self.workers.send_signal(signal.SIGKILL, [rank])

    def _on_signals(self) -> None:
        for signum in os.read(self.signal_fd, 64):
            if self.shutdown_signal is None:
                self.shutdown_signal = signum
                self.kill_at = time.monotonic() + self.config.grace_period
                self.events.emit("signal", f"got {signal.Signals(signum).name}: forwarded to ranks, "
                                 f"SIGKILL in {self.config.grace_period:g}s", signal=signum)
                self._send("leave", node_id=self.node_id,
                           exit_code=exit_codes.SIGNAL_BASE + signum,
                           reason=f"{signal.Signals(signum).name}")
            elif signum in (signal.SIGINT, signal.SIGTERM):
                self.kill_at = time.monotonic()  # asked twice: stop waiting
            self.workers.send_signal(signum)
        if not self.workers.alive():
            self.exit_code = exit_codes.SIGNAL_BASE + (self.shutdown_signal or 0)

    def _on_timers(self, now: float) -> None:
        self._park_or_stop(now)
        if now >= self.hang_check_at and self.recovery is None:
            self.hang_check_at = now + HANG_CHECK_INTERVAL
            self._check_hangs(now)
        if self.pool_fill_at is not None and now >= self.pool_fill_at:
            self.pool_fill_at = None
            self._warm_up()
        if self.rejoin_at is not None and now >= self.rejoin_at:
            self.rejoin_at = None
            if self.recovery is not None:
                self.recovery.mark("backoff")
            self._join()
        if now - self.last_loop > self.config.node_timeout / 2:
            # We were frozen (SIGSTOP, VM pause): the silence was ours, not the coordinator's.
            # Speak first; if we were dropped meanwhile, the coordinator tells us to re-join.
            self.control.last_heard = now
            self.control.next_heartbeat = now
        self.last_loop = now
        self.control.heartbeat_if_due(now)
        if self.control.coordinator_lost(now) and self.shutdown_signal is None:
            self._follow_coordinator()
        elif self.assignment is None and now - self.started_at > self.join_timeout:
            self.events.emit("job_failed", f"no rendezvous within {self.join_timeout:g}s at "
                             f"{self.endpoint}; check --rdzv-endpoint and that the other nodes "
                             "are up", exit_code=exit_codes.JOB_FAILED)
            self.exit_code = exit_codes.JOB_FAILED
        if self.kill_at is not None and now >= self.kill_at:
            self.kill_at = None
            self.events.emit("grace_expired", "grace period over: SIGKILL to remaining ranks")
            self.workers.send_signal(signal.SIGKILL)

    def _follow_coordinator(self) -> None:
        """The coordinator's node went silent: stop our ranks and re-join its successor."""
        lost = self.control.coordinator_node
        self._stop_ranks(self.config.stop_timeout)
        group_world_size = self.assignment["group_world_size"] if self.assignment else 0
        successor = self.control.fail_over(self.epoch, self.restart_count, group_world_size)
        if successor is None:
            self._finish(exit_codes.JOB_FAILED, f"coordinator node {lost} lost, no successor")
            return
        self.events.emit("coordinator_lost", f"coordinator node {lost} lost: following "
                         f"{'this node' if successor == self.node_id else successor}",
                         lost=lost, successor=successor)
        self.recovery = self.recovery or PhaseClock()
        self._join()

    def _join(self) -> None:
        self.control.send("join", self.epoch, node_id=self.node_id,
                          local_world_size=self.local_world_size, addr=self.addr,
                          standby_port=self.control.standby_port or 0,
                          rank_hint=self.rank_hint)

    def _poll_timeout_ms(self) -> int:
        deadlines = [t for t in (self.rejoin_at, self.kill_at, self.parking_until,
                                 self.pool_fill_at) if t is not None]
        deadlines.append(self.control.next_heartbeat)
        if self.hub.links and self.recovery is None:
            deadlines.append(self.hang_check_at)
        return max(0, int((min(deadlines) - time.monotonic()) * 1000) + 1)

    # --- plumbing ------------------------------------------------------------------------

    def _stop_ranks(self, timeout: float, ranks: list[Rank] | None = None) -> None:
        """Stop ``ranks`` (default: all, parked ones included, and the attempt's store)."""
        for exit_ in self.workers.stop(timeout, ranks=ranks,
                                       tick=lambda: self.control.heartbeat_if_due(time.monotonic())):
            self.hub.forget(exit_.pid)
            self.dead_pids.add(exit_.pid)
        self._sync_poller()
        if ranks is None:
            self.parked.clear()
        if self.store is not None:
            self.store.close()
            self.store = None

    def _persist_staged(self) -> None:
        """The ranks are gone: make durable what they staged but did not write (a rank
        killed mid-write, a preempted job, saves staged only), then free the memory."""
        written = staging.flush(self.staging_dir)
        if written:
            steps = sorted({step for _, step in written})
            self.events.emit("checkpoint_persisted", f"persisted {len(written)} staged "
                             f"checkpoint shard(s) the ranks left, steps {steps}",
                             shards=[list(w) for w in written])
        shutil.rmtree(self.staging_dir, ignore_errors=True)

    def _warm_up(self) -> None:
        """Off the training path: refill the warm pool, and prepare the next attempt's store."""
        if self.pool is not None:
            self.pool.fill(range(self.local_world_size))
        if (self.spare_store is None and self.assignment is not None
                and self.assignment["group_rank"] == 0 and self._store_port() == 0):
            self.spare_store = AgentStore(self.addr, 0)

    def _store_port(self) -> int:
        """Torch's store port for the next attempt: the user's --master-port, or any."""
        return self.config.master_port if self.endpoint is None else 0

    def _rank_env(self, rank_dir: Path) -> dict[str, str]:
        """ftlaunch's own variables for a rank: the hub, where its stacks go on a hang."""
        env = {environment.HUB: self.hub.endpoint,
               environment.STACKS_FILE: str(rank_dir / "stacks.txt"),
               environment.STACK_SIGNAL: str(int(stacks.STACK_SIGNAL)),
               environment.STAGING: str(self.staging_dir)}
        if self.committed_step >= 0:
            env[environment.RESUME_STEP] = str(self.committed_step)
        return env

    def _sync_poller(self) -> None:
        """Poll exactly the live ranks' pidfds and output pipes, and warming pool processes."""
        wanted = set(self.workers.fds()) | set(self.pool.fds() if self.pool else ())
        for fd in self._polled - wanted:
            self.poller.unregister(fd)
        for fd in wanted - self._polled:
            self.poller.register(fd, zmq.POLLIN)
        self._polled = wanted

    def _send(self, kind: str, **fields) -> None:
        self.control.send(kind, self.epoch, **fields)

    def _open(self) -> None:
        self.events = EventLog(self.log_dir / "events.jsonl")
        self.guard = OrphanGuard()
        self.context = zmq.Context()
        self.control = ControlPlane(self.context, self.secret, self.node_id, self.addr,
                                    self.endpoint, self._job_state, self.config.node_timeout,
                                    self.config.heartbeat_interval)
        read_end, write_end = os.pipe()
        os.set_blocking(read_end, False)
        os.set_blocking(write_end, False)
        self.signal_fd, self._signal_write_fd = read_end, write_end
        signal.set_wakeup_fd(write_end)
        self._previous_handlers = {sig: signal.signal(sig, lambda *_: None)
                                   for sig in self.config.signals()}
        self.health, why = HealthMonitor.start(self.config.health_interval)
        self.events.emit("gpu_health_monitor", why, active=self.health is not None)
        self.hub = RankHub(self.context)
        self.staging_dir = staging.create_dir()  # checkpoint staging that outlives ranks
        self.workers = WorkerGroup(self.program, self.output, self.guard, self._rank_env)
        self.pool = None if self.config.no_warm_pool or self.config.no_python else WarmPool(
            self.config.preload_modules(), lambda _slot: pre_import_env(self.local_world_size),
            self.guard, rank_preexec_fn())
        self.poller = zmq.Poller()
        self.poller.register(self.control.socket, zmq.POLLIN)
        self.poller.register(self.hub.socket, zmq.POLLIN)
        self.poller.register(self.signal_fd, zmq.POLLIN)
        if self.health is not None:
            self.poller.register(self.health.fd, zmq.POLLIN)
        self._polled: set[int] = set()

    def _close(self) -> None:
        self._stop_ranks(self.config.stop_timeout)
        self._persist_staged()
        if self.health is not None:
            self.health.close()
        if self.pool is not None:
            self.pool.close()
        if self.spare_store is not None:
            self.spare_store.close()
        self.hub.close()
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(-1)
        os.close(self.signal_fd)
        os.close(self._signal_write_fd)
        self.control.close()
        self.context.term()
        self.guard.close()
        self.events.close()
