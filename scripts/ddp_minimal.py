"""A minimal plain DDP script as a new user writes it from the PyTorch DDP tutorial, on gloo.

The shape of the PyTorch examples' ``distributed/ddp-tutorial-series/multigpu_torchrun.py``
(a Trainer that loads a snapshot if there is one, trains epochs of a DistributedSampler'd
DataLoader and saves a snapshot every --save-every epochs; torchrun sets the environment),
adapted to the CPU: gloo instead of NCCL, no ``.to(gpu_id)``. Nothing of ftlaunch in it.
Besides the tutorial's own prints, each rank prints ``start rank R world W pid P
resume_from S`` once it is up and ``step N loss L rank R`` per batch (N counts batches over
the whole run), the lines the benchmarks read; --step-time sleeps per batch (a stand-in for
a GPU's step time).

    torchrun --standalone --nproc-per-node 2 scripts/ddp_minimal.py --snapshot /tmp/snap.pt
"""

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class MyTrainDataset(Dataset):
    def __init__(self, size):
        self.size = size
        self.data = [(torch.rand(20), torch.rand(1)) for _ in range(size)]

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return self.data[index]


def log(msg):
    sys.stdout.write(msg + "\n")
    sys.stdout.flush()


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every, snapshot_path, step_time):
        self.rank = int(os.environ["RANK"])
        self.model = model
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.epochs_run = 0
        self.snapshot_path = snapshot_path
        self.step_time = step_time
        if snapshot_path and os.path.exists(snapshot_path):
            log("Loading snapshot")
            self._load_snapshot(snapshot_path)
        self.model = DDP(self.model)
        self.steps_per_epoch = len(self.train_data)
        log(f"start rank {self.rank} world {int(os.environ['WORLD_SIZE'])} pid {os.getpid()} "
            f"resume_from {self.epochs_run * self.steps_per_epoch} (epoch {self.epochs_run})")

    def _load_snapshot(self, snapshot_path):
        snapshot = torch.load(snapshot_path, map_location="cpu")
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        log(f"Resuming training from snapshot at Epoch {self.epochs_run}")

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.mse_loss(output, targets)
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def _run_epoch(self, epoch):
        b_sz = len(next(iter(self.train_data))[0])
        log(f"[rank{self.rank}] Epoch {epoch} | Batchsize: {b_sz} | Steps: {self.steps_per_epoch}")
        self.train_data.sampler.set_epoch(epoch)
        for i, (source, targets) in enumerate(self.train_data):
            loss = self._run_batch(source, targets)
            log(f"step {epoch * self.steps_per_epoch + i + 1} loss {loss:.4f} rank {self.rank}")
            if self.step_time > 0:
                time.sleep(self.step_time)

    def _save_snapshot(self, epoch):
        snapshot = {"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch}
        torch.save(snapshot, self.snapshot_path)
        log(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}")

    def train(self, max_epochs):
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.rank == 0 and self.snapshot_path and (epoch + 1) % self.save_every == 0:
                self._save_snapshot(epoch + 1)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--save-every", type=int, default=1, help="epochs between snapshots")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--dataset-size", type=int, default=2048)
    p.add_argument("--snapshot", default="snapshot.pt", help="snapshot path ('' = none)")
    p.add_argument("--step-time", type=float, default=0.0, help="extra sleep per batch (s)")
    args = p.parse_args()
    init_process_group(backend="gloo")
    dataset = MyTrainDataset(args.dataset_size)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    train_data = DataLoader(dataset, batch_size=args.batch_size, pin_memory=False,
                            shuffle=False, sampler=DistributedSampler(dataset))
    Trainer(model, train_data, optimizer, args.save_every, args.snapshot,
            args.step_time).train(args.epochs)
    destroy_process_group()


if __name__ == "__main__":
    main()
