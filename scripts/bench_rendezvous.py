"""Rendezvous at scale: N simulated agents, ftlaunch's coordinator vs torch's c10d rendezvous.

The server runs in this process, the N participants in one spawned child process:

  ftlaunch  a real Coordinator on a ROUTER socket; N DEALER agents on one zmq.Poller, each with
            its own Codec. rendezvous = first join sent -> every agent has its assign;
            ready = first join sent -> every agent has start (group rank 0 sends store_ready).
  torch     a TCPStore; N DynamicRendezvousHandlers (c10d backend, a TCPStore client each,
            min = max = N, torch's defaults otherwise) calling next_rendezvous() in N threads.

Then, with the real Coordinator: node loss (64 agents heartbeating every 0.2 s, node_timeout 1 s;
one goes silent: time until every survivor has `recover`) and coordinator failover (64 real
ControlPlanes; the coordinator dies: time until the successor has assigned everyone again).

    python scripts/bench_rendezvous.py --sizes 64       # smoke check (~20 s, mostly torch)
    python scripts/bench_rendezvous.py --out-json rendezvous.json
"""

import argparse
import datetime
import json
import logging
import multiprocessing as mp
import os
import platform
import resource
import threading
import time

import zmq

from ftlaunch_contract.messages import CONTROL, Assign, Join, StoreReady
from ftlaunch_contract.protocol import Codec
from launcher.control_plane import ControlPlane
from launcher.coordinator import Coordinator, JobState, bind_router

# TCPStore reverse-resolves each peer; a dropped DNS reply here costs 5 s by default, 1 s so.
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
SECRET = b"bench-rendezvous-secret-0123456789abcdef"
LOCAL_WORLD = 8


def node_id(i):
    return f"node{i:05d}.bench.cluster:{40000 + i}"  # hostname:pid, like a real agent's id


def job_state(n, node_timeout):
    return JobState(min_nodes=n, max_nodes=n, max_restarts=3, policy="cold", backoff=1.0,
                    backoff_max=30.0, exit_barrier_timeout=300.0, node_timeout=node_timeout,
                    last_call=1.0, join_timeout=600.0, host_node="bench")


def cpu_seconds():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


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


# --- ftlaunch ---------------------------------------------------------------------------------


class Swarm:
    """n DEALER agents on one poller; got[type][agent] = (arrival time, first such message)."""

    def __init__(self, port, n):
        self.n, self.context = n, zmq.Context()
        self.context.set(zmq.MAX_SOCKETS, n + 64)
        self.codecs, self.socks = [Codec(SECRET) for _ in range(n)], []
        self.poller, writable = zmq.Poller(), zmq.Poller()
        for _ in range(n):
            s = self.context.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.IMMEDIATE, 1)  # writable once connected: connect before timing
            s.connect(f"tcp://127.0.0.1:{port}")
            self.socks.append(s)
            self.poller.register(s, zmq.POLLIN)
            writable.register(s, zmq.POLLOUT)
        self.index = {s: i for i, s in enumerate(self.socks)}
        end = time.monotonic() + 60
        while len(writable.poll(100)) < n:
            if time.monotonic() > end:
                raise TimeoutError("agents could not connect")
        self.got, self.size = {}, {}
        self.beat_every, self.next_beat, self.silent, self.last_beat = None, 0.0, set(), {}

    def send(self, i, kind, epoch=0, **fields):
        self.socks[i].send_multipart(self.codecs[i].encode(CONTROL[kind](**fields), epoch))

    def pump(self, done, limit):
        end = time.monotonic() + limit
        while not done():
            now = time.monotonic()
            if now > end:
                raise TimeoutError(f"gave up after {limit:g}s")
            if self.beat_every and now >= self.next_beat:
                for i in set(range(self.n)) - self.silent:
                    self.send(i, "heartbeat", node_id=node_id(i), phase="running", ranks=())
                    self.last_beat[i] = now
                self.next_beat = now + self.beat_every
            for sock, _ in self.poller.poll(10):
                i = self.index[sock]
                while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    frames = sock.recv_multipart()
                    msg = self.codecs[i].decode(frames)
                    kind = msg.body.TYPE
                    self.got.setdefault(kind, {}).setdefault(i, (time.monotonic(), msg))
                    self.size[kind] = max(self.size.get(kind, 0), len(frames[0]))

    def all_got(self, kind, count=None):
        return len(self.got.get(kind, {})) >= (count or self.n)

    def times(self, kind, since):
        return [t - since for t, _ in self.got[kind].values()]


def ft_agents(port, n, node_loss, limit):
    w = Swarm(port, n)
    w.beat_every = 0.2 if node_loss else None
    t0, cpu = time.monotonic(), cpu_seconds()
    for i in range(n):
        w.send(i, "join", node_id=node_id(i), local_world_size=LOCAL_WORLD, addr="127.0.0.1",
               rank_hint=-1, standby_port=20000 + i, replica_port=0, held=(),
               restart_count=0)
    w.pump(lambda: w.all_got("assign"), limit)
    assigns = {i: m for i, (_, m) in w.got["assign"].items()}
    by_rank = {m.body.group_rank: i for i, m in assigns.items()}
    ok = sorted(by_rank) == list(range(n)) and all(
        m.body.world_size == LOCAL_WORLD * n and m.body.group_world_size == n
        for m in assigns.values())
    w.send(by_rank[0], "store_ready", assigns[by_rank[0]].epoch, master_addr="127.0.0.1",
           master_port=29500)
    w.pump(lambda: w.all_got("start"), limit)
    out = {"rendezvous_s": max(w.times("assign", t0)), "ready_s": max(w.times("start", t0)),
           "first_assign_s": min(w.times("assign", t0)), "ok": ok,
           "assign_bytes": w.size["assign"], "agents_cpu_s": cpu_seconds() - cpu}
    if node_loss:  # a second of steady heartbeats, then the last group rank goes silent
        calm = time.monotonic() + 1.0
        w.pump(lambda: time.monotonic() > calm, limit)
        victim, silenced = by_rank[n - 1], time.monotonic()
        w.silent.add(victim)
        w.pump(lambda: w.all_got("recover", n - 1), limit)
        causes = sorted({m.body.cause for _, m in w.got["recover"].values()})
        out.update(loss_after_last_beat_s=max(w.times("recover", w.last_beat[victim])),
                   loss_after_silence_s=max(w.times("recover", silenced)), causes=causes,
                   loss_ok=victim not in w.got["recover"] and all(
                       node_id(victim) in c and "lost" in c for c in causes))
    return out


def bench_ftlaunch(n, node_timeout=30.0, node_loss=False, limit=120.0):
    context = zmq.Context()
    sock, port = bind_router(context, "127.0.0.1", 0)
    coordinator = Coordinator(sock, SECRET, job_state(n, node_timeout))
    coordinator.start()
    cpu = cpu_seconds()
    result = in_child(ft_agents, (port, n, node_loss, limit), limit + 60)
    result["coordinator_cpu_s"] = cpu_seconds() - cpu  # this process only serves meanwhile
    coordinator.close()
    context.term()
    return result


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


# --- coordinator failover: 64 real ControlPlanes in this process -----------------------------


def bench_failover(n=64, node_timeout=1.0, interval=0.2, limit=30.0):
    context = zmq.Context()
    sock, port = bind_router(context, "127.0.0.1", 0)
    first = Coordinator(sock, SECRET, job_state(n, node_timeout))
    first.start()
    planes = {}
    for i in range(n):
        p = ControlPlane(context, SECRET, node_id(i), "127.0.0.1", ("127.0.0.1", port),
                         lambda: job_state(n, node_timeout), node_timeout, interval)
        planes[p.socket] = p
    poller, assigns = zmq.Poller(), {}
    for s in planes:
        poller.register(s, zmq.POLLIN)

    def join(p):
        p.send(Join(node_id=p.node_id, local_world_size=LOCAL_WORLD, addr="127.0.0.1",
                    rank_hint=-1, standby_port=p.standby_port, replica_port=0, held=(),
                    restart_count=0), 0)

    def run_until(done):  # the agent's loop, as far as the control plane goes
        end = time.monotonic() + limit
        while not done() and time.monotonic() < end:
            for s, _ in poller.poll(10):
                p, msg = planes[s], planes[s].receive()
                if msg is not None and isinstance(msg.body, Assign):
                    assigns[p.node_id] = msg
                    if msg.body.group_rank == 0:
                        p.send(StoreReady(master_addr="127.0.0.1", master_port=1), msg.epoch)
            for p in planes.values():
                last = assigns.get(p.node_id)
                p.heartbeat_if_due(time.monotonic(), last.epoch if last else 0)
                if p.coordinator_lost(time.monotonic()) and p.fail_over(
                        last.epoch, last.body.restart_count, last.body.group_world_size):
                    join(p)
        return done()

    for p in planes.values():
        join(p)
    run_until(lambda: len(assigns) == n)
    epoch, killed = max(m.epoch for m in assigns.values()), time.monotonic()
    first.close()
    ok = run_until(lambda: all(m.epoch > epoch for m in assigns.values()))
    took = time.monotonic() - killed
    for p in planes.values():
        p.close()
    context.term()
    return {"failover_s": took, "over_node_timeout_s": took - node_timeout, "ok": ok}


# --- main -------------------------------------------------------------------------------------


def cell(d, key, digits=3):
    value = d.get(key, d.get("error", "-"))
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="64,256,1024", help="numbers of agents, comma-separated")
    p.add_argument("--reps", type=int, default=3, help="ftlaunch runs per size (median shown)")
    p.add_argument("--torch-max", type=int, default=256, help="largest N tried with torch")
    p.add_argument("--torch-timeout", type=float, default=180.0, help="seconds per torch size")
    p.add_argument("--torch-keep-alive", type=int, default=5, help="torch keep_alive_interval "
                   "(default 5 s, torch's; a node silent 3 intervals is evicted)")
    p.add_argument("--no-liveness", action="store_true", help="skip node loss and failover")
    p.add_argument("--out-json")
    args = p.parse_args()
    logging.getLogger("ftlaunch").setLevel(logging.ERROR)  # "node ... lost" is expected here
    rows, liveness = [], {}
    for n in map(int, args.sizes.split(",")):
        runs = sorted((bench_ftlaunch(n) for _ in range(args.reps)),
                      key=lambda r: r.get("rendezvous_s", float("inf")))
        ft = {**runs[len(runs) // 2], "reps_rendezvous_s": [r.get("rendezvous_s") for r in runs]}
        th = bench_torch(n, args.torch_timeout, args.torch_keep_alive) \
            if n <= args.torch_max else {"error": "not run"}
        ratio = th["rendezvous_s"] / ft["rendezvous_s"] if "rendezvous_s" in th and \
            "rendezvous_s" in ft else None
        rows.append({"n": n, "ftlaunch": ft, "torch_c10d": th, "torch_over_ftlaunch": ratio})
        print(f"N={n}: ftlaunch {ft}\n  torch {th}", flush=True)
    if not args.no_liveness:
        liveness = {"node_loss": bench_ftlaunch(64, 1.0, node_loss=True, limit=30.0),
                    "failover": bench_failover()}
        print(f"liveness {liveness}", flush=True)
    print("\n| N | ftlaunch rendezvous s | ftlaunch ready s | torch c10d s | torch / ftlaunch "
          "| coordinator CPU s | assign bytes | torch compare_set ops |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        ft, th = r["ftlaunch"], r["torch_c10d"]
        check = "" if ft.get("ok") and th.get("ok", True) else " CHECK FAILED"
        ratio = f"{r['torch_over_ftlaunch']:.0f}x" if r["torch_over_ftlaunch"] else "-"
        spread = [x for x in ft["reps_rendezvous_s"] if x is not None]
        spread = f" [{min(spread):.3f}-{max(spread):.3f}]" if len(spread) > 1 else ""
        print(f"| {r['n']}{check} | {cell(ft, 'rendezvous_s')}{spread} | {cell(ft, 'ready_s')} "
              f"| {cell(th, 'rendezvous_s', 2)} | {ratio} | {cell(ft, 'coordinator_cpu_s', 2)} "
              f"| {cell(ft, 'assign_bytes')} | {th.get('cas_ops', '-')} |")
    if liveness:
        loss, fo = liveness["node_loss"], liveness["failover"]
        print(f"\nnode loss, 64 agents, node_timeout 1 s (ok={loss.get('loss_ok')}): last heartbeat "
              f"-> every survivor has recover {cell(loss, 'loss_after_last_beat_s')} s")
        print(f"coordinator failover, 64 agents, node_timeout 1 s (ok={fo.get('ok')}): coordinator "
              f"closed -> all assigned by the successor {cell(fo, 'failover_s')} s")
    if args.out_json:
        import torch
        meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
                "machine": f"{os.cpu_count()} CPUs, {platform.platform()}",
                "torch": torch.__version__, "args": vars(args)}
        with open(args.out_json, "w") as f:
            json.dump({**meta, "rows": rows, **liveness}, f, indent=1)


if __name__ == "__main__":
    main()
