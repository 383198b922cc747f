"""Seeded chaos: a deterministic training job under randomized faults, and the invariants after.

One run starts the job (scripts/train_gpt.py through trainer_shim, DDP or FSDP2, on 1-3
loopback nodes, plus a hot spare when the schedule loses nodes), injects the faults the
seed draws, one at a time once the job is past the fault's step again, and then checks:

  completes   the job finished (exit 0), or stopped with 1 once the restart budget was spent
  weights     final weights bitwise equal to the fault-free run's
  no_lost     no rank resumed before the newest step committed before its fault
  no_redo     every step's loss, however often trained, equals the fault-free run's
  untorn      every shard storage lists verifies against its checksum
  clean       no process, staging memory, socket or runtime file of the run left behind
  recoveries  every fault that needs one has exactly one recovery, whose cause names it

Faults: kill (SIGKILL a rank), segv, exception (raised in the training loop), stop (SIGSTOP:
a hang), spin (a GIL-holding hang), writer (SIGKILL a rank right after it staged a save,
while its writer persists it), node (SIGKILL an agent and its ranks), coordinator (the same,
of the node hosting the coordinator), sigterm (preemption of every node; the job is started
again, as a scheduler requeues it), disk (the checkpoint file system full for two saves: a
tmpfs of its own, mounted for the run; needs root), partition (a node other than the
coordinator's cut off by iptables past the node timeout, then healed: it must re-join or
leave), coordinator-partition (the same of the coordinator's node: the others fail over;
drawn only when --kinds names it, so that older seeds keep their schedules) and loss
(10-30% of a node's packets dropped for 3 s: no recovery). The network
faults need root: each agent then runs in a network namespace of its own (scripts/netns.py;
--netns for any schedule). The same seed draws the same schedule.

    python scripts/chaos.py --seed 1 --faults 6                 # one run, 1 node
    python scripts/chaos.py --seed 1 --faults 6 --nodes 3 --fsdp
    python scripts/chaos.py --campaign 40 --faults 5 --nodes 2  # 200 faults, a table
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import random
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
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import netns
import psutil
from ports import free_port

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "scripts" / "train_gpt.py"
sys.path.insert(0, str(REPO))

RANK_KINDS = ("kill", "segv", "exception", "stop", "spin", "writer")
NODE_KINDS = ("node", "coordinator")
PARTITIONS = ("partition", "coordinator-partition")
NET_KINDS = ("partition", "loss", "coordinator-partition")  # iptables in a node's namespace
KINDS = (*RANK_KINDS, *NODE_KINDS, "sigterm", "disk", "partition", "loss")  # the default draw
ALL_KINDS = (*KINDS, "coordinator-partition")  # drawn only when named (older seeds keep theirs)
MULTI_NODE = (*NODE_KINDS, *PARTITIONS)  # drawn only when the job has 2+ nodes
TAG_VAR = "FTLAUNCH_CHAOS_TAG"
CKPT_EVERY = 5
HOLD_AHEAD = 20  # steps past the next fault's the job may train before it is injected (hold_before)
START = re.compile(r"start rank (\d+) world (\d+) pid (\d+) resume_from (\d+)")
STEP = re.compile(r"step (\d+) loss (\S+) rank (\d+)")
PREEMPTED = 128 + signal.SIGTERM
RDZV_PORT = 29400  # in namespaces: each node has the port space to itself
LOSS_SECONDS = 3.0  # how long a "loss" fault lasts
NODE_TIMEOUT = 2.0
# A healed node hears the coordinator at its next heartbeat (0.2 s); then its ranks stop
# (--stop-timeout) and it re-joins: a few node timeouts, with slack for two busy cores.
HEAL_WITHIN = 2 * NODE_TIMEOUT + 4


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int  # injected once the job trains past this step (again)
    target: int  # a global rank for rank faults, a node's place for node and network faults
    percent: int = 0  # "loss": the share of the node's packets dropped


def draw_schedule(seed: int, faults: int, kinds: tuple[str, ...], world: int, nodes: int,
                  first: int = 12, gap: int = 12) -> list[Fault]:
    """The faults a seed stands for: kinds that need more nodes than the job has are left out.
    (A loss's share is drawn only for a loss: other kinds' schedules stay what they were.)"""
    rng = random.Random(seed)
    usable = [k for k in kinds if k not in MULTI_NODE or nodes >= 2]
    return [Fault(kind, first + i * gap,
                  rng.randrange(nodes if kind in ("node", *NET_KINDS) else world),
                  rng.randrange(10, 31, 5) if kind == "loss" else 0)
            for i, kind in enumerate(rng.choice(usable) for _ in range(faults))]


# ---- what a run leaves to check ------------------------------------------------------------

@dataclass
class Cut:
    """A partition's view to set aside, not the job's: the node cut off sees every other lost
    (it may fail over to itself, then stand down once healed) from the cut until it re-joined
    the job. Unless its side kept the job (the coordinator's node, on the tie of a round of
    two): then the other side's view, until they all stood down and re-joined."""

    log: str  # the log dir of the agent cut off
    at: float
    until: float = float("inf")  # by then the side whose view this is was back in the job
    kept: bool = False  # the cut-off side kept the job

    def hides(self, event: dict) -> bool:
        ours = event["node"] == self.log
        return self.at <= event["ts"] < self.until and ours != self.kept


@dataclass
class Injected:
    fault: Fault
    at: float  # time.time() of the injection
    detail: str = ""  # the pid or node it hit
    cut: Cut | None = None  # a partition's


@dataclass
class Reference:
    losses: dict[tuple[int, int], str]  # (step, rank) -> exact loss
    weights: str


@dataclass
class Run:
    steps: int
    injected: list[Injected]
    exit_codes: list[list[int]]  # per start of the job (a requeue starts it again)
    expected_exit: int
    out: dict | None
    losses: list[tuple[float, int, int, str]]  # (time, step, rank, loss) for every step line
    resumes: list[tuple[float, int, int]]  # (time, rank, resume_from)
    events: list[dict]  # every node's events, each with "node" (its log dir's name)
    torn: list[str] = field(default_factory=list)
    leftovers: list[str] = field(default_factory=list)
    stranded: list[str] = field(default_factory=list)  # healed agents that neither re-joined nor left


def needs_recovery(kind: str) -> bool:
    """A requeue, a checkpoint that waits for room and a lossy link that TCP rides out need none."""
    return kind not in ("sigterm", "disk", "loss")


def check_completes(run: Run, ref: Reference) -> str | None:
    if run.stranded:
        return f"after the heal: {run.stranded}"
    *earlier, last = run.exit_codes or [[]]
    if any(code != PREEMPTED for codes in earlier for code in codes):
        return f"a preempted start exited {earlier}, not {PREEMPTED} on every node"
    if not last or any(code != run.expected_exit for code in last):
        return f"the job's nodes exited {last}, expected {run.expected_exit} on every node"
    if run.expected_exit == 0 and (run.out or {}).get("final_step") != run.steps:
        return f"the job reported {run.out}, not step {run.steps}"
    return None


def check_weights(run: Run, ref: Reference) -> str | None:
    if run.expected_exit != 0:
        return None  # stopped early by design: nothing to compare
    got = (run.out or {}).get("weights_sha256")
    return None if got == ref.weights else f"final weights {got} != fault-free {ref.weights}"


def check_no_lost(run: Run, ref: Reference) -> str | None:
    """A committed step is on storage for every rank: no resume may start before it."""
    for inj in run.injected:
        committed = max((e["step"] for e in run.events
                         if e["event"] == "checkpoint_committed" and e["ts"] < inj.at), default=0)
        after = [(rank, step) for t, rank, step in run.resumes if t > inj.at]
        first: dict[int, int] = {}
        for rank, step in after:
            first.setdefault(rank, step)
        lost = {rank: step for rank, step in first.items() if step < committed}
        if lost:
            return f"after {inj.fault.kind} at step {inj.fault.step}: ranks resumed at " \
                   f"{lost}, before the committed step {committed}"
    return None


def check_no_redo(run: Run, ref: Reference) -> str | None:
    """The loss of a step depends on the weights it started from: equal to the fault-free
    run's, every time it is trained, or that step ran against other weights."""
    for _, step, rank, loss in run.losses:
        want = ref.losses.get((step, rank))
        if loss != want:
            return f"step {step} rank {rank}: loss {loss}, the fault-free run's {want}"
    return None


def check_untorn(run: Run, ref: Reference) -> str | None:
    return f"torn shards: {run.torn}" if run.torn else None


def check_clean(run: Run, ref: Reference) -> str | None:
    return f"left behind: {run.leftovers}" if run.leftovers else None


CAUSES = {  # what a recovery's cause says for each fault kind
    "kill": r"^rank {rank} \(.*\) was killed by SIGKILL$",
    "writer": r"^rank {rank} \(.*\) was killed by SIGKILL$",
    "segv": r"^rank {rank} \(.*\) was killed by SIGSEGV",
    "exception": r"^rank {rank} \(.*\) .*raised RuntimeError: injected fault",
    # A hung rank stops its peers at their next collective: any of them may be found first.
    "stop": r"^rank \d+ \(.*\) .*hung", "spin": r"^rank \d+ \(.*\) .*hung",
    "node": r"{node}.*lost", "coordinator": r"{node}.*lost",
    "partition": r"^node {node} lost \((?!.*connection closed)",  # silent, not gone
    "coordinator-partition": r"^coordinator node {node} lost$",  # the others fail over
}


KEPT = r"^node (?!{node} )\S+ lost \((?!.*connection closed)"  # the cut side kept the job:
# its coordinator found a node of the other side silent


FAILOVER = re.compile(r"coordinator node (\S+) lost")


def recoveries(events: list[dict]) -> list[dict]:
    """The job's recoveries, once each: every node logs the one the coordinator ordered, and
    each survivor the loss of the coordinator's node (``coordinator_lost``, then its own
    ``recovering`` with that cause: one recovery, policy "failover" here). A node that was
    the coordinator again later may be lost again: that loss, to another successor, is
    another recovery (chaos 2-node seed 1634)."""
    seen: dict[tuple, dict] = {}
    followed: dict[tuple, str] = {}  # (agent, coordinator lost) -> the successor it followed
    for e in sorted(events, key=lambda e: e["ts"]):
        if e["event"] == "recovering" and (m := FAILOVER.fullmatch(e["cause"])):
            successor = followed.get((e.get("node"), m[1]), "")
            seen.setdefault(("failover", m[1], successor), {**e, "policy": "failover"})
        elif e["event"] == "recovering":
            seen.setdefault((e["restart_count"], e["cause"]), e)
        elif e["event"] == "coordinator_lost" and e["successor"]:
            followed[(e.get("node"), e["lost"])] = e["successor"]
            seen.setdefault(("failover", e["lost"], e["successor"]), {
                "ts": e["ts"], "policy": "failover", "cause": f"coordinator node {e['lost']} lost"})
    return sorted(seen.values(), key=lambda e: e["ts"])


def job_events(run: Run) -> list[dict]:
    return outside_cuts(run.events, [inj.cut for inj in run.injected if inj.cut])


def outside_cuts(events: list[dict], cuts: list[Cut]) -> list[dict]:
    """The events of the nodes in the job, not those of a side a partition cut off."""
    return [e for e in events if not any(cut.hides(e) for cut in cuts)]


def check_recoveries(run: Run, ref: Reference) -> str | None:
    found = recoveries(job_events(run))
    bounds = [inj.at for inj in run.injected] + [float("inf")]
    for i, inj in enumerate(run.injected):
        within = [r for r in found if bounds[i] <= r["ts"] < bounds[i + 1]]
        if not needs_recovery(inj.fault.kind):
            if within:
                return f"{inj.fault.kind} at step {inj.fault.step}: recoveries {within}"
            continue
        ended = [e for e in run.events if e["event"] == "job_failed"
                 and bounds[i] <= e["ts"] < bounds[i + 1]]
        if not within and ended and run.expected_exit == 1:
            continue  # the budget was spent: the job's end is this fault's outcome
        if len(within) != 1:
            causes = [r["cause"] for r in within]
            return f"{inj.fault.kind} at step {inj.fault.step}: {len(within)} recoveries {causes}"
        kept = inj.cut is not None and inj.cut.kept
        pattern = (KEPT if kept else CAUSES[inj.fault.kind]).format(
            rank=inj.fault.target, node=re.escape(inj.detail))
        if not re.search(pattern, within[0]["cause"]):
            return f"{inj.fault.kind} of {inj.detail or inj.fault.target}: recovery cause " \
                   f"{within[0]['cause']!r} does not name it"
    return None


INVARIANTS = {
    "completes": check_completes, "weights": check_weights, "no_lost": check_no_lost,
    "no_redo": check_no_redo, "untorn": check_untorn, "clean": check_clean,
    "recoveries": check_recoveries,
}


def check(run: Run, ref: Reference) -> dict[str, str | None]:
    """Each invariant -> None when it held, else what broke it."""
    return {name: fn(run, ref) for name, fn in INVARIANTS.items()}


# ---- running it ------------------------------------------------------------------------------

@dataclass
class Options:
    seed: int
    faults: int
    nodes: int = 1
    nproc: int = 2
    fsdp: bool = False
    kinds: tuple[str, ...] = KINDS
    budget: int | None = None  # --max-restarts; default: enough for every fault
    work: Path | None = None
    verbose: bool = False
    overlap: bool = False  # saves copied beside the next step (AsyncCheckpointer overlap=True)
    netns: bool = False  # every node in a network namespace even if no network fault is drawn
    intakes: int = 0  # --intakes: processes serving each agent's standby port (launcher.intake)

    @property
    def in_netns(self) -> bool:
        return self.netns or any(f.kind in NET_KINDS for f in self.schedule())

    @property
    def world(self) -> int:
        return self.nodes * self.nproc

    def schedule(self) -> list[Fault]:
        return draw_schedule(self.seed, self.faults, self.kinds, self.world, self.nodes)

    def steps(self) -> int:
        plan = self.schedule()  # room for the last fault to land, and for a lossy link's
        # seconds to be trained through (~150 steps here); the job holds before its last step
        # until the faults are over (train_gpt.py), so no fault finds it ended.
        return (plan[-1].step if plan else 0) + 40 + 150 * sum(f.kind == "loss" for f in plan)

    def train_args(self, work: Path, step_time: float = 0.02) -> list[str]:
        """``step_time``: paces the faulted run's steps (faults land between them); the
        fault-free reference needs none: the weights do not depend on it."""
        return [str(TRAIN), "--shim", "--async-ckpt", *(["--fsdp"] if self.fsdp else []),
                *(["--overlap-ckpt"] if self.overlap else []),
                "--steps", str(self.steps()), "--ckpt-every", str(CKPT_EVERY),
                "--step-time", str(step_time), "--log-every", "1", "--exact-loss",
                "--seed", "0", "--ckpt-dir", str(work / "ckpt"), "--out", str(work / "out.json")]


class Lines:
    """Every line the job's agents print, stamped, with a way to wait for one."""

    def __init__(self, verbose: bool):
        self.lines: list[tuple[float, int, str]] = []
        self.ended: set[int] = set()  # nodes whose agent's output reached its end
        self.followed: set[int] = set()
        self.cond = threading.Condition()
        self.verbose = verbose

    def follow(self, proc: subprocess.Popen, node: int, copy: Path) -> None:
        """Read ``proc``'s output; a stamped copy goes to ``copy`` for the post-mortem."""
        self.followed.add(node)
        def read() -> None:
            with copy.open("w") as f:
                for line in proc.stdout:
                    now = time.time()
                    with self.cond:
                        self.lines.append((now, node, line.rstrip("\n")))
                        self.cond.notify_all()
                    f.write(f"{now:.3f} {line}")
                    f.flush()
                    if self.verbose:
                        sys.stderr.write(f"  n{node} {line}")
            with self.cond:
                self.ended.add(node)
                self.cond.notify_all()
        threading.Thread(target=read, daemon=True).start()

    def wait(self, pattern: str, since: int, timeout: float, node: int | None = None,
             accept: Callable[[re.Match], bool] | None = None) -> tuple[int, re.Match]:
        """The first line from index ``since`` on (of ``node``'s agent, if given) that
        matches (and whose match ``accept`` takes): (its index, the match). EOFError if
        ``node``'s agent (or, without ``node``, every agent) ended first."""
        regex, deadline = re.compile(pattern), time.monotonic() + timeout
        with self.cond:
            while True:
                for i in range(since, len(self.lines)):
                    if node is not None and self.lines[i][1] != node:
                        continue
                    m = regex.search(self.lines[i][2])
                    if m and (accept is None or accept(m)):
                        return i, m
                since = len(self.lines)
                if node in self.ended or node is None and self.ended == self.followed:
                    raise EOFError(f"the agent(s) ended before a line matched {pattern!r}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no line matching {pattern!r} within {timeout}s")
                self.cond.wait(left)

    def wait_step(self, step: int, since: int, timeout: float) -> tuple[int, re.Match]:
        """The first line from index ``since`` on of a step ``step`` or later."""
        return self.wait(r"step (\d+) loss ", since, timeout, accept=lambda m: int(m[1]) >= step)


class Job:
    """The agents of one chaos run on loopback nodes: the job's nodes and a hot spare."""

    def __init__(self, opts: Options, work: Path, tag: str):
        self.opts, self.work, self.tag = opts, work, tag
        self.port = free_port()
        self.out = Lines(opts.verbose)
        self.agents: list[subprocess.Popen] = []  # every agent started, in order
        self.starts: list[list[subprocess.Popen]] = []  # per start of the job
        self.killed: set[int] = set()  # agents a fault SIGKILLed: no exit code to check
        self.env = {**{k: v for k, v in os.environ.items()  # FTLAUNCH_LOG_LEVEL to debug a run
                       if not k.startswith(("FTLAUNCH_", "TRAIN_", "SLURM_", "PET_"))
                       or k == "FTLAUNCH_LOG_LEVEL"},
                    TAG_VAR: tag, "PYTHONPATH": str(REPO), "TMPDIR": str(work / "tmp"),
                    "FTLAUNCH_RUNTIME_DIR": str(work / "runtime"), "FTLAUNCH_LIVE": "0",
                    "TRAIN_CHAOS_DIR": str(work / "chaos")}
        for sub in ("tmp", "chaos", "logs", "ckpt"):
            (work / sub).mkdir(parents=True, exist_ok=True)
        (work / "chaos" / "unpaced").unlink(missing_ok=True)  # paced until the faults are over
        (work / "chaos" / "hold").unlink(missing_ok=True)
        self.mounted = any(f.kind == "disk" for f in opts.schedule())
        if self.mounted:  # a file system that can be filled without filling the machine's
            subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(work / "ckpt")],
                           check=True, capture_output=True)
        self.cluster: netns.Cluster | None = None
        self.placed: dict[int, netns.Node] = {}  # agent pid -> the namespace it runs in
        self.unseated: dict[int, int] = {}  # agent pid -> its output's length when a
        # partition dropped it from the job (a rank it starts after that seats it again)
        self.cuts: list[Cut] = []  # agents a partition cut off
        self.stranded: list[str] = []  # what a healed agent did wrong
        self.host = "127.0.0.1"  # where the rendezvous endpoint is
        if opts.in_netns:  # one "machine" per agent that may be alive at once, reused after
            netns.clean_stale()
            plan = opts.schedule()
            self.cluster = netns.Cluster(opts.nodes + 2 + sum(
                f.kind in (*NODE_KINDS, *PARTITIONS) for f in plan)).up()
            self.host, self.port = self.cluster.node(1).addr, RDZV_PORT
            self.env["GLOO_SOCKET_IFNAME"] = "eth0"

    def close(self) -> None:
        """Unmount the run's file system, tear its namespaces down (killing what is left)."""
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.work / "ckpt")], check=False)
        if self.cluster is not None:
            self.cluster.down()

    def agent(self) -> subprocess.Popen:
        n = len(self.agents)
        cmd = [sys.executable, "-m", "launcher", "--nnodes", f"{self.opts.nodes}:{self.opts.nodes}",
               "--nproc-per-node", str(self.opts.nproc), "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"{self.host}:{self.port}", "--rdzv-id", "chaos",
               "--rdzv-conf", "last_call_timeout=0.5,join_timeout=60",
               "--node-timeout", f"{NODE_TIMEOUT:g}", "--heartbeat-interval", "0.2", "--hang-timeout", "4",
               "--max-restarts", str(self.budget()), "--restart-backoff", "0",
               "--log-dir", str(self.work / "logs" / f"agent{n}"),
               *(["--intakes", str(self.opts.intakes)] if self.opts.intakes else []),
               *self.opts.train_args(self.work)]
        node = self._place() if self.cluster is not None else None
        proc = subprocess.Popen(node.command(cmd) if node else cmd, cwd=self.work, env=self.env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        if node is not None:
            self.placed[proc.pid] = node  # ip netns exec, unshare and sh exec: the agent's pid
        self.agents.append(proc)
        self.out.follow(proc, n, self.work / "logs" / f"agent{n}.out")
        return proc

    def _place(self, timeout: float = 10) -> netns.Node:
        """A namespace no live agent runs in, once what ran there is gone: the endpoint's
        first (a re-created node 0 takes its address, where a successor announces itself)."""
        busy = {self.placed[p.pid].index for p in self.alive() if p.pid in self.placed}
        node = next(n for n in self.cluster.nodes if n.index not in busy)
        deadline = time.monotonic() + timeout
        while node.pids():  # a killed node's ranks die after their agent
            if time.monotonic() > deadline:
                raise TimeoutError(f"processes {node.pids()} still in {node.ns}")
            time.sleep(0.05)  # the namespace's process list: there is no event to wait on
        return node

    def budget(self) -> int:
        if self.opts.budget is not None:
            return self.opts.budget
        return sum(needs_recovery(f.kind) for f in self.opts.schedule()) + 2

    def needs_spare(self) -> bool:
        return any(f.kind in MULTI_NODE for f in self.opts.schedule())

    def start(self) -> None:
        """The job's nodes (the first hosts the coordinator) and, when nodes are lost, a spare."""
        mark = len(self.out.lines)
        first = self.agent()
        _wait_listening(self.port, first, self.placed.get(first.pid))
        procs = [first] + [self.agent() for _ in range(self.opts.nodes - 1)]
        if self.needs_spare():
            procs.append(self.spare(mark))
        self.starts.append(procs)

    def spare(self, mark: int) -> subprocess.Popen:
        """A new agent, once it waits as a spare (or was seated in a round forming)."""
        proc = self.agent()
        node = len(self.agents) - 1
        self.out.wait(r"waiting as a spare|started \d+ ranks", mark, timeout=120, node=node)
        return proc

    def node_id(self, proc: subprocess.Popen) -> str:
        node = self.placed.get(proc.pid)
        return f"{node.hostname if node else socket.gethostname()}:{proc.pid}"

    def seated(self) -> list[subprocess.Popen]:
        """The live agents that run ranks, in the order they joined (not the waiting spare)."""
        with self.out.cond:
            started = {node: at for at, (_, node, line) in enumerate(self.out.lines)
                       if START.search(line)}  # each node's latest rank start
        return [p for i, p in enumerate(self.agents)
                if i in started and p.poll() is None and started[i] > self.unseated.get(p.pid, -1)]

    def coordinator(self) -> subprocess.Popen:
        """The agent hosting the coordinator now: the first of the job's latest start, or the
        successor it handed to since. Of that start only: after a requeue the first hosts
        again (chaos seeds 3110, 3113: an earlier start's successor, long dead, was taken for
        the host, and a partition meant for another node cut the coordinator's off). A
        spare's word names the host too: one that took over and stood down (chaos seed 3423)
        then waits as a spare of the coordinator that went on."""
        start = self.starts[-1]
        logs = {f"agent{self.agents.index(p)}" for p in start}
        host = start[0]
        for e in sorted(outside_cuts(read_events(self.work), self.cuts), key=lambda e: e["ts"]):
            if e["node"] not in logs:
                continue
            node = e.get("successor") if e["event"] == "coordinator_lost" else \
                e.get("coordinator") if e["event"] == "spare" else None
            if node:
                host = next((p for p in start if self.node_id(p) == node), host)
        return host

    def agent_of(self, node_id: str) -> subprocess.Popen:
        return next(p for p in self.agents if self.node_id(p) == node_id)

    def rank_pid(self, rank: int) -> int:
        with self.out.cond:
            for _, _, line in reversed(self.out.lines):
                if (m := START.search(line)) and int(m[1]) == rank:
                    return int(m[3])
        raise LookupError(f"rank {rank} never started")

    def alive(self) -> list[subprocess.Popen]:
        return [p for p in self.agents if p.poll() is None]


def _wait_listening(port: int, proc: subprocess.Popen, node: netns.Node | None,
                    timeout: float = 60) -> None:
    """Until ``proc`` (on loopback, or in ``node``'s namespace) listens on ``port``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the first agent exited {proc.returncode}")
        if node is not None and node.listening(port):
            return
        with socket.socket() as s:
            if node is None and s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)  # nothing to wait on but the port
    raise TimeoutError(f"nothing listened on {port} within {timeout}s")


def read_events(work: Path) -> list[dict]:
    from launcher.events import load as read_log

    found = []
    for path in sorted((work / "logs").rglob("events.jsonl")):
        node = path.relative_to(work / "logs").parts[0]
        found += [{**e, "node": node} for e in read_log(path)]
    return found


def inject(job: Job, fault: Fault) -> Injected:
    """Make the fault happen now (for "writer": at the target's next staged save). Its time
    is taken before: the job may act on it before the call that makes it returns."""
    kind, target, at = fault.kind, fault.target, time.time()
    if kind in ("kill", "segv", "stop"):
        pid = job.rank_pid(target)
        sig = {"kill": signal.SIGKILL, "segv": signal.SIGSEGV, "stop": signal.SIGSTOP}[kind]
        os.kill(pid, sig)
        return Injected(fault, at, f"pid {pid}")
    if kind in ("exception", "spin"):
        (job.work / "chaos" / f"rank{target}").write_text(kind)
        job.out.wait(rf"injecting fault {kind} rank {target} ", 0, timeout=60)
        return Injected(fault, at, f"rank {target}")
    if kind == "writer":
        deadline = time.monotonic() + 60
        while not any(e["event"] == "checkpoint_shard" and e["stage"] == "staged"
                      and e["rank"] == target and e["ts"] > at for e in read_events(job.work)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {target} staged no save within 60s")
            time.sleep(0.01)  # a file other processes append to
        at, pid = time.time(), job.rank_pid(target)  # the one that staged (it started first)
        os.kill(pid, signal.SIGKILL)
        return Injected(fault, at, f"pid {pid}")
    if kind in NODE_KINDS:
        seated = job.seated()
        victim = job.coordinator() if kind == "coordinator" else seated[target % len(seated)]
        if victim.poll() is not None:  # its successor's event not seen yet: the first alive
            victim = seated[0]
        job.killed.add(victim.pid)
        os.killpg(victim.pid, signal.SIGKILL)  # the agent and its ranks: the node is gone
        victim.wait()
        return Injected(fault, at, job.node_id(victim))
    if kind in PARTITIONS:  # see README "Chaos"
        host = job.coordinator()
        others = [p for p in job.seated() if p is not host]
        victim = host if kind == "coordinator-partition" else others[target % len(others)]
        job.unseated[victim.pid] = len(job.out.lines)
        job.placed[victim.pid].partition()
        job.cuts.append(Cut(f"agent{job.agents.index(victim)}", at))
        return Injected(fault, at, job.node_id(victim), job.cuts[-1])
    if kind == "loss":
        seated = job.seated()
        victim = seated[target % len(seated)]
        job.placed[victim.pid].drop_output(fault.percent / 100)
        return Injected(fault, at, job.node_id(victim))
    if kind == "sigterm":
        for proc in job.alive():
            proc.send_signal(signal.SIGTERM)
        return Injected(fault, at, "every node")
    if kind == "disk":
        ckpt = job.work / "ckpt"
        with open(ckpt / ".filler", "wb") as f:  # all there is: the writers take some meanwhile
            free = os.statvfs(ckpt).f_bavail * os.statvfs(ckpt).f_frsize
            while free > 0:
                try:
                    os.posix_fallocate(f.fileno(), 0, free)
                    break
                except OSError:
                    free -= 1 << 20
        return Injected(fault, at, f"{max(free, 0) >> 20} MiB filled")
    raise ValueError(f"unknown fault kind {kind!r}")


def wait_recovered(job: Job, injected: Injected, timeout: float = 120) -> None:
    """Block until the fault's recovery is over: ranks back (a new spare for a lost node);
    after a preemption, the job started again."""
    kind = injected.fault.kind
    if kind == "loss":
        time.sleep(LOSS_SECONDS)  # the fault's length (the job rides it out meanwhile, or not)
        node = job.placed[job.agent_of(injected.detail).pid]
        injected.detail += f", {node.dropped()} packets dropped"
        node.heal()
        return
    if kind == "disk":  # two saves find it full; then there is room again
        step = injected.fault.step + 2 * CKPT_EVERY
        job.out.wait_step(step, len(job.out.lines), timeout=timeout)
        (job.work / "ckpt" / ".filler").unlink()
        return
    if kind == "sigterm":
        for proc in job.starts[-1]:
            proc.wait(timeout=timeout)
        mark = len(job.out.lines)
        job.start()
        # Until its ranks start: the old ones train on after the SIGTERM until they stop, and
        # their steps are not the new job's (chaos seed 6630: the next fault, a writer's kill,
        # was injected while the job started again, into a rank of the old job, long gone).
        job.out.wait(START.pattern, mark, timeout)
        return
    deadline, healed = time.monotonic() + timeout, False
    while not any(e["event"] == "recovered" and e["ts"] > injected.at
                  for e in read_events(job.work)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no recovery from {kind} within {timeout}s")
        if not job.alive():
            return  # the budget is spent: the job ended
        if kind in PARTITIONS and not healed and held(job, injected.at):
            # Half of the round on each side, the other side's coordinator with the tie: no
            # side may go on (membership.has_quorum), so the job recovers once healed.
            rejoin_after_heal(job, job.agent_of(injected.detail), injected.cut)
            healed = True
        time.sleep(0.05)  # the agents' event files
    if kind in PARTITIONS and not healed:
        rejoin_after_heal(job, job.agent_of(injected.detail), injected.cut)
    if kind in MULTI_NODE and job.seated():  # (the job may have ended meanwhile)
        job.starts[-1].append(job.spare(len(job.out.lines)))


def restarted_since(job: Job, at: int) -> int:
    """Where the next fault's wait for a step starts: at the first ranks started since line
    ``at`` (the recovery's), else at ``at`` (no ranks restarted: the steps since are the same
    ranks'). Not at the recovery's end: the job may have trained up to its hold by then (a
    cut node healed and rejoined after three partitions in a row: chaos seed 5701's runner
    waited for a step that never came; a lossy link ridden out, seed 27116's)."""
    try:
        return job.out.wait(START.pattern, at, timeout=0)[0]
    except (TimeoutError, EOFError):
        return at


def held(job: Job, since: float) -> bool:
    """Whether a coordinator said since then that it holds its round for nodes cut off."""
    with job.out.cond:
        return any(t > since and "rendezvous round held" in line
                   for t, _, line in job.out.lines)


def rejoin_after_heal(job: Job, agent: subprocess.Popen, cut: Cut | None) -> None:
    """Heal the partition; its agent must learn that the job went on without it within
    HEAL_WITHIN, and wait as a spare or leave (its exit code is checked with the others').
    Or its side kept the job (the coordinator's node, holding the tie): then the other side
    stands down, and each of its agents must wait as a spare or start ranks again. One that
    does neither is stranded, and killed like a dead machine."""
    mark = len(job.out.lines)
    job.placed[agent.pid].heal()
    cut_off = job.agents.index(agent)
    deadline = time.monotonic() + HEAL_WITHIN
    since = mark
    while True:  # it waits as a spare, or another node stands down
        try:
            i, m = job.out.wait(r"waiting as a spare|standing down", since,
                                max(0.0, deadline - time.monotonic()))
        except (EOFError, TimeoutError):
            if cut_off not in job.out.ended:  # (else it left: its exit code is checked)
                strand(job, agent)
            return
        node, since = job.out.lines[i][1], i + 1
        if m[0] == "standing down" and node != cut_off:
            break
        if node == cut_off and m[0] != "standing down":
            if cut is not None:  # it re-joined the job as a spare: its view is the job's again
                cut.until = job.out.lines[i][0]
            return
    for other in [p for p in job.alive() if p is not agent]:  # its side kept the job
        try:
            job.out.wait(rf"waiting as a spare|{START.pattern}", mark,
                         max(0.0, deadline - time.monotonic()), node=job.agents.index(other))
        except EOFError:
            continue
        except TimeoutError:
            strand(job, other)
    if cut is not None:
        cut.kept, cut.until = True, time.time()


def dump_stacks(job: Job) -> Path:
    """Every live process of the job (agents, templates, ranks, services) dumped by py-spy
    before the runner kills them, one file each: where a run it could not complete stood
    (chaos seed 6802: a job that never trained again, killed with no trace)."""
    from launcher.stacks import capture

    where = job.work / "logs" / "stacks"
    where.mkdir(parents=True, exist_ok=True)
    procs = []
    for agent in job.alive():
        with contextlib.suppress(psutil.NoSuchProcess):
            procs += [psutil.Process(agent.pid), *psutil.Process(agent.pid).children(True)]

    def dump(proc: psutil.Process) -> None:
        with contextlib.suppress(psutil.NoSuchProcess):
            capture(proc.pid, where / f"{proc.pid}-{proc.name()}.txt", "py-spy", armed=False)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(dump, procs))
    return where


def strand(job: Job, agent: subprocess.Popen) -> None:
    from launcher.stacks import capture

    stacks = job.work / "logs" / f"stranded-{agent.pid}.txt"  # where its loop was
    job.stranded.append(f"{job.node_id(agent)} neither re-joined nor left within "
                        f"{HEAL_WITHIN:g}s of the heal; its stacks: "
                        f"{capture(agent.pid, stacks, 'py-spy', armed=False)}")
    job.killed.add(agent.pid)
    os.killpg(agent.pid, signal.SIGKILL)
    agent.wait()
    # Stranded is what failed: its staging and record go with it, like a dead machine's.
    for path in [*Path("/dev/shm").glob(f"ftlaunch-staging-{agent.pid}-*"),
                 *(job.work / "runtime").glob(f"*.{agent.pid}.json")]:
        shutil.rmtree(path) if path.is_dir() else path.unlink()


def hold_before(plan: list[Fault], injected: int, steps: int) -> int:
    """The step the job may reach, not train, while ``injected`` of the plan's faults are:
    HOLD_AHEAD past the next one's, however long a recovery keeps the runner (a heal, a
    re-join), so that fault finds steps and saves still to come (a writer's kill needs a
    save: chaos seed 6538's job had trained to its last step's hold, and saved no more);
    the last step once every fault is."""
    return plan[injected].step + HOLD_AHEAD if injected < len(plan) else steps


def hold_at(job: Job, step: int) -> None:
    """The step the job may reach and not train until moved on (train_gpt.py): replaced
    whole, never read half-written."""
    staged = job.work / "chaos" / "hold.new"
    staged.write_text(str(step))
    staged.replace(job.work / "chaos" / "hold")


def run_job(opts: Options, work: Path) -> Run:
    job = Job(opts, work, uuid.uuid4().hex)
    plan = opts.schedule()
    injected: list[Injected] = []
    try:
        hold_at(job, hold_before(plan, 0, opts.steps()))
        job.start()
        mark = 0
        try:
            for i, fault in enumerate(plan):
                try:
                    mark, _ = job.out.wait_step(fault.step, mark, timeout=180)
                except EOFError:
                    break  # the job ended (the budget spent)
                except TimeoutError:
                    if not job.alive():
                        break  # the job ended (the budget spent)
                    raise
                at = len(job.out.lines)
                hold_at(job, hold_before(plan, i + 1, opts.steps()))
                injected.append(inject(job, fault))
                wait_recovered(job, injected[-1])
                mark = restarted_since(job, at)
            # The faults are over: the job's last steps need no pacing, nor holding.
            (work / "chaos" / "unpaced").touch()
            for proc in job.alive():
                proc.wait(timeout=300)
        except Exception as e:  # the run could not be completed: where was the job?
            e.add_note(f"stacks of the job's processes: {dump_stacks(job)}")
            raise
        finally:
            for proc in job.alive():
                os.killpg(proc.pid, signal.SIGKILL)
        recovering = sum(needs_recovery(f.kind) for f in plan)
        return collect(job, opts, injected,
                       1 if opts.budget is not None and recovering > opts.budget else 0)
    finally:
        job.close()


def collect(job: Job, opts: Options, injected: list[Injected], expected: int) -> Run:
    losses, resumes = [], []
    for t, _, line in job.out.lines:
        if m := STEP.search(line):
            losses.append((t, int(m[1]), int(m[3]), m[2]))
        elif m := START.search(line):
            resumes.append((t, int(m[1]), int(m[4])))
    out_path = job.work / "out.json"
    return Run(
        steps=opts.steps(), injected=injected, expected_exit=expected,
        exit_codes=[[p.returncode for p in procs if p.pid not in job.killed]
                    for procs in job.starts],
        out=json.loads(out_path.read_text()) if out_path.exists() else None,
        losses=losses, resumes=resumes, events=read_events(job.work),
        torn=torn_shards(job.work / "ckpt"), leftovers=leftovers(job), stranded=job.stranded)


def torn_shards(ckpt: Path) -> list[str]:
    from ftlaunch_contract import shards
    from ftlaunch_contract.storage import open_storage

    if not ckpt.exists():
        return []
    storage, torn = open_storage(ckpt), []
    for step, ranks in sorted(shards.listing(storage).items()):
        for rank in sorted(ranks):
            try:
                shards.read(storage, step, rank)
            except shards.ShardError as e:
                torn.append(str(e))
    return torn


def leftovers(job: Job, timeout: float = 10) -> list[str]:
    """What the run's processes left: themselves, staging memory, hub sockets, records."""
    deadline, procs = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        procs = _tagged(job.tag)
        if not procs:
            break
        psutil.wait_procs(procs, timeout=0.5)
    left = [f"process {p.pid} {' '.join(p.cmdline()[:4])}" for p in procs]
    pids = {p.pid for p in job.agents}
    left += [str(p) for p in Path("/dev/shm").glob("ftlaunch-staging-*")
             if int(p.name.split("-")[2]) in pids]
    left += [str(p) for sub in ("tmp", "runtime") for p in (job.work / sub).glob("*")
             if not p.name.startswith("torchinductor_")]  # torch's compile cache, not ours
    return left


def _tagged(tag: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(TAG_VAR) == tag and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


_references: dict[tuple, Reference] = {}


def reference(opts: Options) -> Reference:
    """The fault-free run of the same job (every rank on one node: the same global ranks)."""
    key = (opts.world, opts.fsdp, opts.steps())
    if key not in _references:
        work = Path(tempfile.mkdtemp(prefix="chaos-ref-"))
        cmd = [sys.executable, "-m", "launcher", "--standalone", "--nproc-per-node",
               str(opts.world), "--log-dir", str(work / "logs"),
               *opts.train_args(work, step_time=0)]
        env = {**os.environ, "PYTHONPATH": str(REPO), "FTLAUNCH_LIVE": "0"}
        done = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True,
                              timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"the fault-free run failed:\n{done.stdout}{done.stderr}")
        losses = {(int(m[1]), int(m[3])): m[2] for m in STEP.finditer(done.stdout)}
        weights = json.loads((work / "out.json").read_text())["weights_sha256"]
        _references[key] = Reference(losses, weights)
        shutil.rmtree(work, ignore_errors=True)
    return _references[key]


def one_run(opts: Options) -> tuple[Run, dict[str, str | None]]:
    """The faulted run, with the fault-free one beside it when it is not known yet: the
    faulted job mostly waits (paced steps, timeouts), which the reference fills."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        ref = pool.submit(reference, opts)
        work = opts.work or Path(tempfile.mkdtemp(prefix=f"chaos-{opts.seed}-"))
        run = run_job(opts, work)
        return run, check(run, ref.result())


def report(opts: Options, run: Run, verdict: dict[str, str | None]) -> None:
    kinds = " ".join(f"{i.fault.kind}@{i.fault.step}"
                     + (f" ({i.fault.percent}% on {i.detail})" if i.fault.kind == "loss" else "")
                     for i in run.injected)
    print(f"chaos seed {opts.seed}: {opts.nodes} node(s) x {opts.nproc} ranks"
          f"{' fsdp' if opts.fsdp else ''}, faults: {kinds or 'none'}")
    for name, problem in verdict.items():
        print(f"  {'ok  ' if problem is None else 'FAIL'} {name}" + (f": {problem}" if problem else ""))


def campaign_table(runs: list[tuple[Options, Run, dict]]) -> str:
    """Faults by kind, recoveries by policy, recovery times and lost steps, as markdown."""
    by_kind: dict[str, int] = {}
    policies: dict[str, int] = {}
    lost, failed = 0, 0
    kind_seconds: dict[str, list[float]] = {}  # a slow path shows up by its fault's kind
    for _, run, verdict in runs:
        failed += any(v is not None for v in verdict.values())
        for inj in run.injected:
            by_kind[inj.fault.kind] = by_kind.get(inj.fault.kind, 0) + 1
        for kind, took in recovery_by_fault(run):
            kind_seconds.setdefault(kind, []).append(took)
        for r in recoveries(job_events(run)):
            policies[r["policy"]] = policies.get(r["policy"], 0) + 1
        for inj in run.injected:  # steps trained before the fault and again after it
            back = [step for t, _, step in run.resumes if t > inj.at]
            reached = max((s for t, s, _, _ in run.losses if t < inj.at), default=0)
            if back:
                lost += max(0, reached - min(back))
    # Each fault's recovery, as by kind (not the first agent's log's timing of a restart: a
    # spare seated then timed its wait since it last trained, 21 s in an FSDP campaign).
    seconds = sorted(took for times in kind_seconds.values() for took in times)
    p95 = seconds[min(len(seconds) - 1, int(0.95 * len(seconds)))] if seconds else 0.0
    lines = ["| runs | faults | runs with a broken invariant | recoveries by policy | "
             "recovery median / p95 (s) | steps re-trained |", "|---|---|---|---|---|---|",
             f"| {len(runs)} | {sum(by_kind.values())} | {failed} | "
             f"{', '.join(f'{k} {v}' for k, v in sorted(policies.items()))} | "
             f"{statistics.median(seconds) if seconds else 0:.2f} / {p95:.2f} | {lost} |",
             "", "| fault | injected | recovered in, median / max (s) |", "|---|---|---|"]
    lines += [f"| {k} | {v} | " + (f"{statistics.median(kind_seconds[k]):.2f} / "
                                    f"{max(kind_seconds[k]):.2f} |" if k in kind_seconds else "- |")
              for k, v in sorted(by_kind.items())]
    return "\n".join(lines)


def recovery_by_fault(run: Run) -> list[tuple[str, float]]:
    """(fault kind, seconds) of the first recovery each fault caused (before the next
    fault), as its agents timed it (the slowest of those whose recovery began after the
    fault: a node cut off by an earlier partition times its own wait to rejoin)."""
    done = sorted((e["ts"], e["restart_count"], e["seconds"]) for e in run.events
                  if e["event"] == "recovered")
    out = []
    for k, inj in enumerate(run.injected):
        until = run.injected[k + 1].at if k + 1 < len(run.injected) else float("inf")
        caused = [(c, took) for ts, c, took in done if inj.at < ts - took and ts < until]
        if caused:
            out.append((inj.fault.kind, max(took for c, took in caused if c == caused[0][0])))
    return out


def usable_kinds(kinds: tuple[str, ...], want_netns: bool) -> tuple[str, ...]:
    """``kinds`` less those this machine cannot inject, each left out with one line saying why."""
    skipped = {"disk": "mounting a tmpfs needs root"} if os.geteuid() != 0 else {}
    if (why := netns.missing_requirements()) is not None:
        if want_netns:
            sys.exit(f"chaos: --netns: {why}")
        skipped.update(dict.fromkeys(NET_KINDS, f"network namespaces: {why}"))
    for kind in (k for k in kinds if k in skipped):
        print(f"chaos: not drawing {kind}: {skipped[kind]}", file=sys.stderr)
    return tuple(k for k in kinds if k not in skipped)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--faults", type=int, default=5)
    p.add_argument("--nodes", type=int, default=1, choices=(1, 2, 3))
    p.add_argument("--nproc", type=int, default=2, help="ranks per node")
    p.add_argument("--fsdp", action="store_true", help="FSDP2 instead of DDP")
    p.add_argument("--overlap-ckpt", action="store_true",
                   help="the job's saves copied beside the next step (overlap=True)")
    p.add_argument("--kinds", default=",".join(KINDS),
                   help="fault kinds to draw from (disk and the network's: as root); "
                        f"also: {','.join(k for k in ALL_KINDS if k not in KINDS)}")
    p.add_argument("--netns", action="store_true",
                   help="every node in a network namespace of its own, whatever is drawn")
    p.add_argument("--budget", type=int, default=None, help="--max-restarts (default: enough)")
    p.add_argument("--campaign", type=int, default=0,
                   help="this many runs, seeds from --seed on; prints a table")
    p.add_argument("--work", type=Path, default=None, help="the run's directory (kept)")
    p.add_argument("--verbose", action="store_true", help="echo the job's output")
    p.add_argument("--intakes", type=int, default=0,
                   help="each agent's --intakes: a successor's standby served by that many "
                        "processes (launcher.intake)")
    args = p.parse_args(argv)
    kinds = tuple(k for k in args.kinds.split(",") if k)
    if unknown := set(kinds) - set(ALL_KINDS):
        p.error(f"unknown fault kinds {sorted(unknown)}: choose from {','.join(ALL_KINDS)}")
    kinds = usable_kinds(kinds, args.netns)
    runs, failed = [], 0
    for seed in range(args.seed, args.seed + max(1, args.campaign)):
        opts = Options(seed, args.faults, args.nodes, args.nproc, args.fsdp, kinds, args.budget,
                       args.work if not args.campaign else None, args.verbose,
                       args.overlap_ckpt, args.netns, args.intakes)
        try:
            run, verdict = one_run(opts)
        except Exception as e:  # the runner's own failure: this run counts as broken
            where = traceback.extract_tb(e.__traceback__)[-1]  # (the innermost frame)
            print(f"chaos seed {seed}: the run could not be completed: {e!r} (at "
                  f"{Path(where.filename).name}:{where.lineno} in {where.name})",
                  *getattr(e, "__notes__", ()), sep="; ", flush=True)
            failed += 1
            continue
        report(opts, run, verdict)
        sys.stdout.flush()
        runs.append((opts, run, verdict))
    if args.campaign:
        print(campaign_table(runs) + (f"\n\n{failed} run(s) could not be completed" if failed else ""))
    return 0 if not failed and all(v is None for _, _, verdict in runs
                                   for v in verdict.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
