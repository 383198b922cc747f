"""scripts/train_gpt.py's training, written for TorchFT (scripts/bench_goodput.py's torchft).

TorchFT cannot run an unmodified script: the training loop must go through its Manager
(a quorum each step), its DistributedDataParallel and Optimizer wrappers, with a lighthouse
running beside the job. Each process is one replica group of one rank (REPLICA_GROUP_ID of
NUM_REPLICA_GROUPS), the same model, batches (make_batch of its group, so the groups
together train train_gpt.py's global batch), optimizer and --step-time as train_gpt.py's
ranks. Settings are those of TorchFT's own DDP example (train_ddp.py): gloo timeout 5 s,
manager timeout 30 s, min_replica_size 1, no checkpoint to storage (a restarted group heals
from a live one).

--patch-ddp-hook: TorchFT 0.2.0's DistributedDataParallel comm hook asserts (AssertionError
in ``_comm_hook``) when the gloo all-reduce fails under it (a peer killed mid-all-reduce:
"Connection reset by peer"), so the survivor dies too and every group starts again from
step 0. The patch does what TorchFT's Manager.allreduce documents for an error: the step's
gradients are discarded (the manager reported the error and will not commit the step) and
training goes on. It measures TorchFT's design without that bug.

Lines for the bench, as train_gpt.py's: ``start rank G world N pid P resume_from S`` and,
for each step a group committed, ``step K loss L rank G participants P``.

    torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000 &
    REPLICA_GROUP_ID=0 NUM_REPLICA_GROUPS=2 TORCHFT_LIGHTHOUSE=http://localhost:29510 \\
        torchrun --standalone --nproc-per-node 1 scripts/train_gpt_torchft.py --step-time 0.1
"""

import argparse
import os
import time
from datetime import timedelta

import torch
import torch.nn.functional as F
from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
from train_gpt import VOCAB, TinyGPT, log, make_batch


def comm_hook_surviving_errors(manager, bucket):
    """TorchFT's DDP comm hook, except where the all-reduce failed: its managed future then
    has no torch future (the hook asserted); the manager has the error and the step will not
    commit, so any completed future will do. (After an error, allreduce returns a stand-in
    work whose future is a plain torch one.)"""
    work = manager.allreduce(bucket.buffer())
    work.wait()
    fut = work.get_future()
    fut = getattr(fut, "_fut", fut)
    if fut is None:
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
    return fut


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--step-time", type=float, default=0.0, help="extra sleep per step (s)")
    p.add_argument("--pg-timeout", type=float, default=5.0,
                   help="its gloo process group's timeout (s; its example: 5)")
    p.add_argument("--patch-ddp-hook", action="store_true",
                   help="survive an all-reduce that fails under DDP's comm hook (see above)")
    args = p.parse_args()
    if args.patch_ddp_hook:
        DistributedDataParallel._comm_hook = staticmethod(comm_hook_surviving_errors)
    group = int(os.environ.get("REPLICA_GROUP_ID", 0))
    groups = int(os.environ.get("NUM_REPLICA_GROUPS", 1))
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)

    torch.manual_seed(args.seed)
    model = TinyGPT()
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=True)

    def state_dict():
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(state):
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    pg = ProcessGroupGloo(timeout=timedelta(seconds=args.pg_timeout))
    manager = Manager(pg=pg, min_replica_size=1,
                      load_state_dict=load_state_dict, state_dict=state_dict,
                      replica_id=f"train_gpt_{group}", timeout=timedelta(seconds=30))
    ddp = DistributedDataParallel(manager, model)
    opt = Optimizer(manager, inner)
    log(f"start rank {group} world {groups} pid {os.getpid()} resume_from "
        f"{manager.current_step()}")
    while manager.current_step() < args.steps:
        opt.zero_grad()  # starts the step's quorum (a restarted group heals in it)
        step = manager.current_step() + 1
        x, y = make_batch(args.seed, group, step, args.batch_size)
        loss = F.cross_entropy(ddp(x).reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        opt.step()  # steps only if every participant's all-reduce succeeded
        if manager.current_step() == step:
            log(f"step {step} loss {loss.item():.4f} rank {group} "
                f"participants {manager.num_participants()}")
        if args.step_time > 0:
            time.sleep(args.step_time)
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
