"""Scripts run as real processes forked from one that imported torch already.

Each process of a multi-rank checkpoint test used to start a fresh interpreter and import
torch (~2 s of CPU each: a third of test_checkpoint.py's time). multiprocessing's
forkserver imports it once per pytest worker; a script's process is then a fork of it, as
ftlaunch's ranks are forks of its warm template. Each is still its own process: its own
gloo group, its own exit (atexit handlers run, as at any interpreter's exit), its own pid
to kill.
"""

from __future__ import annotations

import atexit
import itertools
import multiprocessing
import os
import sys
from pathlib import Path

PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp",
           "torch.distributed.checkpoint.state_dict", "trainer_shim", "torch_procs"]

_context = multiprocessing.get_context("forkserver")
_context.set_forkserver_preload(PRELOAD)
_serial = itertools.count()


def _run(script: str, argv: list[str], out: str) -> None:
    """In the child: ``python -c script *argv`` with its stdout in ``out``."""
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.close(fd)
    sys.argv = ["-c", *argv]
    try:
        exec(compile(script, "<script>", "exec"), {"__name__": "__main__"})
    finally:
        sys.stdout.flush()
        atexit._run_exitfuncs()  # the fork ends with os._exit: run them as an exit would


class Script:
    """One script's process; its stdout is collected in a file beside the test's."""

    def __init__(self, script: str, argv: list[str], out: Path):
        self.out = out
        self.process = _context.Process(target=_run, args=(script, argv, str(out)))
        self.process.start()

    def wait(self, timeout: float) -> int:
        """Its exit code (a signal's: negative); kills it and fails past ``timeout``."""
        self.process.join(timeout)
        if self.process.exitcode is None:
            self.process.kill()
            self.process.join(10)
            raise TimeoutError(f"script did not exit within {timeout} s:\n{self.stdout}")
        return self.process.exitcode

    @property
    def stdout(self) -> str:
        return self.out.read_text() if self.out.exists() else ""


def run_all(script: str, argvs: list[list[str]], outdir: Path,
            timeout: float = 120) -> list[tuple[int, str]]:
    """Start one process per argv at once (the ranks of one group), wait for all: each one's
    exit code and stdout."""
    outdir.mkdir(parents=True, exist_ok=True)
    procs = [Script(script, argv, outdir / f"script-{next(_serial)}.out") for argv in argvs]
    return [(p.wait(timeout), p.stdout) for p in procs]
