"""Rank failures: what ended a rank, read from its exit status and torchrun-style error file."""

from __future__ import annotations

import json
import signal
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, kw_only=True)
class RankFailure:
    rank: int
    local_rank: int
    pid: int
    exit_code: int | None  # None when killed by a signal, or alive (it raised and parked)
    signal: str  # "" unless killed by a signal
    error_file: str
    time: float
    message: str = ""
    traceback: str = ""

    @property
    def how(self) -> str:
        if self.signal:
            return f"was killed by {self.signal}"
        if self.exit_code is None:  # trainer_shim: it raised and waits, parked, to re-enter
            return "left its training function"
        return f"exited with code {self.exit_code}"

    @property
    def cause(self) -> str:
        """One line: how it ended and, when the rank recorded it, the exception."""
        return f"{self.how}: {self.message}" if self.message else self.how


def from_returncode(rank: int, local_rank: int, pid: int, returncode: int,
                    error_file: str, agent_cause: str | None = None) -> RankFailure:
    """A failure from ``Popen.returncode`` (negative = signal) plus the rank's error file.

    ``agent_cause`` is why the agent killed the rank (a hang), which the exit cannot tell."""
    exit_code, sig = (returncode, "") if returncode >= 0 else (None, _signal_name(-returncode))
    message, trace, when = _read_error_file(error_file)
    if agent_cause:
        message = agent_cause
    return RankFailure(rank=rank, local_rank=local_rank, pid=pid, exit_code=exit_code,
                       signal=sig, error_file=error_file, time=when or time.time(),
                       message=message, traceback=trace)


def summary(failure: RankFailure) -> str:
    """The root-cause report printed when a job gives up."""
    lines = [f"root cause: rank {failure.rank} (local rank {failure.local_rank}, pid "
             f"{failure.pid}) {failure.how}"]
    if failure.message:
        lines.append(f"  error: {failure.message}")
    if failure.traceback:
        lines.append("  traceback:")
        lines.extend("    " + ln for ln in failure.traceback.rstrip().splitlines())
    elif not failure.message:
        lines.append(f"  (no error file; to record tracebacks, decorate main with "
                     f"torch.distributed.elastic.multiprocessing.errors.record: {failure.error_file})")
    return "\n".join(lines)


def _read_error_file(path: str) -> tuple[str, str, float | None]:
    try:
        data = json.loads(Path(path).read_text())
        body = data["message"]
        if isinstance(body, str):
            return body, "", None
        extra = body.get("extraInfo", {})
        return str(body.get("message", "")), str(extra.get("py_callstack", "")), \
            float(extra.get("timestamp", 0)) or None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return "", "", None


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


PEER_ERRORS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
               "gloo/transport", "remote process exited", "NCCL communicator was aborted",
               "ProcessGroupNCCL's watchdog")
"""What a rank raises when another rank died under it: the failure is the other's."""


def is_peer_error(cause: str) -> bool:
    """Whether a failure's cause reads as a consequence of a peer's failure (a collective's
    connection reset), which a primary failure arriving just after it should name instead."""
    return any(text in cause for text in PEER_ERRORS)
