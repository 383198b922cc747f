"""The coordinator's node lost: how long until the survivors train again.

Three agents on loopback (``--nnodes 2:3``, one rank each, ``train_gpt.py --shim``); node A
hosts the coordinator. Three, not two: a two-node job whose coordinator's machine goes
silent holds its round (its successor cannot tell a dead machine from a cut-off one: see
docs/protocol.md "A partition in two"); of three, the two left are a majority. Mid-run A
is lost in one of two ways, alternating, --reps each:

    process dies  A's agent, template and rank SIGKILLed: their TCP connections close, and
                  the survivor acts on that at once
    machine silent  A's agent, template and rank SIGSTOPped (a frozen or cut-off machine:
                  nothing closes), so the survivor waits --node-timeout

Measured on the successor (the survivor that takes over): the kill/stop -> its "ranks back"
(its recovery) and its rank's next step line, with the detection it logged.

    python scripts/bench_coordinator_loss.py --reps 3 --node-timeout 5
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_node_loss import Agent, wait_listening  # noqa: E402  (same harness)
from ports import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def one_run(mode: str, args, work: Path, env: dict[str, str]) -> dict:
    port = free_port()
    common = ["--nnodes", "2:3", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
              "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"bench-{port}",
              "--node-timeout", str(args.node_timeout), "--heartbeat-interval",
              str(args.node_timeout / 10), str(ROOT / "scripts" / "train_gpt.py"),
              "--steps", "100000", "--step-time", "0.02", "--shim", "--log-every", "1",
              "--ckpt-every", "50", "--ckpt-dir", str(work / f"ckpt-{port}")]
    a = Agent("a", work, common, env)
    others: list[Agent] = []
    try:
        wait_listening(port)
        others = [Agent(name, work, common, env) for name in "bc"]  # within the last call
        for agent in others:
            agent.wait_for(r"\[rank\d\]: step 60 ", timeout=300)
        victims = [psutil.Process(a.proc.pid), *psutil.Process(a.proc.pid).children(True)]
        lost_at = time.time()
        for p in victims:
            p.send_signal(signal.SIGKILL if mode == "process dies" else signal.SIGSTOP)
        following = r"coordinator node \S+ lost: following (this node|\S+) \((.*)\)"
        followed = others[0].wait_for(following, timeout=120, after=lost_at)
        successor = others[0] if followed.group(1) == "this node" else others[1]
        followed = successor.wait_for(following, timeout=120, after=lost_at)
        back = successor.wait_for(r"ranks back", timeout=120, after=lost_at)
        stepped = successor.wait_for(r"\[rank\d\]: step \d+ ", timeout=120, after=lost_at)
        at = {line: ts for ts, line in successor.lines}
        return {"mode": mode, "why": followed.group(2),
                "recovered": back.string.split("ftlaunch: ")[-1],
                "ranks_back": at[back.string] - lost_at, "next_step": at[stepped.string] - lost_at}
    finally:
        if mode != "process dies":
            for p in psutil.Process(a.proc.pid).children(True) + [psutil.Process(a.proc.pid)]:
                p.send_signal(signal.SIGKILL)
        for agent in (a, *others):
            agent.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--node-timeout", type=float, default=5.0)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-coordinator-loss-", dir=os.getcwd()))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "FTLAUNCH_"))}
    env["PYTHONPATH"] = str(ROOT)
    runs = []
    for _ in range(args.reps):
        for mode in ("process dies", "machine silent"):
            run = one_run(mode, args, work, env)
            print(run, flush=True)
            runs.append(run)
    print(f"\ncoordinator's node lost, --node-timeout {args.node_timeout:g}, {args.reps} reps, "
          "medians (min-max)")
    for mode in ("process dies", "machine silent"):
        mine = [r for r in runs if r["mode"] == mode]
        cells = []
        for key in ("ranks_back", "next_step"):
            values = [r[key] for r in mine]
            cells.append(f"{statistics.median(values):.2f} s ({min(values):.2f}-"
                         f"{max(values):.2f})")
        print(f"{mode:15s} ranks back {cells[0]}  next step {cells[1]}  "
              f"({mine[-1]['why']})")


if __name__ == "__main__":
    main()
