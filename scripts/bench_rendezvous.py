"""Rendezvous at scale: N simulated agents on real ControlPlanes, spread over processes;
ftlaunch's coordinator against torch's c10d rendezvous where that is feasible.

Processes (all spawned, one machine, loopback):

  coordinator  agent 0 alone: its ControlPlane binds the rendezvous endpoint and hosts the
               real Coordinator, as on node 0 of a job. Its CPU is what is measured.
  successors   agents 1 and 2, one process each: the nodes that take the coordinator over.
  swarm        the other N-3 agents split over --procs processes, each a real ControlPlane
               (DEALER + monitor + standby ROUTER) on one zmq.Poller, driven as the agent's
               loop drives it: join, store_ready from group rank 0, heartbeat at
               --heartbeat-interval, re-join on recover, fail over to the successor.

For each N: formed (first join sent -> every agent has its assign), ready (-> every agent
has start), the coordinator process's CPU (fraction of one core over --cpu-window seconds
while all N heartbeat), node loss (one agent silent: its last heartbeat -> every survivor
has recover; compare --node-timeout), a dead agent (its sockets closed -> every survivor has
recover), re-formed after each loss, and the coordinator lost twice: its process killed
(connections close: -> every survivor has its assign from the successor) and the
successor's machine gone silent (its process stopped and its port dropped by iptables: the
kernel's keepalive closes the connections after --node-timeout). A silent machine is also
measured for an ordinary node (agent 3, alone in its process), beside a frozen agent process
(heartbeats stop, its kernel still answers TCP: a large job waits three of its beats).
Times are CLOCK_MONOTONIC, one clock for every process of the machine.

    python scripts/bench_rendezvous.py --sizes 256 --torch-max 0       # smoke check (~30 s)
    python scripts/bench_rendezvous.py --sizes 1024,4096,8192,16384 --torch-max 64 \\
        --out-json rendezvous.json --plot docs/rendezvous_scale.png
"""

import argparse
import contextlib
import datetime
import errno
import json
import logging
import multiprocessing as mp
import os
import platform
import resource
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time

import psutil
import zmq
from ports import free_port

from ftlaunch_contract.messages import Assign, Join, RankState, Recover, Redirect, Start, StoreReady
from launcher import membership
from launcher.control_plane import ControlPlane
from launcher.coordinator import JobState

# TCPStore reverse-resolves each peer; a dropped DNS reply here costs 5 s by default, 1 s so.
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
SECRET = b"bench-rendezvous-secret-0123456789abcdef"
LOCAL_WORLD = 8
RANKS = tuple(RankState(r, 1000, 40) for r in range(LOCAL_WORLD))  # rank, step, beat age ms
FDS_PER_AGENT = 20  # 2 DEALERs, their monitor pairs, the standby ROUTER: sockets, mailboxes


def node_id(i):
    return f"node{i:05d}.bench.cluster:{40000 + i}"  # hostname:pid, like a real agent's id


def job_state(n, node_timeout):
    """MAX = N closes the first round; MIN leaves room for the 4 nodes this bench loses."""
    return JobState(min_nodes=max(1, n - 8), max_nodes=n, max_restarts=100, policy="cold", backoff=0.0,
                    backoff_max=0.0, exit_barrier_timeout=300.0, node_timeout=node_timeout,
                    last_call=30.0, join_timeout=600.0, host_node="")


def raise_nofile(want):
    """As many open files as ``want`` (root may raise the hard limit too)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, want))
            return want
        except (ValueError, OSError):
            want = hard
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), hard))
    return max(soft, want)


def cpu_seconds():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def coordinator_cpu(pid, thread_id):
    """CPU seconds of process ``pid``: all of it, its coordinator thread (``thread_id``),
    ZeroMQ's I/O threads."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {"process": 0.0, "coordinator_thread": 0.0, "zmq_io": 0.0}
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        with open(f"/proc/{pid}/task/{task}/comm") as f:
            name = f.read().strip()
        used = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
        out["process"] += used
        if int(task) == thread_id:
            out["coordinator_thread"] += used
        elif name.startswith("ZMQbg/IO"):
            out["zmq_io"] += used
    return out


# --- the simulated agents ------------------------------------------------------------------


def refused_by(addr: str, port: int, until: float) -> None:
    """Until ``addr:port`` refuses connections (ZeroMQ closes a socket in its I/O thread,
    a moment after close() returns)."""
    while time.monotonic() < until:
        with socket.socket() as probe:
            if probe.connect_ex((addr, port)) == errno.ECONNREFUSED:
                return
        time.sleep(0.001)
    raise TimeoutError(f"{addr}:{port} still accepts connections")


class Agents:
    """Real ControlPlanes for agents ``ids``, driven the way the agent's loop drives its own;
    ``seen[kind][epoch][i]`` = when agent i first got that kind of message in that epoch."""

    def __init__(self, port, ids, n, addr, node_timeout, interval, endpoint="127.0.0.1",
                 intakes=0, runtime_dir=None):
        """``intakes``: processes serving each agent's endpoint and standby port, should it
        host (launcher.intake): given to the agents that may (0, 1, 2), alone in theirs;
        their local sockets in ``runtime_dir``."""
        self.context = zmq.Context()
        self.context.set(zmq.MAX_SOCKETS, 12 * len(ids) + 64)  # 9 an agent: 3 monitored
        self.n, self.interval = n, interval
        self.planes, self.epoch, self.assign = {}, {}, {}
        self.seats: dict[int, list[int]] = {}  # as an agent keeps them (see Join)
        self.silent, self.closed = set(), set()
        self.next_scan = 0.0
        self.seen = {"assign": {}, "start": {}, "recover": {}, "failover": {}}
        self.last_beat, self.beats, self.joined = {}, 0, False  # no heartbeat before a join
        # One epoll over ZeroMQ's notification fds: zmq_poll over 6,000 sockets costs 7 ms a
        # call, and a process of 2,000 agents calling it every few ms starves the rest.
        self.epoll, self.by_fd, self.monitor_fds = select.epoll(), {}, set()
        for i in ids:
            p = ControlPlane(self.context, SECRET, node_id(i), addr, (endpoint, port),
                             lambda: job_state(n, node_timeout), node_timeout, interval,
                             intakes if i < 3 else 0, runtime_dir)
            self.planes[i], self.epoch[i] = p, 0
            self.watch(i)
        me, end = psutil.Process(), time.monotonic() + 120
        while True:  # every DEALER connected before the clock starts
            up = sum(1 for c in me.net_connections("tcp") if c.raddr and c.raddr.port == port
                     and c.status == psutil.CONN_ESTABLISHED)
            if up >= len(ids):
                break
            if time.monotonic() > end:
                raise TimeoutError(f"{len(ids) - up} agents could not connect")
            time.sleep(0.1)
        for p in self.planes.values():  # connected: as the agent's loop reads it
            p.on_monitor()

    def live(self):
        return [i for i in self.planes if i not in self.silent and i not in self.closed]

    def join(self, i):
        p = self.planes[i]
        seats = self.seats[i] = membership.seats_to_report(self.seats.get(i, []), p.settled_below)
        p.send(Join(node_id=p.node_id, local_world_size=LOCAL_WORLD, addr=p.addr,
                    rank_hint=-1, standby_port=p.standby_port or 0, replica_port=0, held=(),
                    restart_count=0, group_rank=-1, seated_epoch=seats[-1] if seats else -1,
                    seated_earlier=tuple(seats[:-1]), settled_below=p.settled_below,
                    electorate_epoch=p.electorate_epoch), self.epoch[i])
        self.serve(i)  # a send may take the fd's signal of what arrived meanwhile

    def serve(self, i, monitors=False):
        """Everything agent i's socket holds now (ZeroMQ's fd only says that may be so), and
        its connection events when a monitor's fd said so (as the agent's loop reads them)."""
        p = self.planes[i]
        if monitors:
            p.on_monitor()
        while p.socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            received = p.receive()
            if received is not None:
                self.on_message(i, received, time.monotonic())

    def watch(self, i):
        """Agent i's socket and monitors in the epoll (again after a failover: the
        successor's is another socket)."""
        p = self.planes[i]
        for sock in (p.socket, *p.monitors):
            fd = sock.getsockopt(zmq.FD)
            self.epoll.register(fd, select.EPOLLIN)
            self.by_fd[fd] = i
            if sock is not p.socket:
                self.monitor_fds.add(fd)

    def unwatch(self, i):
        """Agent i is read no more (frozen, or its process died)."""
        p = self.planes[i]
        for sock in (p.socket, *p.monitors):
            fd = sock.getsockopt(zmq.FD)
            if self.by_fd.pop(fd, None) is not None:
                self.epoll.unregister(fd)
            self.monitor_fds.discard(fd)

    def note(self, kind, epoch, i, now):
        self.seen[kind].setdefault(epoch, {}).setdefault(i, now)

    def on_message(self, i, received, now):
        self.epoch[i] = max(self.epoch[i], received.epoch)
        msg, p = received.body, self.planes[i]
        if isinstance(msg, Assign):
            seats = self.seats.setdefault(i, [])
            if seats[-1:] != [received.epoch]:
                seats.append(received.epoch)
            self.assign[i] = msg
            self.note("assign", received.epoch, i, now)
            if msg.group_rank == 0:  # it holds torch's store
                p.send(StoreReady(master_addr="127.0.0.1", master_port=1), received.epoch)
        elif isinstance(msg, Start):
            self.note("start", received.epoch, i, now)
        elif isinstance(msg, Recover):
            self.note("recover", received.epoch, i, now)
            self.join(i)  # a survivor stops its ranks, backs off (0 s here) and re-joins
        elif isinstance(msg, Redirect):
            self.join(i)

    def step(self, timeout_ms=10):
        ready = {}
        for fd, _ in self.epoll.poll(timeout_ms / 1000):
            if fd in self.by_fd:
                i = self.by_fd[fd]
                ready[i] = ready.get(i, False) or fd in self.monitor_fds
        for i, monitors in ready.items():
            self.serve(i, monitors)
        now = time.monotonic()
        if now < self.next_scan:  # 2,000 agents a process: not every few milliseconds
            return
        self.next_scan = now + 0.02
        for i in self.live():
            p = self.planes[i]
            if self.joined and now >= p.next_heartbeat:
                p.heartbeat_if_due(now, self.epoch[i], "running", RANKS)  # as a real node's
                self.last_beat[i], self.beats = now, self.beats + 1
                self.serve(i)
            if p.coordinator_lost(now):
                self.fail_over(i, now)

    def fail_over(self, i, now):
        """Agent i took its coordinator for lost: it follows the successor, as an agent does."""
        p = self.planes[i]
        self.note("failover", self.epoch[i], i, now)
        a = self.assign[i]
        self.unwatch(i)
        if p.fail_over(self.epoch[i], a.restart_count, a.group_world_size) is not None:
            self.watch(i)
            self.join(i)

    def spread_heartbeats(self):
        """Agents start at different moments: their heartbeats are spread over the interval
        each beats at (not assigned yet: a third of the node timeout, as a large job's)."""
        now = time.monotonic()
        for i, p in self.planes.items():
            p.next_heartbeat = now + p.heartbeat_interval * (i % 1000) / 1000

    def report(self, kind, epoch, exclude=()):
        """(how many live agents have ``kind`` at ``epoch`` or later, earliest, latest)."""
        times, missing = [], []
        for i in self.live():
            if i in exclude:
                continue
            t = min((seen[i] for e, seen in self.seen[kind].items() if e >= epoch and i in seen),
                    default=None)
            times.append(t)
            if t is None and len(missing) < 4:  # said should it never come
                p = self.planes[i]
                missing.append(f"agent {i}: epoch {self.epoch[i]}, follows "
                               f"{p.coordinator_node or '?'} at {p.endpoint}, hosting "
                               f"{p.hosting}, seen {sorted(k for k, by in self.seen.items() if any(i in s for s in by.values()))}")
        got = [t for t in times if t is not None]
        return len(got), len(times), min(got, default=None), max(got, default=None), missing


def agents_main(conn, port, ids, n, addr, node_timeout, interval, fds, intakes=0,
                runtime_dir=None):
    raise_nofile(fds)
    logging.basicConfig(level=os.environ.get("BENCH_LOG", "ERROR"))
    try:
        agents = Agents(port, ids, n, addr, node_timeout, interval, intakes=intakes,
                        runtime_dir=runtime_dir)
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", len(ids)))
    while True:
        agents.step(5)
        while conn.poll(0):
            cmd, *args = conn.recv()
            if cmd == "join":
                agents.joined = True
                t = time.monotonic()
                for i in agents.live():
                    agents.join(i)
                agents.spread_heartbeats()
                conn.send(t)
            elif cmd == "report":
                conn.send(agents.report(*args))
            elif cmd == "beats":
                conn.send(agents.beats)
            elif cmd == "silence":  # frozen: no heartbeat, nothing read; its sockets stay open
                agents.silent.add(args[0])
                agents.unwatch(args[0])
                conn.send(agents.last_beat.get(args[0]))
            elif cmd == "machine":  # what this process (its intakes too) holds of TCP
                conn.send(machine_matches())
            elif cmd == "close":  # its process died: the kernel closes its connections
                p = agents.planes[args[0]]
                agents.closed.add(args[0])
                agents.unwatch(args[0])
                if p.standby is not None:  # nothing of a dead process listens (peer_probe):
                    p.standby.close(linger=0)  # gone before its connections close
                    refused_by(p.addr, p.standby_port, time.monotonic() + 10)
                p.watch.close(linger=0)
                t = time.monotonic()
                p.socket.close(linger=0)
                conn.send(t)
            elif cmd == "threads":  # the coordinator's thread, if this process hosts it
                hosts = [p.coordinator for p in agents.planes.values() if p.hosting]
                conn.send(hosts[0]._thread.native_id if hosts else None)
            elif cmd == "epoch":
                conn.send(max(agents.epoch.values()))
            elif cmd == "quit":
                conn.send("bye")
                os._exit(0)


class Job:
    """N agents over processes: [0] hosts the coordinator, [1] and [2] its successors."""

    def __init__(self, n, procs, node_timeout, interval, intakes=0):
        self.n, self.port, self.ctx = n, free_port(), mp.get_context("spawn")
        self.runtime_dir = tempfile.mkdtemp(prefix="bench-rendezvous-")  # intakes' sockets
        rest = list(range(4, n))
        slices = [[0], [1], [2], [3]] + [rest[k::procs] for k in range(procs) if rest[k::procs]]
        self.stopped = set()  # processes SIGSTOPped: asked nothing more
        self.owner = {i: k for k, ids in enumerate(slices) for i in ids}
        self.conns, self.procs = [], []
        for k, ids in enumerate(slices):
            here, there = self.ctx.Pipe()
            proc = self.ctx.Process(target=agents_main, daemon=True, args=(
                there, self.port, ids, n, f"127.0.{k + 1}.1", node_timeout, interval,
                FDS_PER_AGENT * len(ids) + 1024, intakes, self.runtime_dir))
            proc.start()
            self.conns.append(here)
            self.procs.append(proc)
            if k == 0:  # the coordinator's host binds the endpoint before anyone connects
                self._expect(here, "ready")
        for here in self.conns[1:]:
            self._expect(here, "ready")

    @staticmethod
    def _expect(conn, what):
        if not conn.poll(300):
            raise TimeoutError(f"no {what}")
        reply = conn.recv()
        if reply[0] != what:
            raise RuntimeError(str(reply))

    def ask(self, *cmd, which=None):
        which = [k for k in range(len(self.conns)) if k not in self.stopped] \
            if which is None else which
        for k in which:
            self.conns[k].send(cmd)
        return [self.conns[k].recv() for k in which]

    def wait(self, kind, epoch, limit, exclude=(), which=None):
        """Until every live agent (but ``exclude``) has ``kind`` at ``epoch``+: (first, last)."""
        end = time.monotonic() + limit
        while True:
            reports = self.ask("report", kind, epoch, tuple(exclude), which=which)
            got, want = sum(r[0] for r in reports), sum(r[1] for r in reports)
            if got >= want:
                return (min(r[2] for r in reports if r[2] is not None),
                        max(r[3] for r in reports if r[3] is not None))
            if time.monotonic() > end:
                missing = [m for r in reports for m in r[4]][:4]
                raise TimeoutError(f"{kind} at epoch {epoch}: {got} of {want} in {limit:g}s "
                                   f"({'; '.join(missing)})")
            time.sleep(0.05)

    def cpu(self, k):
        """CPU seconds of process k: all of it, its coordinator thread, ZeroMQ's I/O thread,
        and its intake processes, all of their threads."""
        out = coordinator_cpu(self.procs[k].pid, self.ask("threads", which=[k])[0])
        out["intakes"] = sum(coordinator_cpu(pid, -1)["process"] for pid in self.intakes(k))
        return out

    def intakes(self, k):
        return [c.pid for c in psutil.Process(self.procs[k].pid).children()
                if "launcher.intake" in c.cmdline()]

    def stop(self, k):
        """Process k's machine goes silent: the process stops (SIGSTOP), its intakes too,
        nothing reaches it."""
        for pid in [self.procs[k].pid, *self.intakes(k)]:
            os.kill(pid, signal.SIGSTOP)
        self.stopped.add(k)

    def close(self):
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.join(5)
        shutil.rmtree(self.runtime_dir, ignore_errors=True)


def machine_matches():
    """iptables matches of every TCP packet of this process's and its intakes': each
    connection by its addresses and ports (every agent connects from 127.0.0.1, and at
    16,384 agents an ephemeral port number is used by several: a port alone would silence
    others too), each listening port by its address."""
    matches = []
    for proc in [psutil.Process(), *psutil.Process().children()]:
        for c in proc.net_connections("tcp"):
            if c.status == psutil.CONN_LISTEN:
                matches += [["-d", c.laddr.ip, "--dport", str(c.laddr.port)],
                            ["-s", c.laddr.ip, "--sport", str(c.laddr.port)]]
            elif c.raddr:
                matches += [["-s", c.laddr.ip, "--sport", str(c.laddr.port),
                             "-d", c.raddr.ip, "--dport", str(c.raddr.port)],
                            ["-s", c.raddr.ip, "--sport", str(c.raddr.port),
                             "-d", c.laddr.ip, "--dport", str(c.laddr.port)]]
    return matches


@contextlib.contextmanager
def silenced(matches):
    """Nothing of these TCP packets (loopback; machine_matches): iptables rules, removed
    after."""
    rules = [["-p", "tcp", *match, "-j", "DROP"] for match in matches]
    added = []
    try:
        for rule in rules:
            subprocess.run(["iptables", "-I", "INPUT", *rule], check=True, capture_output=True)
            added.append(rule)
        yield
    finally:
        for rule in added:
            subprocess.run(["iptables", "-D", "INPUT", *rule], capture_output=True)


def can_silence():
    return os.geteuid() == 0 and shutil.which("iptables") is not None


ROOMY_FROM = 1024  # agents: fewer fit the kernel's defaults
ROOMY_KERNEL = {"net/ipv4/ip_local_port_range": "10000\t65535", "net/core/somaxconn": "65535",
                "net/ipv4/tcp_max_syn_backlog": "65535", "net/core/netdev_max_backlog": "65536"}
"""One machine plays 16,384: each agent has two connections to the coordinator (see
ControlPlane.watch) and one to its first successor, all from 127.0.0.1, more than the
default 28,232 ephemeral ports; and all of them connect to a successor at once (somaxconn:
the listen backlog's cap). Loopback
packets wait in a CPU's backlog, 1,000 by default, which bursts of thousands of agents
overflowed (/proc/net/softnet_stat counted 11,000 packets dropped over a few runs, each a
TCP retry for its agent); a real machine has a NIC queue per core instead."""


@contextlib.contextmanager
def roomy_kernel(n):
    """ROOMY_KERNEL's settings for a run of ``n`` agents that needs them (as root), the
    machine's own restored after. A small run leaves the machine as it is: a wider port
    range would hand other programs' fixed ports out as ephemeral ones meanwhile."""
    saved = {}
    try:
        if os.geteuid() == 0 and n > ROOMY_FROM:
            for key, value in ROOMY_KERNEL.items():
                path = f"/proc/sys/{key}"
                with open(path) as f:
                    saved[path] = f.read()
                with open(path, "w") as f:
                    f.write(value)
        yield saved
    finally:
        for path, value in saved.items():
            with open(path, "w") as f:
                f.write(value)


@contextlib.contextmanager
def own_core(pids, others):
    """Processes ``pids`` (node 0's agent and its intakes) alone on the first CPU, ``others``
    on the rest, as on a real node 0 (the simulated agents are other machines); the
    affinities restored after."""
    cpus = sorted(os.sched_getaffinity(pids[0]))
    saved = {p: os.sched_getaffinity(p) for p in [*pids, *others]}
    try:
        for p in saved:
            for task in os.listdir(f"/proc/{p}/task"):  # every thread: ZeroMQ's too
                with contextlib.suppress(ProcessLookupError):
                    os.sched_setaffinity(int(task), cpus[:1] if p in pids else cpus[1:])
        yield
    finally:
        for p, mask in saved.items():
            for task in os.listdir(f"/proc/{p}/task"):
                with contextlib.suppress(ProcessLookupError):
                    os.sched_setaffinity(int(task), mask)


def softirq_jiffies():
    with open("/proc/stat") as f:
        return int(f.readline().split()[7])  # cpu user nice system idle iowait irq softirq


def bench_ftlaunch(n, args):
    """One job of N agents through formation, heartbeats, two node losses and two
    coordinator losses. Times in seconds."""
    out = {"n": n, "node_timeout": args.node_timeout, "heartbeat_interval": args.heartbeat_interval}
    t_setup = time.monotonic()
    job = Job(n, args.procs, args.node_timeout, args.heartbeat_interval, args.intakes)
    out["setup_s"] = time.monotonic() - t_setup
    limit = 60 + n / 100
    try:
        cpu0 = job.cpu(0)["process"]
        t0 = min(job.ask("join"))
        first, last = job.wait("assign", 1, limit)
        out["formed_s"], out["first_assign_s"] = last - t0, first - t0
        out["ready_s"] = job.wait("start", 1, limit)[1] - t0
        out["coordinator_cpu_forming_s"] = job.cpu(0)["process"] - cpu0
        # Steady state: everyone heartbeating.
        time.sleep(2.0)
        beats0, cpu0, w0 = sum(job.ask("beats")), job.cpu(0), time.monotonic()
        irq0 = softirq_jiffies()
        time.sleep(args.cpu_window)
        beats1, cpu1, w1 = sum(job.ask("beats")), job.cpu(0), time.monotonic()
        out["heartbeats_per_s"] = (beats1 - beats0) / (w1 - w0)
        # The kernel's share (TCP keepalive probes, softirq of every process): the machine's.
        out["machine_softirq_fraction"] = (softirq_jiffies() - irq0) / os.sysconf(
            "SC_CLK_TCK") / (w1 - w0)
        for key in cpu0:  # the coordinator: its thread and ZeroMQ's I/O thread
            out[f"cpu_{key}"] = (cpu1[key] - cpu0[key]) / (w1 - w0)
        out["coordinator_cpu_fraction"] = out["cpu_coordinator_thread"] + out["cpu_zmq_io"]
        if args.intakes:
            out["coordinator_cpu_fraction"] += out["cpu_intakes"]
        if len(os.sched_getaffinity(0)) > 1:  # again, the coordinator on a core of its own
            with own_core([job.procs[0].pid, *job.intakes(0)], [p.pid for p in job.procs[1:]]):
                cpu0, w0 = job.cpu(0), time.monotonic()
                time.sleep(args.cpu_window)
                cpu1, w1 = job.cpu(0), time.monotonic()
            out["coordinator_cpu_own_core"] = sum(
                cpu1[key] - cpu0[key] for key in ("coordinator_thread", "zmq_io", "intakes")
            ) / (w1 - w0)
        # A frozen agent process: the last agent stops heartbeating and reading; its kernel
        # still answers TCP. Found by heartbeats: three of a large job's beats.
        liveness = membership.liveness_timeout(args.node_timeout, n)
        out["liveness_timeout_s"] = liveness
        epoch = max(job.ask("epoch"))
        silent = n - 1
        silenced_at = time.monotonic()
        last_beat = job.ask("silence", silent, which=[job.owner[silent]])[0]
        first, last = job.wait("recover", epoch, limit + 2 * liveness)
        out["silent_loss_after_last_beat_s"] = last - last_beat
        out["silent_loss_after_silence_s"] = last - silenced_at
        out["silent_loss_first_recover_s"] = first - last_beat
        out["reformed_after_silent_s"] = job.wait("start", epoch + 1, limit)[1] - last
        if can_silence():  # a silent machine: agent 3's process stopped, its port dropped
            epoch = max(job.ask("epoch"))
            with silenced(job.ask("machine", which=[3])[0]):
                machine_at = time.monotonic()
                job.stop(3)
                first, last = job.wait("recover", epoch, limit + 2 * args.node_timeout)
            out["machine_loss_s"], out["machine_loss_first_recover_s"] = \
                last - machine_at, first - machine_at
            out["reformed_after_machine_s"] = job.wait("start", epoch + 1, limit)[1] - last
        # A dead agent process: its connections close.
        epoch = max(job.ask("epoch"))
        dead = n - 2
        closed_at = job.ask("close", dead, which=[job.owner[dead]])[0]
        first, last = job.wait("recover", epoch, limit)
        out["dead_loss_s"], out["dead_loss_first_recover_s"] = last - closed_at, first - closed_at
        out["reformed_after_dead_s"] = job.wait("start", epoch + 1, limit)[1] - last
        # The coordinator's process dies (SIGKILL agent 0's process): agent 1 takes over.
        epoch = max(job.ask("epoch"))
        killed_at = time.monotonic()
        os.kill(job.procs[0].pid, signal.SIGKILL)
        survivors = [k for k in range(1, len(job.conns)) if k not in job.stopped]
        out["failover_dead_s"] = job.wait("assign", epoch + 1, limit + args.node_timeout,
                                          which=survivors)[1] - killed_at
        out["failover_dead_noticed_s"] = job.wait("failover", epoch, limit,
                                                  which=survivors)[1] - killed_at
        out["failover_dead_ready_s"] = job.wait("start", epoch + 1, limit,
                                                which=survivors)[1] - killed_at
        # The successor's machine goes silent (agent 1's process stopped; with iptables,
        # its packets dropped too): agent 2 takes over. First the job settles for a heartbeat
        # interval, as between faults: survivors connect to their next successor then.
        time.sleep(membership.beat_interval(args.heartbeat_interval, n))
        epoch = max(job.ask("epoch", which=survivors))
        machine = job.ask("machine", which=[1])[0]
        with silenced(machine) if can_silence() else contextlib.nullcontext():
            stopped_at = time.monotonic()
            job.stop(1)
            survivors = survivors[1:]
            wait = args.node_timeout if can_silence() else liveness
            out["failover_silent_s"] = job.wait("assign", epoch + 1, limit + 2 * wait,
                                                which=survivors)[1] - stopped_at
            out["failover_silent_ready_s"] = job.wait("start", epoch + 1, limit,
                                                      which=survivors)[1] - stopped_at
            out["failover_silent_noticed_s"] = job.wait("failover", epoch, limit,
                                                        which=survivors)[1] - stopped_at
        out["ok"] = True
    except (TimeoutError, RuntimeError, EOFError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        job.close()
    return out


def in_child(fn, args, limit):
    """fn(*args) in a spawned process: its dict, or {"error": ...} after limit seconds."""
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(there, fn, args), daemon=True)
    proc.start()
    there.close()
    try:
        result = here.recv() if here.poll(limit) else {"error": "timeout"}
    except EOFError:
        result = {"error": "child died"}
    proc.join(5)
    if proc.is_alive():
        proc.kill()
        proc.join()
    return result


def _child(conn, fn, args):
    try:
        result = fn(*args)
    except Exception as e:
        result = {"error": f"{type(e).__name__}: {e}"}
    conn.send(result)
    os._exit(0)  # don't wait for threads stuck in a store call


# --- torch ------------------------------------------------------------------------------------


def torch_participants(port, n, limit, keep_alive):
    from datetime import timedelta

    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
    run_id, results, handlers, cas = f"bench-{n}", [None] * n, [None] * n, [0] * n
    gate = threading.Barrier(n + 1, timeout=120)  # all stores and handlers made: go

    def participant(i):
        try:
            store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=limit))
            backend = C10dRendezvousBackend(store, run_id)
            set_state = backend.set_state

            def counted_set_state(*args):  # every state write is a compare_set of the whole state
                cas[i] += 1
                return set_state(*args)

            backend.set_state = counted_set_state
            handlers[i] = create_handler(store, backend, RendezvousParameters(
                "c10d", f"127.0.0.1:{port}", run_id, n, n, local_addr="127.0.0.1",
                join_timeout=int(limit), keep_alive_interval=keep_alive))
            gate.wait()
            info = handlers[i].next_rendezvous()
            results[i] = (time.monotonic(), info.rank, info.world_size)
        except Exception as e:
            results[i] = e

    threads = [threading.Thread(target=participant, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    gate.wait()
    t0 = time.monotonic()
    for t in threads:
        t.join(max(0.0, t0 + limit - time.monotonic()))
    done = [r for r in results if isinstance(r, tuple)]
    for h, r in zip(handlers, results, strict=True):
        if isinstance(r, tuple):
            h._stop_heartbeats()  # private; stops the keep-alive timer without closing the round
    if len(done) < n:
        errors = sorted({type(r).__name__ for r in results if isinstance(r, Exception)})
        return {"error": f"timeout ({len(done)}/{n} in {limit:g}s){errors or ''}",
                "cas_ops": sum(cas)}
    ok = sorted(r[1] for r in done) == list(range(n)) and all(r[2] == n for r in done)
    return {"rendezvous_s": max(r[0] for r in done) - t0, "ok": ok, "cas_ops": sum(cas)}


def bench_torch(n, limit, keep_alive):
    from torch.distributed import TCPStore
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    cpu = cpu_seconds()
    result = in_child(torch_participants, (store.port, n, limit, keep_alive), limit + 150)
    result["store_cpu_s"] = cpu_seconds() - cpu
    return result


# --- main -------------------------------------------------------------------------------------

COLUMNS = [("formed_s", "formed s"), ("ready_s", "ready s"),
           ("coordinator_cpu_fraction", "coordinator CPU, heartbeating (core)"),
           ("coordinator_cpu_own_core", "the same, on a core of its own"),
           ("heartbeats_per_s", "heartbeats/s"),
           ("machine_softirq_fraction", "machine softirq (core)"),
           ("machine_loss_s", "silent machine: silenced -> all recover s"),
           ("silent_loss_after_last_beat_s", "frozen agent process: last beat -> all recover s"),
           ("liveness_timeout_s", "its liveness timeout s"),
           ("dead_loss_s", "dead agent: closed -> all recover s"),
           ("failover_dead_s", "coordinator process dies -> all assigned s"),
           ("failover_silent_s", "coordinator machine silent -> all assigned s")]


def cell(d, key, digits=3):
    value = d.get(key)
    if value is None:
        return d.get("error", "-") if key == "formed_s" else "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def plot(rows, path, node_timeout):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ok = [r["ftlaunch"] for r in rows if "formed_s" in r["ftlaunch"]]
    ns = [r["n"] for r in ok]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4.5))
    for key, label in [("formed_s", "formed (first join -> all assigned)"),
                       ("ready_s", "ready (-> all started)"),
                       ("dead_loss_s", "dead agent -> all recover"),
                       ("failover_dead_s", "coordinator process dies -> all re-assigned")]:
        ax1.plot(ns, [r.get(key, float("nan")) for r in ok], "o-", label=label)
    ax1.set(xlabel="agents N", ylabel="seconds", title="Time against N")
    ax1.legend(fontsize=8)
    for key, label in [("machine_loss_s", "silent machine -> all recover"),
                       ("failover_silent_s", "coordinator machine silent -> all re-assigned")]:
        ax2.plot(ns, [r.get(key, float("nan")) - node_timeout for r in ok], "o-", label=label)
    ax2.axhline(0.1, color="grey", ls=":", label="target: timeout + 0.1 s")
    ax2.axhline(0.2, color="grey", ls="--", label="target: timeout + 0.2 s")
    ax2.set(xlabel="agents N", ylabel=f"seconds beyond --node-timeout ({node_timeout:g} s)",
            title="Silence: past the node timeout")
    ax2.legend(fontsize=8)
    nan = float("nan")
    ax3.plot(ns, [100 * r.get("coordinator_cpu_fraction", nan) for r in ok], "o-",
             label="coordinator, all heartbeating")
    ax3.plot(ns, [1e6 * r.get("coordinator_cpu_fraction", nan) / r.get("heartbeats_per_s", 1)
                  for r in ok], "s--", label="µs of CPU per heartbeat")
    ax3.axhline(10, color="grey", ls=":", label="target: 10 % of a core")
    ax3.set(xlabel="agents N", ylabel="% of one core  /  µs", title="Coordinator CPU")
    ax3.legend(fontsize=8)
    for ax in (ax1, ax2, ax3):
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1024,4096", help="numbers of agents, comma-separated")
    p.add_argument("--reps", type=int, default=1, help="ftlaunch runs per size (median formed)")
    p.add_argument("--procs", type=int, default=8, help="processes the swarm is spread over")
    p.add_argument("--node-timeout", type=float, default=5.0, help="ftlaunch's default")
    p.add_argument("--heartbeat-interval", type=float, default=0.5, help="ftlaunch's default")
    p.add_argument("--cpu-window", type=float, default=10.0, help="seconds of heartbeats")
    p.add_argument("--torch-max", type=int, default=64, help="largest N tried with torch")
    p.add_argument("--torch-timeout", type=float, default=180.0, help="seconds per torch size")
    p.add_argument("--torch-keep-alive", type=int, default=5, help="torch keep_alive_interval "
                   "(default 5 s, torch's; a node silent 3 intervals is evicted)")
    p.add_argument("--intakes", type=int, default=0,
                   help="intake processes (launcher.intake) for the agents that may host the "
                        "coordinator (0, 1, 2); their CPU counts as the coordinator's")
    p.add_argument("--out-json")
    p.add_argument("--plot", help="PNG of time and CPU against N")
    p.add_argument("--plot-from", metavar="JSON", help="only plot an earlier --out-json")
    args = p.parse_args()
    if args.plot_from:
        with open(args.plot_from) as f:
            saved = json.load(f)
        plot([r for r in saved["rows"] if not r.get("torch_only")], args.plot,
             saved["args"]["node_timeout"])
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    raise_nofile(max(sizes) * FDS_PER_AGENT + 4096)  # the coordinator: one per agent
    logging.getLogger("ftlaunch").setLevel(logging.ERROR)  # "node ... lost" is expected here
    rows = []
    with roomy_kernel(max(sizes)) as changed:
        if not changed and max(sizes) > 8192:
            print("not root: the kernel's port range and listen backlog stay as they are")
        runs_by_size = {}
        for n in sizes:
            runs_by_size[n] = sorted((bench_ftlaunch(n, args) for _ in range(args.reps)),
                                     key=lambda r: r.get("formed_s", float("inf")))
            print(f"N={n}: ftlaunch {json.dumps(runs_by_size[n])}", flush=True)
    for n, runs in runs_by_size.items():
        ft = {**runs[len(runs) // 2], "reps_formed_s": [r.get("formed_s") for r in runs]}
        th = bench_torch(n, args.torch_timeout, args.torch_keep_alive) \
            if n <= args.torch_max else {"error": "not run"}
        rows.append({"n": n, "ftlaunch": ft, "torch_c10d": th})
        print(f"N={n}: torch {th}", flush=True)
    for n in sorted({n for n in [64] if n <= args.torch_max} - set(sizes)):
        rows.append({"n": n, "ftlaunch": {}, "torch_c10d": bench_torch(
            n, args.torch_timeout, args.torch_keep_alive), "torch_only": True})
        print(f"N={n}: torch {rows[-1]['torch_c10d']}", flush=True)
    print(f"\n--node-timeout {args.node_timeout:g}, --heartbeat-interval "
          f"{args.heartbeat_interval:g}, --procs {args.procs}, --intakes {args.intakes}\n")
    print("| N | " + " | ".join(label for _, label in COLUMNS) + " | torch c10d s |")
    print("|---" * (len(COLUMNS) + 2) + "|")
    for r in rows:
        ft, th = r["ftlaunch"], r["torch_c10d"]
        print(f"| {r['n']} | " + " | ".join(cell(ft, key, 2 if "cpu" in key or "per_s" in key
                                                   else 3) for key, _ in COLUMNS)
              + f" | {cell(th, 'rendezvous_s', 2) if 'rendezvous_s' in th else th.get('error')} |")
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": f"{os.cpu_count()} CPUs, {platform.platform()}",
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                     text=True).stdout.strip(),
            "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
            "args": vars(args)}
    print(f"\n{meta['date']}  commit {meta['commit']}  {meta['uptime']}")
    if args.out_json:
        with open(args.out_json, "w") as f:
            json.dump({**meta, "rows": rows}, f, indent=1)
    if args.plot:
        plot([r for r in rows if not r.get("torch_only")], args.plot, args.node_timeout)


if __name__ == "__main__":
    main()
