"""Ports for a process started later to listen on (an agent's endpoint, a server).

A port bound to 0 and closed is an ephemeral one: between the pick and the listener's bind,
any process connecting anywhere may be given it as its own end, and the listener then fails
to bind (a test's agent could not host its job; another's rank waited on a store no one
held). The kernel draws every connection's own port, and every bind to port 0, from
``ip_local_port_range``; these ports come from below it, short of those a SLURM job derives
from its id (29400 + id % 1000, launcher.cluster_env), so only another picker could take
one. Pickers running side by side (pytest-xdist's workers) each take their own share.
"""

from __future__ import annotations

import secrets
import socket
from collections.abc import Iterator
from pathlib import Path


def unclaimed_ports() -> range:
    """Ports the kernel never hands out by itself."""
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    below = range(max(1024, low - 8192), min(low, 29400))
    return below if len(below) >= 1024 else range(max(high + 1, 30400), 65536)


def _walk(index: int, count: int) -> Iterator[int]:
    """Share ``index`` of ``count``, from a random place in it (another picker on the machine
    is unlikely to be at the same place), round and round."""
    ports = unclaimed_ports()
    share = ports[index * len(ports) // count:(index + 1) * len(ports) // count]
    start = secrets.randbelow(len(share))
    while True:
        yield from share[start:]
        yield from share[:start]
        start = 0


_walker = _walk(0, 1)


def take_share(index: int, count: int) -> None:
    """From now on, pick only from share ``index`` of ``count`` (one per parallel picker)."""
    global _walker
    _walker = _walk(index, count)


def free_port() -> int:
    """The next port of this picker's share that nothing holds (no listener, nothing in
    TIME_WAIT); it moves on, so a port it handed out is not handed out again soon."""
    for _ in range(len(unclaimed_ports())):
        port = next(_walker)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {unclaimed_ports()}")
