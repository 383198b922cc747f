"""Node loss, end to end: a node's agent and ranks are SIGKILLed mid-job and a hot spare
takes its place; how long until the job trains again, restoring --gib GiB per rank from a
peer's memory or from storage.

Three agents on loopback (--nnodes 2:2, one rank each; the third waits as a hot spare),
real gloo, a rank script that holds --gib GiB of fp32 state and saves it through
trainer_shim's AsyncCheckpointer every --ckpt-every steps. Once a save is committed (and,
with replicas, held in the other node's memory) and a few steps more have run, node B's
agent, template and rank are SIGKILLed at once. Measured: the kill -> the spare's rank
takes its first training step (the job trains again: every step is a collective), with
the phases that make it up. Modes, alternating, --reps each:

    peer memory   --ckpt-replicas 1: the spare pulls B's shard from node A's memory
    local disk    --ckpt-replicas 0: the spare reads the POSIX checkpoint, page cache
                  dropped just before the kill (root only; else says so)
    S3            --ckpt-replicas 0, checkpoints in a local s3rver bucket (--s3 PATH to
                  npm's s3rver; its objects sit on the local disk, page cache dropped too)

    python scripts/bench_node_loss.py --gib 1 --reps 2 --s3 /tmp/s3rver/node_modules/.bin/s3rver
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
from ports import free_port

ROOT = Path(__file__).resolve().parents[1]

RANK_SCRIPT = """
import os, sys, time, torch, torch.distributed as dist
from trainer_shim.checkpoint import AsyncCheckpointer
gib, every, step_time, steps, uri = float(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), \\
    int(sys.argv[4]), sys.argv[5]
dist.init_process_group("gloo")
rank = dist.get_rank()
n = max(1, int(gib * (1 << 30) / 4 / (16 << 20)))
state = {f"w{i}": torch.zeros(16 << 20) for i in range(n)}  # the model, built and initialised
ckpt = AsyncCheckpointer(uri, keep_last=2)
t0 = time.perf_counter()
start = ckpt.load_latest(state=state)
print(f"restored {start} from {ckpt.restored_from} in {time.perf_counter() - t0:.3f}s",
      flush=True)
one = torch.ones(1)
for step in range(start + 1, steps + 1):
    dist.all_reduce(one)
    state["w0"][0] = step
    time.sleep(step_time)
    print(f"step {step} at {time.time():.3f}", flush=True)
    if step % every == 0:
        ckpt.save(step, state=state)
ckpt.close()
"""


class Agent:
    """One ftlaunch agent (a "node"), its output collected line by line."""

    def __init__(self, name: str, work: Path, args: list[str], env: dict[str, str]):
        self.name, self.log_dir = name, Path(tempfile.mkdtemp(prefix=f"logs-{name}-", dir=work))
        self.lines: list[tuple[float, str]] = []
        self._new = threading.Condition()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "launcher", "--log-dir", str(self.log_dir), *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=work,
            start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with (self.log_dir / "output.txt").open("w") as log:  # kept when a run fails
            for line in self.proc.stdout:
                log.write(line)
                with self._new:
                    self.lines.append((time.time(), line.rstrip("\n")))
                    self._new.notify_all()

    def wait_for(self, pattern: str, timeout: float = 300, after: float = 0.0) -> re.Match:
        regex, seen = re.compile(pattern), 0
        deadline = time.monotonic() + timeout
        with self._new:
            while True:
                for ts, line in self.lines[seen:]:
                    if ts >= after and (m := regex.search(line)):
                        return m
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not left):
                    tail = "\n".join(line for _, line in self.lines[-30:])
                    raise TimeoutError(f"{self.name}: no {pattern!r}:\n{tail}")
                self._new.wait(min(left, 1.0))

    def events(self) -> list[dict]:
        found = []
        for path in self.log_dir.glob("*/events.jsonl"):
            found += [json.loads(line) for line in path.read_text().splitlines() if line]
        return sorted(found, key=lambda e: e["ts"])

    def kill_node(self) -> None:
        """The whole node at once: the agent and everything it started."""
        try:
            procs = [psutil.Process(self.proc.pid)]
            procs += procs[0].children(recursive=True)
        except psutil.NoSuchProcess:
            return
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        for staging in Path("/dev/shm").glob(f"ftlaunch-staging-{self.proc.pid}-*"):
            shutil.rmtree(staging, ignore_errors=True)  # the node's memory is gone with it

    def stop(self) -> None:
        """As a scheduler ends a job: SIGTERM, then SIGKILL after a bound."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.kill_node()


def wait_listening(port: int, timeout: float = 120) -> None:
    """Until node a's coordinator listens on ``port``."""
    deadline = time.monotonic() + timeout
    while not any(c.laddr.port == port and c.status == psutil.CONN_LISTEN
                  for c in psutil.net_connections("tcp")):
        if time.monotonic() > deadline:
            raise TimeoutError("node a's coordinator never listened")
        time.sleep(0.05)  # the kernel's socket table: no event to wait on


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def one_run(mode: str, args, work: Path, env: dict[str, str], uri: str) -> dict:
    port = free_port()
    script = work / "rank.py"
    common = ["--nnodes", "2:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
              "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"bench-{mode}-{port}",
              "--node-timeout", str(args.node_timeout), "--heartbeat-interval",
              str(args.node_timeout / 5), "--ckpt-replicas", "1" if mode == "peer memory" else "0",
              str(script), str(args.gib), str(args.ckpt_every), str(args.step_time),
              "100000", uri]
    agents: list[Agent] = []
    try:
        agents.append(Agent("a", work, common, env))
        wait_listening(port)
        agents.append(Agent("b", work, common, env))
        for agent in agents:
            agent.wait_for(r"restored 0 ", timeout=300)
        spare = Agent("spare", work, common, env)
        agents[0].wait_for(r"waits as a spare")
        a, b = agents
        saved = 2 * args.ckpt_every  # the first save also sizes the staging: skip it
        wait_event(a, "checkpoint_committed", saved)
        if mode == "peer memory":
            wait_event(a, "checkpoint_in_memory", saved)
        dropped = mode != "peer memory" and drop_caches()
        killed = time.time()
        b.kill_node()
        last = last_step(b)
        restored = spare.wait_for(r"restored (\d+) from (.*) in ([\d.]+)s", timeout=600)
        first = spare.wait_for(r"step (\d+) at ([\d.]+)", timeout=300)
        trains_again = float(first.group(2)) - killed
        events = a.events()
        recovering = next(e for e in events if e["event"] == "recovering" and e["ts"] > killed)
        spare_events = spare.events()
        pulled = [e for e in spare_events if e["event"] == "restore_pulled"]
        started = next(e for e in spare_events if e["event"] == "started")
        return {"mode": mode, "seconds": trains_again,
                "detected": recovering["ts"] - killed, "started": started["ts"] - killed,
                "pull": pulled[-1]["seconds"] if pulled else 0.0,
                "load": float(restored.group(3)), "source": restored.group(2),
                "resumed": int(restored.group(1)), "lost_steps": last - int(restored.group(1)),
                "cache_dropped": dropped}
    finally:
        for agent in agents + ([spare] if "spare" in locals() else []):
            agent.stop()


def last_step(agent: Agent) -> int:
    return max((int(m.group(1)) for _, line in list(agent.lines)
                if (m := re.search(r"step (\d+) at ", line))), default=0)


def wait_event(agent: Agent, kind: str, step: int, timeout: float = 600) -> None:
    """Until ``agent`` logged ``kind`` for ``step`` or a later one."""
    deadline = time.monotonic() + timeout
    while not any(e["event"] == kind and e["step"] >= step for e in agent.events()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {kind} of step {step} within {timeout:g}s")
        time.sleep(0.1)  # a file another process appends to: no event to wait on


def start_s3rver(path: str, work: Path, env: dict[str, str]) -> subprocess.Popen:
    port = free_port()
    (work / "s3rver").mkdir()
    server = subprocess.Popen([path, "-d", str(work / "s3rver"), "-a", "127.0.0.1", "-p",
                               str(port), "-s", "--configure-bucket", "bench"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_REGION="us-east-1",
               AWS_ACCESS_KEY_ID="S3RVER", AWS_SECRET_ACCESS_KEY="S3RVER")
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return server
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("s3rver did not start") from None
            time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="state per rank")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--ckpt-every", type=int, default=400,
                        help="steps between saves; the node is lost once the 2nd save is "
                        "committed (and held in a peer's memory)")
    parser.add_argument("--step-time", type=float, default=0.05)
    parser.add_argument("--node-timeout", type=float, default=2.0,
                        help="the test suite's; detection is reported on its own")
    parser.add_argument("--modes", default="peer memory,local disk,S3",
                        help="which restores to measure (S3 only with --s3)")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (logs)")
    parser.add_argument("--s3", metavar="S3RVER", default=None,
                        help="also from a local s3rver (npm install s3rver@3.7.1; the path of "
                        "node_modules/.bin/s3rver)")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-node-loss-", dir=os.getcwd()))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "FTLAUNCH_"))}
    env["PYTHONPATH"] = str(ROOT)
    (work / "rank.py").write_text(RANK_SCRIPT)
    modes = [m for m in args.modes.split(",") if m != "S3" or args.s3]
    server = start_s3rver(args.s3, work, env) if args.s3 else None
    runs: list[dict] = []
    try:
        for rep in range(args.reps):
            for mode in modes:
                uri = f"s3://bench/run-{rep}-{mode[:4]}" if mode == "S3" else \
                    str(work / f"ckpt-{rep}-{mode[:4]}")
                run = one_run(mode, args, work, env, uri)
                print(json.dumps(run), flush=True)
                runs.append(run)
                if not uri.startswith("s3://"):
                    shutil.rmtree(uri, ignore_errors=True)
    finally:
        if server is not None:
            server.terminate()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    print(f"\nnode lost, {args.gib:g} GiB per rank, --node-timeout {args.node_timeout:g}, "
          f"{args.reps} reps, medians")
    print(f"{'restored from':14s} {'kill->training':>14s} {'detected':>9s} {'pull':>6s} "
          f"{'rank up':>8s} {'load':>6s}  source")
    for mode in modes:
        mine = [r for r in runs if r["mode"] == mode]

        def med(key: str, mine: list[dict] = mine) -> float:
            return statistics.median(r[key] for r in mine)

        print(f"{mode:14s} {med('seconds'):14.2f} {med('detected'):9.2f} {med('pull'):6.2f} "
              f"{med('started'):8.2f} {med('load'):6.2f}  {mine[-1]['source']}"
              + ("" if mode == "peer memory" or mine[-1]["cache_dropped"]
                 else " (page cache NOT dropped: not root)"))


if __name__ == "__main__":
    main()
