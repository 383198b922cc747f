"""The coordinator alone on a core, as on node 0 of a large job: its CPU under the job's
heartbeats, and a takeover's cost when every survivor connects and joins at once.

bench_rendezvous.py runs the whole job, so its simulated agents share the coordinator's
cores; here the coordinator's process (its thread and ZeroMQ's I/O thread) has the first
CPU to itself and the agents, plain DEALERs with no agent loop, send from the others.

    heartbeats  N agents of a running job beat at the job's rate (membership.beat_interval:
                at most HEARTBEATS_PER_SECOND): the coordinator's CPU (thread + I/O thread)
                over --window seconds, and per heartbeat.
    takeover    a successor's coordinator starts (as ControlPlane.fail_over starts it) and
                N-1 survivors connect and join: last join sent, round closed, every assign
                received.

    python scripts/bench_coordinator.py --nodes 1024,4096,8192
"""

import argparse
import multiprocessing as mp
import os
import resource
import time

import zmq

from ftlaunch_contract.messages import Assign, Heartbeat, Join
from ftlaunch_contract.protocol import Codec
from launcher import membership
from launcher.coordinator import Coordinator, JobState, RoundPhase, bind_router

SECRET = b"bench-coordinator-secret-0123456789"
NODE_TIMEOUT = 5.0


def node(i):
    return f"node{i:05d}"


def state(n):
    return JobState(min_nodes=1, max_nodes=n, max_restarts=100, policy="cold", backoff=0.0,
                    backoff_max=0.0, exit_barrier_timeout=30.0, node_timeout=NODE_TIMEOUT,
                    last_call=30.0, join_timeout=600.0, host_node=node(0))


def cpu_seconds(pid, thread_id):
    """(the coordinator thread's, ZeroMQ's I/O threads') CPU seconds."""
    tick, mine, io = os.sysconf("SC_CLK_TCK"), 0.0, 0.0
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        with open(f"/proc/{pid}/task/{task}/comm") as f:
            name = f.read().strip()
        used = (int(fields[11]) + int(fields[12])) / tick
        if int(task) == thread_id:
            mine += used
        elif name.startswith("ZMQbg/IO"):
            io += used
    return mine, io


def host(n, takeover, conn, cpu):
    """The coordinator's process, alone on ``cpu``."""
    os.sched_setaffinity(0, [cpu])
    sock, port = bind_router(zmq.Context(), "127.0.0.1", 0, NODE_TIMEOUT)
    s = state(n)
    now = time.monotonic()
    if takeover:  # what fail_over gives it: the named successors, how many survived
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
    coordinator = Coordinator(sock, SECRET, s, "coordinator node lost" if takeover else None)
    coordinator.start()
    conn.send((port, coordinator._thread.native_id, time.monotonic()))
    conn.recv()  # done
    conn.send(s.epoch)


def dealers(context, port, count):
    socks = []
    for _ in range(count):
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{port}")
        socks.append(sock)
    return socks


def bench(n, takeover, window, cpus):
    """``cpus``: the first for the coordinator, the others for the agents (this process)."""
    here, there = mp.Pipe()
    proc = mp.get_context("spawn").Process(target=host, args=(n, takeover, there, cpus[0]),
                                           daemon=True)
    proc.start()
    os.sched_setaffinity(0, cpus[1:])
    context = zmq.Context()
    context.set(zmq.MAX_SOCKETS, n + 64)
    codecs = [Codec(SECRET) for _ in range(n)]
    here.send("ready")
    port, thread_id, started = here.recv()
    out = {"nodes": n}
    if takeover:
        socks, t0 = [], time.monotonic()
        for i in range(1, n):
            socks += dealers(context, port, 1)
            socks[-1].send_multipart(codecs[i].encode(Join(
                node_id=node(i), local_world_size=8, addr="127.0.0.1", rank_hint=-1,
                standby_port=1, replica_port=0, held=(), restart_count=0, seated_epoch=5), 5))
        out["joins_sent_s"] = time.monotonic() - t0
        poller, assigned, index = zmq.Poller(), {}, {sock: i + 1 for i, sock in enumerate(socks)}
        for sock in socks:
            poller.register(sock, zmq.POLLIN)
        end = t0 + 120
        while len(assigned) < n - 1 and time.monotonic() < end:
            for sock, _ in poller.poll(100):
                i = index[sock]
                while sock.poll(0):
                    if isinstance(codecs[i].decode(sock.recv_multipart()).body, Assign):
                        assigned.setdefault(i, time.monotonic())
        out["assigned"] = len(assigned)
        out["first_assign_s"] = min(assigned.values()) - t0
        out["all_assigned_s"] = max(assigned.values()) - t0
    else:
        socks = dealers(context, port, n)
        time.sleep(2.0)  # connected
        beat = membership.beat_interval(0.5, n) / n  # the job's rate, evenly spread
        cpu0, t0, sent = cpu_seconds(proc.pid, thread_id), time.monotonic(), 0
        while (now := time.monotonic()) < t0 + window:
            if now < t0 + sent * beat:
                time.sleep(t0 + sent * beat - now)
            i = sent % n
            socks[i].send_multipart(codecs[i].encode(Heartbeat(node_id=node(i), phase="running",
                                                               ranks=()), 0))
            sent += 1
            if sent % 256 == 0:  # the acks
                for sock in socks:
                    while sock.poll(0):
                        sock.recv_multipart()
        cpu1, wall = cpu_seconds(proc.pid, thread_id), time.monotonic() - t0
        out["heartbeats_per_s"] = sent / wall
        out["coordinator_thread"] = (cpu1[0] - cpu0[0]) / wall
        out["zmq_io"] = (cpu1[1] - cpu0[1]) / wall
        out["cpu"] = out["coordinator_thread"] + out["zmq_io"]
        out["cpu_us_per_heartbeat"] = 1e6 * out["cpu"] / out["heartbeats_per_s"]
    here.send("done")
    here.recv()
    proc.kill()
    for sock in socks:
        sock.close(0)
    context.term()
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default="1024,4096,8192")
    p.add_argument("--window", type=float, default=10.0, help="seconds of heartbeats")
    args = p.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("needs 2 CPUs: one for the coordinator, the rest for the agents")
    sizes = [int(n) for n in args.nodes.split(",")]
    want = 2 * max(sizes) + 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))
    print("| nodes | heartbeats/s | coordinator CPU (thread + I/O) | µs a heartbeat | "
          "takeover: joins sent s | round's assigns: first s | all s |")
    print("|---|---|---|---|---|---|---|")
    for n in sizes:
        hb, tk = bench(n, False, args.window, cpus), bench(n, True, 0, cpus)
        print(f"| {n} | {hb['heartbeats_per_s']:.0f} | {100 * hb['cpu']:.1f} % "
              f"({100 * hb['coordinator_thread']:.1f} + {100 * hb['zmq_io']:.1f}) | "
              f"{hb['cpu_us_per_heartbeat']:.0f} | {tk['joins_sent_s']:.2f} | "
              f"{tk['first_assign_s']:.2f} | {tk['all_assigned_s']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
