"""How long a finished rank takes to exit: from its last line to the parent's wait().

The rank imports torch, trains a small DDP model on a one-rank gloo group and prints the
time; the parent then times the interpreter's exit. Three ways of exiting, alternating:
  python    what a torchrun rank does (full finalization)
  settle    only the gloo settle (ftlaunch before this benchmark)
  ftlaunch  ftlaunch_contract.rank_exit.before_finalize (settle, then gc.freeze)
  floor     os._exit right after the last line (what no script may be given: it would skip
            flushing the script's own files)

    python scripts/bench_rank_exit.py --reps 5
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import textwrap
import time

RANK = textwrap.dedent("""
    import atexit, os, sys, time
    import torch, torch.distributed as dist
    from ftlaunch_contract import rank_exit
    mode = sys.argv[1]
    if mode == "settle":
        atexit.register(rank_exit.settle_gloo_workers)
    elif mode == "ftlaunch":
        atexit.register(rank_exit.before_finalize)
    elif mode == "floor":
        atexit.register(lambda: (sys.stdout.flush(), os._exit(0)))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[2]}",
                            rank=0, world_size=1)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)]))
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(5):
        model(torch.randn(8, 256)).sum().backward()
        opt.step()
    print(time.time(), flush=True)
""")

MODES = ("python", "settle", "ftlaunch", "floor")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exit_seconds(mode: str) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(
               os.path.abspath(__file__))), *sys.path])}
    rank = subprocess.Popen([sys.executable, "-c", RANK, mode, str(_free_port())], env=env,
                            stdout=subprocess.PIPE, text=True)
    assert rank.stdout is not None
    last_line = float(rank.stdout.readline())
    if rank.wait(timeout=120) != 0:
        raise SystemExit(f"bench_rank_exit: the {mode} rank exited {rank.returncode}")
    return time.time() - last_line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(args.reps):
        for mode in MODES:
            seconds[mode].append(exit_seconds(mode))
    base = statistics.median(seconds["python"])
    print(f"{'exit':10} {'median s':>9} {'min s':>7} {'max s':>7} {'vs python':>10}")
    for mode in MODES:
        med = statistics.median(seconds[mode])
        print(f"{mode:10} {med:9.3f} {min(seconds[mode]):7.3f} {max(seconds[mode]):7.3f} "
              f"{med / base:10.2f}")


if __name__ == "__main__":
    main()
