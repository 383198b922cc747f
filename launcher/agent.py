"""The agent: one per node. Joins the job, runs this node's ranks, acts on the coordinator's word.

It is a state machine (``node_policy.Phase``, drawn in docs/protocol.md) driven by one poll
loop over its control socket, the rank pidfds, the rank output pipes and a signal wake-up
pipe: every event is handled the moment it happens, and every wait (survivors parking,
ranks being stopped, GPU memory being released, a backoff, a grace period) is a phase with
a deadline, never a sleep. The coordinator decides the job's recoveries and ``node_policy``
this node's part in them; the agent carries them out through its edges (``node_io``).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ftlaunch_contract import environment, messages
from ftlaunch_contract.messages import Held, Peer
from ftlaunch_contract.protocol import Envelope
from launcher import (
    UsageError,
    events,
    exit_codes,
    failures,
    goodput,
    live_status,
    membership,
    node_policy,
    replica_plan,
    replica_service,
)
from launcher.config import LaunchConfig
from launcher.events import PhaseClock
from launcher.gpu_health import Finding
from launcher.node_io import (
    Event,
    GpuFound,
    NodeIO,
    RanksSpoke,
    ReplicaNews,
    SignalArrived,
)
from launcher.node_plan import NodePlan
from launcher.node_policy import GpuAction, OrderAction, Phase
from launcher.rank_env import Attempt
from launcher.rank_template import TemplateDied, TemplateReady, TemplateUnsafe
from launcher.store import AgentStore
from launcher.workers import Rank, RankExit

HANG_CHECK_INTERVAL = 0.1
FETCH_TIMEOUT = 600.0
"""Seconds the ranks wait at most for their shards to be pulled from peers' memory (each
transfer gives up by itself once a peer stops answering)."""
RELEASE_CHECK_INTERVAL = 0.05
TEMPLATE_TIMEOUT = 120.0
"""Seconds ranks wait at most for the rank template's imports; then they start fresh."""
WARM_UP_AFTER = 30.0
"""Seconds after the ranks start before the next attempt's store is prepared, unless every
rank heartbeats through trainer_shim sooner (it must not compete with their start-up)."""
STRICT_ENV = "FTLAUNCH_STRICT"
"""Set (the test suite does): an illegal phase transition raises instead of being logged."""

log = logging.getLogger("ftlaunch.agent")
PROGRESS_EVERY = 1.0  # seconds between "progress" events while the step advances


class Agent:
    def __init__(self, config: LaunchConfig, script: str, script_args: list[str]):
        self.config = config
        self.plan = NodePlan.from_config(config, script, script_args)
        self.strict = bool(os.environ.get(STRICT_ENV))
        self.clock: Callable[[], float] = time.monotonic

        self.phase = Phase.JOINING
        self.deadline: float | None = None  # when the phase's wait ends
        self.epoch = 0
        self.assignment: messages.Assign | None = None
        # The rounds this node held a seat in, the last one's and those since the oldest not
        # settled: a takeover coordinator tells survivors from spares by the last, and a
        # large earlier round's voters by the others (see Join).
        self.seats: list[int] = []
        self.start_order: messages.Start | None = None  # the one being carried out
        self.store: AgentStore | None = None
        self.spare_store: AgentStore | None = None  # next attempt's, already importing torch
        self.spare_of: str | None = None  # a spare: whose coordinator said so, since an assign
        self.first_failure: failures.RankFailure | None = None
        self.recovery: PhaseClock | None = None  # times a recovery, from failure to ranks back
        self.policy = config.restart_policy  # of the recovery under way
        self.order: messages.Recover | None = None  # the order under way
        self.deferred: messages.Recover | None = None  # came while ranks were being stopped
        self.keep: tuple[int, ...] = ()  # pids that parked: they resume in place
        self.parked: dict[int, Rank] = {}  # local rank -> process waiting to resume in place
        self.stopping: set[int] = set()  # pids being stopped
        self.after_stop: tuple[Phase, int] = (Phase.BACKING_OFF, 0)  # where stopping leads
        self.warm_up_at: float | None = None
        self.hang_check_at = 0.0
        self.shutdown_signal: int | None = None
        self.restart_count = 0
        self.committed_step = -1  # the newest checkpoint step every rank made durable
        self.progress_step, self.progress_at = -1, 0.0  # the last "progress" event's step, next
        self.phase_since = self.live_at = 0.0
        self.draining = ""  # a GPU finding that wants this node out at the next safe point
        self.dead_pids: set[int] = set()  # whose GPU memory must be free before a restart
        self.replicate_to: messages.Peers = ()  # peers keeping copies of our staged shards
        self.fetching = False  # pulling shards from peers for the ranks about to restore
        self.exit_code: int | None = None

    # --- the main loop: read top to bottom ---------------------------------------------------

    def run(self) -> int:
        self.attach(NodeIO(self.plan, self._attempt_env))
        try:
            self.begin()
            while self.phase != Phase.DONE:
                for event in self.io.poll(self._poll_timeout_ms()):
                    self.on_event(event)
                    if self.phase == Phase.DONE:
                        break
                self.on_timers(self.clock())
            assert self.exit_code is not None
            return self.exit_code
        finally:
            self.workers.stop(self.config.stop_timeout)  # none left but after an error
            for store in (self.store, self.spare_store):
                if store is not None:
                    store.close()
            self.io.close()
            if self.exit_code is not None:
                self._report_goodput()

    def _report_goodput(self) -> None:
        """What this node's time went to (``goodput.json`` beside its events; a table)."""
        path = self.plan.log_dir / "events.jsonl"
        if not path.exists():
            return
        acc = goodput.account(events.load(path))
        (self.plan.log_dir / "goodput.json").write_text(json.dumps(acc.as_dict(), indent=2))
        print(f"ftlaunch: {goodput.table(acc)}", file=sys.stderr, flush=True)

    def on_event(self, event: Event) -> None:
        match event:
            case Envelope():
                self.on_control(event)
            case RankExit():
                self.on_rank_exit(event)
            case RanksSpoke():
                self.on_rank_messages()
            case SignalArrived(signum):
                self.on_signal(signum)
            case GpuFound(findings):
                self.on_gpu_findings(findings)
            case ReplicaNews(news):
                self.on_replica_news(news)
            case TemplateReady() | TemplateUnsafe() | TemplateDied():
                self.on_template(event)

    def on_template(self, news: TemplateReady | TemplateUnsafe | TemplateDied) -> None:
        """The rank template is ready, unsafe to fork (fresh interpreters from now on), or
        died (started again: its ranks died with it and are being recovered)."""
        match news:
            case TemplateReady(seconds):
                self.events.emit("rank_template_ready", "rank template ready: imported "
                                 f"{self.config.preload} in {seconds:.2f}s", seconds=seconds)
            case TemplateUnsafe(why):
                self.events.emit("rank_template_unsafe", f"rank template not forked: {why}; "
                                 "ranks start as fresh interpreters (check --preload)",
                                 why=why)
            case TemplateDied(returncode):
                self.events.emit("rank_template_died", f"rank template exited ({returncode});"
                                 " starting it again", returncode=returncode)
                if self.template is not None:
                    self.template.start()
        if self.phase == Phase.PREPARING and self._ready_to_start():
            self._start_ranks()

    def attach(self, io: NodeIO) -> None:
        """The edges (real, or a test's fakes with the same methods)."""
        self.io, self.control, self.hub, self.workers = io, io.control, io.hub, io.workers
        self.events, self.health, self.template = io.events, io.health, io.template
        self.replicas = io.replicas
        self.metrics = getattr(io, "metrics", None)  # --metrics-port
        self.live = getattr(io, "live", None)  # the status line, on a terminal

    def begin(self) -> None:
        self.asking_since = self.last_loop = self.clock()  # for a job to join: join_timeout
        self._send_join()

    def _enter(self, phase: Phase, deadline: float | None = None) -> None:
        node_policy.check_transition(self.phase, phase, self.strict)
        log.debug("phase %s -> %s", self.phase, phase)
        self.phase, self.deadline, self.phase_since = phase, deadline, self.clock()

    # --- the coordinator's word ----------------------------------------------------------

    def on_control(self, received: Envelope) -> None:
        if received.epoch < self.epoch:
            return
        self.epoch = received.epoch
        match received.body:
            case messages.Assign() as msg:
                self._on_assign(msg)
            case messages.Start() as msg:
                self._on_start(msg)
            case messages.Recover() as msg:
                self.spare_of = None  # it joins again: a spare's next word is news
                self._on_recover(msg)
            case messages.Committed(step=step):
                self.committed_step = step
                if self.assignment is not None:  # older worlds' copies: obsolete now
                    self.replicas.forget_other_worlds(self.assignment.world_size)
                self.events.emit("checkpoint_committed", f"checkpoint step {step} committed "
                                 "(every rank's shard durable)", console=False, step=step)
                for rank in self.workers.alive():
                    self.hub.send(rank.proc.pid, messages.Committed(step=step))
            case messages.InMemory(step=step):
                self.events.emit("checkpoint_in_memory", f"checkpoint step {step}: every "
                                 "rank's shard has a copy in another node's memory",
                                 console=False, step=step)
            case messages.Stop(exit_code=exit_code, reason=reason):
                self._on_stop(exit_code, reason)
            case messages.Redirect() if self.phase == Phase.JOINING:
                self._send_join()  # to the coordinator the job now runs under
            case messages.Redirect(coordinator_node=node):
                log.info("the job runs under coordinator node %s: joining it once %s ends",
                         node, self.phase)
            case messages.Spare(coordinator_node=node) if node != self.spare_of:
                # Said again under another coordinator (one it failed over to, or was sent
                # to after re-joining): whom it waits under, in its log and events.
                self.spare_of = node  # the control plane noted whom to follow
                self.events.emit("spare", f"waiting as a spare: the job runs on its maximum "
                                 f"of nodes (coordinator {node})", coordinator=node)

    def _on_assign(self, msg: messages.Assign) -> None:
        self.spare_of = None
        if self.phase != Phase.JOINING:
            log.warning("ignored an assignment in phase %s", self.phase)
            return
        self.assignment, self.replicate_to = msg, msg.replicate_to
        if self.seats[-1:] != [self.epoch]:
            self.seats.append(self.epoch)
        self.events.emit("assigned", f"round of epoch {self.epoch}: group rank "
                         f"{msg.group_rank} of {msg.group_world_size} nodes", console=False,
                         epoch=self.epoch, group_rank=msg.group_rank,
                         group_world_size=msg.group_world_size, world_size=msg.world_size,
                         restart_count=msg.restart_count)
        if self.metrics is not None:
            self.metrics.set_nodes(msg.group_world_size)
        if msg.fetch:  # shards our ranks restore from, held in peers' memory: pull them now
            self.fetching = True
            self.replicas.fetch([(Held(f.world_size, f.rank, f.step),
                                  Peer(f.node_id, f.addr, f.port)) for f in msg.fetch])
        if msg.group_rank == 0:  # the node holding torch's store for this attempt
            try:
                self.store, self.spare_store = self.spare_store, None
                if self.store is None:
                    self.store = self.io.new_store(self.plan.addr, self.plan.store_port())
            except OSError as e:
                raise UsageError(f"cannot serve torch's store on {self.plan.addr}:"
                                 f"{self.config.master_port}: {e.strerror}; pick another "
                                 "--master-port (0 = any free port) or --master-addr") from None
            self._send(messages.StoreReady(master_addr=self.plan.addr,
                                           master_port=self.store.port))
        self._enter(Phase.STARTING)

    def _on_start(self, msg: messages.Start) -> None:
        """Start the ranks, once dead ranks' GPU memory is released and the shards they
        restore from are pulled from peers (bounded: PREPARING)."""
        if self.phase != Phase.STARTING:
            log.info("ignored a start in phase %s", self.phase)
            return
        if self.recovery is not None:
            self.recovery.mark("rendezvous")
        self.start_order = msg
        if self._ready_to_start():
            self._start_ranks()
        else:
            wait = max(self.config.gpu_release_timeout, FETCH_TIMEOUT if self.fetching else 0.0,
                       TEMPLATE_TIMEOUT if self._template_starting() else 0.0)
            self._enter(Phase.PREPARING, self.clock() + wait)

    def _on_recover(self, msg: messages.Recover) -> None:
        # The next attempt's count: our join carries it, should the coordinator go meanwhile.
        self.restart_count = max(self.restart_count, msg.restart_count)
        verdict = node_policy.recover_action(self.phase, self.draining,
                                             seated=self.assignment is not None)
        if verdict.action == OrderAction.REJOIN:
            log.info("%s (%s)", verdict.reason, msg.cause)
            self._send_join()
        elif verdict.action == OrderAction.LEAVE:
            self._leave_unhealthy(self.draining)
        elif verdict.action == OrderAction.DEFER:
            self.deferred = msg
        elif verdict.action == OrderAction.RECOVER:
            self._recover(msg)

    def _recover(self, msg: messages.Recover) -> None:
        """Tell re-enterable survivors to leave their training function (PARKING): a
        ``rank`` restart keeps those that did, any other stops them with the rest
        (STOPPING); those stuck on the way are killed at once. Then back off and re-join."""
        self.recovery = self.recovery or PhaseClock()
        self.recovery.mark("decide")
        self.order, self.policy = msg, msg.policy
        self._note_progress(self.clock(), now=True)
        self.events.emit("recovering", f"{msg.cause} -> {msg.policy} restart "
                         f"{msg.restart_count}/{self.config.max_restarts}",
                         cause=msg.cause, policy=msg.policy, restart_count=msg.restart_count,
                         delay=msg.delay)
        now = self.clock()
        deadline = now + self.config.stop_timeout
        if self.phase == Phase.PARKING:  # a newer order of the same recovery
            self.deadline = deadline
        else:
            self._enter(Phase.PARKING, deadline)
        for pid in node_policy.to_abort(self._survivors()):
            self.hub.send(pid, messages.Abort())
        self._try_park(now)

    def _try_park(self, now: float) -> None:
        assert self.deadline is not None
        verdict = node_policy.park_or_stop(self._survivors(), self.policy, now, self.deadline)
        if verdict is None:
            return
        if verdict.late:
            stacks = self._stacks_of_late(verdict)
            self.events.emit("escalated", verdict.reason if any(verdict.blocked_in) else
                             f"ranks {list(verdict.late)} did not leave their training "
                             f"function within {self.config.stop_timeout:g}s: replacing them",
                             ranks=list(verdict.late), blocked_in=list(verdict.blocked_in),
                             stacks=stacks)
        log.info("%s", verdict.reason)
        self.keep, self.parked = verdict.keep, {}  # rebuilt from keep once the rest is gone
        self._stop(Phase.BACKING_OFF,
                   ranks=[r for r in self.workers.alive() if r.proc.pid in verdict.stop])
        self.workers.send_signal(signal.SIGKILL, [r for r in self.workers.alive()
                                                  if r.rank in verdict.late])

    def _stacks_of_late(self, verdict: node_policy.ParkVerdict) -> list[str]:
        """Per late rank, where its stacks were written before it is killed ("": its shim
        said where it was stuck): one that neither left nor said so is the case to explain."""
        paths = []
        for rank_id, where in zip(verdict.late, verdict.blocked_in, strict=True):
            rank = next((r for r in self.workers.alive() if r.rank == rank_id), None)
            if where or rank is None:
                paths.append("")
                continue
            path = Path(rank.error_file).with_name("stacks.txt")
            log.info("rank %d: %s", rank_id, self.io.capture_stacks(
                rank.proc.pid, path, self.config.stack_dump, self.hub.stacks_armed(rank.proc.pid)))
            paths.append(str(path))
        return paths

    def _on_stop(self, exit_code: int, reason: str) -> None:
        """The job is over (the coordinator's word)."""
        if self.phase in (Phase.LEAVING, Phase.DONE):
            return  # our own signal shutdown ends the job, honouring the grace period
        if self.phase == Phase.STOPPING and self.after_stop[0] == Phase.DONE:
            return  # on our way out already (we left the job)
        self._note_progress(self.clock(), now=True)
        if exit_code == exit_codes.OK:
            self.events.emit("job_finished", "all ranks finished", exit_code=exit_code)
        else:
            self.events.emit("job_failed", f"job failed: {reason}", exit_code=exit_code,
                             reason=reason)
            if self.first_failure is not None:
                print(failures.summary(self.first_failure), flush=True, file=sys.stderr)
        self._stop(Phase.DONE, exit_code)

    # --- the ranks' word -----------------------------------------------------------------

    def on_rank_exit(self, exit_: RankExit) -> None:
        self.hub.forget(exit_.pid)
        self.dead_pids.add(exit_.pid)
        self.parked = {k: r for k, r in self.parked.items() if r.proc.pid != exit_.pid}
        if self.phase == Phase.LEAVING:
            if not self.workers.alive():
                self._done(exit_codes.SIGNAL_BASE + (self.shutdown_signal or 0))
        elif self.phase == Phase.STOPPING:
            self._stop_progress()
        elif self.phase == Phase.PARKING:
            self._try_park(self.clock())
        elif self.phase == Phase.RUNNING or (self.phase == Phase.FAILED
                                             and self._behind_the_peer_error(exit_.failure)):
            if exit_.failure is not None:
                self._report_failure(exit_.failure)
            elif not self.workers.alive():
                self._send(messages.Finished(node_id=self.plan.node_id))
                self._enter(Phase.FINISHED)

    def on_rank_messages(self) -> None:
        now = self.clock()
        news = self.hub.receive(now)
        self._note_progress(now)
        for stage, shard_rank, step, seconds in news.save_times:
            self.events.emit("checkpoint_shard", f"rank {shard_rank}'s step {step} {stage}",
                             console=False, rank=shard_rank, step=step, stage=stage,
                             seconds=seconds)
        for shard_rank, step in news.durable:  # the coordinator tells when every rank's is
            self._send(messages.Durable(node_id=self.plan.node_id, rank=shard_rank, step=step))
        if self.assignment is not None and self.replicate_to:
            for shard_rank, step in news.staged:  # peers pull a copy into their memory
                self.replicas.offer(Held(self.assignment.world_size, shard_rank, step),
                                    self.replicate_to)
        if self.phase == Phase.PARKING:
            self._try_park(now)
        if self.phase != Phase.RUNNING:
            return
        alive = [r.proc.pid for r in self.workers.alive()]
        if self.warm_up_at is not None and self.hub.all_beating(alive):
            self.warm_up_at = now  # every rank is past its start-up: warm up now
        for pid in news.parked:
            rank, error = self.workers.by_pid(pid), self.hub.error(pid)
            if rank is not None and error and self.phase == Phase.RUNNING:
                # It raised on its own and parked in restartable(): this rank's failure.
                last = error.strip().splitlines()[-1] if error.strip() else "an exception"
                self._report_failure(failures.RankFailure(
                    rank=rank.rank, local_rank=rank.local_rank, pid=pid, exit_code=None,
                    signal="", error_file=rank.error_file, time=time.time(),
                    message=f"raised {last}", traceback=error))

    def _note_progress(self, clock: float, now: bool = False) -> None:
        """A ``progress`` event with the highest step a rank reached, at most once a second
        (``now``: at once, before a failure or the end): the timeline goodput is read from."""
        step = self.hub.best_step
        if step > self.progress_step and (now or clock >= self.progress_at):
            self.events.emit("progress", f"step {step}", console=False, step=step,
                             at=round(self.hub.best_step_at, 3))
            self.progress_step, self.progress_at = step, clock + PROGRESS_EVERY

    def _behind_the_peer_error(self, failure: failures.RankFailure | None) -> bool:
        """Whether ``failure`` is what the attempt's first one, a peer's error (a collective's
        connection reset), followed from: a rank of this node that died just after its peer
        reported the reset. The coordinator waits a moment for it, to name it."""
        first = self.first_failure
        return failure is not None and first is not None and \
            failures.is_peer_error(first.cause) and not failures.is_peer_error(failure.cause)

    def _report_failure(self, failure: failures.RankFailure) -> None:
        """An attempt's first failure goes to the coordinator, which orders the recovery
        (and the failure behind it, if the first read as a peer's error)."""
        self.recovery = self.recovery or PhaseClock()
        self._note_progress(self.clock(), now=True)
        self.events.emit("rank_failed", f"rank {failure.rank} {failure.cause}",
                         rank=failure.rank, local_rank=failure.local_rank,
                         exit_code=failure.exit_code, signal=failure.signal,
                         cause=failure.cause)
        self._send(messages.Failure(
            node_id=self.plan.node_id, rank=failure.rank, local_rank=failure.local_rank,
            exit_code=failure.exit_code, signal=failure.signal, cause=failure.cause,
            step=self.hub.best_step))
        self.first_failure = failure  # the one behind a peer's error replaces it
        if self.phase != Phase.FAILED:
            self._enter(Phase.FAILED)

    def _check_hangs(self, now: float) -> None:
        """Capture a hung rank's stacks, then kill it: its exit is then a failure like any."""
        if self.workers.killing():
            return  # one we killed is not reaped yet: its peers may be waiting on it
        other_nodes = self.assignment is not None and self.assignment.group_world_size > 1
        for pid, reason in self.hub.hung(now, self.plan.hang_timeouts, other_nodes):
            rank, armed = self.workers.by_pid(pid), self.hub.stacks_armed(pid)
            self.hub.forget(pid)
            if rank is None:
                continue
            path = Path(rank.error_file).with_name("stacks.txt")
            captured = self.io.capture_stacks(pid, path, self.config.stack_dump, armed)
            self.events.emit("rank_hung", f"rank {rank.rank} hung: {reason}; {captured}",
                             rank=rank.rank, reason=reason, stacks=str(path))
            self.workers.kill_hung(rank, f"hung: {reason}; {captured}")

    # --- the node's own events ---------------------------------------------------------

    def on_replica_news(self, news: list[replica_service.News]) -> None:
        for item in news:
            match item:
                case replica_service.Transferred(held=h, source=source, purpose=purpose):
                    if purpose == "replica":  # whole: the coordinator counts it
                        self._send(messages.Replicated(node_id=self.plan.node_id, rank=h.rank,
                                                       step=h.step))
                    self.events.emit("shard_copied", f"rank {h.rank}'s step {h.step} "
                                     f"({item.nbytes / 1e6:.1f} MB) copied from node {source}'s "
                                     f"memory in {item.seconds:.3f}s", console=False,
                                     purpose=purpose, rank=h.rank, step=h.step, source=source,
                                     nbytes=item.nbytes, seconds=item.seconds)
                case replica_service.NotTransferred(held=h, source=source, purpose=purpose):
                    self.events.emit("shard_not_copied", f"rank {h.rank}'s step {h.step} "
                                     f"not copied from node {source}: {item.reason}",
                                     console=purpose == "restore" or "shm" in item.reason,
                                     purpose=purpose, rank=h.rank, step=h.step, source=source,
                                     reason=item.reason)
                case replica_service.FetchDone(pulled=pulled, failed=failed, seconds=seconds):
                    self.fetching = False
                    self.events.emit("restore_pulled", f"pulled {pulled} checkpoint shard(s) "
                                     f"from peers' memory in {seconds:.3f}s" +
                                     (f"; {failed} not (those restore from storage)"
                                      if failed else ""),
                                     pulled=pulled, failed=failed, seconds=seconds)
                    if self.recovery is not None:
                        self.recovery.mark("pull")
                    if self.phase == Phase.PREPARING and self._ready_to_start():
                        self._start_ranks()

    def on_signal(self, signum: int) -> None:
        """Forward to the ranks and leave the job; exit once they are gone (SIGKILL after
        the grace period, or at once when asked twice)."""
        if self.phase == Phase.DONE:
            return
        if self.shutdown_signal is None:
            self.shutdown_signal = signum
            self.events.emit("signal", f"got {signal.Signals(signum).name}: forwarded to ranks, "
                             f"SIGKILL in {self.config.grace_period:g}s", signal=signum)
            self._send(messages.Leave(node_id=self.plan.node_id,
                                      exit_code=exit_codes.SIGNAL_BASE + signum,
                                      reason=signal.Signals(signum).name))
            self._enter(Phase.LEAVING, self.clock() + self.config.grace_period)
            self.parked.clear()  # no resuming now: they get the signal like every rank
        elif signum in (signal.SIGINT, signal.SIGTERM):
            self.deadline = self.clock()  # asked twice: stop waiting
        self.workers.send_signal(signum)
        if not self.workers.alive():
            self._done(exit_codes.SIGNAL_BASE + self.shutdown_signal)

    def on_gpu_findings(self, findings: list[Finding]) -> None:
        for finding in findings:
            verdict = node_policy.gpu_finding_action(finding.severity, str(finding),
                                                     bool(self.draining))
            self.events.emit("gpu_health", verdict.reason, gpu=finding.gpu, finding=finding.kind,
                             severity=finding.severity, detail=finding.detail,
                             action=verdict.action)
            if self.phase in (Phase.LEAVING, Phase.DONE):
                continue
            if verdict.action == GpuAction.DRAIN:
                self.draining = str(finding)
            elif verdict.action == GpuAction.LEAVE:
                self._leave_unhealthy(str(finding))

    def _leave_unhealthy(self, reason: str) -> None:
        """Stop this node's ranks and leave the job, which goes on without us if it can;
        exit 3 so the scheduler puts no work on this node again."""
        if self.phase == Phase.STOPPING and self.after_stop[0] == Phase.DONE:
            return
        self.events.emit("node_unhealthy", f"this node is unhealthy: {reason}; stopping its "
                         "ranks and leaving the job (exit 3: do not requeue on this node)",
                         reason=reason)
        if self.plan.max_nodes > 1:  # the others recover without us
            self._send(messages.Unhealthy(node_id=self.plan.node_id, reason=reason))
        else:
            self._send(messages.Leave(node_id=self.plan.node_id,
                                      exit_code=exit_codes.DO_NOT_REQUEUE,
                                      reason=f"unhealthy: {reason}"))
        print(f"ftlaunch: node unhealthy: {reason}. Drain this node and have its GPUs checked "
              "(nvidia-smi -q, a GPU reset or a reboot); exit 3: do not requeue here.",
              file=sys.stderr, flush=True)
        self._stop(Phase.DONE, exit_codes.DO_NOT_REQUEUE)

    def _follow_coordinator(self) -> None:
        """The coordinator's node is gone: park or stop our ranks, then join its successor."""
        lost = self.control.coordinator_node
        why = "its connection closed" if self.control.connection_lost else \
            f"silent for {self.clock() - self.control.last_heard:.1f}s"
        if self.phase == Phase.FINISHED:
            # Every rank here finished, so the job trained to its end (its steps are
            # collectives): the coordinator's node is gone because the job ended while we
            # were frozen or cut off, not because it needs a successor waiting for nodes
            # that have all left.
            self.events.emit("coordinator_lost", f"coordinator node {lost} gone after every "
                             "rank here finished: the job is over", lost=lost, successor="")
            self._on_stop(exit_codes.OK, "")
            return
        group_world_size = self.assignment.group_world_size if self.assignment else 0
        # A spare that followed a redirect knows only the successors of the coordinator
        # that sent it on, which stood down (chaos seed 5708: it followed them, one silent
        # after the other, until the job had ended, and found no one at the endpoint).
        stale = self.assignment is None and self.control.redirected
        successor = None if stale else self.control.fail_over(self.epoch, self.restart_count,
                                                              group_world_size)
        if successor is None and self.assignment is None:
            # A spare, and every node it heard would take over is gone (the word naming the
            # next one may not have reached it: chaos seed 1045, the coordinator's node lost
            # twice in 0.5 s): it is not in the job, so this is not the job's end. It asks
            # at the rendezvous endpoint, where whoever runs the job now answers.
            known = "the successors it knows are another coordinator's" if stale else \
                "no successor known to this spare"
            self.events.emit("coordinator_lost", f"coordinator node {lost} lost and {known}: "
                             "asking at the rendezvous endpoint again", lost=lost, successor="")
            self.control.back_to_rendezvous()
            self.asking_since = self.clock()
            self._send_join()
            return
        if successor is None:
            self._on_stop(exit_codes.JOB_FAILED, f"coordinator node {lost} lost, no successor")
            return
        self.events.emit("coordinator_lost", f"coordinator node {lost} lost: following "
                         f"{'this node' if successor == self.plan.node_id else successor} "
                         f"({why})", lost=lost, successor=successor)
        if self.assignment is None:  # a spare: no ranks to stop, wait under the successor
            self._send_join()
            return
        # As in a recovery the coordinator orders (the successor starts one on taking over):
        # ranks that can leave their training function park and resume under the successor,
        # only the others are stopped; then the node joins it.
        self._on_recover(messages.Recover(policy=self.policy, restart_count=self.restart_count + 1,
                                          delay=0.0, cause=f"coordinator node {lost} lost"))

    # --- deadlines ---------------------------------------------------------------------

    def on_timers(self, now: float) -> None:
        """The phase's wait, and the loop's own periodic duties."""
        expired = self.deadline is not None and now >= self.deadline
        if self.phase == Phase.PARKING:
            self._try_park(now)
        elif self.phase == Phase.PREPARING:
            if self._ready_to_start() or expired:
                self._start_ranks()
        elif self.phase == Phase.RUNNING and now >= self.hang_check_at:
            self.hang_check_at = now + HANG_CHECK_INTERVAL
            self._check_hangs(now)
            if self.metrics is not None:
                self.metrics.set_heartbeat_ages(
                    {r.rank: age for r in self.workers.alive()
                     if (age := self.hub.beat_age(r.proc.pid, now)) is not None})
        elif self.phase == Phase.STOPPING and expired:
            self.deadline = None
            self.workers.send_signal(signal.SIGKILL, self._being_stopped())
        elif self.phase == Phase.BACKING_OFF and expired:
            if self.recovery is not None:
                self.recovery.mark("backoff")
            self._join()
        elif self.phase == Phase.LEAVING and expired:
            self.deadline = None
            self.events.emit("grace_expired", "grace period over: SIGKILL to remaining ranks")
            self.workers.send_signal(signal.SIGKILL)
        if self.warm_up_at is not None and now >= self.warm_up_at:
            self.warm_up_at = None
            self._warm_up()
        if self.live is not None and self.live_at <= now:
            self.live_at = now + 0.5
            self.live.show(live_status.status_line(
                str(self.phase), now - self.phase_since,
                None if self.deadline is None else self.deadline - now, self.fetching,
                self.epoch, self.restart_count, self.config.max_restarts,
                self._rank_states(now), self.recovery.phases if self.recovery else None))
        if now - self.last_loop > self.config.node_timeout / 2:
            self.control.woke(now)  # we were frozen: the silence was ours
        self.last_loop = now
        if now >= self.control.next_heartbeat:
            self.control.heartbeat_if_due(now, self.epoch, str(self.phase), self._rank_states(now))
        if (word := self.control.own_redirect()) is not None:
            self.on_control(word)
        if self.phase in (Phase.STOPPING, Phase.LEAVING, Phase.DONE):
            return
        if (failure := self.control.coordinator_failure) is not None:
            self.events.emit("coordinator_failed", "ftlaunch bug: the coordinator this node "
                             f"hosts stopped ({failure}); this node leaves the job, the others "
                             "follow a successor. Please report it with this node's log.",
                             failure=failure)
            self._on_stop(exit_codes.JOB_FAILED, f"coordinator failed: {failure}")
        elif self.control.coordinator_lost(now):
            self._follow_coordinator()
        elif self.phase == Phase.JOINING and self.control.redirect_went_silent(now):
            self.control.back_to_rendezvous()
            self._send_join()
        elif self.assignment is None and not self.control.knows_successors \
                and now - self.asking_since > self.plan.join_timeout:  # a spare waits on
            self.events.emit("job_failed", f"no rendezvous within {self.plan.join_timeout:g}s at "
                             f"{self.plan.endpoint}; check --rdzv-endpoint and that the other "
                             "nodes are up", exit_code=exit_codes.JOB_FAILED)
            self._stop(Phase.DONE, exit_codes.JOB_FAILED)

    def _poll_timeout_ms(self) -> int:
        now = self.clock()
        deadlines = [t for t in (self.deadline, self.warm_up_at) if t is not None]
        deadlines.append(self.control.next_heartbeat)
        if self.phase == Phase.RUNNING:
            deadlines.append(self.hang_check_at)
        elif self.phase == Phase.PREPARING and self.dead_pids:
            deadlines.append(now + RELEASE_CHECK_INTERVAL)
        return max(0, int((min(deadlines) - now) * 1000) + 1)

    # --- moves ---------------------------------------------------------------------------

    def _start_ranks(self) -> None:
        """Each local rank: resume its parked process, or fork it from the rank template,
        or start a fresh interpreter."""
        a, msg = self.assignment, self.start_order
        assert a is not None and msg is not None
        self._report_gpu_memory_held()
        if self.store is not None:  # held back while the template imported torch
            self.store.serve()
        self.restart_count = msg.restart_count
        attempt = Attempt(run_id=self.plan.run_id, role=self.config.role,
                          group_rank=a.group_rank, group_world_size=a.group_world_size,
                          rank_offset=a.rank_offset, world_size=a.world_size,
                          local_world_size=self.plan.local_world_size,
                          master_addr=msg.master_addr, master_port=msg.master_port,
                          restart_count=msg.restart_count, max_restarts=a.max_restarts,
                          signals_to_handle=self.config.signals_to_handle)
        now = self.clock()
        self.hub.reset_steps()
        self.progress_step, self.progress_at = -1, 0.0  # an attempt's first step: at once
        sources: dict[str, list[int]] = {"resumed": [], "forked": [], "fresh": []}
        template = self.template if self.policy != "cold" else None
        for local_rank in range(self.plan.local_world_size):
            kept = self.parked.pop(local_rank, None)
            if kept is not None:
                env = self.workers.resume(kept, attempt)
                self.hub.track(kept.proc.pid, now, resumed=True)
                self.hub.send(kept.proc.pid, messages.Resume(env=env))
                sources["resumed"].append(kept.rank)
                continue
            rank = self.workers.spawn(attempt, local_rank, template)
            self.hub.track(rank.proc.pid, now, stacks=rank.forked)  # the template armed it
            sources["forked" if rank.forked else "fresh"].append(rank.rank)
        self.first_failure = None
        self.warm_up_at = now + WARM_UP_AFTER  # or at every rank's first beat
        self._enter(Phase.RUNNING)
        if self.recovery is not None:
            self.recovery.mark("spawn")
            phases = ", ".join(f"{k} {v:.3f}s" for k, v in self.recovery.phases.items())
            how = "; ".join(f"{k} {v}" for k, v in sources.items() if v)
            self.events.emit("recovered", f"restart {attempt.restart_count} ({self.policy}): "
                             f"ranks back {self.recovery.total:.3f}s after the failure "
                             f"({phases}; ranks {how})",
                             restart_count=attempt.restart_count, seconds=self.recovery.total,
                             policy=self.policy, phases=self.recovery.phases,
                             **dict[str, Any](sources))
            self.recovery = None
        else:
            self.events.emit("started", f"started {self.plan.local_world_size} ranks "
                             f"(world size {attempt.world_size}, run {self.plan.run_id}, logs "
                             f"{self.plan.log_dir})", world_size=attempt.world_size,
                             run_id=self.plan.run_id)

    def _stop(self, then: Phase, exit_code: int = 0, ranks: list[Rank] | None = None) -> None:
        """SIGTERM ``ranks`` (default: all, parked ones too), SIGKILL them at the deadline;
        once all are reaped, go on to ``then`` (BACKING_OFF, or DONE with ``exit_code``).
        Stopping already, the stop widens; leaving outranks re-joining."""
        if ranks is None:
            ranks, self.keep = self.workers.alive(), ()  # parked ones go too
        if self.phase == Phase.STOPPING:
            if self.after_stop[0] != Phase.DONE:
                self.after_stop = (then, exit_code)
            self.stopping |= {r.proc.pid for r in ranks}
        else:
            self.stopping = {r.proc.pid for r in ranks}
            self.after_stop = (then, exit_code)
            self._enter(Phase.STOPPING, self.clock() + self.config.stop_timeout)
        self.workers.send_signal(signal.SIGTERM, ranks)
        self._stop_progress()

    def _being_stopped(self) -> list[Rank]:
        return [r for r in self.workers.alive() if r.proc.pid in self.stopping]

    def _stop_progress(self) -> None:
        """Once every rank being stopped is reaped: release them and move on."""
        if self._being_stopped():
            return
        self.stopping.clear()
        self.workers.release_reaped()
        if self.store is not None:
            self.store.close()
            self.store = None
        then, exit_code = self.after_stop
        if then == Phase.DONE:
            self._done(exit_code)
        else:  # a recovery: survivors that parked stay, then back off (or the next order)
            self.parked = {r.local_rank: r for r in self.workers.alive() if r.proc.pid in self.keep}
            assert self.recovery is not None and self.order is not None
            self.recovery.mark("stop")
            order, self.deferred = self.deferred, None
            if order is not None:
                self._recover(order)
            else:
                self._enter(Phase.BACKING_OFF, self.clock() + self.order.delay)

    def _join(self) -> None:
        self._enter(Phase.JOINING)
        self._send_join()

    def _send_join(self) -> None:
        settled = self.control.settled_below  # (what a successor need not count)
        self.seats = membership.seats_to_report(self.seats, settled)
        self._send(messages.Join(node_id=self.plan.node_id,
                                 local_world_size=self.plan.local_world_size,
                                 addr=self.plan.addr, standby_port=self.control.standby_port or 0,
                                 rank_hint=self.plan.rank_hint, replica_port=self.replicas.port,
                                 held=replica_plan.runs(self.replicas.inventory()),
                                 restart_count=self.restart_count,
                                 seated_epoch=self.seats[-1] if self.seats else -1,
                                 group_rank=self.assignment.group_rank
                                 if self.seats and self.assignment else -1,
                                 seated_earlier=tuple(self.seats[:-1]),
                                 settled_below=settled,
                                 electorate_epoch=self.control.electorate_epoch))

    def _done(self, exit_code: int) -> None:
        self.exit_code = exit_code
        self._enter(Phase.DONE)

    # --- what the agent knows ------------------------------------------------------------

    def _rank_states(self, now: float) -> messages.RankStates:
        """Each live rank's step and heartbeat age, for the coordinator's picture."""
        states = []
        for r in self.workers.alive():
            age = self.hub.beat_age(r.proc.pid, now)
            step = self.hub.step(r.proc.pid)
            states.append(messages.RankState(r.rank, step, -1 if age is None else int(1000 * age)))
        return tuple(states)

    def _survivors(self) -> list[node_policy.Survivor]:
        now = self.clock()
        return [node_policy.Survivor(r.proc.pid, r.rank, self.hub.restartable(r.proc.pid),
                                     self.hub.parked(r.proc.pid), self.hub.stuck(r.proc.pid, now))
                for r in self.workers.alive()]

    def _ready_to_start(self) -> bool:
        """Nothing the ranks must wait for: no shard being pulled, no dead rank's GPU
        memory still held, no rank template still importing."""
        return not (self.fetching or self._template_starting() or self._gpu_memory_held())

    def _template_starting(self) -> bool:
        return self.template is not None and self.template.starting and self.policy != "cold"

    def _gpu_memory_held(self) -> bool:
        """Do dead ranks still hold GPU memory? (Their CUDA contexts tear down after the
        process is reaped; a replacement must not start on a GPU whose memory is taken.)"""
        if self.health is None:
            return False
        self.health.read_now()
        return bool(self.dead_pids & self.health.processes())

    def _report_gpu_memory_held(self) -> None:
        if self.health is not None and (holding := self.dead_pids & self.health.processes()):
            self.events.emit("gpu_memory_held", f"dead ranks {sorted(holding)} still hold GPU "
                             f"memory after {self.config.gpu_release_timeout:g}s; starting anyway",
                             pids=sorted(holding))
        self.dead_pids.clear()

    # --- plumbing ------------------------------------------------------------------------

    def _warm_up(self) -> None:
        """Off the training path: prepare the next attempt's store."""
        if (self.spare_store is None and self.assignment is not None
                and self.assignment.group_rank == 0 and self.plan.store_port() == 0):
            self.spare_store = self.io.new_store(self.plan.addr, 0)

    def _attempt_env(self) -> dict[str, str]:
        """This agent's variables for the ranks of the attempt being started."""
        env = {environment.ROUND: str(self.epoch)}
        if self.committed_step >= 0:
            env[environment.RESUME_STEP] = str(self.committed_step)
        return env

    def _send(self, msg: messages.Body) -> None:
        self.control.send(msg, self.epoch)
