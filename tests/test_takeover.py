"""A coordinator's successor is connected to before it is needed: every agent keeps a socket
open to the standby of the node that would take over, so a takeover of thousands of nodes
waits for no TCP accept and no handshake (real sockets, a real Coordinator)."""

from __future__ import annotations

import time
from collections.abc import Callable

import psutil
import pytest
import zmq
from conftest import needs_iptables, silenced
from ports import free_port

from ftlaunch_contract.messages import CONTROL, Assign, Join
from ftlaunch_contract.protocol import Codec
from launcher.control_plane import ControlPlane
from launcher.coordinator import JobState, bind_router
from launcher.membership import has_quorum

SECRET = b"takeover-test-secret-0123456789ab"
NODE_TIMEOUT = 5.0


def _state() -> JobState:
    return JobState(min_nodes=1, max_nodes=2, max_restarts=3, policy="job", backoff=0.0,
                    backoff_max=0.0, exit_barrier_timeout=5.0, node_timeout=NODE_TIMEOUT,
                    last_call=0.2, join_timeout=10.0, host_node="")


def _join(plane: ControlPlane, epoch: int, seated: int) -> None:
    plane.send(Join(node_id=plane.node_id, local_world_size=1, addr=plane.addr,
                    standby_port=plane.standby_port, rank_hint=-1, replica_port=0, held=(),
                    restart_count=0, seated_earlier=(), settled_below=-1, group_rank=-1, seated_epoch=seated, electorate_epoch=seated), epoch)


def _assigned(plane: ControlPlane, after: int, never_lost: bool = False) -> int:
    """Read ``plane`` until an assign of an epoch past ``after``; its epoch. ``never_lost``:
    meanwhile, its connection events taken as they come, its coordinator never lost."""
    end = time.monotonic() + 10
    while time.monotonic() < end:
        if never_lost:
            plane.on_monitor()
            assert not plane.coordinator_lost(time.monotonic()), "the successor taken for lost"
        if plane.socket.poll(20 if never_lost else 50):
            received = plane.receive()
            if received is not None and isinstance(received.body, Assign) \
                    and received.epoch > after:
                return received.epoch
    raise AssertionError(f"{plane.node_id} got no assign")


def _router(ctx: zmq.Context) -> tuple[zmq.Socket, int]:
    """A ROUTER standing for the job's coordinators, on a free port."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    return sock, sock.bind_to_random_port("tcp://127.0.0.1")


def _told(plane: ControlPlane, job: zmq.Socket, msg, epoch: int) -> None:
    """``job`` (a ROUTER standing for the job's coordinators) sends ``msg`` to ``plane``,
    which reads it (a heartbeat first: the ROUTER learns its identity)."""
    plane.send(CONTROL["heartbeat"](node_id=plane.node_id, phase="", ranks=(),
                                    electorate_epoch=-1), epoch)
    assert job.poll(5000), f"nothing from {plane.node_id}"
    identity = job.recv_multipart()[0]
    job.send_multipart([identity, *Codec(SECRET).encode(msg, epoch)])
    end = time.monotonic() + 5
    while not plane.socket.poll(20) or (plane.receive() is None
                                        and msg.TYPE != "heartbeat_ack"):
        assert time.monotonic() < end, f"{plane.node_id} heard nothing"


def _connections_to(port: int) -> set[int]:
    """Local ports of this process's established connections to ``port``."""
    return {c.laddr.port for c in psutil.Process().net_connections("tcp")
            if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED}


def _until(check: Callable[[], bool], what: str) -> None:
    end = time.monotonic() + 10
    while not check():
        assert time.monotonic() < end, what
        time.sleep(0.02)


@pytest.mark.parametrize("intakes", [0, 2], ids=["agent alone", "two intakes"])
def test_survivors_follow_the_successor_on_a_connection_opened_before_the_coordinator_died(
        intakes):
    """With --intakes, the standby's connections are its intake processes' (launcher.intake):
    the same takeover, served through them."""
    port = free_port()
    ctx = zmq.Context()
    a = ControlPlane(ctx, SECRET, "node-a:1", "127.0.0.1", ("127.0.0.1", port), _state,
                     NODE_TIMEOUT, 0.5, intakes)
    b = ControlPlane(ctx, SECRET, "node-b:1", "127.0.0.1", ("127.0.0.1", port), _state,
                     NODE_TIMEOUT, 0.5, intakes)
    try:
        assert a.hosting and not b.hosting, "node a binds the endpoint, as node 0 does"
        _join(a, 0, -1)
        _join(b, 0, -1)
        epoch = _assigned(a, 0)
        assert _assigned(b, 0) == epoch
        assert a.coordinator_node == "node-a:1"
        # Node b would take over (the lowest group rank but the coordinator's): with their
        # next heartbeat both agents connect to its standby socket, long before any failure.
        assert not _connections_to(b.standby_port)
        for plane in (a, b):
            plane.heartbeat_if_due(plane.next_heartbeat, epoch)
        _until(lambda: len(_connections_to(b.standby_port)) == 2,
               "both agents connect to the successor's standby once assigned")
        before = _connections_to(b.standby_port)

        dying, a.coordinator = a.coordinator, None
        dying.close()  # node a's coordinator dies: its connections close
        _until(lambda: (b.on_monitor(), b.coordinator_lost(time.monotonic()))[1],
               "node b sees its coordinator's connection close")
        assert b.fail_over(epoch, 0, 2) == "node-b:1"
        assert b.hosting
        _join(b, epoch, epoch)
        assert _assigned(b, epoch) > epoch, "node b's own coordinator seats it"
        # b reached its coordinator on the connection it had opened before: no new one.
        assert _connections_to(b.standby_port) <= before
        assert b.endpoint == f"tcp://127.0.0.1:{b.standby_port}"
    finally:
        b.close()
        a.close()
        ctx.term()


@pytest.mark.parametrize("comes_back", [True, False], ids=["comes back", "never comes back"])
def test_a_follower_whose_connection_to_the_successor_blinked_waits_for_it(comes_back):
    """Packet loss (or the successor's kernel timing a connection out) closed a member's
    connection to the successor's standby; ZeroMQ reconnects. Had the coordinator died just
    then, the member took the successor for lost too (its connection was down) and, with
    no other successor, failed the job (scripts/chaos.py seed 704: 3 s of 25 % loss on one
    node, then the coordinator's node killed). It now gives the connection the node timeout
    to come back, and follows the successor; one that never does is lost after it."""
    node_timeout = 1.0
    port = free_port()
    ctx = zmq.Context()

    def three() -> JobState:
        state = _state()
        state.max_nodes, state.node_timeout = 3, node_timeout
        return state
    planes = [ControlPlane(ctx, SECRET, f"node-{n}:1", "127.0.0.1", ("127.0.0.1", port), three,
                           node_timeout, 0.2) for n in "abc"]
    a, b, c = planes
    try:
        for plane in planes:
            _join(plane, 0, -1)
        epoch = _assigned(a, 0)
        assert _assigned(b, 0) == _assigned(c, 0) == epoch
        for plane in planes:
            plane.heartbeat_if_due(plane.next_heartbeat, epoch)
        _until(lambda: len(_connections_to(b.standby_port)) == 3,
               "every agent connects to the successor's standby")
        standby_port = b.standby_port
        assert b.standby is not None
        b.standby.close(linger=0)  # c's connection to it closes (as a blip would close it)
        dying, a.coordinator = a.coordinator, None
        dying.close()
        _until(lambda: (c.on_monitor(), c.coordinator_lost(time.monotonic()))[1],
               "node c sees its coordinator's connection close")
        assert c.fail_over(epoch, 0, 3) == "node-b:1"
        assert not c.coordinator_lost(time.monotonic()), \
            "a connection to the successor that closed before the failover is not its loss"
        if not comes_back:
            _until(lambda: (c.on_monitor(), c.coordinator_lost(time.monotonic()))[1],
                   "a successor that never answers is lost after the node timeout")
            return
        b.standby, _ = bind_router(ctx, "127.0.0.1", standby_port, node_timeout)  # back
        _until(lambda: (b.on_monitor(), b.coordinator_lost(time.monotonic()))[1],
               "node b sees its coordinator's connection close")
        assert b.fail_over(epoch, 0, 3) == "node-b:1" and b.hosting
        _join(c, epoch, epoch)
        _join(b, epoch, epoch)
        assert _assigned(c, epoch) > epoch, "node c reached the successor when it came back"
        c.on_monitor()
        assert not c.coordinator_lost(time.monotonic())
    finally:
        for plane in planes:
            plane.close()
        ctx.term()


@needs_iptables
def test_a_followers_idle_connection_to_the_successor_timed_out_unseen_is_not_its_loss():
    """A follower's connection to the successor's standby carries nothing until a takeover.
    Silent for a while (a lossy link), the successor's kernel timed it out (keepalive), and
    its word of that was lost too: the follower's end still looked open. At the takeover the
    follower's join went out on it and was answered by a reset: the follower took the
    successor for lost at once and, a spare knowing no other, left the job to fail (chaos seed
    1149: 25 % loss on the successor's node, then the coordinator's node killed). It now gives
    the successor the node timeout to be reached again, and its join goes out once it is."""
    node_timeout = 2.0  # the kernel times the idle connections out ~3 s into the silence
    port = free_port()

    def two() -> JobState:
        state = _state()
        state.node_timeout = node_timeout
        return state

    def accepted(port: int) -> int:
        return len([c for c in psutil.Process().net_connections("tcp")
                    if c.laddr.port == port and c.status == psutil.CONN_ESTABLISHED])

    ctx = zmq.Context()
    a, b = (ControlPlane(ctx, SECRET, f"node-{n}:1", "127.0.0.1", ("127.0.0.1", port), two,
                         node_timeout, 0.2) for n in "ab")
    try:
        _join(a, 0, -1)
        _join(b, 0, -1)
        epoch = _assigned(a, 0)
        assert _assigned(b, 0) == epoch
        for plane in (a, b):
            plane.heartbeat_if_due(plane.next_heartbeat, epoch)
        _until(lambda: accepted(b.standby_port) == 2, "a's and b's own connect to b's standby")
        with silenced([b.standby_port]):
            end = time.monotonic() + node_timeout + 6
            while accepted(b.standby_port):
                assert time.monotonic() < end, "the successor's kernel kept the connections"
                time.sleep(0.05)
        dying, a.coordinator = a.coordinator, None
        dying.close()  # node a's coordinator dies; a's agent follows b
        for plane in (a, b):
            _until(lambda p=plane: (p.on_monitor(), p.coordinator_lost(time.monotonic()))[1],
                   f"{plane.node_id} sees its coordinator's end")
            assert plane.fail_over(epoch, 0, 2) == "node-b:1"
        assert b.hosting
        _join(a, epoch, epoch)  # on a connection b's end no longer knows: a reset answers
        _join(b, epoch, epoch)
        assert _assigned(a, epoch, never_lost=True) > epoch, "a reaches its successor"
    finally:
        b.close()
        a.close()
        ctx.destroy(linger=0)


def test_a_join_lost_with_the_successors_connection_goes_out_again_ahead_of_heartbeats():
    """A spare's join to the successor met a reset (its idle connection timed out during
    packet loss); ZeroMQ reconnects. Its heartbeat went out on the new connection before the
    join did, and the successor, which knows no spare by name, answered "dropped from the
    job": a recovery for nothing (chaos 2-node seed 1616). The join goes first."""
    from ftlaunch_contract.protocol import Codec

    ctx = zmq.Context()
    codec = Codec(SECRET)
    successor, port = _router(ctx)
    spare = ControlPlane(ctx, SECRET, "node-c:1", "127.0.0.1", ("127.0.0.1", port), _state,
                         NODE_TIMEOUT, 0.2)
    try:
        spare._unheard = True  # as after its fail-over: the successor has not answered yet
        _join(spare, 3, -1)
        assert successor.poll(5000)
        successor.recv_multipart()
        successor.close()  # the connection resets
        _until(lambda: (spare.on_monitor(), spare._connect_by is not None)[1],
               "the spare sees its connection to the successor close")
        spare.heartbeat_if_due(spare.next_heartbeat, 3)
        successor = ctx.socket(zmq.ROUTER)  # reachable again
        successor.setsockopt(zmq.LINGER, 0)
        successor.bind(f"tcp://127.0.0.1:{port}")
        kinds = []
        while len(kinds) < 2:
            spare.on_monitor()
            if successor.poll(50):
                kinds.append(codec.decode(successor.recv_multipart()[1:]).body.TYPE)
        assert kinds[0] == "join", kinds
    finally:
        spare.close()
        successor.close()
        ctx.term()


def test_a_healed_node_forgets_the_coordinators_it_took_for_lost_once_the_job_speaks():
    """Cut off, node b took the coordinator a and then every successor (c) for lost. Healed,
    it waits as a spare: the job went on under a, c still its successor. When a is lost for
    real, b follows c, not the next one it had not written off (d), which no one follows
    (chaos seeds 1301 and 1306: the healed spare followed a node that never took over, found
    it silent, knew no other and failed)."""
    from ftlaunch_contract.messages import Successor

    ctx = zmq.Context()
    job, port = _router(ctx)  # every coordinator and standby of the job, as one socket
    b = ControlPlane(ctx, SECRET, "b", "127.0.0.1", ("127.0.0.1", port), _state,
                     NODE_TIMEOUT, 0.5)

    def tell(msg) -> None:
        _told(b, job, msg, 1)

    members = tuple(Successor(n, "127.0.0.1", port) for n in "acd") + (
        Successor("b", "127.0.0.1", b.standby_port),)
    try:
        tell(CONTROL["assign"](group_rank=3, group_world_size=4, rank_offset=3, world_size=4,
                               restart_count=0, max_restarts=3, members=members,
                               spares=(), earlier=(), coordinator_node="a", replicate_to=(),
                               fetch=()))
        assert b.fail_over(1, 0, 4) == "c"  # cut off: a silent, then c
        assert b.fail_over(1, 0, 4) == "d"
        b.back_to_rendezvous()  # (healed: the job runs under a, which answers)
        tell(CONTROL["spare"](members=members, spares=(), coordinator_node="a"))
        assert b.coordinator_node == "a"
        assert b.fail_over(1, 0, 4) == "c", "a lost for real: its successor is c"
    finally:
        b.close()
        job.close()
        ctx.destroy(linger=0)


def test_what_an_agent_says_is_settled_comes_from_assigns_and_acks_never_a_spare_word():
    """A join's settled_below is what coordinators said: an assign names every electorate
    before it not settled, an ack says below which epoch all are. A spare word names none:
    it must claim nothing (a successor would stop counting a round not settled)."""
    from ftlaunch_contract.messages import EarlierVoter, HeartbeatAck

    ctx = zmq.Context()
    job, port = _router(ctx)
    plane = ControlPlane(ctx, SECRET, "d", "127.0.0.1", ("127.0.0.1", port), _state,
                         NODE_TIMEOUT, 0.5)
    try:
        assert plane.settled_below == -1, "told nothing yet"
        _told(plane, job, CONTROL["assign"](
            group_rank=1, group_world_size=2, rank_offset=1, world_size=2, restart_count=0,
            max_restarts=3, members=(), spares=(), coordinator_node="a", replicate_to=(),
            fetch=(), earlier=(EarlierVoter(3, 3, "a", False), EarlierVoter(5, 2, "a", False))),
            7)
        assert plane.settled_below == 3, "the oldest round its assign named"
        _told(plane, job, CONTROL["spare"](coordinator_node="a", members=(), spares=()), 9)
        assert plane.settled_below == 3, "a spare word names no round before it"
        _told(plane, job, HeartbeatAck(settled_below=5), 9)
        assert (plane.settled_below, [v.epoch for v in plane.earlier]) == (5, [])
        _told(plane, job, HeartbeatAck(settled_below=4), 9)  # (a successor that knows less)
        assert plane.settled_below == 5, "what was said settled stays so"
    finally:
        plane.close()
        job.close()
        ctx.destroy(linger=0)


@pytest.mark.parametrize("settled", [False, True], ids=["unsettled", "settled"])
def test_a_successor_counts_the_electorate_before_until_told_most_of_it_learnt_the_new(settled):
    """a, b and c scaled up to seven; a's assigns reached d, e, f and g, not b and c (cut
    off in the milliseconds after the close: by the round before they are two of three, and
    train). a is lost too before most of the three said they learnt the new round. d takes
    over: d, e, f and g are four of the new seven, but none of the old three, so its round
    must wait. Once a's heartbeat ack said the old round settled (most of it learnt the
    new: b and c count by it, two of seven), d's round goes on."""
    from ftlaunch_contract.messages import EarlierVoter, HeartbeatAck, Successor

    def seven() -> JobState:
        return JobState(min_nodes=1, max_nodes=7, max_restarts=3, policy="job", backoff=0.0,
                        backoff_max=0.0, exit_barrier_timeout=5.0, node_timeout=NODE_TIMEOUT,
                        last_call=0.2, join_timeout=60.0, host_node="")

    ctx = zmq.Context()
    job, port = _router(ctx)  # a, b and c, as one socket
    d = ControlPlane(ctx, SECRET, "d", "127.0.0.1", ("127.0.0.1", port), seven, NODE_TIMEOUT,
                     0.5)
    others: list[ControlPlane] = []

    def tell(msg) -> None:
        _told(d, job, msg, 2)

    members = (*(Successor(n, "127.0.0.1", port) for n in "abc"),
               Successor("d", "127.0.0.1", d.standby_port),
               *(Successor(n, "127.0.0.1", port) for n in "efg"))
    old_round = tuple(EarlierVoter(1, 3, n, False) for n in "abc")
    try:
        tell(CONTROL["assign"](group_rank=3, group_world_size=7, rank_offset=3, world_size=7,
                               restart_count=0, max_restarts=3, members=members, spares=(),
                               earlier=old_round, coordinator_node="a", replicate_to=(),
                               fetch=()))
        if settled:
            tell(HeartbeatAck(settled_below=2))  # (the round of the assign's is the oldest)
        assert d.earlier == (() if settled else old_round)
        assert d.settled_below == (2 if settled else 1), "what its joins will say is settled"
        successors = [d.fail_over(2, 0, 7) for _ in range(3)]  # a, b, c silent: cut off
        assert successors == ["b", "c", "d"] and d.hosting
        others.extend(ControlPlane(ctx, SECRET, n, "127.0.0.1", ("127.0.0.1", d.standby_port),
                                   seven, NODE_TIMEOUT, 0.5) for n in "efg")
        for plane in (d, *others):
            _join(plane, 2, 2)
        assert has_quorum(3, 2, 0, wins_tie=False), "b and c train, by the round before"
        if settled:
            assert _assigned(others[0], 2) > 2, "the new round's four of seven go on"
        else:
            _until(lambda: d.coordinator._said_short, "the successor holds its round")
            assert d.coordinator._state.phase == "joining", "both sides of a partition train"
    finally:
        for plane in (*others, d):
            plane.close()
        job.close()
        ctx.destroy(linger=0)
