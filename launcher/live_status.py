"""The live status line at the bottom of a terminal: what this node and its ranks are doing.

Only when stdout and stderr are both terminals (and ``FTLAUNCH_LIVE`` is not ``0``): then
rich's Live display redraws one status line below the output, and every line the ranks and
the agent print goes above it, whole. Anywhere else (a file, a pipe, a scheduler's log)
nothing is drawn and the output is plain lines, without a control code.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from rich.console import Console
from rich.live import Live
from rich.text import Text

from ftlaunch_contract.messages import RankStates

WAITING = {  # what a phase waits for; {left}: seconds to its deadline, {waited}: in it so far
    "joining": "{waited:.0f}s, waiting for the round",
    "leaving": "ranks saving; SIGKILL in {left:.0f}s",
    "stopping": "stopping ranks",
    "backing_off": "back off {left:.1f}s",
}


def status_line(phase: str, waited: float, left: float | None, fetching: bool, epoch: int,
                restarts: int, max_restarts: int, ranks: RankStates,
                recovery: Mapping[str, float] | None) -> str:
    """This node at a glance: its phase and what it waits for, epoch, restarts, each rank's
    step and heartbeat age, a recovery's phases so far."""
    wait = WAITING.get(phase, "")
    if phase == "preparing":
        wait = "pulling checkpoint shards" if fetching else "waiting for GPU memory"
    detail = " " + wait.format(waited=waited, left=max(0.0, left or 0.0)) if wait else ""
    beats = "  ".join(f"r{r.rank} step {r.step if r.step >= 0 else '-'}"
                      + (f" ♥{r.beat_age_ms / 1000:.1f}s" if r.beat_age_ms >= 0 else "")
                      for r in ranks)
    recovering = "" if recovery is None else "  recovering: " + (
        ", ".join(f"{k} {v:.2f}s" for k, v in recovery.items()) or "deciding")
    return (f"ftlaunch ▸ {phase}{detail} · epoch {epoch} · restarts {restarts}/{max_restarts}"
            f"  {beats}{recovering}")


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
