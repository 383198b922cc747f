"""Checkpoint cost: how long training is blocked, and how long until the state is durable.

One process, one state of --gib GiB (fp32 "model" + two Adam-like moments, in 64 MiB
tensors), written to --dir (a local disk by default) by each method in turn:

    memcpy floor      copy into preallocated, touched buffers (what any staging must pay)
    dd                raw bytes of the same size, written and fdatasync'ed (the disk's floor)
    torch.save        torch.save + fsync (blocks for everything)
    dcp.save          torch.distributed.checkpoint.save (blocks for everything)
    dcp.async_save    torch.distributed.checkpoint.async_save (blocks for its staging)
    ftlaunch          trainer_shim.AsyncCheckpointer.save / .wait (staging in /dev/shm,
                      owned as an agent owns it)
    ftlaunch overlap  the same with overlap=True (an optimizer over the "model" in the
                      state): blocked is the save call; "staged" below is until the copy is
                      whole, which an optimizer step right after the save would wait for
                      (in training the next step's forward and backward run meanwhile)
    ftlaunch+replica  the same while a peer copies each staged step into its memory at
                      --replica-mbps (default: one save a minute), as --ckpt-replicas 1
                      does: this node's replica service (a process, as the agent is) serves
                      the staging slot; the holder (another process, "another node") pulls

"blocked" is the caller's time in the save call; "durable" is until the data is fsynced
(for async methods: until wait()/result() returns). Each method runs --reps times; medians.
Then restores: ftlaunch from shared memory into state the process already has (a rank that
re-enters in place; a replacement's freshly built model) and into fresh memory (an empty
optimizer), ftlaunch from storage (checksums verified), torch.load (page cache warm: upper
bounds for a restore from disk).

    python scripts/bench_checkpoint.py --gib 1 --reps 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

CHUNK = 16 * 1024 * 1024  # floats per tensor: 64 MiB


def make_state(gib: float) -> dict[str, dict[str, torch.Tensor]]:
    n = int(gib * (1 << 30) / 4 / 3 / CHUNK) or 1
    g = torch.Generator().manual_seed(0)
    return {part: {f"t{i}": torch.rand(CHUNK, generator=g) for i in range(n)}
            for part in ("model", "exp_avg", "exp_avg_sq")}


def nbytes(state) -> int:
    return sum(t.numel() * t.element_size() for d in state.values() for t in d.values())


def fsync_tree(path: Path) -> None:
    for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def bench_memcpy(state, out):
    buffers = {k: {n: torch.zeros_like(t) for n, t in d.items()} for k, d in state.items()}
    t0 = time.perf_counter()  # into buffers already touched: as a reused staging area is
    for k, d in state.items():
        for n, t in d.items():
            buffers[k][n].copy_(t)
    t = time.perf_counter() - t0
    return t, t


def bench_dd(state, out):
    size_mib = nbytes(state) >> 20
    t0 = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={out / 'dd.bin'}", "bs=1M", f"count={size_mib}",
                    "conv=fdatasync", "status=none"], check=True)
    t = time.perf_counter() - t0
    return t, t


def bench_torch_save(state, out):
    t0 = time.perf_counter()
    with open(out / "state.pt", "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    t = time.perf_counter() - t0
    return t, t


def bench_dcp_save(state, out):
    import torch.distributed.checkpoint as dcp

    t0 = time.perf_counter()
    dcp.save(state, checkpoint_id=str(out / "dcp"))
    fsync_tree(out / "dcp")
    t = time.perf_counter() - t0
    return t, t


def bench_dcp_async(state, out):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    if not dist.is_initialized():  # async_save needs a process group, even for one rank
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    t0 = time.perf_counter()
    future = dcp.async_save(state, checkpoint_id=str(out / "dcp_async"))
    blocked = time.perf_counter() - t0
    future.result()
    fsync_tree(out / "dcp_async")
    return blocked, time.perf_counter() - t0


_CHECKPOINTERS: dict = {}


def _checkpointer(root: Path, overlap: bool = False):
    """One checkpointer for every rep (its staging is reused), staging as an agent owns it."""
    from ftlaunch_contract import staging
    from trainer_shim.checkpoint import AsyncCheckpointer

    if (root, overlap) not in _CHECKPOINTERS:
        name = "ftlaunch-overlap" if overlap else "ftlaunch"
        shm = staging.create_dir(f"bench-{name}-{os.getpid()}")
        _CHECKPOINTERS[root, overlap] = AsyncCheckpointer(root / name, keep_last=1,
                                                          staging_dir=str(shm), overlap=overlap)
    return _CHECKPOINTERS[root, overlap]


def bench_ftlaunch(state, out):
    ckpt = _checkpointer(out.parent.parent)
    ckpt.reserve(**state).wait()  # as load_latest starts it, during the first steps
    step = (ckpt.latest_step() or 0) + 1
    t0 = time.perf_counter()
    ckpt.save(step, **state)
    blocked = time.perf_counter() - t0
    ckpt.wait()
    return blocked, time.perf_counter() - t0


_OPTIMIZERS: dict = {}
STAGED: list[float] = []  # ftlaunch overlap: save -> the copy whole, per rep


def bench_ftlaunch_overlap(state, out):
    ckpt = _checkpointer(out.parent.parent, overlap=True)
    key = id(state)
    if key not in _OPTIMIZERS:  # overlap waits for the copy in an optimizer's step
        _OPTIMIZERS[key] = torch.optim.SGD(list(state["model"].values()), lr=0.0)
    ckpt.reserve(**state, optim=_OPTIMIZERS[key]).wait()
    step = (ckpt.latest_step() or 0) + 1
    t0 = time.perf_counter()
    ckpt.save(step, **state, optim=_OPTIMIZERS[key])
    blocked = time.perf_counter() - t0
    _OPTIMIZERS[key].step()  # no gradients: only its pre-step hook, which waits for the copy
    STAGED.append(time.perf_counter() - t0)
    ckpt.wait()
    return blocked, time.perf_counter() - t0


class ReplicaPair:
    """This node's replica service (serving the checkpointer's staging) and a holder that
    pulls every offered step at a capped rate: each its own process, as agents are."""

    SERVICE = """
import sys, zmq
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from ftlaunch_contract.messages import Held, Peer
from launcher.replica_service import ReplicaService
service = ReplicaService(zmq.Context(), b"bench", sys.argv[2], "127.0.0.1", Path(sys.argv[3]),
                         bandwidth=float(sys.argv[4]))
print(service.port, flush=True)
for line in sys.stdin:  # "offer STEP PORT"
    step, port = map(int, line.split()[1:])
    service.offer(Held(1, 0, step), (Peer("holder", "127.0.0.1", port),))
service.close()
"""

    def __init__(self, staging_dir: Path, bandwidth: float):
        from ftlaunch_contract import staging

        root = str(Path(__file__).resolve().parents[1])
        # the other node's /dev/shm
        self.holder_dir = holder_dir = staging.create_dir(f"bench-holder-{os.getpid()}")
        self.procs = [subprocess.Popen([sys.executable, "-c", self.SERVICE, root, name, str(d),
                                        str(bw)], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True)
                      for name, d, bw in (("source", staging_dir, 0.0),
                                          ("holder", holder_dir, bandwidth))]
        self.holder_port = int(self.procs[1].stdout.readline())
        self.procs[0].stdout.readline()

    def offer(self, step: int) -> None:
        self.procs[0].stdin.write(f"offer {step} {self.holder_port}\n")
        self.procs[0].stdin.flush()

    def close(self) -> None:
        for proc in self.procs:
            proc.stdin.close()
            proc.wait(60)
        shutil.rmtree(self.holder_dir, ignore_errors=True)


_REPLICAS: dict = {}


def bench_ftlaunch_replica(state, out):
    """A save while the previous one still streams to the holder (the worst moment)."""
    ckpt = _checkpointer(out.parent.parent / "replica")
    ckpt.reserve(**state).wait()
    if ckpt not in _REPLICAS:
        staging_dir = ckpt._slots[0]._data_path.parent
        _REPLICAS[ckpt] = ReplicaPair(staging_dir, _REPLICA_BANDWIDTH or nbytes(state) / 60)
        step = (ckpt.latest_step() or 0) + 1
        ckpt.save(step, **state)  # the step that streams while the measured one saves
        ckpt.wait()
        _REPLICAS[ckpt].offer(step)
    step = (ckpt.latest_step() or 0) + 1
    t0 = time.perf_counter()
    ckpt.save(step, **state)
    blocked = time.perf_counter() - t0
    ckpt.wait()
    durable = time.perf_counter() - t0
    _REPLICAS[ckpt].offer(step)
    return blocked, durable


_REPLICA_BANDWIDTH = 0.0


def restore_ftlaunch(root: Path, state, from_storage: bool, into_existing: bool = False) -> float:
    """``into_existing``: the targets already hold tensors of the right shapes (a rank that
    re-enters in place, or a model just built); else they are empty (fresh memory)."""
    from trainer_shim.checkpoint import AsyncCheckpointer

    saved = _checkpointer(root)
    staging_dir = None if from_storage else saved._slots[0]._data_path.parent
    fresh = AsyncCheckpointer(root / "ftlaunch", staging_dir=str(staging_dir) if staging_dir
                              else None)
    targets = {k: {n: torch.zeros_like(t) for n, t in d.items()} if into_existing else {}
               for k, d in state.items()}
    t0 = time.perf_counter()
    fresh.load_latest(**targets)
    t = time.perf_counter() - t0
    expected = "storage" if from_storage else "shared memory"
    assert fresh.restored_from == expected, fresh.restored_from
    assert all(torch.equal(targets[k][n], state[k][n]) for k in state for n in state[k])
    fresh.close()
    return t


def restore_torch_load(root: Path, state) -> float:
    path = root / "restore.pt"
    if not path.exists():
        torch.save(state, path)
    t0 = time.perf_counter()
    torch.load(path, weights_only=True)
    return time.perf_counter() - t0


METHODS = {"memcpy floor": bench_memcpy, "dd": bench_dd, "torch.save": bench_torch_save,
           "dcp.save": bench_dcp_save, "dcp.async_save": bench_dcp_async,
           "ftlaunch": bench_ftlaunch, "ftlaunch overlap": bench_ftlaunch_overlap,
           "ftlaunch+replica": bench_ftlaunch_replica}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir on /tmp)")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--threads", type=int, default=0,
                   help="torch's intra-op threads (a rank under torchrun or ftlaunch has 1); "
                        "default: torch's own")
    p.add_argument("--replica-mbps", type=float, default=0.0,
                   help="ftlaunch+replica's copy rate, MB/s (default: the state once a minute)")
    args = p.parse_args()
    global _REPLICA_BANDWIDTH
    _REPLICA_BANDWIDTH = args.replica_mbps * 1e6
    if args.threads:
        torch.set_num_threads(args.threads)
    state = make_state(args.gib)
    root = Path(tempfile.mkdtemp(prefix="bench_ckpt_", dir=args.dir))
    print(f"state {nbytes(state) / (1 << 30):.2f} GiB in {sum(len(d) for d in state.values())} "
          f"tensors; writing under {root}; torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"{torch.get_num_threads()} intra-op threads")
    results = {}
    for rep in range(args.reps):
        for name in args.methods.split(","):
            out = root / f"rep{rep}" / name.replace(" ", "_")
            out.mkdir(parents=True)
            blocked, durable = METHODS[name](state, out)
            results.setdefault(name, []).append((blocked, durable))
            print(f"rep {rep} {name:<15} blocked {blocked:7.3f} s  durable {durable:7.3f} s",
                  flush=True)
            shutil.rmtree(out, ignore_errors=True)
    gib = nbytes(state) / (1 << 30)
    print(f"\n{'method':<15} {'blocked s':>10} {'durable s':>10} {'GiB/s durable':>14}  (medians)")
    for name, values in results.items():
        b = statistics.median(v[0] for v in values)
        d = statistics.median(v[1] for v in values)
        print(f"{name:<15} {b:10.3f} {d:10.3f} {gib / d:14.2f}")
    if STAGED:
        print(f"ftlaunch overlap: save -> copy whole {statistics.median(STAGED):.3f} s (median): "
              "what an optimizer step right after the save waits for")
    if "ftlaunch" in results:
        restores = {"ftlaunch shm -> existing state": lambda: restore_ftlaunch(root, state,
                                                                                  False, True),
                    "ftlaunch shm -> fresh memory": lambda: restore_ftlaunch(root, state, False),
                    "ftlaunch storage -> fresh": lambda: restore_ftlaunch(root, state, True),
                    "torch.load": lambda: restore_torch_load(root, state)}
        print(f"\n{'restore':<28} {'seconds':>8} {'GB/s':>6}  (median of {args.reps})")
        for name, run in restores.items():
            t = statistics.median(run() for _ in range(args.reps))
            print(f"{name:<28} {t:8.3f} {nbytes(state) / t / 1e9:6.2f}", flush=True)
    for pair in _REPLICAS.values():
        pair.close()
    for ckpt in _CHECKPOINTERS.values():
        ckpt.close()
        shutil.rmtree(ckpt._slots[0]._data_path.parent, ignore_errors=True)
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
