"""Rendezvous at scale: N simulated agents against ftlaunch's coordinator and torch's c10d rendezvous.

Both sides keep the server in this process and the N participants in one spawned child:

    ftlaunch  a real Coordinator (launcher.coordinator) on a ROUTER socket; N DEALER agents on one
              zmq.Poller, each with its own Codec. rendezvous: first join sent -> every agent has
              its assign; ready: -> every agent has start (group rank 0 sends store_ready).
    torch     a TCPStore; N DynamicRendezvousHandlers (c10d backend, one TCPStore client each,
              min = max = N) calling next_rendezvous() from N threads at once.

Then, with the real Coordinator: node-loss detection (64 heartbeating agents, one goes silent:
time until every survivor gets `recover`) and coordinator failover (64 real ControlPlanes; the
coordinator dies: time until every agent is assigned by the successor).

    python scripts/bench_rendezvous.py --sizes 64              # smoke check, a few seconds
    python scripts/bench_rendezvous.py --out-json rendezvous.json
"""

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import resource
import threading
import time

import zmq

from launcher.control_plane import ControlPlane
from launcher.coordinator import Coordinator, JobState, bind_router
from launcher.protocol import Codec

SECRET = b"bench-rendezvous-secret-0123456789abcdef"
LOCAL_WORLD = 8


def node_id(i):
    return f"node{i:05d}.bench.cluster:{40000 + i}"  # hostname:pid, like the agent's own ids


def job_state(n, node_timeout, host="bench"):
    return JobState(min_nodes=n, max_nodes=n, max_restarts=3, policy="cold", backoff=1.0,
                    backoff_max=30.0, exit_barrier_timeout=300.0, node_timeout=node_timeout,
                    last_call=1.0, join_timeout=600.0, host_node=host)


def in_child(fn, args, limit):
    """fn(*args) in a spawned process; its dict result, or {"error": ...} after limit seconds."""
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child_main, args=(there, fn, args), daemon=True)
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


def _child_main(conn, fn, args):
    try:
        result = fn(*args)
    except Exception as e:
        result = {"error": f"{type(e).__name__}: {e}"}
    conn.send(result)
    conn.close()
    os._exit(0)  # don't wait for daemon threads stuck in a store call


def cpu_seconds():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# --- ftlaunch: N DEALER agents in the child -------------------------------------------------


class Swarm:
    def __init__(self, port, n):
        self.n = n
        self.context = zmq.Context()
        self.context.set(zmq.MAX_SOCKETS, n + 64)
        self.socks, self.codecs = [], [Codec(SECRET) for _ in range(n)]
        self.poller, writable = zmq.Poller(), zmq.Poller()
        for _ in range(n):
            s = self.context.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.IMMEDIATE, 1)  # writable only once connected
            s.connect(f"tcp://127.0.0.1:{port}")
            self.socks.append(s)
            self.poller.register(s, zmq.POLLIN)
            writable.register(s, zmq.POLLOUT)
        self.index = {s: i for i, s in enumerate(self.socks)}
        deadline = time.monotonic() + 60
        while len(writable.poll(100)) < n:  # connect outside the measurement
            if time.monotonic() > deadline:
                raise TimeoutError("agents could not connect")
        self.got, self.bytes = {}, {}  # type -> {agent: (time, msg)}; type -> largest body
        self.silent, self.last_beat, self.next_beat = set(), {}, None

    def send(self, i, kind, epoch=0, **fields):
        self.socks[i].send_multipart(self.codecs[i].encode(kind, epoch, **fields))

    def pump(self, done, limit):
        end = time.monotonic() + limit
        while not done():
            now = time.monotonic()
            if now > end:
                raise TimeoutError(f"gave up after {limit:g}s")
            if self.next_beat is not None and now >= self.next_beat:
                for i in set(range(self.n)) - self.silent:
                    self.send(i, "heartbeat", node_id=node_id(i))
                    self.last_beat[i] = now
                self.next_beat = now + 0.2
            for sock, _ in self.poller.poll(10):
                i = self.index[sock]
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    msg = self.codecs[i].decode(frames)
                    self.got.setdefault(msg.type, {}).setdefault(i, (time.monotonic(), msg))
                    self.bytes[msg.type] = max(self.bytes.get(msg.type, 0), len(frames[0]))

    def count(self, kind):
        return len(self.got.get(kind, {}))

    def last(self, kind, since):
        return max(t for t, _ in self.got[kind].values()) - since


def ft_agents(port, n, node_loss, limit):
    w = Swarm(port, n)
    if node_loss:
        w.next_beat = 0.0
    t0 = time.monotonic()
    for i in range(n):
        w.send(i, "join", node_id=node_id(i), local_world_size=LOCAL_WORLD, addr="127.0.0.1",
               standby_port=20000 + i)
    w.pump(lambda: w.count("assign") == n, limit)
    assigns = {i: m for i, (_, m) in w.got["assign"].items()}
    ranks = sorted(m["group_rank"] for m in assigns.values())
    ok = ranks == list(range(n)) and all(
        m["world_size"] == LOCAL_WORLD * n and m["group_world_size"] == n for m in assigns.values())
    by_rank = {m["group_rank"]: i for i, m in assigns.items()}
    w.send(by_rank[0], "store_ready", assigns[by_rank[0]].epoch, master_addr="127.0.0.1",
           master_port=29500)
    w.pump(lambda: w.count("start") == n, limit)
    out = {"rendezvous_s": w.last("assign", t0), "ready_s": w.last("start", t0), "ok": ok,
           "assign_bytes": w.bytes["assign"]}
    if node_loss:  # a second of steady heartbeats, then the last group rank goes silent
        calm = time.monotonic() + 1.0
        w.pump(lambda: time.monotonic() > calm, limit)
        victim = by_rank[n - 1]
        w.silent.add(victim)
        stopped = time.monotonic()
        w.pump(lambda: w.count("recover") >= n - 1, limit)
        causes = {m["cause"] for _, m in w.got["recover"].values()}
        out.update(loss_from_last_beat_s=w.last("recover", w.last_beat[victim]),
                   loss_from_stop_s=w.last("recover", stopped), recover_causes=sorted(causes),
                   loss_ok=victim not in w.got["recover"]
                   and all(node_id(victim) in c and "lost" in c for c in causes))
    return out


def bench_ftlaunch(n, node_timeout=30.0, node_loss=False, limit=120.0):
    context = zmq.Context()
    sock, port = bind_router(context, "127.0.0.1", 0)
    coordinator = Coordinator(sock, SECRET, job_state(n, node_timeout))
    coordinator.start()
    cpu = cpu_seconds()
    result = in_child(ft_agents, (port, n, node_loss, limit), limit + 60)
    result["coordinator_cpu_s"] = cpu_seconds() - cpu  # this process only serves (plus connects)
    coordinator.close()
    context.term()
    return result


# --- torch: N DynamicRendezvousHandlers in N threads of the child ---------------------------


def torch_participants(port, n, limit):
    from datetime import timedelta

    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
    run_id = f"bench-{n}"
    handlers = []
    for _ in range(n):
        store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=limit))
        params = RendezvousParameters("c10d", f"127.0.0.1:{port}", run_id, n, n,
                                      local_addr="127.0.0.1", join_timeout=int(limit))
        handlers.append(create_handler(store, C10dRendezvousBackend(store, run_id), params))
    results, gate = [None] * n, threading.Barrier(n + 1)

    def participant(i):
        gate.wait()
        try:
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
    for h in handlers:
        h._stop_heartbeats()  # private: stop the keep-alive timers without closing the round
    if len(done) < n:
        errors = {type(r).__name__ for r in results if isinstance(r, Exception)}
        return {"error": f"timeout: {len(done)}/{n} done after {limit:g}s {sorted(errors)}"}
    ok = sorted(r[1] for r in done) == list(range(n)) and all(r[2] == n for r in done)
    return {"rendezvous_s": max(r[0] for r in done) - t0, "ok": ok}


def bench_torch(n, limit):
    from torch.distributed import TCPStore
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    cpu = cpu_seconds()
    result = in_child(torch_participants, (store.port, n, limit), limit + 120)
    result["store_cpu_s"] = cpu_seconds() - cpu
    del store
    return result


# --- coordinator failover: 64 real ControlPlanes in this process ----------------------------


def bench_failover(n=64, node_timeout=1.0, interval=0.2, limit=30.0):
    context = zmq.Context()
    sock, port = bind_router(context, "127.0.0.1", 0)
    first = Coordinator(sock, SECRET, job_state(n, node_timeout))
    first.start()
    planes = [ControlPlane(context, SECRET, node_id(i), "127.0.0.1", ("127.0.0.1", port),
                           lambda: job_state(n, node_timeout), node_timeout, interval)
              for i in range(n)]
    poller = zmq.Poller()
    for p in planes:
        poller.register(p.socket, zmq.POLLIN)
    assigns, index = {}, {p.socket: p for p in planes}

    def join(p):
        p.send("join", 0, node_id=p.node_id, local_world_size=LOCAL_WORLD, addr="127.0.0.1",
               standby_port=p.standby_port)

    def run_until(done):
        end = time.monotonic() + limit
        while not done() and time.monotonic() < end:
            for sock, _ in poller.poll(10):
                p = index[sock]
                msg = p.receive()
                if msg is not None and msg.type == "assign":
                    assigns[p.node_id] = msg
                    if msg["group_rank"] == 0:
                        p.send("store_ready", msg.epoch, master_addr="127.0.0.1", master_port=1)
            for p in planes:  # the agent's timers: heartbeat, follow a silent coordinator
                p.heartbeat_if_due(time.monotonic())
                last = assigns.get(p.node_id)
                if p.coordinator_lost(time.monotonic()) and \
                        p.fail_over(last.epoch, last["restart_count"]):
                    join(p)
        return done()

    for p in planes:
        join(p)
    run_until(lambda: len(assigns) == n)
    first_epoch, killed = max(m.epoch for m in assigns.values()), time.monotonic()
    first.close()
    ok = run_until(lambda: all(m.epoch > first_epoch for m in assigns.values()))
    took = time.monotonic() - killed
    for p in planes:
        p.close()
    context.term()
    return {"failover_s": took, "failover_minus_timeout_s": took - node_timeout, "ok": ok,
            "node_timeout_s": node_timeout}


# --- main -----------------------------------------------------------------------------------


def fmt(value, digits=3):
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="64,256,1024", help="comma-separated numbers of agents")
    p.add_argument("--torch-max", type=int, default=1024, help="largest N tried with torch")
    p.add_argument("--torch-timeout", type=float, default=300.0, help="seconds per torch size")
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--no-liveness", action="store_true", help="skip node loss and failover")
    p.add_argument("--out-json")
    args = p.parse_args()
    rows = []
    for n in [int(s) for s in args.sizes.split(",")]:
        ft = bench_ftlaunch(n)
        th = {"error": "skipped"} if args.no_torch or n > args.torch_max else \
            bench_torch(n, args.torch_timeout)
        ratio = th["rendezvous_s"] / ft["rendezvous_s"] if "rendezvous_s" in th and \
            "rendezvous_s" in ft else None
        rows.append({"n": n, "ftlaunch": ft, "torch_c10d": th, "ratio": ratio})
        print(f"N={n}: ftlaunch {ft} | torch {th}", flush=True)
    liveness = {}
    if not args.no_liveness:
        liveness["node_loss"] = bench_ftlaunch(64, node_timeout=1.0, node_loss=True, limit=30.0)
        liveness["failover"] = bench_failover()
        print(f"liveness: {liveness}", flush=True)

    print("\n| N agents | ftlaunch rendezvous s | ftlaunch ready s | coordinator CPU s "
          "| assign bytes | torch c10d s | store CPU s | torch / ftlaunch |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        ft, th = r["ftlaunch"], r["torch_c10d"]
        ok = "" if ft.get("ok") and th.get("ok", True) else " (CHECK FAILED)"
        print(f"| {r['n']}{ok} | {fmt(ft.get('rendezvous_s', ft.get('error')))} "
              f"| {fmt(ft.get('ready_s', '-'))} | {fmt(ft.get('coordinator_cpu_s'), 2)} "
              f"| {ft.get('assign_bytes', '-')} | {fmt(th.get('rendezvous_s', th.get('error')))} "
              f"| {fmt(th.get('store_cpu_s', '-'), 2)} | {fmt(r['ratio'], 1)} |")
    if liveness:
        loss, fo = liveness["node_loss"], liveness["failover"]
        print(f"\nnode loss (64 agents, heartbeat 0.2 s, node_timeout 1.0 s, ok={loss.get('loss_ok')}):"
              f" last heartbeat -> all survivors got recover {fmt(loss.get('loss_from_last_beat_s'))} s"
              f" (node_timeout + {fmt(loss.get('loss_from_last_beat_s', 0.0) - 1.0)} s); "
              f"from silence {fmt(loss.get('loss_from_stop_s'))} s")
        print(f"coordinator failover (64 ControlPlanes, ok={fo.get('ok')}): kill -> all re-assigned "
              f"{fmt(fo.get('failover_s'))} s (node_timeout + {fmt(fo.get('failover_minus_timeout_s'))} s)")
    if args.out_json:
        import torch
        meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
                "machine": f"{os.cpu_count()} CPUs, {platform.platform()}",
                "torch": torch.__version__, "args": vars(args)}
        with open(args.out_json, "w") as f:
            json.dump({**meta, "rows": rows, **liveness}, f, indent=1)


if __name__ == "__main__":
    main()
