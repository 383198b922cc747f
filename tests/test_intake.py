"""A coordinator whose port intake processes serve (launcher.intake): real processes sharing a
real port (SO_REUSEPORT), real agents' sockets, a real Coordinator deciding."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest
import zmq
from conftest import JOIN_AND_DIE
from ports import free_port

from ftlaunch_contract.messages import CONTROL, Assign, Redirect
from ftlaunch_contract.protocol import Codec
from launcher.coordinator import Coordinator, JobState
from launcher.intake import Port

SECRET = b"intake-test-secret-0123456789abcd"
NODE_TIMEOUT = 5.0


def _state(nodes: int, host: str = "host", min_nodes: int = 0) -> JobState:
    return JobState(min_nodes=min_nodes or nodes, max_nodes=nodes, max_restarts=3, policy="job",
                    backoff=0.0, backoff_max=0.0, exit_barrier_timeout=5.0,
                    node_timeout=NODE_TIMEOUT, last_call=0.2, join_timeout=60.0,
                    host_node=host)


def _join(codec: Codec, node: str, standby_port: int = 0, epoch: int = 0) -> list[bytes]:
    return codec.encode(CONTROL["join"](
        node_id=node, local_world_size=2, addr="127.0.0.1", standby_port=standby_port,
        rank_hint=-1, replica_port=0, held=(), restart_count=0, seated_earlier=(),
        settled_below=-1, group_rank=-1, seated_epoch=-1, electorate_epoch=-1), epoch)


def _agent(ctx: zmq.Context, port: int) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock


def _assign(sock: zmq.Socket, codec: Codec) -> Assign:
    end = time.monotonic() + 20  # a hang guard
    while time.monotonic() < end:
        if sock.poll(100) and isinstance(body := codec.decode(sock.recv_multipart()).body,
                                         Assign):
            return body
    raise AssertionError("no assign")


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def test_a_round_formed_through_two_intakes_seats_every_agent_on_one_port(ctx):
    """Agents see one port; the kernel spreads their connections over both intakes, which
    forward the joins and sign each agent's assign from the seat the coordinator sends."""
    port = Port(ctx, "127.0.0.1", 0, NODE_TIMEOUT, SECRET, 2, max_nodes=24)
    coordinator = Coordinator(port, SECRET, _state(24))
    agents = {f"n{i:02d}": (_agent(ctx, port.port), Codec(SECRET)) for i in range(24)}
    try:
        coordinator.start()
        for node, (sock, codec) in agents.items():
            sock.send_multipart(_join(codec, node))
        assigns = {node: _assign(sock, codec) for node, (sock, codec) in agents.items()}
        assert sorted(a.group_rank for a in assigns.values()) == list(range(24))
        assert {a.rank_offset for a in assigns.values()} == set(range(0, 48, 2))
        assert all(a.world_size == 48 and a.group_world_size == 24 for a in assigns.values())
        intakes = {identity[0] for identity in coordinator._fds}
        assert intakes == {1, 2}, f"connections served by intakes {intakes}"
    finally:
        coordinator.close()
        for sock, _ in agents.values():
            sock.close()




def test_an_agent_that_joins_and_dies_on_an_intakes_connection_is_lost_at_once(ctx, caplog):
    """Its connection's close is the intake's to see (its monitor): forwarded, it reaches
    the coordinator, whose probe of the dead machine's standby port is refused: lost at
    once, not at the node timeout."""
    caplog.set_level(logging.INFO, logger="ftlaunch.coordinator")
    port = Port(ctx, "127.0.0.1", 0, NODE_TIMEOUT, SECRET, 2, max_nodes=3)
    state = _state(3)
    coordinator = Coordinator(port, SECRET, state)
    try:
        coordinator.start()
        subprocess.run([sys.executable, "-c", JOIN_AND_DIE, str(port.port), SECRET.hex(),
                        str(free_port())],  # its standby port: nothing listens there
                       check=True, timeout=30)
        end = time.monotonic() + NODE_TIMEOUT / 2  # silent, it would be lost at the timeout
        while not any("node s lost (its agent's connection closed)" in r.getMessage()
                      for r in caplog.records):
            assert time.monotonic() < end, (  # what the coordinator did and holds, if not
                f"the dead agent is not lost: {[r.getMessage() for r in caplog.records]}, "
                f"probes {coordinator._probes}, fds {coordinator._fds}, closes unheard "
                f"{coordinator._closed_unheard}, unconfirmed {coordinator._closes_unconfirmed}")
            time.sleep(0.02)  # the coordinator's thread: nothing to wait on
        assert "s" not in state.members
    finally:
        coordinator.close()


def _forwarded(intakes, joins: int, closes: int) -> None:
    """Until the intakes forwarded that many joins and closes, which then wait, unread, for
    the coordinator to serve (held as what it reads while probing is)."""
    end, read = time.monotonic() + 10, []  # a hang guard
    while sum(len(m[2]) for _, m in read) < joins or sum(len(m[1]) for _, m in read) < closes:
        assert time.monotonic() < end and intakes.hub.poll(1000), "not forwarded"
        read.append(intakes._read())
    intakes._held.extend(read)


def test_joins_queued_at_intakes_from_connections_since_closed_take_no_seat(ctx, caplog):
    """A successor's standby: a spare joined there and went on (its connection closed)
    before the successor served. The intake's monitor saw the close, and the intake, asked
    whether that connection stands (a mandatory send there), says it does not: either way
    the spare takes no seat (with neither, it did); survivor b, connected, is assigned a
    round of its own."""
    caplog.set_level(logging.WARNING, logger="ftlaunch.coordinator")
    port = Port(ctx, "127.0.0.1", 0, NODE_TIMEOUT, SECRET, 2, max_nodes=3)
    codec = Codec(SECRET)
    gone = _agent(ctx, port.port)
    gone.send_multipart(_join(codec, "s", epoch=5))
    gone.close(linger=5000)
    b = _agent(ctx, port.port)
    b.send_multipart(_join(codec, "b", epoch=5))
    state = _state(3, host="b", min_nodes=1)
    state.group_ranks, state.expected_count, state.epoch = {"b": 0}, 1, 5
    _forwarded(port.intakes, joins=2, closes=1)
    coordinator = Coordinator(port, SECRET, state, "coordinator node a lost")
    try:
        coordinator.start()
        assign = _assign(b, codec)
        assert [m.node_id for m in assign.members] == ["b"], assign
        assert "s" not in state.members
    finally:
        coordinator.close()


def test_an_intake_says_which_of_its_connections_closed_and_acks_the_open_ones(ctx):
    """Coordinator._unroutable's question, asked of an intake: an open connection gets the
    frames (an ack), a closed one or one it never had is named."""
    port = Port(ctx, "127.0.0.1", 0, NODE_TIMEOUT, SECRET, 1)
    intakes = port.intakes
    agent = _agent(ctx, port.port)
    agent.setsockopt(zmq.LINGER, 5000)
    try:
        agent.send_multipart(_join(Codec(SECRET), "a"))
        assert intakes.hub.poll(5000), "the join was not forwarded"
        [(fd, identity, verified)] = list(intakes.receive(1))
        assert identity[0] == 1 and verified[0] == "join"
        assert intakes.unroutable([identity, b"\x01never"], [b"ack"]) == {b"\x01never"}
        assert agent.poll(5000) and agent.recv_multipart() == [b"ack"]
        agent.close()
        assert intakes.hub.poll(5000), "the close was not forwarded"
        assert list(intakes.receive(1)) == [(fd, b"", None)]
        end = time.monotonic() + 5  # ZeroMQ ends the route after it reports the close
        while intakes.unroutable([identity], [b"ack"]) != {identity}:
            assert time.monotonic() < end, "a closed connection still taken for open"
            time.sleep(0.01)
    finally:
        port.close(linger=0)


def test_an_intake_that_dies_is_the_coordinators_failure(ctx):
    """Its connections died with it: the coordinator stops serving and says why, so its
    agent leaves the job and the others fail over as from any coordinator loss."""
    port = Port(ctx, "127.0.0.1", 0, NODE_TIMEOUT, SECRET, 2, max_nodes=3)
    coordinator = Coordinator(port, SECRET, _state(3))
    try:
        coordinator.start()
        victim = port.intakes._procs[2]
        os.kill(victim.pid, signal.SIGKILL)
        end = time.monotonic() + 5
        while coordinator.failure is None:
            assert time.monotonic() < end, "the coordinator serves on without an intake"
            time.sleep(0.02)
        assert f"intake 2 (pid {victim.pid}) exited" in coordinator.failure
    finally:
        coordinator.close()


def test_a_closed_port_leaves_no_intake_process_nor_its_directory_and_frees_the_port(ctx):
    port = Port(ctx, "127.0.0.1", 0, NODE_TIMEOUT, SECRET, 2)
    pids = [proc.pid for proc in port.intakes._procs.values()]
    directory = port._dir
    assert all(psutil.pid_exists(pid) for pid in pids) and os.path.isdir(directory)
    assert oct(os.stat(directory).st_mode & 0o777) == "0o700"
    number = port.port
    port.close(linger=0)
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"
                   for pid in pids)
    assert not os.path.exists(directory)
    with socket.socket() as again:  # no intake nor held socket keeps it
        again.bind(("127.0.0.1", number))


def test_a_fixed_port_is_one_ports_however_its_rivals_bind_it(ctx):
    """Whoever binds the rendezvous endpoint hosts the job: with intakes the port is bound
    with SO_REUSEPORT, which another agent of the same user could bind too. A second Port
    with intakes fails as on a taken port (its claim: intake._claim), so does a plain bind,
    and a Port with intakes cannot take a port bound the plain way; the first's close
    frees it at once for the next."""
    number = free_port()
    first = Port(ctx, "127.0.0.1", number, NODE_TIMEOUT, SECRET, 1)
    try:
        with pytest.raises(OSError, match="in use"):
            Port(ctx, "127.0.0.1", number, NODE_TIMEOUT, SECRET, 1)
        with pytest.raises(zmq.ZMQError, match="in use"):
            Port(ctx, "127.0.0.1", number, NODE_TIMEOUT, SECRET, 0)
        agent = _agent(ctx, number)  # still served by the first's intake
        agent.send_multipart(_join(Codec(SECRET), "a"))
        assert first.intakes.hub.poll(10_000), "the first Port's intake heard nothing"
        agent.close(linger=0)
    finally:
        first.close(linger=0)
    plain = Port(ctx, "127.0.0.1", number, NODE_TIMEOUT, SECRET, 0)
    try:
        with pytest.raises(OSError, match="in use"):
            Port(ctx, "127.0.0.1", number, NODE_TIMEOUT, SECRET, 1)
    finally:
        plain.close(linger=0)  # (ZeroMQ's I/O thread frees the port after the call)


def test_an_agents_intakes_start_with_room_for_their_share_of_a_large_jobs_connections(
        tmp_path):
    """Intakes inherit the agent's open-file limit: at 16,384 nodes (two connections each:
    the watch) the endpoint's and the standby's two intakes need 16,384 each. The standby's
    started before the agent raised its limit, with the 1,024 a shell gives: most agents
    could not have connected."""
    agent = subprocess.run([sys.executable, "-c", """
import os, resource, sys, psutil, zmq
from launcher.control_plane import ControlPlane
from launcher.coordinator import JobState
resource.setrlimit(resource.RLIMIT_NOFILE, (1024, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
port = int(sys.argv[2])
state = lambda: JobState(min_nodes=1, max_nodes=16384, max_restarts=0, policy="job", backoff=0.0,
                         backoff_max=0.0, exit_barrier_timeout=5.0, node_timeout=5.0,
                         last_call=0.2, join_timeout=10.0, host_node="")
plane = ControlPlane(zmq.Context(), b"intake-test-secret-0123456789abcd", "a", "127.0.0.1",
                     ("127.0.0.1", port), state, 5.0, 0.5, 2, sys.argv[1])
assert plane.hosting
print(*[p.rlimit(psutil.RLIMIT_NOFILE)[0] for p in psutil.Process().children()
        if "launcher.intake" in p.cmdline()], flush=True)
os._exit(0)  # its intakes die with it (PR_SET_PDEATHSIG)
""", str(tmp_path), str(free_port())], capture_output=True, text=True, timeout=60)
    assert agent.returncode == 0, agent.stderr
    limits = [int(limit) for limit in agent.stdout.split()]
    assert len(limits) == 4 and min(limits) >= 16384, limits


def test_intakes_die_with_their_agent():
    """An agent SIGKILLed leaves no intake behind (PR_SET_PDEATHSIG)."""
    agent = subprocess.Popen([sys.executable, "-c", """
import sys, zmq
from launcher.intake import Port
port = Port(zmq.Context(), "127.0.0.1", 0, 5.0, b"intake-test-secret-0123456789abcd", 2)
print(*[p.pid for p in port.intakes._procs.values()], flush=True)
sys.stdin.read()
"""], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(pid) for pid in agent.stdout.readline().split()]
        assert len(pids) == 2
        agent.kill()
        agent.wait(timeout=10)
        end = time.monotonic() + 5
        while any(psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"
                  for pid in pids):
            assert time.monotonic() < end, "an intake outlived its agent"
            time.sleep(0.02)
    finally:
        if agent.poll() is None:
            agent.kill()


def test_a_coordinator_that_stood_down_leaves_its_port_and_intakes_to_the_next(ctx):
    """A standby's coordinator stands down (the job runs at the endpoint); the Port it gives
    back, intakes and connections included, serves the next coordinator on it."""
    codec = Codec(SECRET)
    endpoint = ctx.socket(zmq.ROUTER)
    endpoint_port = endpoint.bind_to_random_port("tcp://127.0.0.1")
    port = Port(ctx, "127.0.0.1", 0, NODE_TIMEOUT, SECRET, 2, max_nodes=2)
    state = _state(2, host="b")
    state.group_ranks, state.expected_count = {"b": 0}, 1
    inside = Coordinator(port, SECRET, state, "coordinator node a lost",
                         ((f"tcp://127.0.0.1:{endpoint_port}",),
                          Redirect(coordinator_node="b", addr="127.0.0.1", port=port.port)))
    spare = _agent(ctx, port.port)
    successor = None
    try:
        inside.start()
        assert endpoint.poll(5000), "the takeover announces itself at the endpoint"
        identity = endpoint.recv_multipart()[0]
        endpoint.send_multipart([identity, *codec.encode(
            Redirect(coordinator_node="a", addr="", port=0), 5)])
        end = time.monotonic() + 5
        while not inside.stood_down:
            assert time.monotonic() < end, "it did not stand down"
            time.sleep(0.01)
        spare.send_multipart(_join(codec, "s", epoch=5))
        assert not spare.poll(500), "answered by a coordinator that stood down"
        given_back = inside.release()
        assert given_back is port
        state = _state(2, host="b")
        state.group_ranks, state.expected_count = {"b": 0}, 1
        successor = Coordinator(given_back, SECRET, state, "coordinator node a lost")
        successor.start()
        assert spare.poll(5000), "the next coordinator does not serve the intakes' joins"
        assert not isinstance(codec.decode(spare.recv_multipart()).body, Redirect)
    finally:
        (successor or inside).close()
        endpoint.close(linger=0)
