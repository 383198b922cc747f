"""torch's key-value store, held by the agent: a brand-new one for every attempt.

A fresh store per attempt is what makes restarts safe: no rank of attempt N+1 can read a
key (an address, a barrier count) left by attempt N. The listening socket is bound at once,
so the port can be announced before torch is imported; torch serves it when it is ready.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from datetime import timedelta

log = logging.getLogger("ftlaunch.store")


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
        self._closed = False
        self._lock = threading.Lock()
        threading.Thread(target=self._serve, name="ftlaunch-store", daemon=True).start()

    def _serve(self) -> None:
        try:
            from torch.distributed import TCPStore  # the slow import overlaps with rank start-up

            store = TCPStore(self.addr, self.port, None, True, timedelta(seconds=300),
                             wait_for_workers=False, master_listen_fd=self._fd, use_libuv=True)
        except Exception:  # ranks time out connecting, fail, and the next attempt retries
            log.exception("could not serve torch's store on %s:%d", self.addr, self.port)
            os.close(self._fd)
            return
        with self._lock:
            if not self._closed:
                self._store = store
        del store  # closed before it was ready: served nothing, dropped here

    def close(self) -> None:
        """Stop serving (after the attempt's ranks are gone); never waits for torch's import."""
        with self._lock:
            self._closed = True
            self._store = None
