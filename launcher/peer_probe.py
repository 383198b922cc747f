"""Did the process behind a closed connection die, or did the network between us fail?

ZeroMQ reports both alike, a disconnect with no reason: a peer process that exited (its
kernel closed its connections) and a connection our kernel ended while the peer lives
(TCP_USER_TIMEOUT under packet loss, while its messages still reach us the other way).
Only the first is a death, acted on at once and counted for no side of a partition; taking
the second for one replaces a live node and can let both sides of a lossy link go on alone.
A fresh connect to the peer's listening port (a ZeroMQ socket) tells them apart within a
round trip: refused, nothing listens there any more, or reset, it was closed meanwhile (the
process died); greeted, a live ZeroMQ I/O thread accepted it; no answer, the probe says
nothing and the peer's silence decides, after the node timeout, as for any machine. A kernel
accepting is not enough: a SIGKILLed process's connections close in the order of their file
descriptors, and a probe that comes between its connection's close and its listening
socket's is accepted by a process already dead (then reset).
"""

from __future__ import annotations

import enum
import errno
import select
import socket
import time


class Verdict(enum.Enum):
    DIED = "died"  # its machine refused, or reset what it had accepted: no process listens
    ALIVE = "alive"  # its process greeted us: it lives
    UNKNOWN = "unknown"  # no answer in time, or no route: silence will decide


def no_death(answer: Verdict) -> str:
    """How a probe that found no death is reported: the peer lives, or said nothing."""
    return "answers" if answer is Verdict.ALIVE else "did not answer in time"


def verdict(error: int) -> Verdict:
    """What a finished connect's error (0: connected) says of the peer."""
    if error == 0:
        return Verdict.ALIVE
    if error in (errno.ECONNREFUSED, errno.ECONNRESET):
        return Verdict.DIED
    return Verdict.UNKNOWN


class Probe:
    """One non-blocking connect to ``host:port``: poll ``fd`` for reading (a refusal or a
    reset shows there as an error, a greeting as data) and read ``answer()``, None while it
    is under way. ``fd`` keeps its number once the answer closed the socket, to unregister
    it; -1 if never polled."""

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
        """The verdict once the peer greeted, refused or reset (or the deadline passed:
        UNKNOWN), else None."""
        if self._result is None and self._sock is not None:
            poller = select.poll()  # not select(): a coordinator holds fds past 1,024
            poller.register(self._sock, select.POLLIN)
            if poller.poll(0):
                self._settle(self._said())
            elif (time.monotonic() if now is None else now) >= self.deadline:
                self._settle(errno.ETIMEDOUT)
        return self._result

    def _said(self) -> int:
        """What a readable probe shows: 0 for a greeting, else an error (an end of stream
        as a reset)."""
        assert self._sock is not None
        error = self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if error:
            return error
        try:
            return 0 if self._sock.recv(1, socket.MSG_PEEK) else errno.ECONNRESET
        except OSError as e:
            return e.errno or errno.ECONNRESET

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _settle(self, error: int) -> None:
        self._result = verdict(error)
        self.close()


class Knocks:
    """Knocks at a silent peer's port (see membership.lost_by_silence): a fresh connect every
    ``every`` seconds, each waited on for ``patience`` (TCP resends a lost SYN-ACK after a
    second: knocks that overlap do not wait on one another), and when the last greeting came.
    A greeting is a live ZeroMQ socket's (Verdict.ALIVE); a refusal or silence says nothing
    here: the peer's death is the closed connection's probe's to find."""

    def __init__(self, host: str, port: int, every: float, patience: float):
        self._host, self._port = host, port
        self._every, self._patience = every, patience
        self._knocks: list[Probe] = []
        self._next = 0.0
        self.answered_at = -1e9

    def knock(self, now: float) -> float:
        """Read the knocks' answers, knock again when due; when the peer last answered."""
        for probe in list(self._knocks):
            if (answer := probe.answer(now)) is not None:
                self._knocks.remove(probe)
                if answer is Verdict.ALIVE:
                    self.answered_at = now
        if now >= self._next:
            self._knocks.append(Probe(self._host, self._port, self._patience))
            self._next = now + self._every
        return self.answered_at

    @property
    def fds(self) -> list[int]:
        """The knocks under way, to wait on (their answers are read at the next knock())."""
        return [probe.fd for probe in self._knocks]

    def close(self) -> None:
        for probe in self._knocks:
            probe.close()
        self._knocks = []
