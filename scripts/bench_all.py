"""Every benchmark in one command: run one after another, one markdown report of them all.

Each benchmark is its own script (scripts/bench_*.py, scripts/chaos.py) and compares against
the alternatives in its own run (torchrun, torch's c10d rendezvous, NVRx, dd, a memcpy); this
runs them in turn, never two at once (the machine is the measuring instrument), and writes
their tables with the date, commit, machine and the exact command of each, for BENCHMARKS.md.
A benchmark that fails is reported as failed and the others still run.

    python scripts/bench_all.py --quick --out /tmp/bench.md      # each at its smallest (~15 min)
    python scripts/bench_all.py --out /tmp/bench.md              # BENCHMARKS.md's sizes (hours)
    python scripts/bench_all.py --only recovery,checkpoint
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Bench:
    name: str
    what: str
    args: tuple[str, ...]  # BENCHMARKS.md's sizes
    quick: tuple[str, ...]  # the smallest run that still says something


BENCHES = (
    Bench("recovery", "kill -9 of one rank -> first step again, and launch -> first step: "
          "torchrun vs ftlaunch",
          ("scripts/bench_recovery.py", "--reps", "3", "--kill-step", "25",
           "--launchers", "torchrun,ftlaunch-plain,ftlaunch-rank"),
          ("scripts/bench_recovery.py", "--reps", "1", "--nproc", "2",
           "--launchers", "torchrun,ftlaunch-plain,ftlaunch-rank")),
    Bench("hang", "a hung rank -> detected, against --hang-timeout; heartbeat overhead per step",
          ("scripts/bench_recovery.py", "--reps", "0", "--hang-timeouts", "1,2,5",
           "--overhead-steps", "2000"),
          ("scripts/bench_recovery.py", "--reps", "0", "--nproc", "2", "--hang-timeouts", "2",
           "--overhead-steps", "300")),
    Bench("checkpoint", "the training stall and time to durable of a save, against a memcpy "
          "and dd of the same bytes",
          ("scripts/bench_checkpoint.py", "--gib", "1", "--reps", "3"),
          ("scripts/bench_checkpoint.py", "--gib", "0.25", "--reps", "1")),
    Bench("node loss", "a node SIGKILLed -> training again, restoring from a peer's memory vs "
          "local disk (page cache dropped)",
          ("scripts/bench_node_loss.py", "--gib", "1", "--reps", "2",
           "--modes", "peer memory,local disk"),
          ("scripts/bench_node_loss.py", "--gib", "0.25", "--reps", "1",
           "--modes", "peer memory,local disk")),
    Bench("reshard", "a resized world's restore: where the saved parts sit, gathered vs "
          "from the saved layout, one rank's work",
          ("scripts/bench_reshard.py", "--ranks", "4096,16384,131072"),
          ("scripts/bench_reshard.py", "--ranks", "1024,4096", "--gather-up-to", "4096")),
    Bench("coordinator loss", "the coordinator's node killed (process dies) vs stopped (silent)",
          ("scripts/bench_coordinator_loss.py", "--reps", "3", "--node-timeout", "5"),
          ("scripts/bench_coordinator_loss.py", "--reps", "1", "--node-timeout", "2")),
    Bench("lossy link", "30 % packet loss on a live job's links: false verdicts of a lost "
          "coordinator or agent, and of the silence alone (as root)",
          ("scripts/bench_lossy_link.py", "--seconds", "300", "--agents", "8"),
          ("scripts/bench_lossy_link.py", "--seconds", "60", "--agents", "4", "--lossy",
           "coordinator")),
    Bench("rendezvous", "N simulated agents form a job: ftlaunch vs torch's c10d rendezvous; "
          "heartbeat CPU, node loss, failover",
          ("scripts/bench_rendezvous.py", "--sizes", "1024,4096,8192,16384", "--torch-max", "64"),
          ("scripts/bench_rendezvous.py", "--sizes", "256", "--torch-max", "0")),
    Bench("coordinator", "the coordinator alone on a core: CPU under a large job's heartbeats, "
          "a takeover's joins and assigns",
          ("scripts/bench_coordinator.py", "--nodes", "1024,4096,8192,16384"),
          ("scripts/bench_coordinator.py", "--nodes", "1024", "--window", "5")),
    Bench("goodput", "productive step time / wall under a kill -9 every 60 s and 30 s: "
          "ftlaunch vs torchrun vs NVRx ft_launcher vs DLRover dlrover-run vs TorchFT",
          ("scripts/bench_goodput.py", "--minutes", "4", "--every", "60,30"),
          ("scripts/bench_goodput.py", "--minutes", "1", "--every", "30", "--variants", "plain",
           "--launchers", "ftlaunch,torchrun")),
    Bench("chaos", "a seeded fault campaign and its invariants",
          ("scripts/chaos.py", "--seed", "100", "--campaign", "14", "--faults", "5", "--nodes",
           "2", "--nproc", "1", "--fsdp"),
          ("scripts/chaos.py", "--seed", "100", "--campaign", "1", "--faults", "4", "--nodes",
           "2", "--nproc", "1")),
)

ANCHORS = """| figure | torchrun | NVRx ft_launcher | DLRover dlrover-run | TorchFT (its own loop) | where measured |
|---|---|---|---|---|---|
| goodput at a kill -9 a minute (DDP, gloo) | 0.909-0.922 | see goodput above | see goodput above | see goodput above | issue #17, this machine |
| recovery after kill -9 of one rank | 4.4 s (with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) | - | - | - | BENCHMARKS.md "Recovery after kill -9" |
| rendezvous of 64 agents | torch c10d, see rendezvous above | - | - | - | the same run |"""


def machine() -> str:
    mem = psutil.virtual_memory().total / 2**30
    try:
        import torch
        torch_version = torch.__version__
    except ImportError:
        torch_version = "not installed"
    return (f"{platform.node()}: {os.cpu_count()} cores ({platform.processor() or platform.machine()}),"
            f" {mem:.0f} GiB, Linux {platform.release()}, Python {platform.python_version()}, "
            f"torch {torch_version}, load average {os.getloadavg()[0]:.2f} at the start")


def commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()
    dirty = " (with uncommitted changes)" if git("status", "--porcelain", "--untracked-files=no") else ""
    return (git("rev-parse", "--short", "HEAD") or "unknown") + dirty


def run(bench: Bench, quick: bool, timeout: float) -> tuple[str, str, int, float]:
    """(the command, its output, its exit code, seconds); output is echoed as it comes."""
    args = bench.quick if quick else bench.args
    command = " ".join(["python", *args])
    print(f"\n=== {bench.name}: {command}", flush=True)
    began, lines = time.monotonic(), []
    proc = subprocess.Popen([sys.executable, *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            lines.append(line)
            if time.monotonic() - began > timeout:
                raise subprocess.TimeoutExpired(command, timeout)
        code = proc.wait(timeout=max(1.0, timeout - (time.monotonic() - began)))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        lines.append(f"\n(killed after {timeout:g}s)\n")
        code = 124
    return command, "".join(lines), code, time.monotonic() - began


def report(results: list[tuple[Bench, str, str, int, float]], quick: bool, started: str) -> str:
    parts = [f"# Benchmarks, {started}", "",
             f"- commit: {commit()}", f"- machine: {machine()}",
             f"- command: `python scripts/bench_all.py{' --quick' if quick else ''}` "
             "(each benchmark alone, one after another)", ""]
    for bench, command, output, code, seconds in results:
        status = "ok" if code == 0 else f"FAILED (exit {code})"
        parts += [f"## {bench.name}", "", bench.what + ".", "",
                  f"`{command}` — {status}, {seconds:.0f} s", "", "```",
                  _tail(output).rstrip(), "```", ""]
    parts += ["## Anchors", "", ANCHORS, ""]
    return "\n".join(parts)


def _tail(output: str, lines: int = 80) -> str:
    """The end of a benchmark's output: its tables (progress lines come before them)."""
    kept = output.splitlines()[-lines:]
    return "\n".join(kept)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="each benchmark at its smallest")
    p.add_argument("--only", default="", help="comma list of: " + ",".join(b.name for b in BENCHES))
    p.add_argument("--out", type=Path, default=None, help="the markdown report (else stdout)")
    p.add_argument("--timeout", type=float, default=7200, help="seconds per benchmark")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    if unknown := set(names) - {b.name for b in BENCHES}:
        p.error(f"unknown benchmark(s) {sorted(unknown)}: choose from "
                + ", ".join(b.name for b in BENCHES))
    chosen = [b for b in BENCHES if not names or b.name in names]
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    results = [(b, *run(b, args.quick, args.timeout)) for b in chosen]
    text = report(results, args.quick, started)
    if args.out:
        args.out.write_text(text)
        print(f"\nreport: {args.out}")
    else:
        print(text)
    return 0 if all(code == 0 for *_, code, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
