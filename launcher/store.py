"""torch's key-value store, held by the agent: a brand-new one for every attempt.

A fresh store per attempt is what makes restarts safe: no rank of attempt N+1 can read a
key (an address, a barrier count) left by attempt N. The listening socket is bound at once,
so the port can be announced before torch is imported; torch serves it when it is ready.
"""

from __future__ import annotations

import socket
import threading
from datetime import timedelta


class AgentStore:
    """One TCPStore server on a socket this agent bound itself."""

    def __init__(self, addr: str, port: int = 0):
        sock = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, port))
        sock.listen(1024)
        self.addr = addr
        self.port = sock.getsockname()[1]
        self._fd = sock.detach()  # TCPStore takes ownership and closes it
        self._store = None
        self._ready = threading.Event()
        threading.Thread(target=self._serve, name="ftlaunch-store", daemon=True).start()

    def _serve(self) -> None:
        from torch.distributed import TCPStore  # the slow import overlaps with rank start-up

        self._store = TCPStore(self.addr, self.port, None, True, timedelta(seconds=300),
                               wait_for_workers=False, master_listen_fd=self._fd, use_libuv=True)
        self._ready.set()

    def wait_ready(self, timeout: float) -> bool:
        return self._ready.wait(timeout)

    def close(self) -> None:
        """Stop serving (after the attempt's ranks are gone)."""
        self._ready.wait(60)
        self._store = None
