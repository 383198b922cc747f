"""The coordinator's state machine under random event sequences (hypothesis, no sockets).

Messages go straight into its handler and its sends are captured by a stand-in socket with
the one method the coordinator uses; the invariants below must hold after every step.
"""

from __future__ import annotations

import time

import pytest
import zmq
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ftlaunch_contract.messages import CONTROL, Assign, Held
from ftlaunch_contract.protocol import Codec, Envelope
from launcher import coordinator as coordinator_module
from launcher import exit_codes
from launcher.coordinator import FOLLOWED_QUIET, Coordinator, JobState
from launcher.membership import Electorate, has_quorum
from launcher.peer_probe import Verdict
from launcher.replica_plan import runs

SECRET = b"k" * 32
NODES = [f"n{i}" for i in range(5)]


class CapturingSocket:
    """Decodes what is sent as each receiver would: one codec per identity (a broadcast is
    one encoding, its sequence number seen once by each)."""

    def __init__(self) -> None:
        self.codecs: dict[bytes, Codec] = {}
        self.sent: list[tuple[bytes, Envelope]] = []
        self.bodies: list[bytes] = []  # as sent, beside each of ``sent``
        self._frames: list[bytes] = []

    def send(self, frame: bytes, flags: int = 0) -> None:
        """A ROUTER's: frames sent with SNDMORE make one message with the last."""
        self._frames.append(frame)
        if not flags & zmq.SNDMORE:
            frames, self._frames = self._frames, []
            codec = self.codecs.setdefault(frames[0], Codec(SECRET))
            self.sent.append((frames[0], codec.decode(frames[1:])))  # (a replay raises)
            self.bodies.append(frames[1])


class CoordinatorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 1000.0
        self.socket = CapturingSocket()
        self.state = JobState(min_nodes=1, max_nodes=3, max_restarts=2, policy="cold",
                              backoff=1.0, backoff_max=4.0, exit_barrier_timeout=30.0,
                              node_timeout=5.0, last_call=1.0, join_timeout=60.0,
                              host_node="n0", joining_since=self.now, replicas=1)
        self.coordinator = Coordinator(self.socket, SECRET, self.state)
        self.last_epoch = 0
        self.final = None
        self.held: dict[str, set[Held]] = {}
        self.checked = 0  # messages whose fetch lists were checked

    def teardown(self) -> None:
        self.coordinator.close_probes()  # never served: its loop's own close never ran

    def _deliver(self, node: str, kind: str, epoch: int | None = None, **fields) -> None:
        msg = Envelope(self.state.epoch if epoch is None else epoch, CONTROL[kind](**fields))
        self.coordinator._handle(node.encode(), msg, self.now)

    @rule(node=st.sampled_from(NODES), size=st.integers(1, 4),
          held=st.lists(st.builds(Held, st.integers(1, 4), st.integers(0, 3), st.integers(1, 3)),
                        max_size=6))
    def join(self, node, size, held=()):
        """``held``: the checkpoint shards the node says it has in memory."""
        self._deliver(node, "join", node_id=node, local_world_size=size, addr=f"10.0.0.{node[1]}",
                      standby_port=4000, rank_hint=-1, replica_port=4100, held=runs(held), restart_count=0,
                      group_rank=-1, seated_epoch=-1, seated_earlier=(), settled_below=-1, electorate_epoch=-1)
        self.held[node] = set(held)

    @rule(node=st.sampled_from(NODES))
    def heartbeat(self, node):
        self._deliver(node, "heartbeat", epoch=0, node_id=node, phase="running", ranks=(), electorate_epoch=-1)

    @precondition(lambda self: self.state.phase == "waiting_store")
    @rule()
    def store_ready(self):
        self._deliver("n0", "store_ready", master_addr="10.0.0.1", master_port=29500)

    @rule(node=st.sampled_from(NODES), stale=st.booleans(), step=st.integers(-1, 3),
          cause=st.sampled_from(["boom", "raised RuntimeError: Connection reset by peer"]))
    def failure(self, node, stale, step, cause="boom"):
        """A cause that reads as a peer's error waits a grace for the failure behind it."""
        self._deliver(node, "failure", epoch=self.state.epoch - stale, node_id=node, rank=0,
                      local_rank=0, exit_code=1, signal="", cause=cause, step=step)

    @rule(node=st.sampled_from(NODES))
    def finished(self, node):
        self._deliver(node, "finished", node_id=node)

    @rule(dt=st.sampled_from([0.1, 0.6, 1.5, 6.0]))
    def time_passes(self, dt):
        self.now += dt
        for node in self.state.members:  # live nodes keep heartbeating, except sometimes
            if node != "n4":
                self.coordinator._seen(node, self.now)
        self.coordinator._tick(self.now)

    @invariant()
    def epoch_only_grows_and_budget_holds(self):
        assert self.state.epoch >= self.last_epoch
        self.last_epoch = self.state.epoch
        assert 0 <= self.state.restart_count <= self.state.max_restarts

    @invariant()
    def round_is_well_formed(self):
        if self.state.phase in ("waiting_store", "running"):
            ranks = sorted(self.state.group_ranks.values())
            assert ranks == list(range(len(ranks)))
            assert 1 <= len(ranks) <= self.state.max_nodes

    @invariant()
    def assignments_of_one_round_agree(self):
        by_epoch: dict[int, dict[bytes, Assign]] = {}
        for i, (to, msg) in enumerate(self.socket.sent):
            if not isinstance(msg.body, Assign):
                continue
            first = by_epoch.setdefault(msg.epoch, {}).setdefault(to, msg.body)
            if first is not msg.body:  # sent again (the node joined again without its seat)
                assert msg.body == first
            elif i >= self.checked:  # sent by the last rule
                node = to.decode()
                assert all(p.node_id != node for p in msg.body.replicate_to)
                for f in msg.body.fetch:  # from a peer that said it holds it, never itself
                    assert f.node_id != node and Held(*f[:3]) in self.held[f.node_id]
                    assert Held(*f[:3]) not in self.held[node]
        self.checked = len(self.socket.sent)
        for assigns in by_epoch.values():
            sizes = {m.world_size for m in assigns.values()}
            assert len(sizes) == 1
            offsets = sorted(m.rank_offset for m in assigns.values())
            assert offsets[0] == 0 and len(set(offsets)) == len(offsets)

    @invariant()
    def the_end_is_final(self):
        if self.final is not None:
            assert self.state.final == self.final and self.state.phase == "done"
        self.final = self.state.final


CoordinatorMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40,
                                                deadline=None)
TestCoordinatorStateMachine = CoordinatorMachine.TestCase


def _two_nodes_joined(held_by_node) -> tuple[Coordinator, CapturingSocket]:
    """Two nodes join with these shards in memory; the round closes at MAX."""
    assert len(held_by_node) == 2
    return _nodes_joined(held_by_node)


def _nodes_joined(held_by_node) -> tuple[Coordinator, CapturingSocket]:
    """These nodes join with these shards in memory; the round closes at MAX (all of them)."""
    socket = CapturingSocket()
    state = JobState(min_nodes=len(held_by_node), max_nodes=len(held_by_node), max_restarts=2,
                     policy="rank", backoff=1.0, backoff_max=4.0, exit_barrier_timeout=30.0,
                     node_timeout=5.0,
                     last_call=1.0, join_timeout=60.0, host_node="a", joining_since=0.0,
                     replicas=1)
    coordinator = Coordinator(socket, SECRET, state)
    for i, (node, held) in enumerate(held_by_node.items()):
        coordinator._handle(node.encode(), Envelope(0, CONTROL["join"](
            node_id=node, local_world_size=1, addr=f"10.0.0.{i + 1}", standby_port=4000,
            rank_hint=-1, replica_port=4100 + i, held=runs(held), restart_count=0, seated_earlier=(), settled_below=-1, group_rank=-1, seated_epoch=-1, electorate_epoch=-1)), 1.0)
    coordinator._tick(1.1)
    return coordinator, socket


def _round(held_by_node, caplog):
    """The assigns of a round whose two nodes hold these shards in memory."""
    import logging

    with caplog.at_level(logging.INFO, logger="ftlaunch.coordinator"):
        _, socket = _two_nodes_joined(held_by_node)
    return {to.decode(): m.body for to, m in socket.sent if isinstance(m.body, Assign)}


def test_a_replacement_is_told_to_pull_its_shards_from_the_peer_holding_them(caplog):
    assigns = _round({"a": [Held(2, 0, 40), Held(2, 1, 40)], "spare": []}, caplog)
    assert assigns["a"].replicate_to[0].node_id == "spare"  # the ring: each keeps the other's
    assert [(f.rank, f.step, f.node_id, f.port) for f in assigns["spare"].fetch] == \
        [(1, 40, "a", 4100)]
    assert assigns["a"].fetch == ()


def test_both_copies_lost_is_said_and_the_ranks_restore_from_storage(caplog):
    assigns = _round({"a": [Held(3, 0, 40)], "b": [Held(3, 1, 40)]}, caplog)  # rank 2: gone
    assert assigns["a"].fetch == assigns["b"].fetch == ()
    assert "no checkpoint step is whole in the memory of the 2 nodes" in caplog.text


def test_a_world_resized_past_eight_nodes_is_told_to_restore_from_storage(caplog):
    """Ten nodes of one rank, the survivors of eleven (the lost one's shard kept by the next):
    resized, each would pull every saved shard. None is told to; the warning says why and
    what storage has."""
    import logging

    shards = {f"n{i}": (Held(11, i, 40), Held(11, (i + 10) % 11, 40))  # its own, its peer's
              for i in range(10)}
    with caplog.at_level(logging.WARNING, logger="ftlaunch.coordinator"):
        _, socket = _nodes_joined(shards)
    assigns = [m.body for _, m in socket.sent if isinstance(m.body, Assign)]
    assert len(assigns) == 10 and all(a.fetch == () for a in assigns)
    assert "step 40, whole in the nodes' memory, was saved by 11 ranks: resized to 10 nodes" \
        in caplog.text and "no step committed there yet" in caplog.text


@pytest.mark.parametrize("enabled", [True, False])
def test_a_round_is_decided_with_the_cyclic_collector_off_and_left_as_it_was(monkeypatch,
                                                                             enabled):
    """A round of thousands allocates as many objects, and each full collection walked the
    whole heap (0.4 s of a 16,384-node round): off while it is decided, as it was after."""
    import gc

    from launcher.coordinator import Coordinator as Decider

    during = []
    decide = Decider._complete_round
    monkeypatch.setattr(Decider, "_complete_round",
                        lambda self, now: (during.append(gc.isenabled()), decide(self, now)))
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        _two_nodes_joined({"a": (), "b": ()})
        assert (during, gc.isenabled()) == ([False], enabled)
    finally:
        (gc.enable if was else gc.disable)()


def test_a_step_every_rank_has_a_peer_copy_of_is_announced_once():
    """Holders report whole copies; once every rank's shard of a step has one, all hear it."""
    coordinator, socket = _two_nodes_joined({"a": (), "b": ()})

    def announced():
        return [m.body.step for _, m in socket.sent if m.body.TYPE == "in_memory"]
    coordinator._handle(b"b", Envelope(1, CONTROL["replicated"](node_id="b", rank=0, step=10)), 2)
    assert announced() == []  # rank 1's copy is not whole yet
    coordinator._handle(b"a", Envelope(1, CONTROL["replicated"](node_id="a", rank=1, step=10)), 2)
    assert announced() == [10, 10]  # to both nodes
    coordinator._handle(b"a", Envelope(1, CONTROL["replicated"](node_id="a", rank=1, step=10)), 3)
    assert announced() == [10, 10]


def test_a_node_lost_while_a_round_forms_gives_its_seat_to_a_waiting_spare():
    """The usual order of a node loss: its ranks die, the peers' collectives fail and are
    reported (a new round forms), and only then does the node's silence pass the timeout.
    The hot spare must take the lost node's seat in that round, not wait for a next one."""
    coordinator, socket = _two_nodes_joined({"a": (), "b": ()})
    state = coordinator._state
    join = CONTROL["join"](node_id="spare", local_world_size=1, addr="10.0.0.3",
                           standby_port=4000, rank_hint=-1, replica_port=4102, held=(), restart_count=0, seated_earlier=(), settled_below=-1, group_rank=-1, seated_epoch=-1, electorate_epoch=-1)
    coordinator._handle(b"spare", Envelope(0, join), 1.2)
    coordinator._handle(b"a", Envelope(1, CONTROL["store_ready"](master_addr="10.0.0.1",
                                                                 master_port=29500)), 1.3)
    assert state.phase == "running" and "spare" not in state.group_ranks  # it waits
    coordinator._handle(b"a", Envelope(1, CONTROL["failure"](
        node_id="a", rank=0, local_rank=0, exit_code=1, signal="", cause="peer closed",
        step=30)), 2.0)
    assert state.phase == "joining"
    coordinator._handle(b"a", Envelope(1, CONTROL["join"](
        node_id="a", local_world_size=1, addr="10.0.0.1", standby_port=4000, rank_hint=0,
        replica_port=4100, held=(), restart_count=0, seated_earlier=(), settled_below=-1, group_rank=-1, seated_epoch=-1, electorate_epoch=-1)), 2.1)
    for now in (3.0, 5.0, 6.0, 7.5):  # b is silent; a and the spare are not
        state.last_seen.update(a=now, spare=now)
        coordinator._tick(now)
    assert state.phase == "waiting_store", "the round never formed: the spare was left out"
    assert sorted(state.group_ranks) == ["a", "spare"]
    assigned = [to.decode() for to, m in socket.sent if isinstance(m.body, Assign)
                and m.epoch == state.epoch]
    assert sorted(assigned) == ["a", "spare"]


def _running(coordinator: Coordinator) -> None:
    coordinator._handle(b"a", Envelope(coordinator._state.epoch, CONTROL["store_ready"](
        master_addr="10.0.0.1", master_port=29500)), 1.3)
    assert coordinator._state.phase == "running"


def _leave(coordinator: Coordinator, node: str, now: float) -> None:
    coordinator._handle(node.encode(), Envelope(1, CONTROL["leave"](
        node_id=node, exit_code=143, reason="SIGTERM")), now)


def test_a_pod_stopped_by_sigterm_leaves_and_its_replacement_takes_its_seat():
    """A pod deleted (kubelet's SIGTERM): its ranks and the others agree to save and stop
    (trainer_shim.preempted); the job then goes on with a replacement, not to an end."""
    coordinator, socket = _two_nodes_joined({"a": (), "b": ()})
    state = coordinator._state
    _running(coordinator)
    _leave(coordinator, "b", 2.0)
    assert state.final is None and state.phase == "running"  # b's ranks save first
    coordinator._handle(b"a", Envelope(1, CONTROL["finished"](node_id="a")), 3.0)
    assert state.final is None and state.phase == "joining", "a finished a job that goes on"
    for node, now in (("a", 3.1), ("b-replacement", 4.0)):
        coordinator._handle(node.encode(), Envelope(1, CONTROL["join"](
            node_id=node, local_world_size=1, addr="10.0.0.9", standby_port=4000,
            rank_hint=-1, replica_port=4100, held=(), restart_count=0, seated_earlier=(), settled_below=-1, group_rank=-1, seated_epoch=-1, electorate_epoch=-1)), now)
    coordinator._tick(5.5)
    assert sorted(state.group_ranks) == ["a", "b-replacement"]
    assert state.phase == "waiting_store" and state.restart_count == 0, "not a failure"


def test_every_node_stopped_by_a_signal_ends_the_job_with_its_code():
    coordinator, socket = _two_nodes_joined({"a": (), "b": ()})
    _running(coordinator)
    _leave(coordinator, "b", 2.0)
    _leave(coordinator, "a", 2.01)
    assert coordinator._state.final == (143, "every node left (SIGTERM)")


def _fresh(host: str = "p0") -> tuple[Coordinator, CapturingSocket]:
    """A coordinator that just started at the rendezvous endpoint (a re-created pod 0)."""
    socket = CapturingSocket()
    state = JobState(min_nodes=2, max_nodes=2, max_restarts=3, policy="rank", backoff=1.0,
                     backoff_max=4.0, exit_barrier_timeout=30.0, node_timeout=5.0,
                     last_call=1.0, join_timeout=60.0, host_node=host, joining_since=1.0)
    return Coordinator(socket, SECRET, state), socket


def _join(coordinator: Coordinator, node: str, epoch: int, now: float) -> None:
    coordinator._handle(node.encode(), Envelope(epoch, CONTROL["join"](
        node_id=node, local_world_size=1, addr="10.0.0.9", standby_port=4000, rank_hint=-1,
        replica_port=4100, held=(), restart_count=0, seated_earlier=(), settled_below=-1, group_rank=-1, seated_epoch=-1, electorate_epoch=-1)), now)


def test_a_fresh_coordinator_continues_the_epochs_of_the_job_it_finds():
    """Pod 0 re-created at the endpoint before the others noticed: their heartbeats carry
    the job's epoch; the fresh coordinator's answer must not look stale to them."""
    coordinator, socket = _fresh()
    _join(coordinator, "p0", 0, 1.0)
    coordinator._handle(b"p1", Envelope(7, CONTROL["heartbeat"](node_id="p1", phase="finished",
                                                                 ranks=(), electorate_epoch=-1)), 1.1)
    (to, reply), = [(to, m) for to, m in socket.sent if to == b"p1"]
    assert reply.body.TYPE == "recover" and reply.epoch == 7  # p1 drops epochs below its 7
    _join(coordinator, "p1", 7, 1.2)
    coordinator._tick(1.3)
    assigns = [m for to, m in socket.sent if m.body.TYPE == "assign"]
    assert len(assigns) == 2 and all(m.epoch > 7 for m in assigns)


def test_a_fresh_coordinator_redirects_its_agents_to_the_successor_the_job_runs_under():
    coordinator, socket = _fresh()
    _join(coordinator, "p0", 0, 1.0)
    redirect = CONTROL["redirect"](coordinator_node="p1", addr="10.0.0.2", port=4000)
    coordinator._handle(b"announcer", Envelope(3, redirect), 1.1)
    assert [(to, m.body) for to, m in socket.sent] == [(b"p0", redirect)]
    _join(coordinator, "p2", 0, 1.2)  # whoever comes next is sent there too
    assert socket.sent[-1] == (b"p2", Envelope(0, redirect))
    assert coordinator._state.phase == "joining" and not coordinator._state.group_ranks


def test_a_coordinator_that_formed_a_round_ignores_a_redirect():
    coordinator, socket = _two_nodes_joined({"a": (), "b": ()})
    epoch, sent = coordinator._state.epoch, len(socket.sent)
    coordinator._handle(b"announcer", Envelope(epoch + 5, CONTROL["redirect"](
        coordinator_node="z", addr="10.0.0.2", port=4000)), 2.0)
    assert coordinator._state.redirect is None, "its agents are not sent away"
    assert [(to, m.body.TYPE) for to, m in socket.sent[sent:]] == [(b"announcer", "redirect")], \
        "only the announcer is told where the job runs"
    assert coordinator._state.epoch == epoch, "an announcement's epoch is not adopted"


def test_a_members_closed_connection_is_a_lost_node_at_once():
    """An agent's connection closed (its process died): lost at once, not after the timeout."""
    coordinator, socket = _two_nodes_joined({"a": (), "b": ()})
    _running(coordinator)
    state, restarts = coordinator._state, coordinator._state.restart_count
    coordinator._disconnected(b"someone-else", 2.0)  # a status query's socket, say
    coordinator._disconnected(b"a", 2.0)  # the host's own agent: alive by definition
    assert sorted(state.group_ranks) == ["a", "b"] and state.phase == "running"
    coordinator._connection_closed("b", Verdict.DIED, 2.0)  # long before the node timeout (5 s)
    assert "b" not in state.group_ranks and state.restart_count == restarts + 1
    recover = [m.body for to, m in socket.sent if m.body.TYPE == "recover"][-1]
    assert recover.cause == "node b lost (its agent's connection closed)"


@pytest.mark.parametrize("answer", [Verdict.ALIVE, Verdict.UNKNOWN])
def test_a_members_connection_closed_by_the_network_is_no_death(answer):
    """Closed while heard from, and its machine accepts a new connection (or says nothing):
    the kernel ended it (packet loss past TCP_USER_TIMEOUT). No recovery; its silence
    decides, and then it is lost as silent (it may train on: it counts as the other side)."""
    coordinator, socket = _two_nodes_joined({"a": (), "b": ()})
    _running(coordinator)
    state, restarts = coordinator._state, coordinator._state.restart_count
    coordinator._connection_closed("b", answer, 2.0)
    assert sorted(state.group_ranks) == ["a", "b"] and state.restart_count == restarts
    assert not [m for _, m in socket.sent if m.body.TYPE == "recover"]
    state.last_seen["a"] = 1.0 + coordinator._liveness() + 0.5
    coordinator._tick(1.0 + coordinator._liveness() + 0.5)
    assert "b" not in state.group_ranks and state.gone == set()


def test_heartbeats_are_acked_a_few_times_per_node_timeout_not_each():
    """An agent needs a word from the coordinator within its node timeout, not an ack per
    heartbeat: a large job's heartbeats would cost the coordinator twice as much."""
    coordinator, socket = _two_nodes_joined({"a": (), "b": ()})
    _running(coordinator)
    state, t = coordinator._state, 10.0
    before = len(socket.sent)
    for _ in range(100):  # 10 s of heartbeats every 0.1 s, node_timeout 5 s
        coordinator._handle(b"b", Envelope(0, CONTROL["heartbeat"](
            node_id="b", phase="running", ranks=(), electorate_epoch=-1)), t)
        t += 0.1
    acks = [m for to, m in socket.sent[before:] if m.body.TYPE == "heartbeat_ack"]
    assert all(to == b"b" for to, m in socket.sent[before:])
    assert 8 <= len(acks) <= 9  # each within a quarter of the node timeout of the last: 1.2 s
    assert state.last_seen["b"] == t - 0.1, "every heartbeat still counts as a sign of life"


def test_one_encoding_of_an_ack_serves_node_after_node_and_none_takes_it_for_a_replay():
    """Acks share an encoding (each receiver checks sequence numbers on its own), but a node
    never gets one twice, nor one older than another message it got: it would drop it."""
    coordinator, socket = _two_nodes_joined({"a": (), "b": ()})
    _running(coordinator)

    def beat(node: str, now: float) -> bytes:
        coordinator._handle(node.encode(), Envelope(1, CONTROL["heartbeat"](
            node_id=node, phase="running", ranks=(), electorate_epoch=1)), now)
        (to, ack), body = socket.sent[-1], socket.bodies[-1]
        assert (to.decode(), ack.body.TYPE) == (node, "heartbeat_ack")
        return body

    assert beat("a", 10.0) == beat("b", 10.0), "one encoding for both"
    assert beat("a", 20.0) != beat("a", 30.0), "a node gets a new one each time"
    coordinator._handle(b"a", Envelope(1, CONTROL["durable"](node_id="a", rank=0, step=5)), 31.0)
    coordinator._handle(b"b", Envelope(1, CONTROL["durable"](node_id="b", rank=1, step=5)), 31.0)
    assert [m.body.TYPE for _, m in socket.sent[-2:]] == ["committed"] * 2  # newer than the ack
    b_acked = beat("b", 40.0)  # decoded by b: not the ack b got at 30 s, nor older than step 5's
    coordinator._state.epoch += 1  # what an ack says changed: so does the encoding
    assert beat("a", 40.0) != b_acked


def test_a_small_job_is_served_at_once_and_a_large_one_a_few_messages_a_wake_up():
    """A small job's failure reports are not held back; a large job's heartbeats (up to
    HEARTBEATS_PER_SECOND) are served about ten or more at a wake-up, never late by more
    than MAX_PACE."""
    from launcher.coordinator import MAX_PACE, pace
    from launcher.membership import HEARTBEATS_PER_SECOND

    assert pace(8) < 0.001
    assert pace(1024) * HEARTBEATS_PER_SECOND >= 10
    assert pace(16384) == MAX_PACE <= 0.02


@pytest.mark.parametrize(("nodes", "interval", "every_beat"), [
    (2, 0.5, False), (2, 2.4, True), (2048, 2.9, True), (4096, 0.5, False), (16384, 0.5, False)])
def test_an_agent_hears_an_ack_well_within_its_liveness_timeout(nodes, interval, every_beat):
    """Fewer acks must never make a live coordinator look lost to its agents: at the beat
    of a job of ``nodes`` with ``--heartbeat-interval`` ``interval``, no gap between acks
    reaches the liveness timeout. Beats just under half the timeout apart are each acked
    (acking every other left 4.8 s of a 5 s timeout without a word)."""
    acked, beat, liveness = _acked_beats(nodes, interval, first=10.0, livenesses=4)
    gaps = [b - a for a, b in zip(acked, acked[1:], strict=False)]
    assert len(acked) >= 4 and max(gaps) <= 0.7 * liveness, (beat, liveness, gaps)
    assert (len(acked) >= round(4 * liveness / beat)) == every_beat, (len(acked), beat, gaps)


@pytest.mark.parametrize("nodes", [2, 16384])
def test_the_beat_that_follows_an_assign_is_not_acked(nodes):
    """An assign is word from the coordinator, as an ack is: the node's first beat after it
    needs none (a 16,384-node round was followed by 16,384 acks), and the beats after are
    acked as always, well within the liveness timeout of the assign."""
    _, beat, _ = _acked_beats(nodes, 0.5, first=0.0, livenesses=0)
    acked, beat, liveness = _acked_beats(nodes, 0.5, first=1.1 + beat, livenesses=3)
    assert acked and acked[0] > 1.1 + beat, "the first beat after the assign (at 1.1)"
    heard = [1.1, *acked]
    assert max(b - a for a, b in zip(heard, heard[1:], strict=False)) <= 0.75 * liveness, \
        (beat, acked)


def _acked_beats(nodes: int, interval: float, first: float,
                 livenesses: int) -> tuple[list[float], float, float]:
    """A running round of two (assigned at 1.1) whose node b beats from ``first`` for that
    many liveness timeouts at the pace of a job of ``nodes`` with ``--heartbeat-interval``
    ``interval``: when it was acked, the beat and the liveness timeout."""
    from launcher.membership import beat_interval, liveness_timeout

    coordinator, socket = _two_nodes_joined({"a": (), "b": ()})
    _running(coordinator)
    state = coordinator._state
    state.max_nodes = nodes
    beat, liveness = beat_interval(interval, nodes), liveness_timeout(state.node_timeout, nodes)
    t, acked = first, []
    while t < first + livenesses * liveness:
        before = len(socket.sent)
        coordinator._handle(b"b", Envelope(1, CONTROL["heartbeat"](
            node_id="b", phase="running", ranks=(), electorate_epoch=-1)), t)
        acked += [t for _, m in socket.sent[before:] if m.body.TYPE == "heartbeat_ack"]
        t += beat
    return acked, beat, liveness


def test_a_large_job_heartbeats_less_often_and_waits_three_of_its_beats():
    from launcher.membership import (
        HEARTBEATS_PER_SECOND,
        MAX_BEAT_INTERVAL,
        beat_interval,
        liveness_timeout,
    )

    assert beat_interval(0.5, 2) == 0.5 and liveness_timeout(5.0, 2) == 5.0
    n = HEARTBEATS_PER_SECOND  # at 0.5 s: twice what the coordinator should hear
    assert n / beat_interval(0.5, n) == HEARTBEATS_PER_SECOND
    assert liveness_timeout(5.0, n) == 5.0, "three 1 s beats: still the node timeout"
    big = 16 * HEARTBEATS_PER_SECOND
    assert big / beat_interval(0.5, big) == HEARTBEATS_PER_SECOND
    assert liveness_timeout(5.0, big) == 3 * beat_interval(0.5, big)
    assert beat_interval(0.5, 1 << 30) == MAX_BEAT_INTERVAL
    assert beat_interval(2.0, 2) == 2.0, "never shorter than configured"


def test_a_large_jobs_coordinator_waits_three_of_its_beats_for_a_heartbeat():
    """A large job heartbeats less often: its coordinator does not take the silence between
    two beats for a lost node (a silent machine is found by TCP: see keep_alive)."""
    from launcher.membership import HEARTBEATS_PER_SECOND, liveness_timeout

    coordinator, socket = _two_nodes_joined({"a": (), "b": ()})
    _running(coordinator)
    state = coordinator._state
    state.max_nodes = 8 * HEARTBEATS_PER_SECOND  # a job that may grow that large
    wait = liveness_timeout(state.node_timeout, state.max_nodes)
    assert wait > state.node_timeout
    seen = state.last_seen["b"]
    coordinator._tick(seen + state.node_timeout + 1)
    assert "b" in state.group_ranks, "lost after the node timeout, between two of its beats"
    coordinator._tick(seen + wait + 0.1)
    assert "b" not in state.group_ranks


def _running_pair() -> tuple[Coordinator, CapturingSocket]:
    coordinator, socket = _two_nodes_joined({"a": (), "b": ()})
    coordinator._handle(b"a", Envelope(1, CONTROL["store_ready"](master_addr="10.0.0.1",
                                                                 master_port=29500)), 1.3)
    assert coordinator._state.phase == "running"
    return coordinator, socket


def _fail(coordinator, node: str, rank: int, cause: str, now: float) -> None:
    coordinator._handle(node.encode(), Envelope(1, CONTROL["failure"](
        node_id=node, rank=rank, local_rank=0, exit_code=None, signal="", cause=cause,
        step=30)), now)


def _recover_causes(socket) -> list[str]:
    return sorted({m.body.cause for _, m in socket.sent if m.body.TYPE == "recover"})


PEER_ERROR = "left its training function: raised RuntimeError: [gloo/transport/tcp/pair.cc:537] " \
             "Read error [127.0.0.1]:21169: Connection reset by peer"


def test_a_recovery_names_the_rank_that_died_not_the_peer_that_lost_its_connection():
    """A rank killed on one node resets its peers' collective connections: their node may
    report first, but the cause is the dead rank."""
    coordinator, socket = _running_pair()
    _fail(coordinator, "b", 1, PEER_ERROR, 2.0)
    coordinator._tick(2.1)
    assert coordinator._state.phase == "running"  # waits for the failure that caused it
    _fail(coordinator, "a", 0, "was killed by SIGSEGV", 2.2)
    assert _recover_causes(socket) == ["rank 0 (node a) was killed by SIGSEGV"]


def test_a_peer_error_alone_is_recovered_from_after_a_short_grace():
    coordinator, socket = _running_pair()
    _fail(coordinator, "b", 1, PEER_ERROR, 2.0)
    coordinator._tick(2.0 + coordinator_module.PEER_ERROR_GRACE / 2)
    assert _recover_causes(socket) == []
    coordinator._tick(2.0 + coordinator_module.PEER_ERROR_GRACE)
    assert _recover_causes(socket) == [f"rank 1 (node b) {PEER_ERROR}"]


def test_the_endpoints_running_coordinator_tells_a_node_it_lost_that_took_over_to_stand_down():
    """A node cut off by a partition takes the coordinator over for itself (from inside it
    every other node looks lost); once healed, its announcement reaches the endpoint, whose
    coordinator went on without it: the answer names the endpoint's coordinator. A member
    announcing (the endpoint's coordinator was frozen, not the others) gets no such answer."""
    coordinator, socket = _two_nodes_joined({"a": (), "b": ()})
    _running(coordinator)
    announcement = CONTROL["redirect"](coordinator_node="b", addr="10.0.0.2", port=4000)
    before = len(socket.sent)
    coordinator._handle(b"b-announcer", Envelope(1, announcement), 2.0)
    assert socket.sent[before:] == [], "b is still a member: no answer"
    coordinator._connection_closed("b", Verdict.DIED, 2.0)  # b lost; the job goes on without it, with c
    _join_round(coordinator, "c", seated_epoch=-1, now=2.1)
    _join_round(coordinator, "a", seated_epoch=1, now=2.1)
    coordinator._tick(2.2)
    assert sorted(coordinator._state.group_ranks) == ["a", "c"]
    before = len(socket.sent)
    coordinator._handle(b"b-announcer", Envelope(1, announcement), 2.5)
    answers = [m.body for to, m in socket.sent[before:] if to == b"b-announcer"]
    assert answers and answers[-1] == CONTROL["redirect"](coordinator_node="a", addr="", port=0)
    assert coordinator._state.redirect is None, "the endpoint's coordinator is not redirected"


def test_a_spare_joining_a_round_first_does_not_take_a_survivors_seat():
    """After a loss, the round waits for the last round's nodes: a spare that joins before
    one of them (it saw the coordinator go first) takes only a seat nobody expects."""
    coordinator, socket = _two_nodes_joined({"a": (), "b": ()})
    _running(coordinator)
    coordinator._recover_from("rank 0 (node b) exited with code 1", 2.0)  # a and b re-join
    state = coordinator._state
    _join_round(coordinator, "spare", seated_epoch=-1, now=2.1)
    assert "spare" not in state.round_joined, "both seats are the last round's"
    for node in ("b", "a"):
        _join_round(coordinator, node, seated_epoch=state.epoch, now=2.2)
    coordinator._tick(2.3)
    assert sorted(state.group_ranks) == ["a", "b"], "the spare waits"


def _join_round(coordinator: Coordinator, node: str, seated_epoch: int, now: float,
                electorate_epoch: int | None = None, seated_earlier: tuple[int, ...] = (),
                settled_below: int = -1) -> None:
    """``electorate_epoch``: of the assign (or spare word) it follows; by default the round
    it held a seat in."""
    coordinator._handle(node.encode(), Envelope(coordinator._state.epoch, CONTROL["join"](
        node_id=node, local_world_size=1, addr="10.0.0.9", standby_port=4000, rank_hint=-1,
        replica_port=0, held=(), restart_count=1, seated_earlier=seated_earlier,
        settled_below=settled_below, group_rank=-1, seated_epoch=seated_epoch,
        electorate_epoch=seated_epoch if electorate_epoch is None else electorate_epoch)), now)


def test_a_takeovers_survivors_not_named_by_the_assign_keep_their_seats():
    """A job of 20 nodes at its maximum loses the coordinator's node: the successor knows 15
    survivors by name (an assign names 16) and counts 19. Of two spares that join first, one
    takes the lost node's seat; the other must not take an unnamed survivor's, which says in
    its join that it held a seat in the last round. The round closes at MAX, none dropped."""
    nodes = [f"n{i:02}" for i in range(20)]
    state = JobState(min_nodes=1, max_nodes=20, max_restarts=3, policy="job", backoff=0.0,
                     backoff_max=1.0, exit_barrier_timeout=30.0, node_timeout=5.0,
                     last_call=1.0, join_timeout=60.0, host_node="n01", joining_since=1.0)
    state.epoch = 3
    state.expected_count = 19  # what ControlPlane.fail_over counts
    for rank, node in enumerate(nodes[1:coordinator_module.SUCCESSORS], start=1):
        state.group_ranks[node], state.standby_ports[node], state.last_seen[node] = rank, 4000, 1.0
    coordinator = Coordinator(CapturingSocket(), SECRET, state, "coordinator node n00 lost")
    for spare in ("s1", "s2"):
        _join_round(coordinator, spare, seated_epoch=-1, now=1.1)
    assert state.round_joined == {"s1"}, "one free seat: the lost node's"
    for node in nodes[1:]:
        _join_round(coordinator, node, seated_epoch=3, now=1.2)
    coordinator._tick(1.3)
    assert state.phase == "waiting_store", "MAX joined: the round closed"
    assert sorted(state.group_ranks) == [*nodes[1:], "s1"], "s2 waits; no survivor dropped"


@pytest.mark.parametrize("how", ["died", "left"])
def test_a_spare_lost_while_a_large_takeovers_round_forms_leaves_the_survivors_count(how):
    """20 nodes at their maximum lose the coordinator's; the successor counts 19 survivors,
    15 by name. A spare joins first (the lost node's seat), then dies or leaves before they
    come: it was no survivor, so the count stays 19 and the round waits for n19 too (it
    used to count 18, close without n19, who came back as a scale-up: one more round)."""
    nodes = [f"n{i:02}" for i in range(20)]
    coordinator = _large_takeover(nodes, 3, gone={"n00"})
    state = coordinator._state
    _join_round(coordinator, "s1", seated_epoch=-1, now=1.1)
    assert "s1" in state.round_joined
    if how == "died":
        coordinator._connection_closed("s1", Verdict.DIED, 1.15)
    else:
        coordinator._on_leaving("s1", CONTROL["leave"](node_id="s1", exit_code=143,
                                                       reason="SIGTERM"), 1.15)
    assert state.expected_count == 19
    for node in nodes[1:19]:
        _join_round(coordinator, node, seated_epoch=3, now=1.2)
    coordinator._tick(1.3)
    assert state.phase == "joining", "n19, a survivor, is still to come"
    _join_round(coordinator, "n19", seated_epoch=3, now=1.4)
    coordinator._tick(1.5)
    assert state.phase == "waiting_store" and sorted(state.group_ranks) == nodes[1:]


def test_an_unnamed_survivor_that_leaves_while_a_large_takeovers_round_forms_is_not_waited_for():
    """As above; n19, a survivor no assign named, joins and then is stopped (a pod
    deleted): the round closes once the 18 others are back, not at the last call."""
    nodes = [f"n{i:02}" for i in range(20)]
    coordinator = _large_takeover(nodes, 3, gone={"n00"})
    state = coordinator._state
    state.last_call = 30.0
    _join_round(coordinator, "n19", seated_epoch=3, now=1.1)
    coordinator._on_leaving("n19", CONTROL["leave"](node_id="n19", exit_code=143,
                                                    reason="SIGTERM"), 1.15)
    for node in nodes[1:19]:
        _join_round(coordinator, node, seated_epoch=3, now=1.2)
    coordinator._tick(1.3)
    assert state.phase == "waiting_store" and sorted(state.group_ranks) == nodes[1:19]


def _large_takeover(nodes: list[str], epoch: int, **fields) -> Coordinator:
    """n01's coordinator, taking over ``nodes``' job from n00 at ``epoch`` as
    ControlPlane.fail_over starts it: it knows the 16 first by name, counts the others."""
    named = nodes[:coordinator_module.SUCCESSORS]
    state = JobState(min_nodes=1, max_nodes=len(nodes), max_restarts=3, policy="job",
                     backoff=0.0, backoff_max=1.0, exit_barrier_timeout=30.0, node_timeout=5.0,
                     last_call=1.0, join_timeout=60.0, host_node="n01", joining_since=1.0,
                     epoch=epoch, expected_count=len(nodes) - 1, electorate=len(nodes),
                     electorate_epoch=epoch, voters=set(named), **fields)
    for rank, node in enumerate(named[1:], start=1):
        state.group_ranks[node], state.standby_ports[node], state.last_seen[node] = rank, 4000, 1.0
    return Coordinator(CapturingSocket(), SECRET, state, "coordinator node n00 lost")


def test_a_large_takeovers_survivors_keep_their_group_ranks_whatever_their_node_ids():
    """40 nodes whose group ranks past the 16 an assign names are not in node-id order (the
    job replaced or added nodes: a newcomer takes the last seat) lose the coordinator's
    node. Each survivor's join says its seat; the successor keeps their order, so each
    node's ranks move only as far as the lost seat shifts them (its own shards, or its
    predecessor's copies, which it holds: no pulls). Ordered by node id, the 24 would have
    been reversed."""
    nodes = [f"n{i:02}" for i in range(16)] + [f"m{99 - i}" for i in range(16, 40)]
    coordinator = _large_takeover(nodes, 3, gone={"n00"})
    state = coordinator._state
    for rank, node in enumerate(nodes[1:], start=1):
        coordinator._handle(node.encode(), Envelope(3, CONTROL["join"](
            node_id=node, local_world_size=1, addr="10.0.0.9", standby_port=4000, rank_hint=-1,
            replica_port=0, held=(), restart_count=1, seated_earlier=(), settled_below=-1,
            seated_epoch=3, group_rank=rank, electorate_epoch=3)), 1.2)
    coordinator._tick(2.5)
    assert state.phase == "waiting_store"
    assert sorted(state.group_ranks, key=state.group_ranks.get) == nodes[1:]


def test_the_round_after_a_large_takeover_counts_the_survivors_that_said_they_held_seats():
    """40 nodes lose the coordinator's: its successor knows 16 by name (the assign's) and the
    others by their joins, which say they held a seat in the last round. The round after
    (a node lost) counts that round as an earlier electorate until most of it learnt the
    new one: by all 39 survivors, not by the 16 names (15 of 40 back: held until the join
    timeout, the job lost)."""
    nodes = [f"n{i:02}" for i in range(40)]
    coordinator = _large_takeover(nodes, 3, gone={"n00"})
    state = coordinator._state
    for node in nodes[1:]:
        _join_round(coordinator, node, seated_epoch=3, now=1.2)
    coordinator._tick(2.5)
    assert state.phase == "waiting_store" and len(state.group_ranks) == 39
    _running(coordinator)
    for node in nodes[1:]:
        _beat(coordinator, node, electorate_epoch=4, now=3.0)
    _silent_but(coordinator, nodes[1:-1], 9.0)  # n39 lost
    for node in nodes[1:-1]:
        _join_round(coordinator, node, seated_epoch=4, now=9.1)
    _silent_but(coordinator, nodes[1:-1], 10.5)
    assert state.phase == "waiting_store" and state.epoch == 5, "the round after was held"


@pytest.mark.parametrize("old_side_back", [False, True])
def test_a_large_jobs_successor_counts_the_round_before_by_the_seats_its_nodes_report(
        old_side_back, caplog):
    """20 nodes scaled up to 41; n00 lost in the heartbeat after the close, and a partition
    holds n06-n19, their assigns not come: by the round before they are 14 of 20, and train.
    n01 takes over, knowing the 16 first by name (its assign named the round before in one
    row, 20 voters unnamed): n01-n05 and the 21 newcomers are 26 of the new 41, yet only the
    five that say in their join they held a seat in the round before count for it: held.
    With n06-n19 back (saying so too) the round goes on."""
    import logging

    from launcher.membership import Electorate

    old, new = [f"n{i:02}" for i in range(20)], [f"n{i:02}" for i in range(20, 41)]
    coordinator = _large_takeover([*old, *new], 3, wins_tie=False,  # n00 silent: cut off
                                  earlier=[Electorate(2, 20, frozenset())])
    state = coordinator._state
    back = old[1:] if old_side_back else old[1:6]
    with caplog.at_level(logging.WARNING, logger="ftlaunch.coordinator"):
        for node in back:
            _join_round(coordinator, node, seated_epoch=3, seated_earlier=(2,), now=1.2)
        for node in new:
            _join_round(coordinator, node, seated_epoch=3, now=1.2)
        _silent_but(coordinator, [*back, *new], 2.5)
        _silent_but(coordinator, [*back, *new], 4.0)
    if old_side_back:
        assert state.phase == "waiting_store" and state.epoch == 4
    else:
        assert has_quorum(20, 14, 0, wins_tie=False), "n06-n19 train, by the round before"
        assert state.phase == "joining", "both sides of a partition train"
        assert "5 of the round of epoch 2's (most not yet told of the next) 20 nodes" \
            in caplog.text


@pytest.mark.parametrize("joins_say", ["every seat", "the last two", "settled"])
def test_a_large_jobs_successor_counts_each_earlier_round_its_nodes_report(joins_say, caplog):
    """20 nodes scaled up to 21, then to 22, before most heard of either round (at 16,384
    nodes a node beats every 16 s); then n00, the coordinator, is lost. Its successor n01
    knows the rounds of epochs 2 and 3 by size only. The survivors' joins say every round
    they held a seat in since the oldest not settled: the round closes. Had they said only
    their last two (as joins did), nobody would have said so of epoch 2's: held to the join
    timeout. Had their coordinator told them those rounds were settled, n01 counts them no
    more."""
    import logging

    from launcher.membership import Electorate

    nodes = [f"n{i:02}" for i in range(22)]
    coordinator = _large_takeover(nodes, 4, wins_tie=False,  # n00 silent: cut off
                                  earlier=[Electorate(2, 20, frozenset()),
                                           Electorate(3, 21, frozenset())])
    state = coordinator._state
    with caplog.at_level(logging.WARNING, logger="ftlaunch.coordinator"):
        for i, node in enumerate(nodes[1:], start=1):
            seats = [e for e, size in ((2, 20), (3, 21)) if i < size]  # n20 came at 3, n21 at 4
            if joins_say == "the last two":
                seats = seats[-1:]
            _join_round(coordinator, node, seated_epoch=4, now=1.2,
                        seated_earlier=() if joins_say == "settled" else tuple(seats),
                        settled_below=4 if joins_say == "settled" else 2)
        _silent_but(coordinator, nodes[1:], 2.5)
        _silent_but(coordinator, nodes[1:], 4.0)
    if joins_say == "the last two":
        assert state.phase == "joining"
        assert "0 of the round of epoch 2's (most not yet told of the next) 20 nodes" \
            in caplog.text
    else:
        assert state.phase == "waiting_store" and state.epoch == 5, "the round was held"
        assert len(state.group_ranks) == 21


def test_a_fresh_endpoint_coordinator_keeps_the_successor_of_the_newest_epoch():
    """The endpoint's node itself was cut off and took over from inside the partition while
    the job went on (rounds, epochs) under a successor: both announce themselves at the
    endpoint. The one behind is told to stand down; the agents stay sent to the other."""
    coordinator, socket = _fresh()
    ahead = CONTROL["redirect"](coordinator_node="p1", addr="10.0.0.2", port=4000)
    behind = CONTROL["redirect"](coordinator_node="p0", addr="10.0.0.1", port=4001)
    coordinator._handle(b"p1-announcer", Envelope(7, ahead), 1.0)
    coordinator._handle(b"p0-announcer", Envelope(4, behind), 1.1)
    assert coordinator._state.redirect == ahead
    assert socket.sent[-1] == (b"p0-announcer", Envelope(0, CONTROL["redirect"](
        coordinator_node="p1", addr="", port=0)))
    coordinator._handle(b"p1-announcer", Envelope(7, ahead), 1.2)
    assert coordinator._state.redirect == ahead, "no flip-flop between the two"


def test_a_late_joiner_takes_the_seat_it_opened_before_an_idle_spare():
    """Found by the state machine: n1 idles as a spare (its round closed without it) when n2
    joins and the job scales up by one seat; n2 gets it, not n1 as well (4 nodes of MAX 3)."""
    m = CoordinatorMachine()
    m.join(node="n1", size=1)
    m.time_passes(dt=1.5)  # n1 alone: last call
    m.join(node="n0", size=1)  # scale up to 2; n1 never re-joins
    m.join(node="n3", size=1)
    m.time_passes(dt=1.5)  # n0 and n3 seated at last call; n1 idles
    m.join(node="n2", size=1)  # scale up to 3
    m.join(node="n0", size=1)
    m.join(node="n3", size=1)
    m.time_passes(dt=0.1)
    assert m.state.phase == "waiting_store"
    assert sorted(m.state.group_ranks) == ["n0", "n2", "n3"]


def test_a_member_that_joins_again_without_its_seat_is_sent_its_assign_again():
    """Chaos (3 nodes, seed 1332): a cut-off node's join, held up by the partition, reached
    the successor late and put the node in the takeover's round; its assign went to the
    connection that join came on, which the node had left. Its join on the new one was taken
    for a duplicate: it never started and the job waited for its ranks for good."""
    coordinator, socket = _two_nodes_joined({"a": (), "b": ()})
    state = coordinator._state
    first = {to: m.body for to, m in socket.sent if isinstance(m.body, Assign)}

    def sent_to(identity: bytes) -> list[str]:
        return [m.body.TYPE for to, m in socket.sent if to == identity]

    _join_round(coordinator, "b", seated_epoch=state.epoch, now=1.2)  # it has its seat
    assert sent_to(b"b") == ["assign"]
    coordinator._handle(b"b-again", Envelope(state.epoch, CONTROL["join"](
        node_id="b", local_world_size=1, addr="10.0.0.2", standby_port=4000, rank_hint=-1,
        replica_port=4101, held=(), restart_count=0, seated_earlier=(), settled_below=-1, group_rank=-1, seated_epoch=-1, electorate_epoch=-1)), 1.25)
    assert [m.body for to, m in socket.sent if to == b"b-again"] == [first[b"b"]]
    _running(coordinator)
    coordinator._handle(b"b-third", Envelope(state.epoch, CONTROL["join"](
        node_id="b", local_world_size=1, addr="10.0.0.2", standby_port=4000, rank_hint=-1,
        replica_port=4101, held=(), restart_count=0, seated_earlier=(), settled_below=-1, group_rank=-1, seated_epoch=0, electorate_epoch=0)), 1.4)
    assert sent_to(b"b-third") == ["assign", "start"], "started already: the start as well"
    assert sorted(state.group_ranks) == ["a", "b"] and state.phase == "running"


def test_an_endpoint_cut_off_from_every_node_follows_the_successor_the_job_went_on_under():
    """Chaos (coordinator-partition): the endpoint's own node was cut off; the others failed
    over to the successor and went on. Healed, the endpoint's coordinator, left with no node
    but its own, hears the successor announce itself: it sends its agents there, and
    whoever comes later, even at a tied epoch (seed 313: cut off, it had closed a round with
    a spare it had not yet found silent). An announcer behind it is told to stand down, and
    once it redirects, told where the job runs; one of the same epoch as the successor it
    sends agents to is that successor's own successor (it takes over at its epoch): it wins."""
    coordinator, socket = _two_nodes_joined({"a": (), "b": ()})
    _running(coordinator)
    state = coordinator._state
    coordinator._connection_closed("b", Verdict.DIED, 2.0)  # cut off: b is lost, a is alone
    assert set(state.group_ranks) == {"a"} and state.epoch == 1

    def answers(to: bytes, after: int) -> list[object]:
        return [m.body for who, m in socket.sent[after:] if who == to]

    before = len(socket.sent)
    coordinator._handle(b"z-announcer", Envelope(0, CONTROL["redirect"](
        coordinator_node="z", addr="10.0.0.9", port=4000)), 2.5)
    assert answers(b"z-announcer", before) == [CONTROL["redirect"](
        coordinator_node="a", addr="", port=0)] and state.redirect is None, "z is behind"
    tied = CONTROL["redirect"](coordinator_node="b", addr="10.0.0.2", port=4000)
    before = len(socket.sent)
    coordinator._handle(b"b-announcer", Envelope(1, tied), 3.0)
    assert state.redirect == tied and answers(b"a", before) == [tied], "its agents go there"
    before = len(socket.sent)
    coordinator._handle(b"c-announcer", Envelope(0, CONTROL["redirect"](
        coordinator_node="c", addr="10.0.0.3", port=4000)), 3.5)
    assert answers(b"c-announcer", before) == [CONTROL["redirect"](
        coordinator_node="b", addr="", port=0)], "behind: told where the job runs"
    took_over = CONTROL["redirect"](coordinator_node="e", addr="10.0.0.5", port=4000)
    coordinator._handle(b"e-announcer", Envelope(1, took_over), 3.6)
    assert state.redirect == took_over, "b's successor took over at b's epoch: it wins"
    _join_round(coordinator, "d", seated_epoch=-1, now=4.0)
    assert answers(b"d", before) == [took_over], "a newcomer is sent there too"


def test_a_successor_sends_no_agent_to_an_announcer_of_an_older_epoch():
    """Chaos (seed 3011): b, healed after a partition, waited as a spare while c and then d
    ran the job; c had announced itself to b's standby socket, where nothing reads until b
    takes over. d lost, b takes over at the job's epoch and finds c's announcements queued:
    c is dead and behind, not where the job runs (its agent followed c and waited 2 s for
    it to go silent)."""
    state = JobState(min_nodes=1, max_nodes=2, max_restarts=5, policy="rank", backoff=0.0,
                     backoff_max=0.0, exit_barrier_timeout=30.0, node_timeout=5.0,
                     last_call=0.5, join_timeout=60.0, host_node="b", joining_since=0.0,
                     epoch=5, group_ranks={"b": 1}, expected_count=1, electorate=2,
                     electorate_epoch=5, voters={"b", "d"}, gone={"d"})
    socket = CapturingSocket()
    coordinator = Coordinator(socket, SECRET, state, takeover_cause="d lost")
    stale = CONTROL["redirect"](coordinator_node="c", addr="10.0.0.3", port=4000)
    coordinator._handle(b"c-announcer", Envelope(2, stale), 1.0)
    assert state.redirect is None
    assert [(to, m.body) for to, m in socket.sent if m.body.TYPE == "redirect"] == [
        (b"c-announcer", CONTROL["redirect"](coordinator_node="b", addr="", port=0))]


def test_two_successors_announcing_at_one_epoch_do_not_send_the_endpoints_agents_back_and_forth():
    """Chaos (2 nodes, seed 1611): after a heal, a held successor and the cut-off coordinator
    it took over from both announced themselves at the endpoint, at one epoch, every tick;
    the endpoint redirected its agents to each in turn for a second. It keeps the one it
    follows while that one announces; the other wins once the first goes quiet."""
    coordinator, socket = _two_nodes_joined({"a": (), "b": ()})
    _running(coordinator)
    coordinator._connection_closed("b", Verdict.DIED, 2.0)  # a alone
    first = CONTROL["redirect"](coordinator_node="b", addr="10.0.0.2", port=4000)
    second = CONTROL["redirect"](coordinator_node="c", addr="10.0.0.3", port=4000)
    for i in range(10):
        coordinator._handle(b"b-announcer", Envelope(1, first), 3.0 + i * 0.05)
        coordinator._handle(b"c-announcer", Envelope(1, second), 3.01 + i * 0.05)
    assert coordinator._state.redirect == first
    assert sum(m.body == second for _, m in socket.sent) == 0, "no agent sent to c"
    coordinator._handle(b"c-announcer", Envelope(1, second), 3.45 + FOLLOWED_QUIET)
    assert coordinator._state.redirect == second, "b went quiet: c runs the job"


def test_a_spare_silent_for_half_the_liveness_timeout_is_not_seated_until_it_speaks():
    """Chaos (coordinator-partition, seed 1436): the coordinator's node, cut off, found one
    node lost and closed the next round at once with spares as silent as the rest of the
    job, not yet found lost; its epoch then matched the job's and it never stood down. A
    spare silent for half the liveness timeout takes no seat; once it speaks, it does."""
    coordinator, socket = _two_nodes_joined({"a": (), "b": ()})
    _running(coordinator)
    state = coordinator._state
    spare = CONTROL["join"](node_id="s", local_world_size=1, addr="10.0.0.3", standby_port=4000,
                            rank_hint=-1, replica_port=4102, held=(), restart_count=0,
                            seated_earlier=(), settled_below=-1, group_rank=-1, seated_epoch=-1, electorate_epoch=-1)
    coordinator._handle(b"s", Envelope(1, spare), 1.4)
    liveness = coordinator._liveness()
    later = 1.4 + liveness / 2 + 0.1  # s silent since 1.4; a beats on
    state.last_seen["a"] = later
    coordinator._connection_closed("b", Verdict.DIED, later)  # b gone: its seat is free
    assert state.phase == "joining" and "s" not in state.round_joined
    coordinator._tick(later + 0.05)
    assert state.phase == "joining", "the round must not close with a silent spare"
    coordinator._handle(b"s", Envelope(1, CONTROL["heartbeat"](node_id="s", phase="joining",
                                                               ranks=(), electorate_epoch=-1)), later + 0.1)
    _join_round(coordinator, "a", seated_epoch=1, now=later + 0.1)
    coordinator._tick(later + 0.2)
    assert state.phase == "waiting_store" and sorted(state.group_ranks) == ["a", "s"]


def _elastic_job(nodes: str) -> Coordinator:
    """A job of --nnodes 1:N running its first round on these nodes (the first hosts)."""
    state = JobState(min_nodes=1, max_nodes=len(nodes), max_restarts=5, policy="rank",
                     backoff=0.0, backoff_max=0.0, exit_barrier_timeout=30.0, node_timeout=5.0,
                     last_call=0.5, join_timeout=60.0, host_node=nodes[0], joining_since=0.0)
    coordinator = Coordinator(CapturingSocket(), SECRET, state)
    for node in nodes:
        _join_round(coordinator, node, seated_epoch=-1, now=1.0)
    coordinator._tick(1.1)
    _running(coordinator)
    assert sorted(state.group_ranks) == list(nodes)
    return coordinator


def _silent_but(coordinator: Coordinator, heard: str, now: float) -> None:
    """Time passes; only the nodes in ``heard`` are heard from."""
    for node in heard:
        coordinator._seen(node, now)
    coordinator._tick(now)


def test_a_partition_leaves_the_round_to_the_side_with_most_of_its_nodes(caplog):
    """1:3, and b and c go silent together: they may be alive on the other side of a
    partition, where two of the round's three nodes may go on. a alone is MIN, yet holds its
    round; one of them back is a majority here."""
    import logging

    coordinator = _elastic_job("abc")
    state = coordinator._state
    with caplog.at_level(logging.WARNING, logger="ftlaunch.coordinator"):
        _silent_but(coordinator, "a", 7.0)
        assert state.phase == "joining" and state.gone == set()
        _join_round(coordinator, "a", seated_epoch=1, now=7.1)
        _silent_but(coordinator, "a", 9.0)  # well past the last call
    assert state.phase == "joining", "a minority closed a round"
    assert "rendezvous round held: 1 of the last round's 3 nodes here, 2 may go on" \
        in caplog.text
    _join_round(coordinator, "b", seated_epoch=1, now=9.1)  # healed: b was dropped, joins
    _silent_but(coordinator, "ab", 9.7)
    assert state.phase == "waiting_store" and sorted(state.group_ranks) == ["a", "b"]
    assert (state.electorate, state.back) == (2, set()), "a new round: its own count"


def test_nodes_not_yet_found_silent_are_not_counted_on_our_side():
    """1:3, and a's ranks fail (stuck in a collective with b and c, cut off) before b and c
    are found silent: the round must not close with a alone on the strength of nodes that
    only have not timed out yet (b's side, taking over, would count them too). Heard from
    since the round opened, one is with us."""
    coordinator = _elastic_job("abc")
    state = coordinator._state
    _silent_but(coordinator, "abc", 1.9)  # their last beats before the cut
    coordinator._recover_from("rank 0 (node a) hung", 2.0)
    _join_round(coordinator, "a", seated_epoch=1, now=2.1)
    _silent_but(coordinator, "a", 3.0)
    assert state.phase == "joining" and state.back == {"a"}
    _join_round(coordinator, "b", seated_epoch=1, now=3.1)
    _silent_but(coordinator, "abc", 3.7)
    assert state.phase == "waiting_store" and sorted(state.group_ranks) == ["a", "b"]


def test_nodes_whose_agents_died_count_for_no_side():
    """Closed connections (dead agent processes, their machines still answering) are no
    partition: one node of three goes on."""
    coordinator = _elastic_job("abc")
    state = coordinator._state
    coordinator._connection_closed("b", Verdict.DIED, 2.0)
    coordinator._connection_closed("c", Verdict.DIED, 2.0)
    assert state.gone == {"b", "c"}
    _join_round(coordinator, "a", seated_epoch=1, now=2.1)
    _silent_but(coordinator, "a", 2.7)
    assert state.phase == "waiting_store" and list(state.group_ranks) == ["a"]


def test_half_the_round_goes_on_on_the_side_that_ran_it():
    """1:2 and the other node silent: a tie, which the coordinator of the round wins (its
    successor, on the other side, does not: see the next test)."""
    coordinator = _elastic_job("ab")
    state = coordinator._state
    _silent_but(coordinator, "a", 7.0)
    assert state.phase == "joining" and state.gone == set()
    _join_round(coordinator, "a", seated_epoch=1, now=7.1)
    _silent_but(coordinator, "a", 7.7)
    assert state.phase == "waiting_store" and list(state.group_ranks) == ["a"]


@pytest.mark.parametrize("predecessor", ["silent", "died"])
def test_a_successor_takes_half_the_round_only_if_its_predecessor_died(predecessor):
    """b takes over a 1:2 job from a. a's process died (its connection closed while heard
    from): b goes on alone. a went silent: it may train on, cut off, and wins the tie."""
    silent = predecessor == "silent"
    state = JobState(min_nodes=1, max_nodes=2, max_restarts=5, policy="rank", backoff=0.0,
                     backoff_max=0.0, exit_barrier_timeout=30.0, node_timeout=5.0,
                     last_call=0.5, join_timeout=60.0, host_node="b", joining_since=0.0,
                     epoch=1, group_ranks={"b": 1}, expected_count=1, electorate=2,
                     electorate_epoch=1, gone=set() if silent else {"a"}, wins_tie=not silent)
    coordinator = Coordinator(CapturingSocket(), SECRET, state, takeover_cause="a lost")
    _join_round(coordinator, "b", seated_epoch=1, now=time.monotonic())
    coordinator._tick(time.monotonic() + 1.0)
    assert (state.phase == "joining") is silent


def test_a_successor_counts_survivors_its_assign_did_not_name():
    """A 1:40 job's successor knows 16 of the round's nodes by name: the others count as
    back by the round they say they held a seat in; a newcomer does not count."""
    nodes = [f"n{i:02}" for i in range(40)]
    state = JobState(min_nodes=1, max_nodes=41, max_restarts=5, policy="rank", backoff=0.0,
                     backoff_max=0.0, exit_barrier_timeout=30.0, node_timeout=5.0,
                     last_call=0.5, join_timeout=60.0, host_node="n01", joining_since=0.0,
                     epoch=4, group_ranks={n: i for i, n in enumerate(nodes[1:16], 1)},
                     expected_count=39, electorate=40, electorate_epoch=4, wins_tie=False)
    coordinator = Coordinator(CapturingSocket(), SECRET, state, takeover_cause="n00 lost")
    now = time.monotonic()
    for node in nodes[1:20]:  # 19 of 40 back, n00 silent: 20 may be on the other side
        _join_round(coordinator, node, seated_epoch=4, now=now)
    _join_round(coordinator, "new", seated_epoch=-1, now=now)
    coordinator._tick(now + 1.0)
    assert state.phase == "joining" and len(state.back) == 19
    _join_round(coordinator, "n20", seated_epoch=4, now=now + 1.1)  # 20 of 40, no tie
    _join_round(coordinator, "n21", seated_epoch=4, now=now + 1.1)
    coordinator._tick(now + 2.0)
    assert state.phase == "waiting_store" and "new" in state.group_ranks


def test_a_rounds_idle_spares_vote_on_the_next():
    """1:2 on a and b, with a spare s. a's machine goes silent: b's side (b and s) is two
    of the three, and goes on; a, cut off alone, holds its round though it is MIN (without
    the spare's vote, a's side would win the tie and b's hold: the job stalled on a machine
    gone for good, the common case of a lost coordinator's node)."""
    coordinator = _elastic_job("ab")
    state = coordinator._state
    _join_round(coordinator, "s", seated_epoch=-1, now=1.2)  # after the round: waits
    coordinator._connection_closed("b", Verdict.DIED, 1.5)  # b's agent died: s takes its seat
    _join_round(coordinator, "a", seated_epoch=1, now=1.6)
    _silent_but(coordinator, "as", 2.2)
    assert state.phase == "waiting_store" and sorted(state.group_ranks) == ["a", "s"]
    _join_round(coordinator, "t", seated_epoch=-1, now=2.3)  # a new spare
    _running(coordinator)
    assert state.electorate == 2, "t came after the round closed: it does not vote on it"
    coordinator._recover_from("rank 1 (node s) hung", 2.5)
    _join_round(coordinator, "a", seated_epoch=2, now=2.6)
    _join_round(coordinator, "s", seated_epoch=2, now=2.6)
    _silent_but(coordinator, "ast", 3.2)
    assert state.electorate == 3 and [spare.node_id for spare in state.spares] == ["t"]
    _running(coordinator)
    _silent_but(coordinator, "a", 9.0)  # s and t cut off with the rest of the network
    _join_round(coordinator, "a", seated_epoch=3, now=9.1)
    _silent_but(coordinator, "a", 10.0)
    assert state.phase == "joining", "one of three held a round"


@pytest.mark.parametrize("spare_with_us", [True, False])
def test_a_successor_with_the_rounds_spare_has_a_majority(spare_with_us):
    """b takes over from a, silent, with the round's spare s named in its last assign: b
    and s are two of three. Without s, b holds (a tie it does not win)."""
    state = JobState(min_nodes=1, max_nodes=2, max_restarts=5, policy="rank", backoff=0.0,
                     backoff_max=0.0, exit_barrier_timeout=30.0, node_timeout=5.0,
                     last_call=0.5, join_timeout=60.0, host_node="b", joining_since=0.0,
                     epoch=1, group_ranks={"b": 1}, expected_count=1, electorate=3,
                     electorate_epoch=1, voters={"a", "b", "s"}, wins_tie=False)
    coordinator = Coordinator(CapturingSocket(), SECRET, state, takeover_cause="a lost")
    now = time.monotonic()
    _join_round(coordinator, "b", seated_epoch=1, now=now)
    if spare_with_us:
        _join_round(coordinator, "s", seated_epoch=-1, now=now)
    coordinator._tick(now + 1.0)
    assert (state.phase == "joining") is not spare_with_us


def test_an_earlier_rounds_node_that_died_counts_gone_in_every_round_after(caplog):
    """Chaos seed 2701 (1:2, FSDP): a's round of epoch 1 on a and b never settles (a died
    before it learnt the next). b took over with s, then died too; s takes over, its round
    of epoch 3 closes with t (a and b gone, none away). A rank restart then opens another
    round: b's death, learnt as the last round closed, must still count there, else the
    round waits for b as if it might train behind a partition, and the job fails."""
    import logging

    state = JobState(min_nodes=1, max_nodes=2, max_restarts=5, policy="rank", backoff=0.0,
                     backoff_max=0.0, exit_barrier_timeout=30.0, node_timeout=5.0,
                     last_call=0.5, join_timeout=60.0, host_node="s", joining_since=0.0,
                     epoch=2, group_ranks={"s": 1}, expected_count=1, electorate=3,
                     electorate_epoch=2, voters={"b", "s", "t"}, gone={"b"}, wins_tie=True,
                     earlier=[Electorate(1, 2, frozenset("ab"), frozenset("a"))])
    coordinator = Coordinator(CapturingSocket(), SECRET, state, takeover_cause="b lost")
    _join_round(coordinator, "s", seated_epoch=2, now=1.0)
    _join_round(coordinator, "t", seated_epoch=-1, now=1.0, electorate_epoch=2)
    _silent_but(coordinator, "st", 1.6)
    _running(coordinator)
    assert state.epoch == 3 and sorted(state.group_ranks) == ["s", "t"]
    assert [e.epoch for e in state.earlier] == [1, 2], "a and b never learnt epoch 3"
    coordinator._recover_from("rank 0 (node s) hung", 2.0)
    with caplog.at_level(logging.WARNING, logger="ftlaunch.coordinator"):
        for node in "st":
            _join_round(coordinator, node, seated_epoch=3, now=2.1)
        _silent_but(coordinator, "st", 2.7)
    assert "round held" not in caplog.text
    assert state.epoch == 4 and state.phase == "waiting_store"
    assert {(v.epoch, v.node_id, v.gone) for v in state.assigns["t"].earlier} >= {
        (1, "a", True), (1, "b", True)}, "its successor is told b is gone too"


def test_an_earlier_round_whose_nodes_all_died_holds_no_successor_back():
    """After the test above, s's machine goes silent and t takes over (the tie is not its:
    s may train on). t and the spare u are two of the last round's three: a majority. The
    round of epoch 1 (a and b, both dead) is not settled and never will be; none of it can
    count by it anywhere, so it must not hold t's round as a tie t does not win."""
    state = JobState(min_nodes=1, max_nodes=2, max_restarts=5, policy="rank", backoff=0.0,
                     backoff_max=0.0, exit_barrier_timeout=30.0, node_timeout=5.0,
                     last_call=0.5, join_timeout=60.0, host_node="t", joining_since=0.0,
                     epoch=3, group_ranks={"t": 1}, expected_count=1, electorate=3,
                     electorate_epoch=3, voters={"s", "t", "u"}, wins_tie=False,
                     earlier=[Electorate(1, 2, frozenset("ab"), frozenset("ab"))])
    coordinator = Coordinator(CapturingSocket(), SECRET, state, takeover_cause="s lost")
    _join_round(coordinator, "t", seated_epoch=3, now=1.0)
    _join_round(coordinator, "u", seated_epoch=-1, now=1.0, electorate_epoch=3)
    _silent_but(coordinator, "tu", 1.6)
    assert state.phase == "waiting_store" and sorted(state.group_ranks) == ["t", "u"]


def _beat(coordinator: Coordinator, node: str, electorate_epoch: int, now: float) -> None:
    coordinator._handle(node.encode(), Envelope(coordinator._state.epoch, CONTROL["heartbeat"](
        node_id=node, phase="running", ranks=(), electorate_epoch=electorate_epoch)), now)


@pytest.mark.parametrize("told", [False, True])
def test_a_round_counts_the_electorate_before_until_most_of_it_learnt_the_new(told, caplog):
    """1:5 on a, b, c scales up to five: d and e join, and the round closes. b and c are cut
    off before their assigns reach them (the milliseconds between a round's close and its
    assign): on their side they count by the round before, a, b and c, of which they are
    two, a majority. a, d and e are three of the new five: the round that replaces b and c
    must not close on that alone (both sides would train), but wait for a majority of the
    round before too. Had b and c said they learnt the new round first, they would count
    by it (two of five) and for no coordinator still on the old one: a, d and e go on."""
    import logging

    state = JobState(min_nodes=1, max_nodes=5, max_restarts=5, policy="rank", backoff=0.0,
                     backoff_max=0.0, exit_barrier_timeout=30.0, node_timeout=5.0,
                     last_call=0.5, join_timeout=60.0, host_node="a", joining_since=0.0)
    coordinator = Coordinator(CapturingSocket(), SECRET, state)
    for node in "abc":
        _join_round(coordinator, node, seated_epoch=-1, now=1.0)
    coordinator._tick(1.6)  # the last call
    _running(coordinator)
    assert state.epoch == 1 and sorted(state.group_ranks) == ["a", "b", "c"]
    _join_round(coordinator, "d", seated_epoch=-1, now=2.0)  # a scale-up
    _join_round(coordinator, "e", seated_epoch=-1, now=2.0)
    for node in "abc":
        _join_round(coordinator, node, seated_epoch=1, now=2.1)
    coordinator._tick(2.2)
    _running(coordinator)
    assert state.epoch == 2 and (state.electorate, len(state.earlier)) == (5, 1)
    assert {(v.epoch, v.size, v.node_id) for v in state.assigns["d"].earlier} == {
        (1, 3, "a"), (1, 3, "b"), (1, 3, "c")}, "a successor is told to count it too"
    for node in "de":
        _beat(coordinator, node, electorate_epoch=2, now=2.5)
    if told:
        for node in "bc":
            _beat(coordinator, node, electorate_epoch=2, now=2.5)
    coordinator._tick(2.6)
    assert coordinator._settled_below == (2 if told else 1), "what its acks say"
    with caplog.at_level(logging.WARNING, logger="ftlaunch.coordinator"):
        _silent_but(coordinator, "ade", 9.0)  # b and c lost, silent: maybe cut off
        for node in "ade":
            _join_round(coordinator, node, seated_epoch=2, now=9.1)
        _silent_but(coordinator, "ade", 9.7)
    assert has_quorum(3, 2, 0, wins_tie=False), "b and c on their side, by the old round"
    if told:
        assert state.phase == "waiting_store" and sorted(state.group_ranks) == ["a", "d", "e"]
        assert [e.epoch for e in state.earlier] == [2], "epoch 1's settled, 2's now counts"
    else:
        assert state.phase == "joining", "both sides of a partition closed a round"
        assert "rendezvous round held: 1 of the round of epoch 1's (most not yet told of " \
            "the next) 3 nodes here, 2 may go on behind a partition" in caplog.text
        _join_round(coordinator, "b", seated_epoch=1, now=9.8)  # healed: b is back
        _silent_but(coordinator, "abde", 10.4)
        assert state.phase == "waiting_store" and sorted(state.group_ranks) == list("abde")


@pytest.mark.parametrize("learnt_the_next", [False, True])
def test_a_coordinator_on_an_old_electorate_counts_no_node_that_learnt_a_newer(learnt_the_next):
    """b took over from a, silent, knowing the round of epoch 1 on a, b and c. c joins it,
    one of three more: a majority with b. Unless c says it learnt a later round (b's assign
    of it never came): then c counts by that round, not by b's, where the coordinator's
    side may count it too."""
    state = JobState(min_nodes=1, max_nodes=3, max_restarts=5, policy="rank", backoff=0.0,
                     backoff_max=0.0, exit_barrier_timeout=30.0, node_timeout=5.0,
                     last_call=0.5, join_timeout=60.0, host_node="b", joining_since=0.0,
                     epoch=1, group_ranks={"b": 1, "c": 2}, expected_count=2, electorate=3,
                     electorate_epoch=1, voters={"a", "b", "c"}, wins_tie=False)
    coordinator = Coordinator(CapturingSocket(), SECRET, state, takeover_cause="a lost")
    now = time.monotonic()
    _join_round(coordinator, "b", seated_epoch=1, now=now)
    _join_round(coordinator, "c", seated_epoch=2 if learnt_the_next else 1, now=now)
    coordinator._tick(now + 1.0)
    assert (state.phase == "joining") is learnt_the_next


def test_a_round_held_past_the_join_timeout_says_why_and_what_to_do():
    coordinator = _elastic_job("abc")
    state = coordinator._state
    _silent_but(coordinator, "a", 7.0)  # b and c cut off
    _join_round(coordinator, "a", seated_epoch=1, now=7.1)
    _silent_but(coordinator, "a", 7.0 + state.join_timeout + 1)
    assert state.final == (exit_codes.JOB_FAILED, (
        "rendezvous timed out: held for a quorum: 1 of the last round's 3 nodes came back "
        "within 60s, 2 may have gone on behind a partition; heal the network or raise "
        "--rdzv-conf join_timeout"))
