"""Tiny GPT trained on synthetic tokens: a plain torchrun-style DDP (gloo) script.

It demonstrates what a fault-tolerant launcher has to cope with, using only torch:
env:// rendezvous as torchrun sets it up, atomic self-managed checkpoints that make a
killed-and-resumed run end bit-identical to an uninterrupted one, and env-controlled
fault injection (TRAIN_FAULT_RANK / TRAIN_FAULT_STEP / TRAIN_FAULT_KIND: kill, segv, exit,
exception, stop, hang, spin; TRAIN_FAULT_DELAY: seconds the rank waits first) that fires only in the first attempt (TORCHELASTIC_RESTART_COUNT
unset or "0") unless TRAIN_FAULT_EVERY_ATTEMPT is set; TRAIN_STUCK_RANK blocks that rank for
good at the same step. TRAIN_CHAOS_DIR (scripts/chaos.py): a file ``rank<r>`` there holds a
fault kind rank r injects at its next step, in any attempt, and a file ``unpaced`` ends
--step-time's pacing (the faults are over: the rest only has to reach --steps); until it
exists, the ranks hold before the step a file ``hold`` names, else before the last step. --shim runs the same training through trainer_shim (and stops at
ft.preempted(), saving first); --async-ckpt checkpoints through its AsyncCheckpointer
(every rank its own state; --persist-every); --cuda puts each rank on its GPU with NCCL.

Note: with torch's own torchrun (torch 2.13), gloo workers restarted via --max-restarts hang
or fail in connectFullMesh on stale keys in the shared rendezvous TCPStore
(pytorch/pytorch#135712, #167288); set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 to avoid it.

    python scripts/train_gpt.py --steps 20
    torchrun --standalone --nproc-per-node 2 scripts/train_gpt.py --ckpt-dir /tmp/ck --out r.json
"""

import argparse
import ctypes
import hashlib
import itertools
import json
import os
import signal
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP

VOCAB, D_MODEL, N_HEAD, N_LAYER, SEQ_LEN = 256, 64, 4, 2, 32


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)
        self.qkv, self.proj = nn.Linear(D_MODEL, 3 * D_MODEL), nn.Linear(D_MODEL, D_MODEL)
        self.mlp = nn.Sequential(
            nn.Linear(D_MODEL, 4 * D_MODEL), nn.GELU(), nn.Linear(4 * D_MODEL, D_MODEL)
        )

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, N_HEAD, c // N_HEAD).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, D_MODEL), nn.Embedding(SEQ_LEN, D_MODEL)
        self.blocks = nn.Sequential(*[Block() for _ in range(N_LAYER)])
        self.ln_f = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        return self.head(self.ln_f(self.blocks(x)))


def make_batch(seed, rank, step, batch_size):
    """Sequences x[t+1] = (a*x[t] + b) % VOCAB; depends only on (seed, rank, step)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + rank * 10_007 + step)
    a = torch.randint(1, VOCAB, (batch_size, 1), generator=g)
    b = torch.randint(0, VOCAB, (batch_size, 1), generator=g)
    x = [torch.randint(0, VOCAB, (batch_size, 1), generator=g)]
    for _ in range(SEQ_LEN):
        x.append((a * x[-1] + b) % VOCAB)
    seq = torch.cat(x, dim=1)
    return seq[:, :-1], seq[:, 1:]


def log(msg):
    sys.stdout.write(msg + "\n")  # one write() per line so ranks sharing a pipe don't interleave
    sys.stdout.flush()


def chaos_fault(rank):
    """The fault scripts/chaos.py asks this rank to inject now, if any (taken once)."""
    path = os.path.join(os.environ["TRAIN_CHAOS_DIR"], f"rank{rank}")
    try:
        with open(path) as f:
            kind = f.read().strip()
        os.unlink(path)
    except FileNotFoundError:
        return None
    return kind


def chaos_over():
    """scripts/chaos.py injected its last fault: the steps left need no pacing."""
    return "TRAIN_CHAOS_DIR" in os.environ and os.path.exists(
        os.path.join(os.environ["TRAIN_CHAOS_DIR"], "unpaced"))


def chaos_hold(last):
    """The step scripts/chaos.py lets the job reach, not train: its file ``hold`` (the next
    fault's step and some), else the last step."""
    try:
        with open(os.path.join(os.environ["TRAIN_CHAOS_DIR"], "hold")) as f:
            return min(int(f.read()), last)
    except (FileNotFoundError, ValueError):  # (a hold being rewritten: read again next time)
        return last


def hold_for_chaos(step, last, heartbeat):
    """Before a step at scripts/chaos.py's hold, wait for it to move the hold on or be done
    with its faults: a fault it still watches (a heal, a lossy link) must find the job
    running, and the next one (a checkpoint writer's kill) steps and saves still to come,
    however fast the job trained meanwhile."""
    deadline = time.monotonic() + 600
    while "TRAIN_CHAOS_DIR" in os.environ and not chaos_over() and step >= chaos_hold(last) \
            and time.monotonic() < deadline:
        heartbeat(step - 1)
        time.sleep(0.02)


def maybe_inject_fault(rank, step, heartbeat):
    env = os.environ
    if "TRAIN_CHAOS_DIR" in env and (kind := chaos_fault(rank)):
        inject(kind, rank, step)
    if env.get("TORCHELASTIC_RESTART_COUNT", "0") != "0" and not env.get("TRAIN_FAULT_EVERY_ATTEMPT"):
        return
    if "TRAIN_FAULT_STEP" not in env or step != int(env["TRAIN_FAULT_STEP"]):
        return
    gate = env.get("TRAIN_FAULT_GATE")  # every rank waits here until this file exists
    deadline = time.monotonic() + 120
    while gate and not os.path.exists(gate) and time.monotonic() < deadline:
        heartbeat(step - 1)
        time.sleep(0.02)
    if rank == int(env.get("TRAIN_STUCK_RANK", -1)):
        log(f"stuck rank {rank} step {step}")
        libc = ctypes.CDLL(None)  # a zeroed pthread_mutex_t is a default (non-recursive) one
        mutex = ctypes.create_string_buffer(64)
        libc.pthread_mutex_lock(mutex)
        libc.pthread_mutex_lock(mutex)  # blocks in C, even a signal handler does not end it
    if rank != int(env.get("TRAIN_FAULT_RANK", -1)):
        return
    time.sleep(float(env.get("TRAIN_FAULT_DELAY", 0)))  # its peers wait in a collective
    inject(env.get("TRAIN_FAULT_KIND", "exception"), rank, step)


def inject(kind, rank, step):
    log(f"injecting fault {kind} rank {rank} step {step}")
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    elif kind == "exit":
        sys.exit(3)
    elif kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
        threading.Event().wait()  # if continued, still no progress
    elif kind == "hang":
        threading.Event().wait()  # sleeps forever, GIL released
    elif kind == "spin":
        sum(itertools.repeat(1, 10**15))  # one C call: never gives the GIL back
    raise RuntimeError(f"injected fault at step {step}")


def atomic_save(obj, path):
    directory = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".ckpt-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def weights_sha256(model):
    h = hashlib.sha256()
    for t in model.state_dict().values():
        t = t.full_tensor() if hasattr(t, "full_tensor") else t  # FSDP: gathered, collective
        h.update(bytes(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).tolist()))
    return h.hexdigest()


@record
def main():
    args = parse_args()
    if args.shim:  # fast recovery: re-entered in place, heartbeats for hang detection
        import trainer_shim

        trainer_shim.restartable(train)(args, trainer_shim)
    else:
        train(None, args, None)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--ckpt-dir", default=None, help="checkpoint directory (default: none)")
    p.add_argument("--ckpt-every", type=int, default=20)
    p.add_argument("--async-ckpt", action="store_true",
                   help="checkpoint with trainer_shim's AsyncCheckpointer (every rank its own)")
    p.add_argument("--persist-every", type=int, default=1,
                   help="with --async-ckpt: persist steps that are multiples of this, stage all")
    p.add_argument("--overlap-ckpt", action="store_true",
                   help="with --async-ckpt: copy each save beside the next step (overlap=True)")
    p.add_argument("--step-time", type=float, default=0.0, help="extra sleep per step (s)")
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--exact-loss", action="store_true",
                   help="log each loss exactly (repr), to compare runs step by step")
    p.add_argument("--out", default=None, help="rank 0 writes a JSON summary here")
    p.add_argument("--shim", action="store_true", help="use trainer_shim (restartable, heartbeat)")
    p.add_argument("--cuda", action="store_true", help="one GPU per rank (LOCAL_RANK), NCCL")
    p.add_argument("--fsdp", action="store_true",
                   help="shard the model with FSDP2 instead of DDP (needs --async-ckpt)")
    args = p.parse_args()
    if args.fsdp and args.ckpt_dir and not args.async_ckpt:
        p.error("--fsdp checkpoints through trainer_shim: add --async-ckpt")
    return args


def train(ctx, args, shim):
    """One entry into training: resume from the checkpoint, run to --steps."""
    heartbeat = shim.heartbeat if shim else (lambda step: None)

    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    distributed = "WORLD_SIZE" in os.environ and "RANK" in os.environ
    if distributed:
        if args.cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend="nccl" if args.cuda else "gloo")  # env:// rendezvous
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1

    torch.manual_seed(args.seed)
    device = torch.device("cuda", torch.cuda.current_device()) if args.cuda else torch.device("cpu")
    model = TinyGPT().to(device)
    if args.fsdp and distributed:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=True)
    start, source = 0, "nothing"
    train_state = {"model": model, "optim": opt}
    ckpt_path = os.path.join(args.ckpt_dir, "ckpt.pt") if args.ckpt_dir else None
    checkpointer = None
    if args.async_ckpt and args.ckpt_dir:
        from trainer_shim.checkpoint import AsyncCheckpointer, DistributedState

        checkpointer = AsyncCheckpointer(args.ckpt_dir, persist_every=args.persist_every,
                                         overlap=args.overlap_ckpt)
        if args.fsdp:
            train_state = {"train": DistributedState(model, opt)}
        extra = {}
        start = checkpointer.load_latest(**train_state, extra=extra)
        source = checkpointer.restored_from
        if start:
            torch.set_rng_state(extra["rng"])
            if shim:
                shim.load_state_dict(extra["shim"])
        ckpt_path = None
    elif ckpt_path and os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optim"])
        torch.set_rng_state(ckpt["rng"])
        start, source = int(ckpt["step"]), "storage"
        if shim and "shim" in ckpt:
            shim.load_state_dict(ckpt["shim"])  # the learned pace, for hang timeouts
    if ckpt_path and rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
    # find_unused_parameters: DDP then keeps its first gradient-bucket layout. By default it
    # rebuilds the buckets after a process's first step, so a resumed attempt's first step
    # would reduce in another layout than the uninterrupted run's, and a ring all-reduce of
    # 3+ ranks adds each element in an order that depends on its place in the bucket: the
    # weights would then differ in the last bits (scripts/chaos.py found it).
    ddp = DDP(model, find_unused_parameters=True) if distributed and not args.fsdp else model
    log(f"start rank {rank} world {world} pid {os.getpid()} resume_from {start} ({source}) "
        f"agents_committed {ctx.resume_step if ctx else None}")

    loss_val, t0, stopped_early = None, time.perf_counter(), False
    for step in range(start + 1, args.steps + 1):  # `step` = number of steps done after it
        maybe_inject_fault(rank, step, heartbeat)
        hold_for_chaos(step, args.steps, heartbeat)
        x, y = (t.to(device) for t in make_batch(args.seed, rank, step, args.batch_size))
        loss = F.cross_entropy(ddp(x).reshape(-1, VOCAB), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss_val = loss.item()
        if step % args.log_every == 0:
            shown = repr(loss_val) if args.exact_loss else f"{loss_val:.4f}"
            log(f"step {step} loss {shown} rank {rank}")
        heartbeat(step)
        # SIGTERM: save, then leave within the grace period. A collective, so at the same steps
        # everywhere; the first call (first step) arms the handler.
        if shim and (step % 10 == 0 or step == start + 1) and shim.preempted():
            log(f"preempted at step {step} rank {rank}")
            if checkpointer:
                checkpointer.save(step, **train_state, extra={
                    "rng": torch.get_rng_state(), "shim": shim.state_dict()})
            stopped_early = True
            break
        if checkpointer and step % args.ckpt_every == 0:
            checkpointer.save(step, **train_state, extra={
                "rng": torch.get_rng_state(), "shim": shim.state_dict() if shim else {}})
        if ckpt_path and step % args.ckpt_every == 0:
            if rank == 0:
                state = {
                    "model": model.state_dict(),
                    "optim": opt.state_dict(),
                    "step": step,
                    "rng": torch.get_rng_state(),
                }
                if shim:
                    state["shim"] = shim.state_dict()
                atomic_save(state, ckpt_path)
            if distributed:
                dist.barrier()
        if args.step_time > 0 and not chaos_over():
            time.sleep(args.step_time)
    if checkpointer:
        checkpointer.close()  # everything saved is durable before we report done
    n = args.steps - start
    if n > 0 and rank == 0:
        log(f"time per step {1000 * (time.perf_counter() - t0) / n:.2f} ms")

    digest = weights_sha256(model) if args.out and not stopped_early else ""  # every rank
    if args.out and rank == 0 and not stopped_early:
        result = {
            "final_step": max(args.steps, start),
            "loss": loss_val,
            "weights_sha256": digest,
            "resumed_from": start,
            "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
        }
        with open(args.out + ".tmp", "w") as f:
            json.dump(result, f)
        os.replace(args.out + ".tmp", args.out)
    log(f"{'stopped' if stopped_early else 'done'} rank {rank} step "
        f"{step if stopped_early else max(args.steps, start)}")
    if distributed:
        # DDP's reducer must not hold the last reference to the process group: freed from
        # there, ~ProcessGroupGloo joins its threads with the GIL held and can deadlock
        # (torch 2.13; seen about 1 run in 15 at exit).
        del ddp
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
