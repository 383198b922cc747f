"""Telling a dead peer from a broken connection (launcher/peer_probe.py), on real sockets:
a probe of a port nothing listens on is refused, one of a live ZeroMQ socket greeted, one
of a silenced machine or a frozen process unanswered; and the coordinator loses a member
whose connection closed only when its machine refuses the probe."""

from __future__ import annotations

import dataclasses
import errno
import select
import socket
import time

import pytest
import zmq
from conftest import needs_iptables, silenced
from test_coordinator_state import _running, _two_nodes_joined

from launcher.peer_probe import Probe, Verdict, verdict


def _answer(probe: Probe, within: float = 5.0) -> Verdict:
    """The probe's verdict, waiting on its socket (bounded)."""
    end = time.monotonic() + within
    while (answer := probe.answer()) is None:
        assert time.monotonic() < end, "the probe never answered"
        select.select([probe.fd], [], [], 0.05)
    return answer


def _listener() -> socket.socket:
    """A port the kernel accepts connections on, and no process greets."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def _zmq_router(ctx: zmq.Context) -> tuple[zmq.Socket, int]:
    """What a probe meets at a live agent or coordinator: a ZeroMQ socket, which greets."""
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    return router, router.bind_to_random_port("tcp://127.0.0.1")


def test_errors_say_died_alive_or_nothing():
    assert verdict(0) is Verdict.ALIVE
    assert verdict(errno.ECONNREFUSED) is Verdict.DIED
    assert verdict(errno.ECONNRESET) is Verdict.DIED
    for error in (errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EMFILE):
        assert verdict(error) is Verdict.UNKNOWN


def test_a_live_zeromq_socket_is_alive_and_a_closed_port_died():
    ctx = zmq.Context()
    router, port = _zmq_router(ctx)
    try:
        assert _answer(Probe("127.0.0.1", port, 5.0)) is Verdict.ALIVE
    finally:
        router.close()
        ctx.term()
    probe = Probe("127.0.0.1", port, 5.0)
    assert _answer(probe) is Verdict.DIED
    assert probe.answer() is Verdict.DIED and probe.fd >= 0, "answered once, kept"


def test_a_connection_accepted_by_a_process_already_dying_is_a_death():
    """A SIGKILLed process's sockets close in file-descriptor order: a probe sent as its
    connection closed may be accepted by its listening socket, closed a moment later. The
    accept alone proves nothing; the reset that follows says it died."""
    listener = _listener()
    probe = Probe("127.0.0.1", listener.getsockname()[1], 5.0)
    assert not select.select([probe.fd], [], [], 0.2)[0], "no process greets here"
    assert probe.answer() is None, "accepted by the kernel, not yet answered"
    listener.close()  # the rest of the dying process's descriptors
    assert _answer(probe) is Verdict.DIED


def test_a_port_accepted_but_never_greeted_says_nothing_by_the_deadline():
    """A frozen process: its kernel accepts, its I/O thread never speaks. Silence decides."""
    listener = _listener()
    try:
        assert _answer(Probe("127.0.0.1", listener.getsockname()[1], 0.3)) is Verdict.UNKNOWN
    finally:
        listener.close()


def test_a_name_is_not_looked_up_and_says_nothing():
    """A probe runs on a failure's path, where DNS may not answer: literal addresses only."""
    assert Probe("localhost", 1, 5.0).answer() is Verdict.UNKNOWN


@needs_iptables
def test_a_silent_machine_says_nothing_by_the_deadline():
    ctx = zmq.Context()
    router, port = _zmq_router(ctx)
    try:
        with silenced([port]):
            probe = Probe("127.0.0.1", port, 0.3)
            assert not select.select([probe.fd], [], [], 0.2)[0], "answered through a DROP"
            assert _answer(probe, within=3.0) is Verdict.UNKNOWN
    finally:
        router.close()
        ctx.term()


@pytest.mark.parametrize("agent", ["alive", "died"])
def test_the_coordinator_loses_a_member_whose_connection_closed_only_if_it_died(agent):
    """b's connection closed while it was heard from. Its standby port (its agent's
    process) still listens: a network fault, no recovery. Closed too: its agent died."""
    coordinator, socket_ = _two_nodes_joined({"a": (), "b": ()})
    _running(coordinator)
    state, restarts = coordinator._state, coordinator._state.restart_count
    ctx = zmq.Context()
    standby, port = _zmq_router(ctx)
    state.members["b"] = dataclasses.replace(state.members["b"], addr="127.0.0.1")
    state.standby_ports["b"] = port
    if agent == "died":
        standby.close()
        ctx.term()  # ZeroMQ closes the listening socket in its I/O thread: done by then
    try:
        coordinator._disconnected(b"b", 2.0)
        end = time.monotonic() + 5
        while coordinator._probes:
            assert time.monotonic() < end, "the probe never answered"
            # Not served: the probe's socket is waited on here, as the serving loop polls it.
            select.select([probe.fd for probe in coordinator._probes.values()], [], [], 0.05)
            coordinator._probes_answered(time.monotonic())
    finally:
        if agent == "alive":
            standby.close()
            ctx.term()
    lost = "b" not in state.group_ranks
    assert lost is (agent == "died")
    assert state.restart_count == restarts + lost
    if lost:
        recover = [m.body for _, m in socket_.sent if m.body.TYPE == "recover"][-1]
        assert recover.cause == "node b lost (its agent's connection closed)"


@pytest.mark.parametrize("standby", ["greets", "never greets"])
def test_a_silent_member_whose_machine_answers_knocks_is_lost_only_at_twice_the_timeout(standby):
    """b falls silent. Knocked at its standby port from half the liveness timeout on: its
    ZeroMQ greets (a lossy link holds its heartbeats back, or its agent stalls) -> kept until
    twice the timeout; nothing greets (frozen, cut off) -> lost at the timeout, as ever."""
    coordinator, _ = _two_nodes_joined({"a": (), "b": ()})
    _running(coordinator)
    state, liveness = coordinator._state, coordinator._liveness()
    ctx = zmq.Context()
    router, port = _zmq_router(ctx) if standby == "greets" else (None, 0)
    listener = _listener() if router is None else None
    if listener is not None:
        port = listener.getsockname()[1]
    state.members["b"] = dataclasses.replace(state.members["b"], addr="127.0.0.1")
    state.standby_ports["b"] = port
    heard = state.last_seen["b"]
    try:
        knocking = heard + 0.6 * liveness  # the clock of the job's messages, not the probe's
        coordinator._tick(knocking)
        end = time.monotonic() + 5
        while standby == "greets" and coordinator._knock("b", knocking) < 0:
            assert time.monotonic() < end, "the knock was never answered"
            select.select(coordinator._knocks["b"].fds, [], [], 0.05)
        coordinator._tick(heard + 1.1 * liveness)
        assert ("b" in state.group_ranks) is (standby == "greets")
        coordinator._tick(heard + 2.1 * liveness)
        assert "b" not in state.group_ranks, "silent for twice the timeout, and kept"
        assert not coordinator._knocks, "a knock left open"
    finally:
        if router is not None:
            router.close()
        if listener is not None:
            listener.close()
        ctx.term()


def test_a_silent_member_that_announced_a_takeover_is_lost_at_the_timeout_though_it_answers():
    """a, cut off, was healed; b took over meanwhile and announces itself to a. b's agent
    follows its own coordinator, so b's machine answering a's knocks tells nothing of a
    stall: lost at the liveness timeout, not twice it (chaos 2-node seed 3900: a's round of
    a and b held b's 5.5 s, its own half of the job waiting until a let go)."""
    from ftlaunch_contract.messages import Redirect
    from ftlaunch_contract.protocol import Envelope

    coordinator, _ = _two_nodes_joined({"a": (), "b": ()})
    _running(coordinator)
    state, liveness = coordinator._state, coordinator._liveness()
    ctx = zmq.Context()
    router, port = _zmq_router(ctx)
    state.members["b"] = dataclasses.replace(state.members["b"], addr="127.0.0.1")
    state.standby_ports["b"] = port
    heard = state.last_seen["b"]
    try:
        knocking = heard + 0.6 * liveness
        coordinator._tick(knocking)
        end = time.monotonic() + 5
        while coordinator._knock("b", knocking) < 0:
            assert time.monotonic() < end, "the knock was never answered"
            select.select(coordinator._knocks["b"].fds, [], [], 0.05)
        coordinator._handle(b"b-announcer", Envelope(state.epoch, Redirect(
            coordinator_node="b", addr="127.0.0.1", port=port)), heard + 0.7 * liveness)
        assert state.redirect is None, "a keeps its round until b is lost"
        coordinator._tick(heard + 1.1 * liveness)
        assert "b" not in state.group_ranks, "b hosts the job, and a waited on its knocks"
    finally:
        router.close()
        ctx.term()
