"""The live status line at the bottom of a terminal: what this node and its ranks are doing.

Only when stdout and stderr are both terminals (and ``FTLAUNCH_LIVE`` is not ``0``): then
rich's Live display redraws one status line below the output, and every line the ranks and
the agent print goes above it, whole. Anywhere else (a file, a pipe, a scheduler's log)
nothing is drawn and the output is plain lines, without a control code.
"""

from __future__ import annotations

import os
import sys

from rich.console import Console
from rich.live import Live
from rich.text import Text


class LiveStatus:
    def __init__(self) -> None:
        from launcher import events, rank_output

        console = Console(stderr=True, highlight=False, soft_wrap=True, emoji=False,
                          markup=False)
        self._live = Live(Text("ftlaunch ▸ starting", style="dim"), console=console,
                          refresh_per_second=4, transient=True, redirect_stdout=True,
                          redirect_stderr=True)
        self._live.start()
        for module in (events, rank_output):  # their lines go above the status line, whole
            module.use_console(console)

    @classmethod
    def start_if_terminal(cls) -> LiveStatus | None:
        if os.environ.get("FTLAUNCH_LIVE") == "0" or not (sys.stdout.isatty()
                                                          and sys.stderr.isatty()):
            return None
        return cls()

    def show(self, line: str) -> None:
        """The status line now (the display redraws it on its own clock)."""
        self._live.update(Text(line, style="dim"))

    def stop(self) -> None:
        self._live.stop()
