"""scripts/ports.py: ports a test hands to a listener it starts later."""

from __future__ import annotations

import socket
from pathlib import Path

import ports


def test_a_picked_port_is_none_the_kernel_would_hand_a_connection_nor_a_slurm_jobs():
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    picked = [ports.free_port() for _ in range(200)]
    assert not [p for p in picked if low <= p <= high or 29400 <= p < 30400], picked
    assert len(set(picked)) == 200, "a picker moves on: none handed out twice in a row"


def test_shares_side_by_side_never_meet(monkeypatch):
    """(monkeypatch puts back this xdist worker's own share afterwards)"""
    every = ports.unclaimed_ports()
    picked = []
    for index in range(3):
        monkeypatch.setattr(ports, "_walker", ports._walk(index, 3))
        picked.append({ports.free_port() for _ in range(300)})
    assert not (picked[0] & picked[1] or picked[1] & picked[2] or picked[0] & picked[2])
    assert set().union(*picked) <= set(every)


def test_a_port_something_listens_on_is_passed_over(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        spare = ports.free_port()  # outside the ephemeral range: nothing else takes it
        monkeypatch.setattr(ports, "_walker", iter([taken, spare]))
        assert ports.free_port() == spare
