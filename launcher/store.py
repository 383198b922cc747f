"""torch's key-value store, held by the agent: a brand-new one for every attempt.

A fresh store per attempt is what makes restarts safe: no rank of attempt N+1 can read a
key (an address, a barrier count) left by attempt N. The agent binds the listening socket
itself, so the port is known at once; a small child process imports torch and serves it.
The child keeps torch's multi-second import (which holds the GIL) out of the agent, whose
heartbeats and coordinator must never stall; it dies with the agent (PR_SET_PDEATHSIG).
While the rank template is still importing torch, the child waits for it (the ranks do too):
a second import beside it would slow the job's start-up on a busy node.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys

from launcher.rank_template import RankTemplate
from launcher.workers import die_with_agent

_SERVE = """
import signal, sys
from datetime import timedelta
from torch.distributed import TCPStore
addr, port, fd = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
store = TCPStore(addr, port, None, True, timedelta(seconds=300), wait_for_workers=False,
                 master_listen_fd=fd, use_libuv=True)
signal.pause()
"""


class AgentStore:
    """One TCPStore server, in a child process, on a socket this agent bound: forked from
    the rank ``template`` when there is one (it serves at once), else a new interpreter
    (it serves once torch is imported: seconds). Clients that come before the server are
    held in the socket's backlog."""

    def __init__(self, addr: str, port: int = 0, template: RankTemplate | None = None):
        sock = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, port))
        sock.listen(1024)
        self.addr = addr
        self.port = sock.getsockname()[1]
        self._listening: socket.socket | None = sock  # until a server holds it
        self._template = template
        self._server: subprocess.Popen | None = None
        self._forked: int | None = None
        if template is None or not template.starting:
            self.serve()

    def serve(self) -> None:
        """Start the server now, if it is not running yet (the agent calls this as its
        ranks start: the template is ready by then, or they start without it)."""
        if self._listening is None:
            return
        with self._listening as sock:  # the child holds its own copy of the listening socket
            self._listening = None
            self._forked = self._template.fork_store(self.addr, self.port, sock.fileno()) \
                if self._template is not None else None
            if self._forked is None:
                self._server = subprocess.Popen(
                    [sys.executable, "-c", _SERVE, self.addr, str(self.port), str(sock.fileno())],
                    pass_fds=[sock.fileno()], stdin=subprocess.DEVNULL, close_fds=True,
                    preexec_fn=die_with_agent(os.getpid()))

    def close(self) -> None:
        """Stop serving (after the attempt's ranks are gone); a forked server is reaped
        by the template."""
        if self._listening is not None:
            self._listening.close()
            self._listening = None
        if self._server is not None:
            self._server.send_signal(signal.SIGKILL)
            self._server.wait()
        elif self._forked is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._forked, signal.SIGKILL)
