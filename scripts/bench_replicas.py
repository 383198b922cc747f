"""Node loss: how long until a lost node's rank has its state back, from a peer's memory or
from storage.

One rank's state of --gib GiB (fp32 tensors of 64 MiB) is saved once through
trainer_shim's AsyncCheckpointer, staged in node A's staging directory (as A's agent owns
it) and persisted. Node A is then "lost"; a replacement node B restores that rank:

    peer memory   B's replica service pulls the shard from the copy A's peer keeps (real
                  ZeroMQ over loopback, MAC-checked chunks), then load_latest reads it
                  from B's shared memory (what a hot spare does before its ranks start)
    local disk    load_latest from the POSIX checkpoint with the page cache dropped first
                  (SHA-256 verified, as every storage read is)
    S3            load_latest from a local S3 server's bucket (--s3 PATH_TO_S3RVER: the npm
                  server s3rver, which keeps objects on disk and streams ranged GETs; needs
                  ftlaunch[s3]). moto_server, the test suite's S3, is too slow for 1 GiB.

Each path runs --reps times, alternating; medians. Times are to "state restored into the
replacement's model" (its tensors built and initialised, as a script does before
load_latest). Node A's replica service runs in its own process, as on another node. Also
printed: the replica pull alone, and how much a training-like loop (one thread of small
matmuls, in its own process: a rank) slows down while a replica streams beside it at
--bandwidth MB/s (default: one shard a minute, i.e. one save a minute).

    python scripts/bench_replicas.py --gib 1 --reps 3
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
import zmq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ftlaunch_contract.messages import Held, Peer  # noqa: E402
from launcher.replica_service import FetchDone, ReplicaService  # noqa: E402
from trainer_shim.checkpoint import AsyncCheckpointer  # noqa: E402

SECRET = b"bench-secret-0123456789abcdef"
CHUNK = 16 * 1024 * 1024  # floats per tensor


def make_state(gib: float) -> dict[str, torch.Tensor]:
    n = max(1, int(gib * (1 << 30) / 4 / CHUNK))
    return {f"w{i}": torch.randn(CHUNK) for i in range(n)}


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def wait_news(service, kind, timeout=600.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        zmq.select([service.fd], [], [], 0.1)
        for item in service.news():
            if isinstance(item, kind):
                return item
    raise TimeoutError(kind.__name__)


def restore(uri: str, staging: str | None, like: dict[str, torch.Tensor]) -> tuple[float, str]:
    target = {k: torch.zeros_like(v) for k, v in like.items()}  # the replacement's model
    t0 = time.perf_counter()
    ckpt = AsyncCheckpointer(uri, rank=0, world_size=1, staging_dir=staging)
    step = ckpt.load_latest(state=target)
    seconds = time.perf_counter() - t0
    assert step == 7, step
    assert all(torch.equal(target[k], like[k]) for k in like), "restored state differs"
    source = ckpt.restored_from
    ckpt.close()
    return seconds, source


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", default=None, help="checkpoint directory (default: a temp dir "
                        "on the local disk)")
    parser.add_argument("--s3", metavar="S3RVER", default=None,
                        help="also restore from a local s3rver (npm install s3rver@3.7.1; "
                        "the path of its node_modules/.bin/s3rver)")
    parser.add_argument("--bandwidth", type=float, default=0.0,
                        help="MB/s cap for the slowdown measurement (default: --gib per minute)")
    args = parser.parse_args()

    state = make_state(args.gib)
    nbytes = sum(t.numel() * 4 for t in state.values())
    bandwidth = args.bandwidth or nbytes / 60 / 1e6
    work = Path(args.dir or tempfile.mkdtemp(prefix="bench-replicas-", dir=os.getcwd()))
    shm = Path(tempfile.mkdtemp(prefix="bench-replicas-", dir="/dev/shm"))
    context = zmq.Context()
    results: dict[str, list[float]] = {"peer memory": [], "replica pull": [], "local disk": []}
    sources: dict[str, str] = {}
    server = None
    try:
        node_a, uri = shm / "a", str(work / "ckpt")
        node_a.mkdir()
        saver = AsyncCheckpointer(uri, rank=0, world_size=1, staging_dir=str(node_a))
        saver.save(7, state=state)
        saver.close()
        a = NodeProcess(node_a)
        s3_uri = None
        if args.s3:
            server, s3_uri = start_s3(args.s3, work, shm, state)
            results["S3"] = []
        for _ in range(args.reps):
            node_b = shm / "b"
            shutil.rmtree(node_b, ignore_errors=True)
            node_b.mkdir()
            b = ReplicaService(context, SECRET, "b", "127.0.0.1", node_b)
            t0 = time.perf_counter()
            b.fetch([(Held(1, 0, 7), a.peer)])
            done = wait_news(b, FetchDone)
            pulled = time.perf_counter() - t0
            assert done.pulled == 1, done
            seconds, sources["peer memory"] = restore(uri, str(node_b), state)
            results["replica pull"].append(pulled)
            results["peer memory"].append(pulled + seconds)
            b.close()
            shutil.rmtree(node_b, ignore_errors=True)
            dropped = drop_caches()
            seconds, sources["local disk"] = restore(uri, None, state)
            results["local disk"].append(seconds)
            if s3_uri:
                drop_caches()  # s3rver serves its objects from the local disk
                seconds, sources["S3"] = restore(s3_uri, None, state)
                results["S3"].append(seconds)
        slowdown = replica_slowdown(context, a, shm, bandwidth * 1e6)
        a.close()
    finally:
        context.term()
        shutil.rmtree(shm, ignore_errors=True)
        if server is not None:
            server.terminate()
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)

    print(f"state {nbytes / (1 << 30):.2f} GiB, {args.reps} reps, page cache dropped: {dropped}")
    print(f"{'restore of a lost node rank':32s} {'median s':>9s} {'GB/s':>7s}  source")
    for name, times in results.items():
        med = statistics.median(times)
        print(f"{name:32s} {med:9.3f} {nbytes / med / 1e9:7.2f}  {sources.get(name, '')}")
    base = statistics.median(results["local disk"])
    print(f"peer memory vs local disk: {statistics.median(results['peer memory']) / base:.2f}x "
          "the time")
    print(f"a rank's loop while a replica streams beside it at {bandwidth:.1f} MB/s: "
          f"{slowdown:+.1%} slower")


LOOP = """
import sys, time, torch
torch.set_num_threads(1)
x = torch.randn(256, 256)
n, end = 0, time.perf_counter() + float(sys.argv[1])
while time.perf_counter() < end:
    x @ x
    n += 1
print(n)
"""


def loop_rate(seconds: float) -> float:
    """Iterations/s of a training-like loop in its own process (a rank)."""
    out = subprocess.run([sys.executable, "-c", LOOP, str(seconds)], capture_output=True,
                         text=True, check=True)
    return int(out.stdout) / seconds


def replica_slowdown(context, a: NodeProcess, shm: Path, bandwidth: float) -> float:
    """How much slower a rank's loop runs while node A's shard streams to node C."""
    quiet = loop_rate(3.0)
    node_c = shm / "c"
    node_c.mkdir()
    c = ReplicaService(context, SECRET, "c", "127.0.0.1", node_c, bandwidth=bandwidth)
    a.offer(Peer("c", "127.0.0.1", c.port))
    busy = loop_rate(3.0)
    c.close()  # the rest of the transfer is not measured
    return quiet / busy - 1


NODE = """
import sys, zmq
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from ftlaunch_contract.messages import Held, Peer
from launcher.replica_service import ReplicaService
service = ReplicaService(zmq.Context(), sys.argv[2].encode(), "a", "127.0.0.1", Path(sys.argv[3]))
print(service.port, flush=True)
for line in sys.stdin:  # "offer PORT": offer the shard to that peer
    service.offer(Held(1, 0, 7), (Peer("c", "127.0.0.1", int(line.split()[1])),))
service.close()
"""


class NodeProcess:
    """Node A's replica service, in its own process (as on another node)."""

    def __init__(self, directory: Path):
        self.proc = subprocess.Popen([sys.executable, "-c", NODE, str(ROOT), SECRET.decode(),
                                      str(directory)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.peer = Peer("a", "127.0.0.1", int(self.proc.stdout.readline()))

    def offer(self, to: Peer) -> None:
        self.proc.stdin.write(f"offer {to.port}\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def start_s3(s3rver: str, work: Path, shm: Path,
             state: dict[str, torch.Tensor]) -> tuple[subprocess.Popen, str]:
    """A local s3rver (objects on the local disk) with the same checkpoint in a bucket."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (work / "s3rver").mkdir()
    server = subprocess.Popen([s3rver, "-d", str(work / "s3rver"), "-a", "127.0.0.1", "-p",
                               str(port), "-s", "--configure-bucket", "bench"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_REGION="us-east-1",
                      AWS_ACCESS_KEY_ID="S3RVER", AWS_SECRET_ACCESS_KEY="S3RVER")
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("s3rver did not start") from None
            time.sleep(0.1)
    uri = "s3://bench/ckpt"
    (shm / "s3").mkdir()
    saver = AsyncCheckpointer(uri, rank=0, world_size=1, staging_dir=str(shm / "s3"))
    saver.save(7, state=state)
    saver.close()
    return server, uri

if __name__ == "__main__":
    main()
