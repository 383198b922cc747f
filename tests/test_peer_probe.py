"""Telling a dead peer from a broken connection (launcher/peer_probe.py), on real sockets:
a probe of a port nothing listens on is refused, one of a live listener accepted, one of a
silenced machine unanswered; and the coordinator loses a member whose connection closed
only when its machine refuses the probe."""

from __future__ import annotations

import dataclasses
import errno
import select
import socket
import time

import pytest
from conftest import needs_iptables, silenced
from test_coordinator_state import _running, _two_nodes_joined

from launcher.peer_probe import Probe, Verdict, verdict


def _answer(probe: Probe, within: float = 5.0) -> Verdict:
    """The probe's verdict, waiting on its socket (bounded)."""
    end = time.monotonic() + within
    while (answer := probe.answer()) is None:
        assert time.monotonic() < end, "the probe never answered"
        select.select([], [probe.fd], [], 0.05)
    return answer


def _listener() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def test_errors_say_died_alive_or_nothing():
    assert verdict(0) is Verdict.ALIVE
    assert verdict(errno.ECONNREFUSED) is Verdict.DIED
    for error in (errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EMFILE):
        assert verdict(error) is Verdict.UNKNOWN


def test_a_listening_port_is_alive_and_a_closed_one_died():
    listener = _listener()
    port = listener.getsockname()[1]
    try:
        assert _answer(Probe("127.0.0.1", port, 5.0)) is Verdict.ALIVE
    finally:
        listener.close()
    probe = Probe("127.0.0.1", port, 5.0)
    assert _answer(probe) is Verdict.DIED
    assert probe.answer() is Verdict.DIED and probe.fd >= 0, "answered once, kept"


def test_a_name_is_not_looked_up_and_says_nothing():
    """A probe runs on a failure's path, where DNS may not answer: literal addresses only."""
    assert Probe("localhost", 1, 5.0).answer() is Verdict.UNKNOWN


@needs_iptables
def test_a_silent_machine_says_nothing_by_the_deadline():
    listener = _listener()
    port = listener.getsockname()[1]
    try:
        with silenced([port]):
            probe = Probe("127.0.0.1", port, 0.3)
            assert not select.select([], [probe.fd], [], 0.2)[1], "answered through a DROP"
            assert _answer(probe, within=3.0) is Verdict.UNKNOWN
            assert probe.answer() is Verdict.UNKNOWN
    finally:
        listener.close()


@pytest.mark.parametrize("agent", ["alive", "died"])
def test_the_coordinator_loses_a_member_whose_connection_closed_only_if_it_died(agent):
    """b's connection closed while it was heard from. Its standby port (its agent's
    process) still listens: a network fault, no recovery. Closed too: its agent died."""
    coordinator, socket_ = _two_nodes_joined({"a": (), "b": ()})
    _running(coordinator)
    state, restarts = coordinator._state, coordinator._state.restart_count
    standby = _listener()
    state.members["b"] = dataclasses.replace(state.members["b"], addr="127.0.0.1")
    state.standby_ports["b"] = standby.getsockname()[1]
    if agent == "died":
        standby.close()
    try:
        coordinator._disconnected(b"b", 2.0)
        end = time.monotonic() + 5
        while coordinator._probes:
            assert time.monotonic() < end, "the probe never answered"
            time.sleep(0.01)  # not served: the coordinator's loop would poll the probe's fd
            coordinator._probes_answered(time.monotonic())
    finally:
        standby.close()
    lost = "b" not in state.group_ranks
    assert lost is (agent == "died")
    assert state.restart_count == restarts + lost
    if lost:
        recover = [m.body for _, m in socket_.sent if m.body.TYPE == "recover"][-1]
        assert recover.cause == "node b lost (its agent's connection closed)"
