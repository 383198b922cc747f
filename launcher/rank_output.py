"""Rank output: prefixed lines on the console, copies in per-rank log files (--redirects/--tee)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import IO, Any

from rich.console import Console
from rich.text import Text

from launcher.config import StreamMode

_STYLES = ("cyan", "magenta", "green", "yellow", "blue", "red", "bright_cyan", "bright_magenta")
_OUT = Console(highlight=False, soft_wrap=True, emoji=False, markup=False)
_ERR = Console(stderr=True, highlight=False, soft_wrap=True, emoji=False, markup=False)


def use_console(console: Console) -> None:
    """Print both streams to ``console`` (the live status line's: every line goes above it)."""
    global _OUT, _ERR
    _OUT = _ERR = console


class Pump:
    """Copies one rank stream from a pipe, line by line, to the console and/or a log file."""

    def __init__(self, fd: int, prefix: Text, console: Console | None, file: IO[bytes] | None):
        self.fd = fd
        self._prefix, self._console, self._file = prefix, console, file
        self._partial = b""

    def relabel(self, rank: int) -> None:
        """The process now runs as ``rank`` (resumed in place with a new rank)."""
        self._prefix = rank_prefix(rank)

    def pump(self) -> bool:
        """Move what is readable now; False once the rank closed the stream."""
        try:
            data = os.read(self.fd, 1 << 16)
        except BlockingIOError:
            return True
        if not data:
            self._emit(self._partial, final=True)
            self.close()
            return False
        if self._file:
            self._file.write(data)
            self._file.flush()
        self._emit(self._partial + data)
        return True

    def close(self) -> None:
        """Close the pipe once: the moment it is closed, its number may be another rank's."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self._file:
            self._file.close()

    def _emit(self, data: bytes, final: bool = False) -> None:
        lines = data.split(b"\n")
        self._partial = b"" if final else lines.pop()
        if self._console:
            try:
                for line in lines if not final else [ln for ln in lines if ln]:
                    text = line.decode(errors="replace")
                    # torch prefixes its own tracebacks with "[rankN]: ": do not double it
                    prefix = Text() if text.startswith(self._prefix.plain) else self._prefix
                    self._console.print(prefix + Text(text))
            except BrokenPipeError:  # nobody reads our console any more; keep the job running
                self._console = None


class RankStreams:
    """Where one rank's stdout and stderr go, and the pumps the agent must service.

    A stream shown on the console goes through a pipe the agent reads (and copies to the
    log file under --tee); a stream only redirected is written by the rank to its file.
    """

    def __init__(self, rank: int, log_dir: Path | None, modes: tuple[StreamMode, StreamMode],
                 show_rank: bool):
        self.pumps: list[Pump] = []
        self.popen_kwargs: dict[str, Any] = {}
        self._child_ends: list[int | IO[bytes]] = []  # the agent's copies, closed once the child has them
        prefix = rank_prefix(rank)
        for name, console, mode in (("stdout", _OUT, modes[0]), ("stderr", _ERR, modes[1])):
            file = _open_log(log_dir, name) if mode.file and log_dir else None
            show = show_rank and mode.console
            if show:
                read_end, write_end = os.pipe()
                os.set_blocking(read_end, False)
                self.pumps.append(Pump(read_end, prefix, console, file))
                target: int | IO[bytes] = write_end
            else:
                target = file or open(os.devnull, "wb")  # noqa: SIM115 - closed after spawn
            self.popen_kwargs[name] = target
            self._child_ends.append(target)

    def child_fds(self) -> tuple[int, int]:
        """The (stdout, stderr) descriptors the rank writes to."""
        out, err = (t if isinstance(t, int) else t.fileno()
                    for t in (self.popen_kwargs["stdout"], self.popen_kwargs["stderr"]))
        return out, err

    def after_spawn(self) -> None:
        """Close the agent's copies of what the child now holds."""
        for end in self._child_ends:
            if isinstance(end, int):
                os.close(end)
            else:
                end.close()


def rank_prefix(rank: int) -> Text:
    return Text(f"[rank{rank}]: ", style=_STYLES[rank % len(_STYLES)])


def _open_log(log_dir: Path, name: str) -> IO[bytes]:
    log_dir.mkdir(parents=True, exist_ok=True)
    return open(log_dir / f"{name}.log", "ab")  # noqa: SIM115 - owned by a pump or the child
