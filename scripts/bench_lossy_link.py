"""Packet loss on a live job's links: how often is a live coordinator, or agent, taken for lost?

Two throwaway machines (network namespaces, scripts/netns.py): node1 hosts the coordinator
(agent 0: a real ControlPlane hosting a real Coordinator), node2 runs --agents more real
ControlPlanes that join it and heartbeat as the agent's loop does (bench_rendezvous.Agents).
For --seconds iptables drops --loss of one machine's outgoing packets (--lossy: the
coordinator's, the agents', or both in turn). Nothing fails over here: each agent counts the
silences ftlaunch's verdict took for a lost coordinator (membership.lost_by_silence: the
silence and knocks at its port) beside those the silence alone would have (the rule before
it: chaos seed 3423), and the coordinator counts the agents it dropped beside those it kept
only because they answered knocks. Every one is a false verdict: both machines stayed up.

    python scripts/bench_lossy_link.py --loss 0.3 --seconds 300 --agents 8   # as root
"""

from __future__ import annotations

import argparse
import json
import logging
import selectors
import subprocess
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
import netns  # noqa: E402
from bench_rendezvous import Agents  # noqa: E402  (same harness)
from ports import free_port  # noqa: E402

from launcher import membership  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


class Counting(Agents):
    """Agents that note their verdicts on the coordinator instead of acting on them."""

    def __init__(self, port, ids, n, addr, node_timeout, interval, endpoint):
        super().__init__(port, ids, n, addr, node_timeout, interval, endpoint)
        self.liveness = membership.liveness_timeout(node_timeout, n)
        self.said_lost: set[tuple[int, float]] = set()  # (agent, heard last): one a silence
        self.silent_past: set[tuple[int, float]] = set()  # by the silence alone
        self.counting = False

    def step(self, timeout_ms=10):
        super().step(timeout_ms)
        now = time.monotonic()
        for i, p in self.planes.items():
            if self.counting and now - p.last_heard > self.liveness:
                self.silent_past.add((i, p.last_heard))

    def fail_over(self, i, now):
        p = self.planes[i]
        if self.counting and (i, p.last_heard) not in self.said_lost:
            self.said_lost.add((i, p.last_heard))
            why = "its connection closed" if p.connection_lost else \
                f"its machine last answered {now - p._answered_at:.1f}s ago"  # its own word
            print(f"agent {i}: coordinator lost after {now - p.last_heard:.1f}s silent, {why}",
                  file=sys.stderr, flush=True)


class CoordinatorVerdicts(logging.Handler):
    """The coordinator's words that it dropped a member, or kept one silent past the timeout
    whose machine answers knocks (a drop the silence alone would have made)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.kept, self.lost, self.counting = 0, 0, False

    def emit(self, record):
        if self.counting:
            self.kept += "but its machine answers" in record.getMessage()
            self.lost += " lost: " in record.getMessage()


def serve(args) -> None:
    """One machine's agents (run inside its namespace), driven by lines on stdin: "count"
    starts counting, "report" prints what was counted and ends."""
    logging.basicConfig(level=logging.WARNING, format=f"{args.role}: %(message)s")
    kept = CoordinatorVerdicts()  # those of the coordinator this process hosts, if any
    logging.getLogger("ftlaunch.coordinator").addHandler(kept)
    n = args.agents + 1
    ids = [0] if args.role == "host" else list(range(1, n))
    agents = Counting(args.port, ids, n, args.addr, args.node_timeout, args.heartbeat_interval,
                      args.endpoint)
    agents.joined = True
    for i in ids:
        agents.join(i)
    agents.spread_heartbeats()
    print("joined", flush=True)
    sel = selectors.DefaultSelector()
    sel.register(sys.stdin, selectors.EVENT_READ)
    started = False
    while True:
        agents.step(5)
        if not started and all(any(i in seen for seen in agents.seen["start"].values())
                               for i in ids):
            started = True
            print("started", flush=True)
        if sel.select(0):
            line = sys.stdin.readline().strip()
            if line == "count":
                agents.counting = kept.counting = True
            elif line == "report" or not line:
                print(json.dumps({"said_lost": len(agents.said_lost), "kept": kept.kept,
                                  "silent_past": len(agents.silent_past), "lost": kept.lost}),
                      flush=True)
                return


def _expect(proc: subprocess.Popen, word: str, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{proc.args[-1]} ended before saying {word}")
        if line.strip() == word:
            return
    raise TimeoutError(f"no {word!r} within {timeout}s")


def one_run(args, lossy: int) -> dict:
    """--seconds of loss on node ``lossy`` (1: the coordinator's, 2: the agents')."""
    with netns.Cluster(2) as cluster:
        host, agents = cluster.node(1), cluster.node(2)
        port = free_port()
        common = ["--port", str(port), "--endpoint", host.addr, "--agents", str(args.agents),
                  "--node-timeout", str(args.node_timeout), "--heartbeat-interval",
                  str(args.heartbeat_interval)]
        procs = []
        try:
            for node, role in ((host, "host"), (agents, "agents")):
                procs.append(subprocess.Popen(
                    node.command([sys.executable, __file__, "--role", role, "--addr", node.addr,
                                  *common]),
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT))
                _expect(procs[-1], "joined")
            _expect(procs[1], "started")
            for proc in procs:
                proc.stdin.write("count\n")
                proc.stdin.flush()
            cluster.node(lossy).drop_output(args.loss)
            time.sleep(args.seconds)  # the fault's length
            dropped = cluster.node(lossy).dropped()
            cluster.node(lossy).heal()
            time.sleep(2 * args.node_timeout)  # verdicts on silences begun under it
            reports = []
            for proc in procs:
                proc.stdin.write("report\n")
                proc.stdin.flush()
                while not (line := proc.stdout.readline()).startswith("{"):
                    if not line:
                        raise RuntimeError(f"{proc.args[-1]} ended without a report")
                reports.append(json.loads(line))
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
    host_side, agents_side = reports
    return {"lossy": "coordinator's" if lossy == 1 else "agents'", "dropped": dropped,
            "coordinator_lost": agents_side["said_lost"],
            "coordinator_lost_by_silence_alone": agents_side["silent_past"],
            "agents_dropped": host_side["lost"],
            "agents_dropped_by_silence_alone": host_side["lost"] + host_side["kept"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--loss", type=float, default=0.3, help="share of packets dropped")
    p.add_argument("--seconds", type=float, default=120.0)
    p.add_argument("--agents", type=int, default=8)
    p.add_argument("--node-timeout", type=float, default=2.0)
    p.add_argument("--heartbeat-interval", type=float, default=0.2)
    p.add_argument("--lossy", choices=("coordinator", "agents", "both"), default="both",
                   help="whose machine loses packets")
    p.add_argument("--role", choices=("host", "agents"), help=argparse.SUPPRESS)
    p.add_argument("--addr", help=argparse.SUPPRESS)
    p.add_argument("--endpoint", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.role:
        serve(args)
        return 0
    if (why := netns.missing_requirements()) is not None:
        sys.exit(f"bench_lossy_link: {why}")
    print(f"{args.loss:.0%} loss for {args.seconds:g}s, {args.agents} agents, --node-timeout "
          f"{args.node_timeout:g}, --heartbeat-interval {args.heartbeat_interval:g}")
    for lossy in {"coordinator": (1,), "agents": (2,), "both": (1, 2)}[args.lossy]:
        print(json.dumps(one_run(args, lossy)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
