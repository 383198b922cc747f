"""The coordinator alone on a core, as on node 0 of a large job: its CPU under the job's
heartbeats, and a takeover's cost when every survivor connects and joins at once.

bench_rendezvous.py runs the whole job, so its simulated agents share the coordinator's
cores; here the coordinator's process (its thread and ZeroMQ's I/O thread) has the first
CPU to itself and the agents, plain DEALERs with no agent loop (up to 6,000 a process), send
from the others.

    heartbeats  N agents of a running job beat at the job's rate (membership.beat_interval:
                at most HEARTBEATS_PER_SECOND): the coordinator's CPU (thread + I/O thread)
                over --window seconds, and per heartbeat, once each node has beaten once
                (--warmup, default one beat interval: the steady state, acks included).
                With --intakes their processes' CPU counts as the coordinator's.
    takeover    a successor's coordinator starts (as ControlPlane.fail_over starts it) and
                N-1 survivors join, on connections to its standby socket opened beforehand
                (ControlPlane._prepare_takeover) or, with --connect-at-takeover, all
                connecting at once: the last join sent, the round closed and its assigns
                queued (by the coordinator thread), the first and the last assign received.
                With --joins-first the survivors' joins wait on the standby socket before
                the successor serves (they noticed the loss first, as on a cluster, where
                every survivor's connection closes at once): times from its start. And the
                CPU seconds its thread and ZeroMQ's I/O thread spent from its start: on a
                node whose cores let them run side by side, the thread's is the floor.
    formation   --formation: the same, as a job forms at the rendezvous endpoint: a fresh
                coordinator (--nnodes N:N) and N agents joining, their connections open
                (agents dial the endpoint as they start): formed = the first join sent ->
                every agent has its assign.
    socket floor  --socket-floor: the takeover's messages alone, nothing decoded or decided
                (see floor_host): what a node costs the successor's one thread in ZeroMQ.
    decider     --decider-only: the takeover's joins handled and its round decided with no
                socket, decoding nor encoding (see decider): what no intake process could
                take off the coordinator (docs/scale.md). One process, no agents.

    python scripts/bench_coordinator.py --nodes 1024,4096,8192,16384
"""

import argparse
import logging
import multiprocessing as mp
import os
import resource
import select
import time

import msgpack
import psutil
import zmq
from bench_rendezvous import coordinator_cpu, roomy_kernel

from ftlaunch_contract.messages import CONTROL, Assign, Heartbeat, Held, Join, RankState
from ftlaunch_contract.protocol import Codec, Envelope
from launcher import membership
from launcher.coordinator import Coordinator, JobState, RoundPhase, bind_router
from launcher.intake import Port
from launcher.replica_plan import runs

SECRET = b"bench-coordinator-secret-0123456789"
NODE_TIMEOUT = 5.0


def node(i):
    return f"node{i:05d}"


def state(n):
    return JobState(min_nodes=1, max_nodes=n, max_restarts=100, policy="cold", backoff=0.0,
                    backoff_max=0.0, exit_barrier_timeout=30.0, node_timeout=NODE_TIMEOUT,
                    last_call=30.0, join_timeout=600.0, host_node=node(0))


def host(n, takeover, conn, cpus, io_threads=1, joins_first=False, intakes=0,
         formation=False):
    """The coordinator's process, alone on ``cpus``, with ``io_threads`` ZeroMQ I/O threads
    (each accepted connection is served by the least loaded one) and ``intakes`` intake
    processes sharing its port (on the same ``cpus``)."""
    os.sched_setaffinity(0, cpus)
    logging.getLogger("ftlaunch").setLevel(logging.ERROR)  # the agents' exits at the end
    shared = Port(zmq.Context(io_threads=io_threads), "127.0.0.1", 0, NODE_TIMEOUT, SECRET,
                  intakes, max_nodes=n)
    port = shared.port
    s = state(n)
    now = time.monotonic()
    if formation:  # the endpoint's, as a job starts: it forms once all n joined
        s.min_nodes = n
    elif takeover:  # what fail_over gives it: the named successors, how many survived
        s.epoch, s.expected_count = 5, n - 1
        for rank in range(16):
            s.group_ranks[node(rank + 1)], s.standby_ports[node(rank + 1)] = rank, 1
            s.last_seen[node(rank + 1)] = now
    else:  # a running round of n nodes
        for i in range(n):
            s.members[node(i)] = membership.Member(node(i), 8, "127.0.0.1", -1)
            s.group_ranks[node(i)], s.last_seen[node(i)] = i, now + 3600
        s.phase = RoundPhase.RUNNING
    conn.recv()  # the agents are ready
    if joins_first:  # they connect and join, then the successor serves
        conn.send((port, None))
        conn.recv()
        now = time.monotonic()
    coordinator = Coordinator(shared, SECRET, s,
                              "coordinator node lost" if takeover and not formation else None)
    pids = [p.pid for p in shared.intakes._procs.values()] if shared.intakes else []
    round_times = []  # the round closed, its assigns queued: the coordinator thread's share
    complete = coordinator._complete_round

    def timed_round(now: float) -> None:
        round_times.append(time.monotonic())
        complete(now)
        round_times.append(time.monotonic())
    coordinator._complete_round = timed_round
    io_before = coordinator_cpu(os.getpid(), -1)["zmq_io"]  # before: the joins read off TCP
    intakes_before = sum(coordinator_cpu(pid, -1)["process"] for pid in pids)
    coordinator.start()
    if not joins_first:
        conn.send((port, coordinator._thread.native_id))
    conn.recv()  # done
    cpu = coordinator_cpu(os.getpid(), coordinator._thread.native_id)
    intakes_cpu = sum(coordinator_cpu(pid, -1)["process"] for pid in pids) - intakes_before
    conn.send((now, round_times, cpu["coordinator_thread"], cpu["zmq_io"] - io_before,
               intakes_cpu))


def floor_host(n, conn, cpus):
    """--socket-floor: a takeover's messages and nothing else, in one thread: the queued
    joins read as the coordinator reads them (frame by frame, each one's descriptor) and one
    assign's encoding sent to each survivor (each receiver checks it on its own). What
    ZeroMQ and pyzmq cost a node before any decoding, signature or decision."""
    os.sched_setaffinity(0, cpus)
    sock, port = bind_router(zmq.Context(), "127.0.0.1", 0, NODE_TIMEOUT)
    conn.recv()  # the agents are ready
    conn.send((port, None))
    conn.recv()  # their joins are queued
    (frame,) = Codec(SECRET).encode(Assign(
        group_rank=1, group_world_size=n - 1, rank_offset=8, world_size=8 * (n - 1),
        restart_count=1, max_restarts=100, members=(), spares=(), earlier=(),
        coordinator_node=node(1), replicate_to=(), fetch=()), 6)
    io_before = coordinator_cpu(os.getpid(), -1)["zmq_io"]
    start, cpu = time.monotonic(), time.thread_time()
    identities = []
    while len(identities) < n - 1:
        try:
            parts = [sock.recv(zmq.NOBLOCK, copy=False)]
        except zmq.Again:
            sock.poll(100)
            continue
        while parts[-1].more:
            parts.append(sock.recv(copy=False))
        parts[1].get(zmq.SRCFD)
        identities.append(parts[0].bytes)
        _ = [part.bytes for part in parts[1:]]
    read = time.monotonic()
    for identity in identities:
        sock.send(identity, zmq.SNDMORE)
        sock.send(frame)
    sent, cpu = time.monotonic(), time.thread_time() - cpu
    conn.recv()  # done
    conn.send((start, [read, sent], cpu, coordinator_cpu(os.getpid(), -1)["zmq_io"] - io_before,
               0.0))


class _Discard:
    """A socket that sends nowhere (--decider-only)."""

    def send(self, frame, flags=0):
        pass


def decider(n, encode):
    """Seconds to handle a takeover's n-1 joins, already decoded, and to decide its round:
    ranks, replica plan and assigns built, each assign's encoding left out unless ``encode``
    (its sending is a call to _Discard). As in a job with the default one replica: each node
    on a host of its own holds its 8 ranks' staged shards of the last step and its
    predecessor's copies (the world was n nodes: the round is resized). The best of three."""
    logging.getLogger("ftlaunch").setLevel(logging.ERROR)  # (the resize's warning)
    world = 8 * n

    def held(i):
        return runs(Held(world, 8 * j + r, 100) for j in (i, (i - 1) % n) for r in range(8))
    joins = [Envelope(5, CONTROL["join"](
        node_id=node(i), local_world_size=8, addr=f"10.{i // 65536}.{i // 256 % 256}.{i % 256}",
        standby_port=1, rank_hint=-1, replica_port=7000, held=held(i), restart_count=0,
        seated_earlier=(), settled_below=-1, group_rank=-1, seated_epoch=5, electorate_epoch=5))
        for i in range(1, n)]
    best = (float("inf"), float("inf"))
    for _ in range(3):
        s, now = state(n), time.monotonic()
        s.epoch, s.expected_count, s.replicas = 5, n - 1, 1
        for rank in range(16):
            s.group_ranks[node(rank + 1)], s.standby_ports[node(rank + 1)] = rank, 1
            s.last_seen[node(rank + 1)] = now
        coordinator = Coordinator(_Discard(), SECRET, s, "coordinator node lost")
        if not encode:
            coordinator._codec.sign = lambda head, kind, own, values, seq: [b""]
        start = time.perf_counter()
        for i, join in enumerate(joins, 1):
            coordinator._handle(b"%d" % i, join, now)
        handled = time.perf_counter()
        if not coordinator._maybe_complete_round(now) or len(s.assigns) != n - 1:
            raise SystemExit(f"the round of {n} did not close with every survivor seated")
        decided = time.perf_counter()
        best = min(best, (handled - start, decided - handled), key=sum)
    return best


def decider_table(sizes):
    print("| nodes | joins handled s (µs a node) | round decided s (µs a node) | "
          "the same with assigns encoded s (µs a node) |")
    print("|---|---|---|---|")
    for n in sizes:
        (handled, decided), (_, encoded) = decider(n, False), decider(n, True)
        cells = [f"{t:.3f} ({1e6 * t / (n - 1):.1f})" for t in (handled, decided, encoded)]
        print(f"| {n} | " + " | ".join(cells) + " |", flush=True)


ASSIGN = msgpack.packb(Assign.TYPE)
AGENTS_PER_PROCESS = 6000  # each DEALER takes two files: a process may open 20,000 here


def dealer(context, port):
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock


def swarm(ids, n, port, takeover, window, conn, cpus, connect_at_takeover=False,
          joins_first=False, warmup=0.0, spread=0.0, formation=False):
    """Agents ``ids`` of a job of ``n`` in one process on ``cpus``: they beat at their share
    of the job's rate for ``window`` seconds, or join a takeover and wait for their assigns."""
    os.sched_setaffinity(0, cpus)
    context = zmq.Context()
    context.set(zmq.MAX_SOCKETS, len(ids) + 64)
    codecs = {i: Codec(SECRET) for i in ids}
    socks = {} if connect_at_takeover else {i: dealer(context, port) for i in ids}
    conn.send("ready")
    t0 = conn.recv()  # one start for every process (CLOCK_MONOTONIC is the machine's)
    if takeover:
        for j, i in enumerate(ids):
            if spread and (wait := t0 + spread * j / len(ids) - time.monotonic()) > 0:
                time.sleep(wait)  # (each process's share spread alike: they interleave)
            if connect_at_takeover:
                socks[i] = dealer(context, port)
            epoch = -1 if formation else 5  # a newcomer's, or a survivor's of epoch 5
            socks[i].send_multipart(codecs[i].encode(Join(
                node_id=node(i), local_world_size=8, addr="127.0.0.1", rank_hint=-1,
                standby_port=1, replica_port=0, held=(), restart_count=0,
                seated_earlier=(), settled_below=-1, group_rank=-1, seated_epoch=epoch,
                electorate_epoch=epoch), max(epoch, 0)))
        sent_at, arrived = time.monotonic(), {}
        if joins_first:
            conn.send(sent_at)
        # One epoll over ZeroMQ's notification fds (zmq_poll over thousands of sockets costs
        # milliseconds a call), and each message decoded only after the last arrived: on a
        # cluster every agent receives and decodes its own, here one core would serialize it.
        epoll, index = select.epoll(), {}
        done = set()  # an assign came (a small job's successor acks the joins it found queued)

        def read(i):
            while socks[i].getsockopt(zmq.EVENTS) & zmq.POLLIN:
                frames = socks[i].recv_multipart()
                arrived.setdefault(i, []).append((time.monotonic(), frames))
                if ASSIGN in frames[0][:32]:  # its type, near the start: no decoding here
                    done.add(i)
        for i, sock in socks.items():
            index[sock.getsockopt(zmq.FD)] = i
            epoll.register(sock.getsockopt(zmq.FD), select.EPOLLIN)
            # ZeroMQ's fd signals only a reader that found its pipe empty: what arrived before
            # a socket's first read never makes it readable, so each is read once first.
            read(i)
        while len(done) < len(ids) and time.monotonic() < t0 + 120:
            for fd, _ in epoll.poll(0.1):
                read(index[fd])
        assigned = {i: next(t for t, frames in got if isinstance(codecs[i].decode(frames).body, Assign))
                    for i, got in arrived.items()}
        conn.send((sent_at, min(assigned.values()), max(assigned.values()), len(assigned)))
    else:
        beat, sent, counted = membership.beat_interval(0.5, n) / len(ids), 0, 0  # spread
        order = list(ids)
        # As a node of 8 ranks says them for `ftlaunch status`: rank, step, beat age (ms).
        ranks = {i: tuple(RankState(8 * i + r, 1000, 40) for r in range(8)) for i in ids}
        while (now := time.monotonic()) < t0 + warmup + window:
            if now < t0 + sent * beat:
                time.sleep(t0 + sent * beat - now)
            i = order[sent % len(order)]
            socks[i].send_multipart(codecs[i].encode(Heartbeat(node_id=node(i), phase="running",
                                                               ranks=ranks[i], electorate_epoch=0), 0))
            sent += 1
            counted += now >= t0 + warmup
            if sent % 256 == 0:  # the acks
                for sock in socks.values():
                    while sock.poll(0):
                        sock.recv_multipart()
        conn.send(counted)
    for sock in socks.values():
        sock.close(0)
    context.term()


def answer(conn, timeout=300):
    """A worker's next word; a worker that died says nothing (its traceback is above)."""
    if not conn.poll(timeout):
        raise SystemExit(f"a process of the benchmark gave no answer in {timeout} s")
    return conn.recv()


def bench(n, takeover, window, cpus, connect_at_takeover=False, coordinator_cpus=1,
          io_threads=1, joins_first=False, socket_floor=False, warmup=0.0, intakes=0,
          spread=0.0, agent_procs=1, formation=False):
    """``cpus``: the first ``coordinator_cpus`` for the coordinator, the others for the
    agents."""
    spawn = mp.get_context("spawn")
    here, there = mp.Pipe()
    proc = spawn.Process(target=host, daemon=True,
                         args=(n, takeover, there, cpus[:coordinator_cpus], io_threads,
                               joins_first, intakes, formation)) if not socket_floor else \
        spawn.Process(target=floor_host, daemon=True, args=(n, there, cpus[:coordinator_cpus]))
    proc.start()
    here.send("ready")
    port, thread_id = answer(here)
    ids = list(range(1, n) if takeover and not formation else range(n))
    procs = max(agent_procs, -(-len(ids) // AGENTS_PER_PROCESS))
    swarms = []
    for k in range(procs):
        mine, theirs = mp.Pipe()
        worker = spawn.Process(target=swarm, daemon=True, args=(
            ids[k::procs], n, port, takeover, window, theirs, cpus[coordinator_cpus:],
            connect_at_takeover, joins_first, warmup, spread, formation))
        worker.start()
        swarms.append((worker, mine))
    for _, conn in swarms:
        answer(conn)
    if not connect_at_takeover:
        time.sleep(2.0)  # connected
    t0 = time.monotonic()
    for _, conn in swarms:
        conn.send(t0)
    if not takeover:  # measured once every node has beaten (and been acked) once
        time.sleep(warmup)
    measured_from = time.monotonic()
    intake_pids = [c.pid for c in psutil.Process(proc.pid).children()
                   if "launcher.intake" in c.cmdline()]

    def cpu():  # the coordinator's process, and its intakes as one more key
        out = coordinator_cpu(proc.pid, thread_id)
        out["intakes"] = sum(coordinator_cpu(pid, -1)["process"] for pid in intake_pids)
        return out
    cpu0 = None if thread_id is None else cpu()
    if joins_first:
        joined = max(answer(conn) for _, conn in swarms)
        time.sleep(max(0.0, joined + 1.0 - time.monotonic()))  # delivered and queued by then
        here.send("serve")
    reports = [answer(conn) for _, conn in swarms]
    wall = time.monotonic() - measured_from
    out = {"nodes": n}
    if takeover:
        out["joins_sent_s"] = max(r[0] for r in reports) - t0
        out["first_assign_s"] = min(r[1] for r in reports) - t0
        out["all_assigned_s"] = max(r[2] for r in reports) - t0
        out["assigned"] = sum(r[3] for r in reports)
    else:
        out["heartbeats_per_s"] = sum(reports) / wall
        cpu1 = cpu()
        for key in ("coordinator_thread", "zmq_io", "intakes"):
            out[key] = (cpu1[key] - cpu0[key]) / wall
        out["cpu"] = out["coordinator_thread"] + out["zmq_io"] + out["intakes"]
        out["cpu_us_per_heartbeat"] = 1e6 * out["cpu"] / out["heartbeats_per_s"]
    here.send("done")
    served_at, round_times, out["thread_cpu_s"], out["io_cpu_s"], out["intakes_cpu_s"] = \
        here.recv()
    if joins_first:  # from the successor's start: the joins were sent before it
        for key in ("joins_sent_s", "first_assign_s", "all_assigned_s"):
            out[key] -= served_at - t0
        t0 = served_at
    if takeover and round_times:
        out["round_closed_s"], out["assigns_queued_s"] = (t - t0 for t in round_times[:2])
    proc.kill()
    for worker, _ in swarms:
        worker.join(10)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default="1024,4096,8192,16384")
    p.add_argument("--window", type=float, default=10.0, help="seconds of heartbeats measured")
    p.add_argument("--warmup", type=float, default=None,
                   help="seconds of heartbeats before (default: one of the job's beat intervals)")
    p.add_argument("--connect-at-takeover", action="store_true",
                   help="survivors connect to the successor as they join (no connection "
                        "opened beforehand)")
    p.add_argument("--takeover-only", action="store_true", help="skip the heartbeats")
    p.add_argument("--joins-first", action="store_true",
                   help="the survivors' joins wait on the standby socket before the successor "
                        "serves; times from its start")
    p.add_argument("--socket-floor", action="store_true",
                   help="the takeover's joins read and one assign's encoding sent to each, "
                        "nothing decoded or decided: ZeroMQ's and pyzmq's cost a node "
                        "(implies --takeover-only --joins-first; 'round closed' = all read)")
    p.add_argument("--coordinator-cpus", type=int, default=1,
                   help="CPUs of the coordinator's process (its thread and ZeroMQ's I/O "
                        "thread: 2 lets them run side by side, as on a real node 0)")
    p.add_argument("--io-threads", type=int, default=1,
                   help="ZeroMQ I/O threads of the coordinator's context (the launcher's: 1); "
                        "more spread a takeover's writes over more cores")
    p.add_argument("--decider-only", action="store_true",
                   help="the takeover's joins handled and round decided, no socket, decoding "
                        "or encoding: the coordinator's share that intakes could not take")
    p.add_argument("--joins-spread", type=float, default=0.0,
                   help="the survivors' joins spread evenly over this many seconds, as a "
                        "silent coordinator's are (each survivor's kernel ends its connection "
                        "the node timeout after the last keepalive answer it had, those up to "
                        "a probe interval apart: coordinator.probe_interval, 1 s at 5 s)")
    p.add_argument("--agent-procs", type=int, default=1,
                   help="processes the simulated agents are spread over, at least (more "
                        "where a process would hold over 6,000): on a many-core host, so "
                        "that their receiving is not what a takeover's time measures")
    p.add_argument("--intakes", type=int, default=0,
                   help="intake processes sharing the coordinator's port (launcher.intake), "
                        "on its CPUs")
    p.add_argument("--formation", action="store_true",
                   help="a job forming at the rendezvous endpoint instead of a takeover "
                        "(implies --takeover-only)")
    args = p.parse_args()
    if args.decider_only:
        decider_table([int(n) for n in args.nodes.split(",")])
        return
    if args.socket_floor:
        args.takeover_only = args.joins_first = True
    args.takeover_only |= args.formation
    cpus = sorted(os.sched_getaffinity(0))
    if args.coordinator_cpus < 1 or len(cpus) <= args.coordinator_cpus:
        raise SystemExit(f"needs {args.coordinator_cpus + 1} CPUs or more: "
                         f"{args.coordinator_cpus} for the coordinator, the rest for the "
                         f"agents (this machine lets it use {len(cpus)}); lower --coordinator-cpus")
    sizes = [int(n) for n in args.nodes.split(",")]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # the coordinator's connections,
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # two files a DEALER
    print("| nodes | heartbeats/s | coordinator CPU (thread + I/O"
          + (" + intakes" if args.intakes else "") + ") | µs a heartbeat | "
          f"{'formation' if args.formation else 'takeover'}: joins sent s | round closed s | its assigns queued s | "
          "first received s | all received s | after the last join s | "
          "CPU s: thread + I/O (+ intakes) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for n in sizes:
        with roomy_kernel(n):  # as root, when n needs it: the loopback's backlog, ports, queue
            warmup = membership.beat_interval(0.5, n) if args.warmup is None else args.warmup
            hb = None if args.takeover_only else bench(n, False, args.window, cpus,
                                                       coordinator_cpus=args.coordinator_cpus,
                                                       io_threads=args.io_threads, warmup=warmup,
                                                       intakes=args.intakes)
            tk = bench(n, True, 0, cpus, args.connect_at_takeover, args.coordinator_cpus,
                       args.io_threads, args.joins_first, args.socket_floor,
                       intakes=args.intakes, spread=args.joins_spread,
                       agent_procs=args.agent_procs, formation=args.formation)
        beats = "| - | - | - " if hb is None else (
            f"| {hb['heartbeats_per_s']:.0f} | {100 * hb['cpu']:.1f} % "
            f"({100 * hb['coordinator_thread']:.1f} + {100 * hb['zmq_io']:.1f}"
            + (f" + {100 * hb['intakes']:.1f}" if args.intakes else "") + ") | "
            f"{hb['cpu_us_per_heartbeat']:.0f} ")
        print(f"| {n} {beats}| {tk['joins_sent_s']:.2f} | {tk['round_closed_s']:.2f} | "
              f"{tk['assigns_queued_s']:.2f} | {tk['first_assign_s']:.2f} | "
              f"{tk['all_assigned_s']:.2f} | "
              + ("- | " if args.joins_first else  # (sent before the successor served)
                 f"{tk['all_assigned_s'] - tk['joins_sent_s']:.2f} | ")
              + f"{tk['thread_cpu_s']:.2f} + {tk['io_cpu_s']:.2f}"
              + (f" (+ {tk['intakes_cpu_s']:.2f})" if args.intakes else "") + " |",
              flush=True)


if __name__ == "__main__":
    main()
