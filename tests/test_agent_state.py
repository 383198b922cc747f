"""The agent's state machine under random event sequences (hypothesis, no processes, no sockets).

The agent gets fakes of its edges (rank processes, the ranks' hub, the control plane, GPU
health) with the methods the real ones have; a rank's death and its reaping are separate
steps, as with real processes. The rules play a coordinator, the ranks, the GPU monitor,
signals and time; the agent checks every phase transition against its table (strict), and
the invariants below must hold after every step.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ftlaunch_contract.messages import CONTROL, Abort, Body, Fetch, Held, Peer, Resume
from ftlaunch_contract.protocol import Codec, Envelope, pack_local
from launcher import exit_codes, failures
from launcher.agent import FETCH_TIMEOUT, Agent
from launcher.config import LaunchConfig
from launcher.gpu_health import Finding, Severity
from launcher.node_policy import Phase
from launcher.rank_hub import HubNews
from launcher.replica_service import FetchDone, Transferred
from launcher.workers import RankExit

LOCAL_WORLD_SIZE = 2
STOP_TIMEOUT = 2.0
LOG_DIR = ""  # one for every example of the machine, under pytest's tmp (not /tmp)


@pytest.fixture(autouse=True, scope="module")
def _log_dir(tmp_path_factory):
    global LOG_DIR
    LOG_DIR = str(tmp_path_factory.mktemp("agent-state-logs"))


DIES_ON = (signal.SIGKILL,)  # every other signal: the fake rank exits when the test says


@dataclass
class FakeRank:
    """What the agent reads of a ``workers.Rank``."""

    local_rank: int
    rank: int
    proc: SimpleNamespace
    error_file: str = "/nonexistent/error.json"
    cause: str | None = None
    returncode: int | None = None
    dead: int | None = None  # exit status once the process is gone (not reaped before)
    forked: bool = False
    signals: list[int] = field(default_factory=list)


class FakeWorkers:
    """Rank processes: spawned, signalled, dying, reaped. Asserts what must never happen."""

    def __init__(self, hub: FakeHub) -> None:
        self.hub = hub
        self.ranks: dict[int, FakeRank] = {}
        self.next_pid = 1000
        self.may_spawn = lambda: True

    def spawn(self, attempt, local_rank, template) -> FakeRank:
        assert self.may_spawn(), "a rank started while its shards were still being pulled"
        previous = [r for r in self.ranks.values() if r.local_rank == local_rank]
        assert all(r.returncode is not None for r in previous), \
            f"local rank {local_rank} started again before its last process was reaped"
        self.next_pid += 1
        rank = FakeRank(local_rank, attempt.rank_offset + local_rank,
                        SimpleNamespace(pid=self.next_pid))
        self.ranks[self.next_pid] = rank
        return rank

    def resume(self, kept: FakeRank, attempt) -> dict[str, str]:
        assert kept.returncode is None, "resumed a rank whose exit the agent had seen"
        assert self.hub.parked(kept.proc.pid), "resumed a rank that had not parked"
        kept.rank = attempt.rank_offset + kept.local_rank
        return {"RANK": str(kept.rank)}

    def alive(self) -> list[FakeRank]:
        return [r for r in self.ranks.values() if r.returncode is None]

    def by_pid(self, pid: int) -> FakeRank | None:
        return self.ranks.get(pid)

    def send_signal(self, sig: int, ranks=None) -> None:
        for rank in self.alive() if ranks is None else ranks:
            if rank.returncode is None:
                rank.signals.append(sig)
                if sig in DIES_ON and rank.dead is None:
                    rank.dead = -sig

    def kill_hung(self, rank: FakeRank, cause: str) -> None:
        rank.cause = cause
        self.send_signal(signal.SIGKILL, [rank])

    def killing(self) -> bool:
        return any(r.cause and r.returncode is None for r in self.ranks.values())

    def release_reaped(self) -> None:
        self.ranks = {pid: r for pid, r in self.ranks.items() if r.returncode is None}

    def stop(self, timeout: float) -> list[RankExit]:
        for rank in self.alive():
            rank.dead, rank.returncode = -9, -9
        return []

    def reap(self, rank: FakeRank) -> RankExit:
        assert rank.dead is not None
        rank.returncode = rank.dead
        failure = None if rank.dead == 0 else failures.from_returncode(
            rank.rank, rank.local_rank, rank.proc.pid, rank.dead, rank.error_file, rank.cause)
        return RankExit(rank.proc.pid, rank.rank, rank.local_rank, rank.dead, failure)


class FakeHub:
    def __init__(self) -> None:
        self.links: dict[int, dict] = {}
        self.news = HubNews([], [])
        self.hung_next: list[tuple[int, str]] = []
        self.aborted: set[int] = set()
        self.best_step, self.best_step_at = -1, 0.0
        self.restartable_from_start = False

    def track(self, pid: int, now: float, stacks: bool = False, resumed: bool = False) -> None:
        link = self.links.setdefault(pid, {"restartable": self.restartable_from_start,
                                           "error": ""})
        link["parked"], link["stuck"] = False, ""
        self.aborted.discard(pid)

    def forget(self, pid: int) -> None:
        self.links.pop(pid, None)

    def restartable(self, pid: int) -> bool:
        return self.links.get(pid, {}).get("restartable", False)

    def parked(self, pid: int) -> bool:
        return self.links.get(pid, {}).get("parked", False)

    def error(self, pid: int) -> str:
        return self.links.get(pid, {}).get("error", "")

    def stuck(self, pid: int, now: float) -> str:
        return self.links.get(pid, {}).get("stuck", "")

    def stacks_armed(self, pid: int) -> bool:
        return False

    def all_beating(self, pids: list[int]) -> bool:
        return True

    def receive(self, now: float) -> HubNews:
        news, self.news = self.news, HubNews([], [])
        return news

    def send(self, pid: int, msg: Body) -> None:
        pack_local(msg)  # a well-formed node-local message
        if isinstance(msg, Abort):
            self.aborted.add(pid)
        elif isinstance(msg, Resume):
            assert self.links[pid]["parked"] is False  # tracked (resumed) first

    def hung(self, now, timeouts, other_nodes=False) -> list[tuple[int, str]]:
        hung, self.hung_next = self.hung_next, []
        return [(pid, reason) for pid, reason in hung if pid in self.links]

    def reset_steps(self) -> None:
        self.best_step = -1

    def beat_age(self, pid: int, now: float) -> float | None:
        return 0.1 if pid in self.links else None

    def step(self, pid: int) -> int:
        return -1


class FakeControl:
    def __init__(self, machine: AgentMachine) -> None:
        self.machine = machine
        self.sent: list[Body] = []
        self.codec = Codec(b"k" * 32)
        self.lost = False
        self.successor: str | None = "n1"
        self.electorate_epoch = -1  # the assign its members came with (see Heartbeat)
        self.settled_below = -1  # what its coordinator said is settled (see Join)
        self.coordinator_node, self.standby_port, self.next_heartbeat = "n0", 4000, 0.0
        self.connection_lost, self.last_heard = False, 0.0
        self.knows_successors = False
        self.redirected = False
        self.coordinator_failure: str | None = None

    def send(self, msg: Body, epoch: int) -> None:
        self.codec.encode(msg, epoch)  # a well-formed control message
        self.machine.on_sent(msg.TYPE)
        self.sent.append(msg)

    def heartbeat_if_due(self, now: float, epoch: int, phase: str = "", ranks=()) -> None:
        pass

    def woke(self, now: float) -> None:
        pass

    def coordinator_lost(self, now: float) -> bool:
        return self.lost

    def redirect_went_silent(self, now: float) -> bool:
        return False

    def own_redirect(self) -> None:
        return None

    def back_to_rendezvous(self) -> None:
        self.knows_successors = False
        self.asked_again = True

    def fail_over(self, epoch: int, restart_count: int, group_world_size: int) -> str | None:
        self.lost = False
        return self.successor


class FakeHealth:
    def __init__(self) -> None:
        self.holding: set[int] = set()

    def read_now(self) -> None:
        pass

    def processes(self) -> set[int]:
        return set(self.holding)


class FakeReplicas:
    """The replica service: what it was asked to copy and to pull."""

    port = 4100

    def __init__(self) -> None:
        self.offered: list[Held] = []
        self.pulls = 0

    def inventory(self) -> tuple[Held, ...]:
        return ()

    def offer(self, held: Held, to) -> None:
        assert to, "offered a shard to nobody"
        self.offered.append(held)

    def fetch(self, wanted) -> None:
        self.pulls += 1

    def forget_other_worlds(self, world_size: int) -> None:
        assert world_size > 0


class FakeEvents:
    def __init__(self) -> None:
        self.kinds: list[str] = []
        self.messages: list[str] = []

    def emit(self, kind: str, text: str, console: bool = True, **fields) -> None:
        self.kinds.append(kind)
        self.messages.append(text)


class AgentMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        config = LaunchConfig(nnodes="1:2", nproc_per_node=str(LOCAL_WORLD_SIZE),
                              rdzv_endpoint="127.0.0.1:29999", rdzv_id="state-test",
                              log_dir=LOG_DIR,
                              stop_timeout=STOP_TIMEOUT)
        self.agent = Agent(config, "train.py", [])
        self.agent.strict = True
        self.now = 1000.0
        self.agent.clock = lambda: self.now
        self.hub = FakeHub()
        self.workers = FakeWorkers(self.hub)
        self.control = FakeControl(self)
        self.health = FakeHealth()
        self.events = FakeEvents()
        self.replicas = FakeReplicas()
        self.workers.may_spawn = lambda: not self.agent.fetching or self.now >= self.pull_deadline
        self.pull_deadline = float("inf")
        store = SimpleNamespace(port=29500, serve=lambda: None, close=lambda: None)
        self.agent.attach(SimpleNamespace(
            control=self.control, hub=self.hub, workers=self.workers, events=self.events,
            health=self.health, template=None, new_store=lambda addr, port: store,
            replicas=self.replicas,
            capture_stacks=lambda pid, path, method, armed: "not captured"))
        self.epoch = 0
        self.joins_pending = 0  # joins sent since the last assignment
        self.assigned = False  # an assignment with no start yet
        self.agent.begin()

    # --- what the agent sends ------------------------------------------------------------

    def on_sent(self, kind: str) -> None:
        unreaped = {r.proc.pid for r in self.workers.alive()}
        parked = {r.proc.pid for r in self.agent.parked.values()}
        if kind == "join":
            assert unreaped <= parked, "re-joined before the ranks it stopped were reaped"
            self.joins_pending += 1
        elif kind == "failure":  # the first of an attempt, and the one behind a peer's error
            first = self.agent.first_failure
            assert self.agent.phase == Phase.RUNNING or (
                self.agent.phase == Phase.FAILED and first is not None
                and failures.is_peer_error(first.cause)), \
                f"reported a failure in {self.agent.phase}"

    # --- the coordinator -----------------------------------------------------------------

    def _order(self, kind: str, **fields) -> None:
        self.agent.on_control(Envelope(self.epoch, CONTROL[kind](**fields)))

    @initialize(running=st.booleans(), restartable=st.booleans())
    def maybe_running(self, running, restartable):
        """Half the sequences begin with the ranks started; in half, the script runs
        inside trainer_shim.restartable from the start."""
        self.hub.restartable_from_start = restartable
        if running:
            self.assign(group_rank=0)
            self.start()

    @precondition(lambda self: self.joins_pending > 0)
    @rule(group_rank=st.sampled_from([0, 1]), pull=st.booleans())
    def assign(self, group_rank, pull=False):
        """``pull``: the node's ranks restore from shards it must pull from a peer first."""
        self.epoch += 1
        self.joins_pending, self.assigned = 0, True
        fetch = (Fetch(4, 1, 40, "n2", "127.0.0.1", 4100),) if pull else ()
        if pull:
            self.pull_deadline = self.now + FETCH_TIMEOUT
        self._order("assign", group_rank=group_rank, group_world_size=2,
                    rank_offset=group_rank * LOCAL_WORLD_SIZE, world_size=2 * LOCAL_WORLD_SIZE,
                    restart_count=0, max_restarts=3, members=(), spares=(), earlier=(),
                    coordinator_node="n0", replicate_to=(Peer("n1", "127.0.0.1", 4100),),
                    fetch=fetch)

    @precondition(lambda self: self.assigned)
    @rule()
    def start(self):
        self.assigned = False
        self._order("start", master_addr="127.0.0.1", master_port=29500, restart_count=0)

    @rule(kind=st.sampled_from(["assign", "start"]))
    def stray_order(self, kind):
        """An order the agent's phase does not expect: ignored, never a crash."""
        if kind == "assign":
            self._order("assign", group_rank=1, group_world_size=2, rank_offset=2,
                        world_size=4, restart_count=0, max_restarts=3, members=(), spares=(),
                        earlier=(), coordinator_node="n0", replicate_to=(), fetch=())
        else:
            self._order("start", master_addr="127.0.0.1", master_port=29500, restart_count=0)

    @rule()
    def spare(self):
        """Told to wait as a spare (whatever the phase): it only learns whom to follow."""
        self._order("spare", coordinator_node="n0", members=(), spares=())

    @rule(step=st.integers(0, 5))
    def committed(self, step):
        self._order("committed", step=step)

    @rule(step=st.integers(0, 5))
    def in_memory(self, step):
        self._order("in_memory", step=step)

    @rule(what=st.sampled_from(["recover rank 0", "recover rank 1", "recover job 0",
                                "recover cold 1", "coordinator lost"]))
    def disruption(self, what):
        """A recovery somewhere in the job, or the coordinator's node lost (one rule, so
        that the job mostly gets to run)."""
        if what == "coordinator lost":
            self.control.lost, self.control.successor = True, "n1"
            self.agent.on_timers(self.now)
            return
        _, policy, delay = what.split()
        self.assigned = False
        self._order("recover", policy=policy, restart_count=1, delay=float(delay),
                    cause="test")

    @rule(how=st.sampled_from(["stop 0", "stop 1", "no successor", "fatal GPU", "SIGTERM",
                               "SIGINT"]), now=st.integers(0, 3))
    def the_end(self, how, now):
        """Whatever ends the node (one rule, rarely taken, so that most sequences run long)."""
        if now:
            return
        if how.startswith("stop"):
            self._order("stop", exit_code=int(how[-1]), reason="test")
        elif how == "no successor":
            self.control.lost, self.control.successor = True, None
            self.agent.on_timers(self.now)
        elif how == "fatal GPU":
            self.agent.on_gpu_findings([Finding(Severity.FATAL, 0, "xid", "XID 79")])
        else:
            self.agent.on_signal(int(getattr(signal, how)))

    # --- the ranks -----------------------------------------------------------------------

    def _living(self) -> list[FakeRank]:
        return [r for r in self.workers.alive() if r.dead is None]

    @precondition(lambda self: self.agent.phase == Phase.RUNNING and self._living())
    @rule()
    def every_rank_finishes(self):
        for rank in self._living():
            rank.dead = 0

    @precondition(lambda self: self._living())
    @rule(data=st.data(), status=st.sampled_from([0, 1, -9]))
    def a_rank_ends(self, data, status):
        """Exits on its own, or after a signal it was sent (SIGTERM, SIGINT)."""
        rank = data.draw(st.sampled_from(self._living()))
        rank.dead = status
        if status and data.draw(st.booleans()):
            self.health.holding.add(rank.proc.pid)  # its CUDA context is not torn down yet

    @precondition(lambda self: any(r.dead is not None for r in self.workers.alive()))
    @rule(data=st.data())
    def the_agent_reaps_one(self, data):
        rank = data.draw(st.sampled_from([r for r in self.workers.alive() if r.dead is not None]))
        self.agent.on_rank_exit(self.workers.reap(rank))

    @precondition(lambda self: self._living())
    @rule(data=st.data())
    def a_rank_enters_restartable(self, data):
        rank = data.draw(st.sampled_from(self._living()))
        if rank.proc.pid in self.hub.links:
            self.hub.links[rank.proc.pid]["restartable"] = True

    @precondition(lambda self: any(r.proc.pid in self.hub.aborted for r in self._living()))
    @rule(data=st.data())
    def an_aborted_rank_parks(self, data):
        rank = data.draw(st.sampled_from([r for r in self._living()
                                          if r.proc.pid in self.hub.aborted]))
        self._park(rank, error="")

    @precondition(lambda self: any(r.proc.pid in self.hub.aborted for r in self._living()))
    @rule(data=st.data())
    def an_aborted_rank_is_stuck_in_native_code(self, data):
        rank = data.draw(st.sampled_from([r for r in self._living()
                                          if r.proc.pid in self.hub.aborted]))
        parking = self.agent.phase == Phase.PARKING
        self.hub.links[rank.proc.pid]["stuck"] = "all_gather_single (distributed_c10d.py:1)"
        self.agent.on_rank_messages()
        if parking and self.agent.phase != Phase.PARKING:  # decided: killed, not waited for
            assert signal.SIGKILL in rank.signals, "a stuck rank is killed at once"

    @precondition(lambda self: any(self.hub.restartable(r.proc.pid) for r in self._living()))
    @rule(data=st.data())
    def a_rank_raises_and_parks(self, data):
        rank = data.draw(st.sampled_from([r for r in self._living()
                                          if self.hub.restartable(r.proc.pid)]))
        self._park(rank, error="Traceback ...\nRuntimeError: boom")

    def _park(self, rank: FakeRank, error: str) -> None:
        self.hub.aborted.discard(rank.proc.pid)
        self.hub.links[rank.proc.pid].update(parked=True, error=error)
        self.hub.news.parked.append(rank.proc.pid)
        self.agent.on_rank_messages()

    @rule(rank=st.integers(0, 3), step=st.integers(0, 5))
    def a_shard_is_durable(self, rank, step):
        self.hub.news.durable.append((rank, step))
        self.agent.on_rank_messages()

    @precondition(lambda self: self._living())
    @rule(data=st.data())
    def a_rank_hangs(self, data):
        rank = data.draw(st.sampled_from(self._living()))
        self.hub.hung_next = [(rank.proc.pid, "no heartbeat for 9.0s (timeout 5s)")]
        self.agent.on_timers(self.now)

    # --- the node ------------------------------------------------------------------------

    @rule(severity=st.sampled_from(["warn", "drain"]))
    def gpu_finding(self, severity):
        self.agent.on_gpu_findings([Finding(Severity(severity), 0, "xid", "XID 63")])

    @precondition(lambda self: self.agent.phase == Phase.LEAVING)
    @rule(signum=st.sampled_from([signal.SIGTERM, signal.SIGINT, signal.SIGHUP]))
    def another_signal(self, signum):
        self.agent.on_signal(int(signum))

    @precondition(lambda self: self.agent.phase == Phase.PREPARING)
    @rule()
    def gpu_memory_released(self):
        self.health.holding.clear()

    @precondition(lambda self: self.agent.fetching)
    @rule(failed=st.integers(0, 1))
    def shards_pulled(self, failed):
        self.agent.on_replica_news([FetchDone(1 - failed, failed, 0.2)])

    @rule(step=st.integers(0, 5), purpose=st.sampled_from(["replica", "restore"]))
    def a_copy_arrived(self, step, purpose):
        """A peer's shard is whole in this node's memory (only replicas are reported)."""
        self.agent.on_replica_news([Transferred(Held(4, 3, step), "n2", purpose, 100, 0.1)])

    @rule(step=st.integers(0, 5))
    def a_rank_staged(self, step):
        """Its shard is copied to the peer the assignment names, if any."""
        alive = self.workers.alive()
        if alive:
            self.hub.news.staged.append((alive[0].rank, step))
            self.agent.on_rank_messages()

    @rule(seconds=st.sampled_from([0.05, 0.5, 1.0, 3.0]))
    def time_passes(self, seconds):
        self.now += seconds
        self.agent.on_timers(self.now)

    # --- invariants ----------------------------------------------------------------------

    @invariant()
    def a_node_that_is_done_left_no_rank_behind(self):
        if self.agent.phase == Phase.DONE:
            assert self.agent.exit_code is not None
            assert not self.workers.alive(), "done with ranks still running"

    @invariant()
    def parked_ranks_are_alive_and_only_kept_during_a_recovery(self):
        for rank in self.agent.parked.values():
            assert rank.returncode is None and self.hub.parked(rank.proc.pid)
        if self.agent.parked:
            assert self.agent.phase in (Phase.STOPPING, Phase.BACKING_OFF, Phase.JOINING,
                                        Phase.STARTING, Phase.PREPARING, Phase.PARKING)
            assert self.agent.policy == "rank", "kept a process under a job or cold restart"

    @invariant()
    def one_process_per_local_rank(self):
        local_ranks = [r.local_rank for r in self.workers.alive()]
        assert len(local_ranks) == len(set(local_ranks))

    @invariant()
    def what_is_being_stopped_was_told_to_stop(self):
        if self.agent.phase == Phase.STOPPING:
            for rank in self.agent._being_stopped():
                assert signal.SIGTERM in rank.signals

    @invariant()
    def a_leaving_node_forwarded_the_signal_to_every_rank(self):
        if self.agent.phase == Phase.LEAVING:
            for rank in self.workers.alive():
                assert self.agent.shutdown_signal in rank.signals

    @invariant()
    def hangs_are_watched_only_while_running(self):
        if self.agent.phase == Phase.RUNNING:
            assert self.agent.recovery is None and not self.agent.stopping

    @invariant()
    def a_node_ended_by_a_signal_exits_128_plus_it(self):
        if self.agent.phase == Phase.DONE and self.agent.shutdown_signal is not None:
            assert self.agent.exit_code == exit_codes.SIGNAL_BASE + self.agent.shutdown_signal


AgentMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=80,
                                          deadline=None)
TestAgentStateMachine = AgentMachine.TestCase


def test_the_diagram_in_the_docs_is_the_transition_table():
    import re
    from pathlib import Path

    from launcher.node_policy import TRANSITIONS

    doc = (Path(__file__).resolve().parents[1] / "docs" / "protocol.md").read_text()
    section = doc.split("## Agent state machine", 1)[1].split("\n## ", 1)[0]
    drawn = set()
    for sources, target in re.findall(r"^([a-z_, ]+) --\(.*?\)--> ([a-z_]+)", section, re.M):
        drawn |= {(Phase(s.strip()), Phase(target)) for s in sources.split(",")}
    table = {(a, b) for a, targets in TRANSITIONS.items() for b in targets}
    assert drawn == table, f"drawn only: {drawn - table}; in the table only: {table - drawn}"


def test_a_finished_node_that_loses_its_coordinator_ends_with_0():
    """Every rank here finished when the coordinator's node went silent: the job ended
    (a frozen or cut-off node finds its coordinator gone once it is back). It exits 0
    instead of hosting a successor and waiting join_timeout for nodes that all left."""
    machine = AgentMachine()
    machine.maybe_running(running=True, restartable=False)
    assert machine.agent.phase == Phase.RUNNING
    machine.every_rank_finishes()
    for rank in list(machine.workers.alive()):
        machine.agent.on_rank_exit(machine.workers.reap(rank))
    assert machine.agent.phase == Phase.FINISHED
    machine.control.lost = True
    machine.agent.on_timers(machine.now)
    assert machine.agent.phase == Phase.DONE and machine.agent.exit_code == exit_codes.OK
    assert machine.control.lost, "no fail-over to a successor"


def test_a_spare_that_knows_no_successor_asks_at_the_rendezvous_endpoint_again():
    """Chaos seed 1045: the coordinator's node was lost twice in 0.5 s, and a spare had not
    heard who would take over from the first successor. Not in the job, it did not end it
    (it exited 1): it joins again at the rendezvous endpoint, and waits on as a spare; a
    member that knows no successor ends (every node that could host the job is gone)."""
    machine = AgentMachine()
    assert machine.agent.assignment is None and machine.agent.phase == Phase.JOINING
    machine.control.lost, machine.control.successor = True, None
    machine.control.knows_successors = True
    machine.now += 700  # long after join_timeout (600 s)
    machine.agent.on_timers(machine.now)
    assert machine.control.asked_again and machine.agent.phase == Phase.JOINING
    assert machine.control.sent[-1].TYPE == "join" and machine.agent.exit_code is None
    machine.now += 1
    machine.agent.on_timers(machine.now)
    assert machine.agent.phase == Phase.JOINING, "join_timeout counts from the new question"
    machine.maybe_running(running=True, restartable=False)
    machine.control.lost = True
    machine.agent.on_timers(machine.now)
    assert machine.agent.phase == Phase.STOPPING


def test_a_spare_sent_on_by_a_redirect_asks_at_the_endpoint_when_that_coordinator_is_lost():
    """Chaos seed 5708: a spare, redirected to the job's coordinator, which died before it
    answered, followed the successors an earlier coordinator had named (one that stood
    down since), each silent, until the job had ended: none was there to tell it, and it
    exited 1. It asks at the rendezvous endpoint, where whoever runs the job answers."""
    machine = AgentMachine()
    machine.spare()
    machine.control.knows_successors, machine.control.redirected = True, True
    machine.control.lost = True
    machine.agent.on_timers(machine.now)
    assert machine.control.asked_again, "followed another coordinator's successors"
    assert machine.control.lost, "failed over"
    assert machine.agent.phase == Phase.JOINING and machine.control.sent[-1].TYPE == "join"
    assert "another coordinator's" in machine.events.messages[-1]


def test_a_node_whose_coordinator_died_of_a_bug_leaves_the_job_loudly():
    """The coordinator thread this node hosts died (a bug): the node stops its ranks and
    exits 1, naming it, instead of running on without the job's decider until every other
    node's timeout; its exit closes the connections, so the others fail over at once."""
    machine = AgentMachine()
    machine.maybe_running(running=True, restartable=False)
    machine.control.coordinator_failure = "RuntimeError: boom"
    machine.agent.on_timers(machine.now)
    assert machine.agent.phase == Phase.STOPPING and "coordinator_failed" in machine.events.kinds
    for rank in list(machine.workers.alive()):
        rank.dead = -15
        machine.agent.on_rank_exit(machine.workers.reap(rank))
    assert machine.agent.phase == Phase.DONE
    assert machine.agent.exit_code == exit_codes.JOB_FAILED


def test_a_rank_that_dies_after_its_peer_reported_the_reset_is_reported_too():
    """One node: a rank killed resets its peer's collective, and the peer's error may reach
    the agent before the killed rank's exit. The exit is reported too, so the coordinator
    (which waits a moment after a peer's error) names the rank that died."""
    machine = AgentMachine()
    machine.maybe_running(running=True, restartable=False)
    killed, peer = machine.workers.alive()[:2]
    peer.dead, peer.cause = 1, "raised RuntimeError: Read error: Connection reset by peer"
    machine.agent.on_rank_exit(machine.workers.reap(peer))
    killed.dead = -11
    machine.agent.on_rank_exit(machine.workers.reap(killed))
    reported = [m for m in machine.control.sent if m.TYPE == "failure"]
    assert [m.rank for m in reported] == [peer.rank, killed.rank], reported
    assert "SIGSEGV" in reported[1].cause and machine.agent.phase == Phase.FAILED


def test_a_spare_says_whom_it_waits_under_each_time_that_changes():
    """Chaos (2 nodes, seed 1607): a spare dropped by the successor it followed re-joined
    and was told to wait as a spare by the job's coordinator, and said nothing (it had said
    so once, under another coordinator): the runner took it for stranded. It says so again
    after a re-join, and under each new coordinator; not twice under one."""
    machine = AgentMachine()
    machine.spare()
    machine.spare()
    assert machine.events.kinds.count("spare") == 1
    machine._order("spare", coordinator_node="n4", members=(), spares=())  # followed a successor
    assert machine.events.kinds.count("spare") == 2
    machine._order("recover", policy="rank", restart_count=1, delay=0.0,
                   cause="node n2 was dropped from the job; re-joining")
    machine._order("spare", coordinator_node="n4", members=(), spares=())
    assert machine.events.kinds.count("spare") == 3


def test_a_spare_told_it_was_dropped_joins_again_and_logs_no_recovery():
    """Chaos seed 5709: a spare followed a coordinator that stood down to the job's, where
    its heartbeat came before its join and was answered "dropped from the job; re-joining".
    It has no rank: it joins again, and logs no recovery (one more than the fault's, and
    "-> rank restart" on a node with no rank); a seated node still recovers."""
    machine = AgentMachine()
    machine.spare()
    joins = [m.TYPE for m in machine.control.sent].count("join")
    machine._order("recover", policy="rank", restart_count=6, delay=0.0,
                   cause="node n6 was dropped from the job; re-joining")
    assert "recovering" not in machine.events.kinds
    assert machine.agent.phase == Phase.JOINING and machine.agent.restart_count == 6
    assert [m.TYPE for m in machine.control.sent].count("join") == joins + 1
    seated = AgentMachine()
    seated.maybe_running(running=True, restartable=False)
    seated._order("recover", policy="rank", restart_count=1, delay=0.0,
                  cause="node n1 was dropped from the job; re-joining")
    assert "recovering" in seated.events.kinds and seated.agent.phase != Phase.JOINING


def test_a_join_says_every_round_the_node_held_a_seat_in_since_the_oldest_not_settled():
    """A large job's successor knows an earlier round by size only: its voters are the nodes
    whose joins say they held a seat in it. However many rounds closed before most heard of
    them, each not settled is reported (not only the last two); a settled one no more."""
    machine = AgentMachine()

    def rounds(restarts, group_rank=0):
        for restart in restarts:
            machine.joins_pending = 1
            machine.assign(group_rank=group_rank)
            machine._order("recover", policy="job", restart_count=restart, delay=0.0,
                           cause="x")
            for _ in range(3):  # (no ranks run: it stops at once and joins again)
                machine.now += 1
                machine.agent.on_timers(machine.now)

    rounds((1, 2, 3))
    machine.control.settled_below = 2  # its coordinator said the round of epoch 1's is
    rounds((4,), group_rank=1)
    joins = [(m.seated_epoch, m.seated_earlier, m.settled_below)
             for m in machine.control.sent if m.TYPE == "join"]
    assert joins == [(-1, (), -1), (1, (), -1), (2, (1,), -1), (3, (1, 2), -1),
                     (4, (2, 3), 2)]
    # and its seat in the last of them, which a successor keeps (it knows 16 by name)
    assert [m.group_rank for m in machine.control.sent if m.TYPE == "join"] == [-1, 0, 0, 0, 1]
