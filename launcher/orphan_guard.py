"""A tiny watchdog process that kills every rank's process group when the agent dies.

PR_SET_PDEATHSIG kills a rank when the agent dies, but not the rank's own children (data
loader workers, shell pipelines). The guard reads ``+PGID``/``-PGID`` lines from a pipe the
agent holds; when the pipe closes, for any reason including SIGKILL, it kills what is left.
Run it as ``python -m launcher.orphan_guard``; it imports nothing heavy.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys


def main() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # only the agent's death ends the guard
    groups: set[int] = set()
    for line in sys.stdin:
        line = line.strip()
        if line.startswith("+"):
            groups.add(int(line[1:]))
        elif line.startswith("-"):
            groups.discard(int(line[1:]))
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)


class OrphanGuard:
    """The agent's handle on its guard process."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-S", "-c",
             "import sys; sys.path.insert(0, sys.argv[1]); "
             "from launcher.orphan_guard import main; main()", _package_root()],
            stdin=subprocess.PIPE, text=True, start_new_session=True, close_fds=True)

    def watch(self, pgid: int) -> None:
        self._send(f"+{pgid}")

    def forget(self, pgid: int) -> None:
        self._send(f"-{pgid}")

    def _send(self, line: str) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.write(line + "\n")
        self._proc.stdin.flush()

    def close(self) -> None:
        """Normal shutdown: the ranks are already gone, so the guard has nothing left to kill."""
        if self._proc.stdin:
            self._proc.stdin.close()
        self._proc.wait(timeout=10)


def _package_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


if __name__ == "__main__":
    main()
