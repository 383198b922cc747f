"""The demo: 4 ranks, forked from the node's rank template, train a tiny GPT under ftlaunch
with trainer_shim; one rank is killed with SIGKILL; the three survivors re-enter in place, a
new fork of the template replaces the dead one, all resume from the last asynchronous checkpoint (from
the shared memory the agent owns, not from disk), and the job finishes.
Run it with scripts/demo.sh."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KILL_RANK, KILL_AT_STEP, STEPS = 2, 40, 400


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="ftlaunch_demo_"))
    cmd = [sys.executable, "-m", "launcher", "--standalone", "--nproc-per-node", "4",
           "--log-dir", str(work / "logs"), str(ROOT / "scripts" / "train_gpt.py"),
           "--steps", str(STEPS), "--ckpt-every", "10", "--log-every", "10", "--step-time", "0.03",
           "--ckpt-dir", str(work / "ckpt"), "--out", str(work / "result.json"), "--shim",
           "--async-ckpt"]
    print(f"$ ftlaunch {' '.join(cmd[3:])}\n", flush=True)
    agent = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    pid, killed_at = None, None
    for line in agent.stdout:
        sys.stdout.write(line)
        if m := re.search(rf"\[rank{KILL_RANK}\]: start rank {KILL_RANK} .*pid (\d+)", line):
            pid = int(m.group(1))
        step = re.search(rf"\[rank{KILL_RANK}\]: step (\d+) ", line)
        if killed_at is None and pid and step and int(step.group(1)) >= KILL_AT_STEP:
            print(f"\n>>> demo: kill -9 {pid} (rank {KILL_RANK}) at step {step.group(1)}\n",
                  flush=True)
            os.kill(pid, signal.SIGKILL)
            killed_at = time.monotonic()
    code = agent.wait()
    result = json.loads((work / "result.json").read_text()) if code == 0 else {}
    print(f"\n>>> demo: ftlaunch exited {code}; restarts {result.get('restart_count')}, resumed "
          f"from step {result.get('resumed_from')}, finished step {result.get('final_step')}, "
          f"final loss {result.get('loss', float('nan')):.4f}")
    print(f">>> demo: events in {next((work / 'logs').glob('*/events.jsonl'), None)}")
    return 0 if code == 0 and result.get("restart_count") == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
