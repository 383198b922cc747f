"""Liveness on real sockets: a silent machine's connection is closed by the kernel after the
node timeout (keep_alive), and an agent that was itself frozen does not take the closing of
its connection for a lost coordinator."""

from __future__ import annotations

import select
import signal
import subprocess
import sys
import time

import psutil
import pytest
import zmq
from conftest import JOIN_AND_DIE, end_connections_to, needs_iptables, needs_ss_kill, silenced
from zmq.utils.monitor import recv_monitor_message

from ftlaunch_contract.messages import Successor
from launcher.control_plane import ControlPlane
from launcher.coordinator import JobState, bind_router, keep_alive, probe_interval

SECRET = b"liveness-test-secret-0123456789"
NODE_TIMEOUT = 2.0


def _events(monitor: zmq.Socket, until: float) -> list[tuple[float, int]]:
    """(when, event) of ``monitor`` until ``until`` (monotonic), or its first disconnect."""
    out = []
    while time.monotonic() < until:
        if monitor.poll(50):
            event = recv_monitor_message(monitor)["event"]
            out.append((time.monotonic(), event))
            if event == zmq.EVENT_DISCONNECTED:
                break
    return out


def _connected_pair(ctx: zmq.Context, tuned: bool) -> tuple[zmq.Socket, zmq.Socket, int]:
    router, port = bind_router(ctx, "127.0.0.1", 0, NODE_TIMEOUT) if tuned else (None, 0)
    if router is None:
        router = ctx.socket(zmq.ROUTER)
        port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    if tuned:
        keep_alive(dealer, NODE_TIMEOUT)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    dealer.send(b"hello")
    assert router.poll(5000), "no message over loopback"
    router.recv_multipart()
    return router, dealer, port


@needs_iptables
def test_a_silent_machines_connection_is_closed_after_the_node_timeout_on_both_ends():
    ctx = zmq.Context()
    tuned = _connected_pair(ctx, tuned=True)
    plain = _connected_pair(ctx, tuned=False)  # what ZeroMQ does without keep_alive
    monitors = {name: sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
                for name, sock in [("router", tuned[0]), ("dealer", tuned[1]),
                                   ("plain router", plain[0])]}
    try:
        with silenced([tuned[2], plain[2]]):  # nothing in or out: the machine behind is gone
            cut_at = time.monotonic()
            # By the node timeout (the kernel's timers; slack for a busy machine), not the
            # default keepalive's count of probes.
            got = {name: _events(m, cut_at + NODE_TIMEOUT + 3)
                   for name, m in monitors.items() if name != "plain router"}
            plain_events = _events(monitors["plain router"], time.monotonic() + 0.2)
    finally:
        for m in monitors.values():
            m.close(linger=0)
        ctx.destroy(linger=0)
    probe = probe_interval(NODE_TIMEOUT)
    for name, events in got.items():
        assert events and events[-1][1] == zmq.EVENT_DISCONNECTED, f"{name}: no disconnect"
        # Nothing came back for the node timeout, counted from the last packet heard (a
        # keepalive probe's answer, at most one probe interval before the silence).
        assert events[-1][0] - cut_at >= NODE_TIMEOUT - probe - 0.1, f"{name}: too early"
    assert plain_events == [], "without keep_alive the connection looks open for minutes"


def _control_plane(ctx: zmq.Context, port: int, max_nodes: int = 2) -> ControlPlane:
    def state() -> JobState:
        return JobState(min_nodes=1, max_nodes=max_nodes, max_restarts=0, policy="cold", backoff=0.0,
                        backoff_max=0.0, exit_barrier_timeout=5.0, node_timeout=NODE_TIMEOUT,
                        last_call=1.0, join_timeout=10.0, host_node="")
    plane = ControlPlane(ctx, SECRET, "node-b:1", "127.0.0.1", ("127.0.0.1", port), state,
                         NODE_TIMEOUT, 0.5)
    assert not plane.hosting, "the endpoint is the test's ROUTER"
    return plane


def _closed_under(plane: ControlPlane, router: zmq.Socket) -> None:
    """The coordinator's end closes; the plane reads its monitor until it has seen that."""
    plane.socket.send(b"x")  # connected (the ROUTER has it), so the close is news
    assert router.poll(5000)
    router.recv_multipart()
    _close_for_good(router)
    end = time.monotonic() + 10
    while time.monotonic() < end:
        if plane.monitors[0].poll(50):
            event = recv_monitor_message(plane.monitors[0])
            plane.on_connection_event(event)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                _probe_answered(plane, end)
                return
    raise AssertionError("no disconnect seen")


def _close_for_good(router: zmq.Socket) -> None:
    """Close ``router`` and its own context: once this returns its port refuses (ZeroMQ
    closes sockets in its I/O thread, later; a probe could meet the listener still open)."""
    router.close(linger=0)
    router.context.term()


def _probe_answered(plane: ControlPlane, until: float) -> None:
    """Until the plane's probe of a closed connection (if it sent one) has its answer."""
    while plane.probe_fd >= 0:
        assert time.monotonic() < until, "the probe was never answered"
        select.select([plane.probe_fd], [], [], 0.05)
        plane.on_probe()


def test_an_agent_that_was_frozen_does_not_take_its_dropped_connection_for_a_lost_coordinator():
    """While an agent was frozen, a coordinator may have given up on its connection (the
    kernel's keepalive): on waking that close is our silence, not the coordinator's loss."""
    ctx = zmq.Context()
    try:
        for frozen in (False, True):
            router = zmq.Context().socket(zmq.ROUTER)  # its own: see _close_for_good
            port = router.bind_to_random_port("tcp://127.0.0.1")
            plane = _control_plane(ctx, port)
            if frozen:
                plane.woke(time.monotonic())
            _closed_under(plane, router)
            assert plane.connection_lost is (not frozen)
            plane.close()
    finally:
        ctx.destroy(linger=0)


@needs_ss_kill
def test_an_agent_whose_connection_the_kernel_ended_keeps_its_live_coordinator():
    """The connection to the coordinator closes while it is heard from and its process
    listens on: a network fault, not its death (a chaos run with packet loss replaced a
    live node). Then its process ends: the probe is refused, lost at once."""
    ctx = zmq.Context()
    router = zmq.Context().socket(zmq.ROUTER)  # its own: see _close_for_good
    port = router.bind_to_random_port("tcp://127.0.0.1")
    plane = _control_plane(ctx, port)
    try:
        plane.socket.send(b"x")
        assert router.poll(5000)
        router.recv_multipart()
        end_connections_to(port)
        end, seen = time.monotonic() + 10, 0
        while seen != zmq.EVENT_DISCONNECTED:
            assert time.monotonic() < end, "no disconnect seen"
            if plane.monitors[0].poll(50):
                event = recv_monitor_message(plane.monitors[0])
                plane.on_connection_event(event)
                seen = event["event"]
        _probe_answered(plane, end)
        assert not plane.connection_lost and not plane.coordinator_lost(time.monotonic())
        plane.socket.send(b"y")  # ZeroMQ reconnected: the coordinator hears us again
        assert router.poll(5000), "the connection did not come back"
        router.recv_multipart()
    finally:
        _close_for_good(router)
    try:
        while not plane.connection_lost:
            assert time.monotonic() < end, "the coordinator's death was not seen"
            if plane.monitors[0].poll(50):
                plane.on_connection_event(recv_monitor_message(plane.monitors[0]))
                _probe_answered(plane, end)
    finally:
        plane.close()
        ctx.destroy(linger=0)


@needs_iptables
def test_an_agent_finds_its_coordinators_silent_machine_within_the_node_timeout_while_sending():
    """A message in flight to a silent machine holds TCP keepalive off, and the kernel then
    counts the timeout from that message's sending: the agent's second, idle connection is
    what finds the silence within the node timeout, whenever the agent last sent."""
    ctx = zmq.Context()
    router, port = bind_router(ctx, "127.0.0.1", 0, NODE_TIMEOUT)

    def connections() -> int:
        return len([c for c in psutil.Process().net_connections("tcp") if c.raddr
                    and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED])
    small = _control_plane(ctx, port)  # a small job: its heartbeats are enough
    small.socket.send(b"x")
    assert router.poll(5000)
    router.recv_multipart()
    time.sleep(0.2)
    assert connections() == 1, "a small job has no idle connection to lose on a lossy link"
    small.close()
    end = time.monotonic() + 5
    while connections():  # gone before the next one's are counted
        assert time.monotonic() < end, "a closed connection stayed"
        time.sleep(0.01)
    # Too large for heartbeats to find a silent machine in time:
    plane = _control_plane(ctx, port, max_nodes=1 << 14)
    plane.socket.send(b"x")
    assert router.poll(5000)
    router.recv_multipart()
    end = time.monotonic() + 5
    while connections() < 2:
        assert time.monotonic() < end, "the watch did not connect"
        time.sleep(0.01)
    try:
        with silenced([port]):
            cut_at, sent, lost_at = time.monotonic(), False, None
            while time.monotonic() < cut_at + NODE_TIMEOUT + 3:
                if not sent and time.monotonic() > cut_at + NODE_TIMEOUT - 0.5:
                    plane.socket.send(b"heartbeat")  # in flight, unanswered, from now on
                    sent = True
                if any(m.poll(0) for m in plane.monitors):
                    plane.on_monitor()
                if plane.connection_lost:
                    lost_at = time.monotonic()
                    break
                time.sleep(0.02)
    finally:
        plane.close()
        router.close(linger=0)
        ctx.destroy(linger=0)
    probe = probe_interval(NODE_TIMEOUT)
    assert lost_at is not None, "the coordinator's silent machine was not found"
    assert NODE_TIMEOUT - probe - 0.1 <= lost_at - cut_at < NODE_TIMEOUT + 0.75, \
        "not counted from the last message's sending"


def _silence_when_lost(plane: ControlPlane, limit: float) -> float:
    """Drive the plane as the agent's loop does (heartbeats, connection events) while the
    coordinator never answers; the silence after which the plane takes it for lost."""
    plane.members = (Successor("node-a:1", "127.0.0.1", 1), Successor("node-b:1", "127.0.0.1", 2))
    plane.coordinator_node = "node-a:1"
    end = time.monotonic() + limit
    while (now := time.monotonic()) < end:
        plane.on_monitor()
        plane.heartbeat_if_due(now, 0)
        if plane.coordinator_lost(now):
            return now - plane.last_heard
        time.sleep(0.02)  # the agent's loop polls; nothing comes
    raise AssertionError(f"the coordinator was not taken for lost within {limit}s")


def test_a_coordinator_whose_machine_answers_knocks_is_lost_only_at_twice_the_timeout():
    """Its words late, its ZeroMQ greeting our knocks: a lossy link, whose TCP retries hold a
    message back over a second now and then (chaos seed 3423 failed over from a live
    coordinator for it), or its agent's Python stalls. Its machine is not gone: it is lost
    at twice the timeout, not at the first."""
    ctx = zmq.Context()
    router, port = bind_router(ctx, "127.0.0.1", 0, NODE_TIMEOUT)  # it reads, never answers
    plane = _control_plane(ctx, port)
    try:
        silence = _silence_when_lost(plane, 4 * NODE_TIMEOUT)
    finally:
        plane.close()
        router.close(linger=0)
        ctx.destroy(linger=0)
    assert silence > 2 * NODE_TIMEOUT, f"lost after {silence:.2f}s, its machine answering"


_ROUTER = ("import time, zmq; r = zmq.Context().socket(zmq.ROUTER); "
           "print(r.bind_to_random_port('tcp://127.0.0.1'), flush=True); time.sleep(60)")


def test_a_frozen_coordinator_is_lost_at_the_timeout():
    """SIGSTOPped, its process greets no knock (its kernel accepts them): lost at the
    timeout, as a machine gone."""
    proc = subprocess.Popen([sys.executable, "-c", _ROUTER], stdout=subprocess.PIPE, text=True)
    ctx = zmq.Context()
    try:
        port = int(proc.stdout.readline())
        plane = _control_plane(ctx, port)
        plane.socket.send(b"x")
        end = time.monotonic() + 5
        while not any(c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
                      for c in psutil.Process().net_connections("tcp")):
            assert time.monotonic() < end, "never connected"
            time.sleep(0.01)
        proc.send_signal(signal.SIGSTOP)
        plane.last_heard = time.monotonic()  # heard as it froze
        silence = _silence_when_lost(plane, 4 * NODE_TIMEOUT)
        plane.close()
    finally:
        proc.kill()
        proc.wait()
        ctx.destroy(linger=0)
    assert silence < 2 * NODE_TIMEOUT, f"lost only after {silence:.2f}s, frozen"


@needs_iptables
def test_a_coordinator_whose_machine_went_silent_is_lost_at_the_timeout():
    ctx = zmq.Context()
    router, port = bind_router(ctx, "127.0.0.1", 0, NODE_TIMEOUT)
    plane = _control_plane(ctx, port)
    try:
        plane.socket.send(b"x")
        assert router.poll(5000), "not connected"
        with silenced([port]):
            plane.last_heard = time.monotonic()  # heard as the machine went silent
            silence = _silence_when_lost(plane, 4 * NODE_TIMEOUT)
    finally:
        plane.close()
        router.close(linger=0)
        ctx.destroy(linger=0)
    assert silence < 2 * NODE_TIMEOUT, f"lost only after {silence:.2f}s, its machine silent"


def _takeover_state(group_ranks: dict[str, int]) -> JobState:
    state = JobState(min_nodes=1, max_nodes=2, max_restarts=3, policy="rank", backoff=0.0,
                     backoff_max=0.0, exit_barrier_timeout=5.0, node_timeout=NODE_TIMEOUT,
                     last_call=0.2, join_timeout=60.0, host_node="b",
                     joining_since=time.monotonic())
    state.group_ranks, state.expected_count = dict(group_ranks), len(group_ranks)
    return state


def test_a_node_that_stood_down_leaves_its_standby_socket_to_the_successor_it_may_become():
    """b took over from inside a partition, and stood down once the endpoint answered that
    the job still ran there. Later the endpoint's node is lost and b is the successor: a
    spare that notices first joins b before b's agent has noticed. That join must wait on
    b's standby socket for b's takeover, not be answered by the coordinator that stood down
    (its redirect sent the spare back to the lost endpoint: a chaos run saw the job recover
    twice more, once per spare)."""
    from ftlaunch_contract.messages import CONTROL, Redirect
    from ftlaunch_contract.protocol import Codec
    from launcher.coordinator import Coordinator

    ctx = zmq.Context()
    codec = Codec(SECRET)
    endpoint = ctx.socket(zmq.ROUTER)
    endpoint_port = endpoint.bind_to_random_port("tcp://127.0.0.1")
    standby, port = bind_router(ctx, "127.0.0.1", 0, NODE_TIMEOUT)
    spare = ctx.socket(zmq.DEALER)
    spare.setsockopt(zmq.LINGER, 0)
    coordinators = []
    try:
        inside = Coordinator(standby, SECRET, _takeover_state({"b": 0}), "coordinator node a lost",
                             ((f"tcp://127.0.0.1:{endpoint_port}",),
                              Redirect(coordinator_node="b", addr="127.0.0.1", port=port)))
        coordinators.append(inside)
        inside.start()
        assert endpoint.poll(5000), "the takeover announces itself at the endpoint"
        identity = endpoint.recv_multipart()[0]  # the job runs here: stand down
        endpoint.send_multipart([identity, *codec.encode(
            Redirect(coordinator_node="a", addr="", port=0), 5)])
        deadline = time.monotonic() + 5
        while not inside.stood_down and time.monotonic() < deadline:
            time.sleep(0.01)  # the coordinator's thread: no event to wait on
        assert inside.stood_down
        spare.connect(f"tcp://127.0.0.1:{port}")
        spare.send_multipart(codec.encode(CONTROL["join"](
            node_id="s", local_world_size=1, addr="127.0.0.1", standby_port=0, rank_hint=-1,
            replica_port=0, held=(), restart_count=1, seated_earlier=(), settled_below=-1, group_rank=-1, seated_epoch=-1, electorate_epoch=-1), 5))
        assert not spare.poll(500), "answered by a coordinator that stood down"
        state = _takeover_state({"b": 0})  # a lost for good: b takes over for real
        successor = Coordinator(inside.release(), SECRET, state, "coordinator node a lost")
        coordinators.append(successor)
        successor.start()
        assert spare.poll(5000), "the successor does not serve on the given-back socket"
        answer = codec.decode(spare.recv_multipart()).body
        assert not isinstance(answer, Redirect), answer
    finally:
        for coordinator in coordinators:
            coordinator.release()  # its thread is gone: the context's sockets can close
        ctx.destroy(linger=0)


def _wait_until_route_ended(router: zmq.Socket, identity: bytes) -> None:
    """Until ``router`` itself knows that the connection of ``identity``, whose close its
    monitor reported, closed: a mandatory send to it is refused. (ZeroMQ's monitor reports
    a close before the socket's route to it ends: its I/O thread passes that on in commands
    after; under load, many ms later. Before the close, a refusal could mean not yet
    connected.)"""
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    end = time.monotonic() + 5
    try:
        while True:
            assert time.monotonic() < end, f"{identity!r}: its route never ended"
            router.getsockopt(zmq.EVENTS)  # reads the socket's pending commands
            try:
                router.send_multipart([identity, b""], zmq.NOBLOCK)
            except zmq.ZMQError as e:
                if e.errno == zmq.EHOSTUNREACH:
                    return
                raise
            time.sleep(0.001)  # (nothing to wait on: the I/O thread's commands are internal)
    finally:
        router.setsockopt(zmq.ROUTER_MANDATORY, 0)


@pytest.mark.parametrize("max_nodes", [3, 4096])
def test_joins_queued_on_a_successors_standby_from_connections_since_closed_take_no_seat(
        caplog, max_nodes):
    """A spare cut off from the coordinator followed b, the first successor, and joined at
    b's standby socket while b still followed the coordinator; then it went on, and its
    connection closed. Survivor c did the same when the coordinator died, and died too.
    ZeroMQ still hands b both joins when b takes over: taken as they stood, the spare held a
    seat its assign never reached and c counted as back, and b's ranks waited for theirs
    until the liveness timeout. The spare's join is forgotten; c's machine refuses a probe:
    c is lost at once, for its closed connection. (A large job's survivors are not asked,
    those its assign named (c) nor those only counted (u, whose join says it held a seat):
    an ack each would delay a round of thousands; their seats wait for their silence.)"""
    import logging

    from ftlaunch_contract.messages import CONTROL, Assign
    from ftlaunch_contract.protocol import Codec
    from launcher.coordinator import Coordinator, connection_monitor

    caplog.set_level(logging.WARNING, logger="launcher.coordinator")
    ctx = zmq.Context()
    codec = Codec(SECRET)
    standby, port = bind_router(ctx, "127.0.0.1", 0, NODE_TIMEOUT)
    closed = ctx.socket(zmq.ROUTER)  # c's standby port, refused once c died
    closed_port = closed.bind_to_random_port("tcp://127.0.0.1")
    closed.close(linger=0)

    def join(node: str, seated_epoch: int, standby_port: int = 0):
        """Its own codec, as each agent has: the order in which the ROUTER hands over
        messages of different connections is ZeroMQ's (one sender's would be replays)."""
        return Codec(SECRET).encode(CONTROL["join"](
            node_id=node, local_world_size=1, addr="127.0.0.1", standby_port=standby_port,
            rank_hint=-1, replica_port=0, held=(), restart_count=1, seated_earlier=(),
            settled_below=-1, group_rank=-1, seated_epoch=seated_epoch, electorate_epoch=5), 5)

    monitor = connection_monitor(standby, zmq.EVENT_DISCONNECTED)
    large = max_nodes > 3
    for node, seated_epoch, its_port in (("s", -1, 0), ("c", 5, closed_port),
                                         *([("u", 5, closed_port)] if large else [])):
        gone = ctx.socket(zmq.DEALER)
        gone.setsockopt(zmq.ROUTING_ID, f"{node}'s connection".encode())
        gone.connect(f"tcp://127.0.0.1:{port}")
        gone.send_multipart(join(node, seated_epoch, its_port))
        gone.close(linger=5000)  # sent, then its connection closes
        assert monitor.poll(5000), f"{node}'s connection did not close"
        assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
        _wait_until_route_ended(standby, f"{node}'s connection".encode())
    standby.disable_monitor()
    monitor.close(linger=0)
    b = ctx.socket(zmq.DEALER)  # b's own agent, connected
    b.setsockopt(zmq.LINGER, 0)
    b.connect(f"tcp://127.0.0.1:{port}")
    b.send_multipart(join("b", 5))
    state = _takeover_state({"b": 0, "c": 1})
    state.max_nodes, state.expected_count, state.epoch = max_nodes, 3 if large else 2, 5
    coordinator = Coordinator(standby, SECRET, state, "coordinator node a lost")
    try:
        coordinator.start()
        while True:  # an ack first: the successor serves
            assert b.poll(int(10 * NODE_TIMEOUT * 1000)), "b got no assign"  # a hang guard
            if isinstance(word := codec.decode(b.recv_multipart()).body, Assign):
                break
        seated = ["b", "c", "u"] if large else ["b"]
        assert sorted(m.node_id for m in word.members) == seated, word
        assert word.group_world_size == len(seated)
        lost = [r.getMessage() for r in caplog.records if "lost" in r.getMessage()]
        assert any("node c lost (its agent's connection closed)" in m
                   for m in lost) == (max_nodes == 3), lost
        assert "s" not in state.members
    finally:
        coordinator.release()
        ctx.destroy(linger=0)


_TWO_PEERS = """
import sys, zmq
from ftlaunch_contract.messages import StatusQuery
from ftlaunch_contract.protocol import Codec
port, secret = sys.argv[1], bytes.fromhex(sys.argv[2])
ctx, codec, peer = zmq.Context(), Codec(secret), None
for line in sys.stdin:
    if peer is None:
        peer = ctx.socket(zmq.DEALER)
        peer.connect(f"tcp://127.0.0.1:{port}")
    if line.strip() in ("send", "send, close"):
        peer.send_multipart(codec.encode(StatusQuery(), 0))
    if line.strip().endswith("close"):
        peer.close(linger=5000)
        peer = None
    print("ok", flush=True)
"""


def test_a_close_is_not_taken_for_a_gone_connection_on_the_same_descriptor(monkeypatch):
    """The serving loop reads connection events before messages, so an agent's last message
    is often handled after its connection's close, recording the descriptor again for a
    connection that is gone. The kernel gives the next connection the lowest free
    descriptor (that of the agent restarted on the node, say): its close must still be
    taken for its own, not for the gone one's, or its death waits the liveness timeout.
    (The peers live in a child process: only the coordinator's descriptors are ours.)"""
    from launcher.coordinator import Coordinator, connection_monitor

    ctx = zmq.Context()
    sock, port = bind_router(ctx, "127.0.0.1", 0, NODE_TIMEOUT)
    coordinator = Coordinator(sock, SECRET, _takeover_state({"b": 0}))
    closed: list[bytes] = []
    monkeypatch.setattr(coordinator, "_disconnected", lambda identity, now: closed.append(identity))
    monitor = connection_monitor(sock, zmq.EVENT_DISCONNECTED)
    peers = subprocess.Popen([sys.executable, "-c", _TWO_PEERS, str(port), SECRET.hex()],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def peer(command: str) -> None:
        peers.stdin.write(command + "\n")
        peers.stdin.flush()
        assert peers.stdout.readline() == "ok\n"

    def handled() -> bytes:
        """The identity of the next message, once handled."""
        before = set(coordinator._fds)
        assert sock.poll(5000), "no message"
        coordinator._drain()
        [identity] = set(coordinator._fds) - before
        return identity

    def closing() -> None:
        assert monitor.poll(5000), "no close"
        coordinator._closed_connections(monitor)

    try:
        peer("send")
        first = handled()
        descriptor = coordinator._fds[first]
        peer("send, close")  # its last message and its close come together
        closing()
        assert closed == [first]
        assert handled() == first and coordinator._fds[first] == descriptor  # recorded again
        peer("send")
        second = handled()
        assert coordinator._fds[second] == descriptor, "the kernel gave another descriptor"
        peer("close")
        closing()
        assert second in closed[1:], "the second connection's close was taken for the first's"
    finally:
        peers.stdin.close()
        peers.wait(timeout=10)
        monitor.close(linger=0)
        coordinator.close()
        ctx.destroy(linger=0)




def test_an_agent_that_dies_right_after_its_first_join_is_lost_at_once(caplog):
    """The serving loop reads connection events before messages: the close of an agent
    that joined and died at once named no connection yet (its join still queued), and
    the join then seated a dead node, found only by its silence. A close no message named
    is kept until the queue is emptied; the first words heard on that descriptor are
    checked (a mandatory ack), and a connection that is gone closed like any: its
    machine refuses a probe, lost at once."""
    import logging

    from launcher.coordinator import Coordinator, connection_monitor

    caplog.set_level(logging.WARNING, logger="launcher.coordinator")
    ctx = zmq.Context()
    sock, port = bind_router(ctx, "127.0.0.1", 0, NODE_TIMEOUT)
    state = _takeover_state({"b": 0})
    coordinator = Coordinator(sock, SECRET, state)
    monitor = connection_monitor(sock, zmq.EVENT_DISCONNECTED)
    refused = ctx.socket(zmq.ROUTER)  # s's standby port, closed with its agent
    refused_port = refused.bind_to_random_port("tcp://127.0.0.1")
    refused.close(linger=0)
    try:
        subprocess.run([sys.executable, "-c", JOIN_AND_DIE, str(port), SECRET.hex(),
                        str(refused_port)], check=True, timeout=30)
        assert monitor.poll(5000), "no close"
        coordinator._closed_connections(monitor)  # first, as the serving loop does
        assert sock.poll(5000), "the join is not queued"
        coordinator._drain()
        end = time.monotonic() + 5
        while coordinator._probes:
            assert time.monotonic() < end, "the probe never answered"
            select.select([p.fd for p in coordinator._probes.values()], [], [], 0.05)
            coordinator._probes_answered(time.monotonic())
        assert "s" not in state.members, "a dead agent's join kept it a member"
        assert any("node s lost (its agent's connection closed)" in r.getMessage()
                   for r in caplog.records)
    finally:
        monitor.close(linger=0)
        coordinator.close()
        ctx.destroy(linger=0)


def test_a_close_read_before_its_route_ended_is_asked_again_until_it_ends(caplog):
    """ZeroMQ's monitor reports a close before the socket's route to that connection ends
    (its I/O thread ends it after; under load, many ms later). So an agent that joined and
    died at once, its close read before its join, could still look open when asked, and
    the dead node held its seat until its silence. Here the close is read while the
    connection still stands (the order load makes), and the agent dies after: the tick
    asks again, and the node is lost at once, for its closed connection."""
    import logging

    from launcher.coordinator import TICK_SECONDS, Coordinator

    caplog.set_level(logging.WARNING, logger="launcher.coordinator")
    ctx = zmq.Context()
    sock, port = bind_router(ctx, "127.0.0.1", 0, NODE_TIMEOUT)
    state = _takeover_state({"b": 0})
    coordinator = Coordinator(sock, SECRET, state)
    refused = ctx.socket(zmq.ROUTER)  # s's standby port, closed with its agent
    refused_port = refused.bind_to_random_port("tcp://127.0.0.1")
    refused.close(linger=0)
    peer = subprocess.Popen([sys.executable, "-c", JOIN_AND_DIE, str(port), SECRET.hex(),
                             str(refused_port), "when told"], stdin=subprocess.PIPE)
    try:
        assert sock.poll(5000), "the join is not queued"
        [fd] = [c.fd for c in psutil.Process().net_connections("tcp")
                if c.laddr.port == port and c.raddr]
        coordinator._closed_unheard.add(fd)  # its close, read first
        coordinator._drain()
        assert "s" in state.members, "its connection is open yet"
        peer.stdin.close()
        peer.wait(timeout=10)
        end = time.monotonic() + NODE_TIMEOUT / 2  # (silent, it is lost after the timeout)
        while "s" in state.members:
            assert time.monotonic() < end, "its close was never asked about again"
            select.select([p.fd for p in coordinator._probes.values()], [], [], TICK_SECONDS)
            coordinator._probes_answered(time.monotonic())
            coordinator._tick(time.monotonic())
        assert any("node s lost (its agent's connection closed)" in r.getMessage()
                   for r in caplog.records)
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait(timeout=10)
        coordinator.close()
        ctx.destroy(linger=0)


def test_an_agent_whose_own_coordinator_stood_down_before_it_spoke_follows_the_redirect():
    """b is cut off, takes over, and its coordinator learns at the endpoint that the job went
    on, before b's own agent has said a word to it (its ranks were still stopping: the
    partition had healed as b took over). The stand-down's word went to no one, and the
    coordinator serves no more: b's join, sent there once its ranks stopped, went unanswered
    for good (a chaos run's healed node, stranded). b's agent follows the redirect itself."""
    from ftlaunch_contract.messages import CONTROL, Redirect, Successor
    from ftlaunch_contract.protocol import Codec

    ctx = zmq.Context()
    codec = Codec(SECRET)
    endpoint = ctx.socket(zmq.ROUTER)  # the job's coordinator, a raw socket: what b says
    endpoint.setsockopt(zmq.LINGER, 0)
    endpoint_port = endpoint.bind_to_random_port("tcp://127.0.0.1")
    b = ControlPlane(ctx, SECRET, "b", "127.0.0.1", ("127.0.0.1", endpoint_port),
                     lambda: _takeover_state({}), NODE_TIMEOUT, 0.5)

    def heard() -> object:
        assert endpoint.poll(5000), "nothing from b at the endpoint"
        frames = endpoint.recv_multipart()
        return frames[0], codec.decode(frames[1:])

    try:
        b.send(CONTROL["heartbeat"](node_id="b", phase="", ranks=(), electorate_epoch=-1), 5)
        identity, _ = heard()
        endpoint.send_multipart([identity, *codec.encode(CONTROL["assign"](
            group_rank=1, group_world_size=2, rank_offset=1, world_size=2, restart_count=0,
            max_restarts=3, members=(Successor("a", "127.0.0.1", 1),
                                     Successor("b", "127.0.0.1", b.standby_port)),
            spares=(Successor("s", "127.0.0.1", 2),), earlier=(), coordinator_node="a",
            replicate_to=(), fetch=()), 5)])
        assert b.socket.poll(5000) and b.receive() is not None and b.knows_successors
        assert b.fail_over(5, 0, 2) == "b" and b.hosting  # cut off: b takes over
        state = b.coordinator._state  # the quorum it needs: a silent, the round's spare votes
        assert (state.electorate, state.voters, state.gone, state.wins_tie) == (
            3, {"a", "b", "s"}, set(), False)
        assert b.own_redirect() is None, "its coordinator has not stood down"
        while True:  # its coordinator announces itself; the job runs here: stand down
            announcer, announced = heard()
            if isinstance(announced.body, Redirect):
                break
        endpoint.send_multipart([announcer, *codec.encode(
            Redirect(coordinator_node="a", addr="", port=0), 6)])
        deadline = time.monotonic() + 5
        while (word := b.own_redirect()) is None:  # the coordinator's thread: no event to
            assert time.monotonic() < deadline, "b's coordinator did not stand down"
            time.sleep(0.01)  # wait on
        assert word.body == Redirect(coordinator_node="a", addr="127.0.0.1", port=endpoint_port)
        assert b.endpoint == f"tcp://127.0.0.1:{endpoint_port}" and b.coordinator_node == "a"
        assert b.own_redirect() is None, "taken once"
        b.send(CONTROL["join"](node_id="b", local_world_size=1, addr="127.0.0.1",
                               standby_port=b.standby_port, rank_hint=-1, replica_port=0,
                               held=(), restart_count=1, seated_earlier=(), settled_below=-1, group_rank=-1, seated_epoch=5, electorate_epoch=5), word.epoch)
        while not isinstance((message := heard()[1]).body, CONTROL["join"]):
            pass  # its announcements, until the stand-down took effect
        assert message.body.node_id == "b", "b's join reaches the job's coordinator"
    finally:
        b.close()
        endpoint.close()
        ctx.destroy(linger=0)


def test_a_sockets_connection_monitor_can_be_started_again_at_once():
    """libzmq tears a stopped monitor's endpoint down asynchronously: pyzmq's default one,
    named after the socket, was refused as 'Address already in use' when the next monitor of
    the same socket started at once (a coordinator that stood down, then hosted again on its
    standby socket, died that way in a chaos run: the job failed with no successor)."""
    from launcher.coordinator import connection_monitor

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind("tcp://127.0.0.1:*")
    try:
        for _ in range(200):
            monitor = connection_monitor(sock, zmq.EVENT_DISCONNECTED)
            sock.disable_monitor()
            monitor.close(linger=0)
    finally:
        sock.close(linger=0)
        ctx.term()


def test_a_coordinator_whose_thread_dies_says_why(monkeypatch, caplog):
    """A bug outside a message's or a tick's handling ends the coordinator's thread: it says
    so, loudly and with the traceback, and ``failure`` names it for its agent to leave on."""
    from launcher.coordinator import Coordinator

    def broken(self) -> None:
        raise RuntimeError("a bug in the loop")

    monkeypatch.setattr(Coordinator, "_check_handed_over", broken)
    ctx = zmq.Context()
    sock, _ = bind_router(ctx, "127.0.0.1", 0, NODE_TIMEOUT)
    coordinator = Coordinator(sock, SECRET, _takeover_state({"b": 0}))
    try:
        assert coordinator.failure is None
        coordinator.start()
        coordinator._thread.join(timeout=5)  # it ends on the bug, at its first turn
        assert not coordinator._thread.is_alive()
        assert coordinator.failure == "RuntimeError: a bug in the loop"
        assert any(r.levelname == "CRITICAL" and r.exc_info for r in caplog.records)
    finally:
        coordinator.release().close(linger=0)
        ctx.term()


def test_a_successor_cut_off_after_its_rounds_stands_down_when_the_endpoint_says_so():
    """Chaos (coordinator-partition, twice): the successor b ran the job for a round, then
    its own node was cut off; the others failed over to the next and went on. Healed, b
    announces itself at the endpoint, which answers where the job runs: b, with no node of
    its rounds left but its own, stands down (before, having formed a round, it ignored the
    answer and its agent waited there for good). One whose round still has others does not."""
    from ftlaunch_contract.messages import CONTROL, Redirect
    from ftlaunch_contract.protocol import Codec
    from launcher.coordinator import Coordinator

    ctx = zmq.Context()
    codec = Codec(SECRET)
    endpoint = ctx.socket(zmq.ROUTER)  # the endpoint's coordinator, a raw socket
    endpoint.setsockopt(zmq.LINGER, 0)
    port = endpoint.bind_to_random_port("tcp://127.0.0.1")
    here = Redirect(coordinator_node="b", addr="127.0.0.1", port=1)
    coordinators = []
    try:
        for group_ranks in ({"b": 0, "x": 1}, {"b": 0}):  # x still with it; then alone
            router = ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.bind_to_random_port("tcp://127.0.0.1")
            coordinator = Coordinator(router, SECRET, _takeover_state(group_ranks),
                                      announce=((f"tcp://127.0.0.1:{port}",), here))
            coordinators.append(coordinator)
            coordinator._rounds, coordinator._state.epoch = 1, 4  # it ran the job a round
            deadline = time.monotonic() + 5
            while not endpoint.poll(50):  # the announcer connects: nothing queued before
                assert time.monotonic() < deadline, "no announcement at the endpoint"
                coordinator._announce()
            announcer, *frames = endpoint.recv_multipart()
            assert codec.decode(frames).body == here
            endpoint.send_multipart([announcer, *codec.encode(CONTROL["redirect"](
                coordinator_node="c", addr="", port=0), 6)])
            [to_endpoint] = coordinator._announcers
            assert to_endpoint.poll(5000)
            coordinator._answers_to_announcement(to_endpoint)
        assert coordinators[0]._state.redirect is None, "its round has x: it keeps the job"
        assert coordinators[1]._state.redirect == Redirect(
            coordinator_node="c", addr="127.0.0.1", port=port), "alone: it stands down"
    finally:
        for coordinator in coordinators:
            coordinator.close()
        endpoint.close()
        ctx.destroy(linger=0)


def test_a_successor_drops_announcements_queued_on_its_standby_socket_before_it_served():
    """Chaos (seed 3000): c took over from b while b was cut off, and kept announcing itself
    to b's standby socket, where nothing reads until b hosts a coordinator there; b healed
    and re-joined c. Later c's own node was cut off and b took over: c's announcements, of
    the job's epoch still, stood queued, and b stood down at once for the node cut off,
    sending its followers there (several recoveries for one fault, a cut-off node stranded).
    What was queued before b served is old news: one that runs the job announces itself each
    tick, and is followed once it does so again."""
    from ftlaunch_contract.messages import CONTROL, JobStatus, Redirect
    from ftlaunch_contract.protocol import Codec
    from launcher.coordinator import Coordinator

    ctx = zmq.Context()
    codec = Codec(SECRET)
    standby, port = bind_router(ctx, "127.0.0.1", 0, NODE_TIMEOUT)
    c = ctx.socket(zmq.DEALER)  # c's announcer to b, its silent predecessor
    c.setsockopt(zmq.LINGER, 0)
    c.connect(f"tcp://127.0.0.1:{port}")
    c_runs = Redirect(coordinator_node="c", addr="127.0.0.1", port=1)
    state = _takeover_state({"b": 0})  # c lost, b alone: any announcer may run the job
    state.epoch = 5
    coordinator = None

    def announce_then_ask() -> None:  # one connection: handled in the order sent
        c.send_multipart(codec.encode(c_runs, 5))
        c.send_multipart(codec.encode(CONTROL["status_query"](), 5))

    def answered() -> None:
        assert c.poll(5000), "no answer to the status query"
        assert isinstance(codec.decode(c.recv_multipart()).body, JobStatus)

    try:
        announce_then_ask()
        assert standby.poll(5000), "c's announcement is not queued"
        coordinator = Coordinator(standby, SECRET, state, "coordinator node c lost")
        coordinator.start()
        answered()
        assert state.redirect is None, "stood down for a queued announcement"
        deadline = time.monotonic() + 5
        while state.redirect is None:  # c, healed, says so each tick: it runs the job
            assert time.monotonic() < deadline, "a live announcer is not followed"
            announce_then_ask()  # (one that came while b still drained its queue is dropped)
            answered()
        assert state.redirect == c_runs
    finally:
        if coordinator is not None:
            coordinator.release()
        ctx.destroy(linger=0)
