"""Did the process behind a closed connection die, or did the network between us fail?

ZeroMQ reports both alike, a disconnect with no reason: a peer process that exited (its
kernel closed its connections) and a connection our kernel ended while the peer lives
(TCP_USER_TIMEOUT under packet loss, while its messages still reach us the other way).
Only the first is a death, acted on at once and counted for no side of a partition; taking
the second for one replaces a live node and can let both sides of a lossy link go on alone.
A fresh connect to the peer's listening port tells them apart within a round trip: refused,
nothing listens there any more (the process died); accepted, it lives; no answer, the probe
says nothing and the peer's silence decides, after the node timeout, as for any machine.
"""

from __future__ import annotations

import enum
import errno
import select
import socket
import time


class Verdict(enum.Enum):
    DIED = "died"  # its machine answered and refused: no process listens any more
    ALIVE = "alive"  # its machine accepted: the process (or its kernel, for a frozen one) is there
    UNKNOWN = "unknown"  # no answer in time, or no route: silence will decide


def verdict(error: int) -> Verdict:
    """What a finished connect's error (0: connected) says of the peer."""
    if error == 0:
        return Verdict.ALIVE
    if error == errno.ECONNREFUSED:
        return Verdict.DIED
    return Verdict.UNKNOWN


class Probe:
    """One non-blocking connect to ``host:port``: poll ``fd`` for writing (a refusal shows
    there as an error) and read ``answer()``, None while it is under way. ``fd`` keeps its
    number once the answer closed the socket, to unregister it; -1 if never polled."""

    def __init__(self, host: str, port: int, timeout: float):
        self.deadline = time.monotonic() + timeout
        self._result: Verdict | None = None
        self._sock: socket.socket | None = None
        try:
            family, kind, proto, _, address = socket.getaddrinfo(
                host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)[0]
            self._sock = socket.socket(family, kind, proto)
            self._sock.setblocking(False)
            error = self._sock.connect_ex(address)
        except OSError as e:  # not a literal address, no route, no file descriptors
            error = e.errno or errno.EINVAL
        if error not in (errno.EINPROGRESS, errno.EAGAIN):
            self._settle(error)
        self.fd = self._sock.fileno() if self._sock is not None else -1

    def answer(self, now: float | None = None) -> Verdict | None:
        """The verdict once the connect finished (or timed out: UNKNOWN), else None."""
        if self._result is None and self._sock is not None:
            poller = select.poll()  # not select(): a coordinator holds fds past 1,024
            poller.register(self._sock, select.POLLOUT)
            if poller.poll(0):
                self._settle(self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR))
            elif (time.monotonic() if now is None else now) >= self.deadline:
                self._settle(errno.ETIMEDOUT)
        return self._result

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _settle(self, error: int) -> None:
        self._result = verdict(error)
        self.close()
