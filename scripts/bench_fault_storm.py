"""A fault every --every seconds for --minutes: is every recovery a fork of the rank template?

Runs the unmodified scripts/train_gpt.py (DDP, gloo) with --nproc ranks under ftlaunch
(--restart-backoff 0, a large restart budget), SIGKILLs a random rank every --every seconds
(seeded), then stops the job and reads its events.jsonl: per recovery, how its ranks came
back (resumed / forked / fresh) and ftlaunch's own recovery time (failure -> ranks back),
plus kill -> next step line from the output's stamps.

    python scripts/bench_fault_storm.py --every 30 --minutes 5
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
START = re.compile(r"\[rank(\d+)\]: start rank \d+ world \d+ pid (\d+)")
STEP = re.compile(r"\[rank\d+\]: step \d+ loss")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--every", type=float, default=30.0)
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fault_storm_"))
    cmd = [sys.executable, "-m", "launcher", "--standalone", "--nproc-per-node",
           str(args.nproc), "--max-restarts", "1000", "--restart-backoff", "0",
           "--log-dir", str(work / "logs"), str(REPO / "scripts" / "train_gpt.py"),
           "--steps", "10000000", "--ckpt-dir", str(work / "ckpt"), "--ckpt-every", "20",
           "--step-time", "0.02"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    pids: dict[int, int] = {}
    steps: list[float] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if m := START.search(line):
                pids[int(m[1])] = int(m[2])
            elif STEP.search(line):
                steps.append(time.monotonic())

    threading.Thread(target=read, daemon=True).start()
    rng, kills = random.Random(args.seed), []
    end = time.monotonic() + args.minutes * 60
    next_kill = time.monotonic() + args.every
    while time.monotonic() < end and proc.poll() is None:
        time.sleep(max(0.0, min(next_kill, end) - time.monotonic()))
        if time.monotonic() >= next_kill and len(pids) == args.nproc:
            rank = rng.randrange(args.nproc)
            try:
                os.kill(pids[rank], signal.SIGKILL)
                kills.append(time.monotonic())
            except ProcessLookupError:  # replaced a moment ago: its start line is coming
                pass
            next_kill += args.every
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)
    events = [json.loads(line) for f in (work / "logs").glob("*/events.jsonl")
              for line in f.read_text().splitlines()]
    recovered = [e for e in events if e["event"] == "recovered"]
    to_step = [min((s for s in steps if s > k), default=float("nan")) - k for k in kills]
    print(f"{len(kills)} kills, {len(recovered)} recoveries, every {args.every:g}s for "
          f"{args.minutes:g} min, {args.nproc} ranks, seed {args.seed}")
    for i, e in enumerate(recovered):
        how = " ".join(f"{k} {e[k]}" for k in ("resumed", "forked", "fresh") if e[k])
        print(f"  restart {e['restart_count']}: ranks back {e['seconds']:.3f}s ({how}); "
              f"kill -> next step {to_step[i] if i < len(to_step) else float('nan'):.2f}s")
    fresh = sum(bool(e["fresh"]) for e in recovered)
    print(f"recoveries with a fresh interpreter: {fresh}; kill -> next step median "
          f"{statistics.median(to_step):.2f}s, max {max(to_step):.2f}s" if to_step else "")
    return 0 if recovered and not fresh else 1


if __name__ == "__main__":
    sys.exit(main())
