"""trainer_shim.checkpoint (first slice of #5): bitwise round trips, commits only when every
rank's shard is durable, damage detected, kill -9 at any instant never tears the latest."""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
import torch_procs

from ftlaunch_contract import shards, storage
from ftlaunch_contract.storage import PosixStorage
from trainer_shim.checkpoint import AsyncCheckpointer, CheckpointError


def _model_and_optimizer(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    return model, opt


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.view(-1).view(torch.uint8) if a.numel() else a,
                                b.view(-1).view(torch.uint8) if b.numel() else b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b and type(a) is type(b)


def test_nested_state_round_trips_bitwise(tmp_path):
    model, opt = _model_and_optimizer()
    extra = {"rng": torch.get_rng_state(), "loader": {"epoch": 3, "offsets": (1, 2, None)},
             "mixed": [torch.arange(5, dtype=torch.int64), torch.tensor([True, False]),
                       torch.randn(2, 3).to(torch.bfloat16), torch.empty(0), "text", 2.5],
             7: "an int key"}
    ckpt = AsyncCheckpointer(tmp_path)
    ckpt.save(10, model=model, optim=opt, extra=extra)
    ckpt.wait()
    assert ckpt.latest_step() == 10

    model2, opt2 = _model_and_optimizer(seed=1)
    extra2: dict = {}
    assert AsyncCheckpointer(tmp_path).load_latest(model=model2, optim=opt2, extra=extra2) == 10
    assert _same(model.state_dict(), model2.state_dict())
    assert _same(opt.state_dict(), opt2.state_dict())
    assert _same(extra, extra2)
    ckpt.close()


def test_save_returns_before_the_data_is_durable_and_the_copy_is_a_snapshot(tmp_path):
    weights = {"w": torch.zeros(1 << 20)}
    ckpt = AsyncCheckpointer(tmp_path)
    ckpt.save(1, state=weights)
    weights["w"].fill_(7.0)  # training goes on and changes the tensor at once
    ckpt.wait()
    restored: dict = {}
    assert ckpt.load_latest(state=restored) == 1
    assert torch.count_nonzero(restored["w"]) == 0, "the staged copy, not the live tensor"
    ckpt.close()


@pytest.fixture
def copy_gate(monkeypatch):
    """Holds every staging copy until set: what an overlapped save's copy races against
    is then in the test's hands."""
    import trainer_shim.checkpoint as checkpoint
    gate, stage = threading.Event(), checkpoint._stage

    def gated(*args):
        assert gate.wait(60)
        return stage(*args)
    monkeypatch.setattr(checkpoint, "_stage", gated)
    yield gate
    gate.set()  # a failed test leaves no copy waiting


def test_an_overlapped_save_is_copied_before_the_optimizer_steps(tmp_path, copy_gate):
    model, opt = _model_and_optimizer()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt = AsyncCheckpointer(tmp_path, overlap=True)
    ckpt.save(1, model=model, optim=opt)  # returns with the copy not yet begun
    model(torch.randn(3, 8)).sum().backward()  # forward and backward leave the state as it is
    stepper = threading.Thread(target=opt.step)
    stepper.start()
    stepper.join(0.3)
    assert stepper.is_alive(), "the optimizer's step waits for the copy"
    copy_gate.set()
    stepper.join(10)
    assert not stepper.is_alive()
    assert not _same(before, model.state_dict()), "the step ran once the copy was whole"
    ckpt.wait()
    restored = {k: torch.empty_like(v) for k, v in before.items()}
    assert ckpt.load_latest(model=restored) == 1
    assert _same(before, restored), "the copy holds the state the save was called with"
    ckpt.close()


def test_a_checkpointer_of_a_new_attempt_waits_for_the_copy_of_the_one_it_replaces(
        tmp_path, copy_gate):
    """A rank re-entered in place builds a new checkpointer over the same staging slots,
    while the dropped attempt's last save may still be copying into one of them."""
    model, opt = _model_and_optimizer()
    (tmp_path / "shm").mkdir()
    old = AsyncCheckpointer(tmp_path, overlap=True, staging_dir=str(tmp_path / "shm"))
    old.save(3, model=model, optim=opt)  # then the attempt is left (RestartRequested)
    threading.Timer(0.3, copy_gate.set).start()
    new = AsyncCheckpointer(tmp_path, overlap=True, staging_dir=str(tmp_path / "shm"))
    assert copy_gate.is_set() and new.staged_steps() == {3: 0}, "it saw the copy whole"
    new.save(4, model=model, optim=opt)
    opt.step()
    assert new.staged_steps() == {3: 0, 4: 1}, "the next save went to the other slot"
    for ckpt in (old, new):
        ckpt.close()
    copiers = [t for t in threading.enumerate() if t.name == "ftlaunch-ckpt-copy"]
    assert len(copiers) <= 1, "one copier thread for the process, however many attempts"


def test_a_state_changed_outside_the_optimizer_during_an_overlapped_copy_is_not_saved(
        tmp_path, copy_gate):
    model, opt = _model_and_optimizer()
    ckpt = AsyncCheckpointer(tmp_path, overlap=True)
    ckpt.save(1, model=model, optim=opt)
    with torch.no_grad():
        model[0].weight.mul_(2)  # not the optimizer: nothing waits for the copy here
    copy_gate.set()
    with pytest.raises(CheckpointError, match=r"step 1 not saved: its tensor #0 was changed "
                       r"while it was being copied .* save with overlap=False"):
        ckpt.wait()
    assert ckpt.staged_steps() == {} and ckpt.latest_step() is None, "nothing torn is kept"
    ckpt.save(2, model=model, optim=opt)  # the next save is whole
    ckpt.wait()
    assert ckpt.latest_step() == 2
    ckpt.close()


def test_an_overlapped_save_of_an_inference_tensor_copies_at_once(tmp_path, copy_gate):
    """An inference tensor has no version counter: a change during the copy could not be
    seen, so that save is not overlapped."""
    copy_gate.set()
    model, opt = _model_and_optimizer()
    with torch.inference_mode():
        table = torch.arange(4.0)
    ckpt = AsyncCheckpointer(tmp_path, overlap=True)
    ckpt.save(1, model=model, optim=opt, extra={"table": table})
    assert ckpt._in_flight is None, "copied in the call"
    ckpt.close()


def test_an_overlapped_save_without_an_optimizer_copies_at_once(tmp_path, copy_gate):
    copy_gate.set()
    weights = {"w": torch.zeros(4)}
    ckpt = AsyncCheckpointer(tmp_path, overlap=True)
    ckpt.save(1, state=weights)  # nothing would wait for the copy: it is made here
    weights["w"].fill_(7.0)
    ckpt.wait()
    restored: dict = {}
    assert ckpt.load_latest(state=restored) == 1 and torch.count_nonzero(restored["w"]) == 0
    ckpt.close()


def test_a_step_is_committed_only_when_every_rank_has_written(tmp_path):
    ranks = [AsyncCheckpointer(tmp_path, rank=r, world_size=2) for r in (0, 1)]
    ranks[0].save(5, state={"x": torch.ones(3)})
    ranks[0].wait()
    assert ranks[0].latest_step() is None and ranks[0].load_latest(state={}) == 0
    ranks[1].save(5, state={"x": torch.full((3,), 2.0)})
    ranks[1].wait()
    got = [{}, {}]
    assert [c.load_latest(state=g) for c, g in zip(ranks, got, strict=True)] == [5, 5]
    assert got[0]["x"].tolist() == [1.0] * 3 and got[1]["x"].tolist() == [2.0] * 3
    for c in ranks:
        c.close()


def test_keeps_the_last_k_steps(tmp_path):
    ckpt = AsyncCheckpointer(tmp_path, keep_last=2)
    for step in range(1, 6):
        ckpt.save(step, state={"x": torch.full((4,), float(step))})
    ckpt.wait()
    assert ckpt.committed_steps() == [4, 5]
    ckpt.close()


def test_a_flipped_byte_is_detected_and_the_previous_step_used(tmp_path, caplog):
    ckpt = AsyncCheckpointer(tmp_path, keep_last=5)
    for step in (1, 2):
        ckpt.save(step, state={"x": torch.full((64,), float(step))})
    ckpt.wait()
    shard = tmp_path / "step_000000002" / "rank_0.bin"
    data = bytearray(shard.read_bytes())
    data[17] ^= 0x01
    shard.write_bytes(bytes(data))
    restored: dict = {}
    assert AsyncCheckpointer(tmp_path).load_latest(state=restored) == 1  # a new process
    assert restored["x"].tolist() == [1.0] * 64
    assert "fails its checksum" in caplog.text
    ckpt.close()


def test_unsupported_values_get_a_clear_error(tmp_path):
    ckpt = AsyncCheckpointer(tmp_path)
    with pytest.raises(CheckpointError, match="cannot checkpoint a object"):
        ckpt.save(1, state={"x": object()})
    ckpt.close()


@contextlib.contextmanager
def _small_tmpfs(path, size):
    """A real file system that fills up: a tmpfs of ``size`` mounted at ``path``."""
    path.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False)


def test_a_full_disk_commits_nothing_says_so_and_training_goes_on(tmp_path, caplog):
    """A full file system is not a reason to stop training: the step is not durable (it
    stays staged), a warning says where to free space, and the next save tries again."""
    with _small_tmpfs(tmp_path / "small", "256k") as mount:
        ckpt = AsyncCheckpointer(mount)
        ckpt.save(1, state={"x": torch.ones(1000)})
        ckpt.wait()
        ckpt.save(2, state={"x": torch.ones(1 << 20)})  # 4 MiB: does not fit
        with caplog.at_level("WARNING", logger="trainer_shim.checkpoint"):
            ckpt.wait()
        assert f"checkpoint storage {mount} is full" in caplog.text
        assert ckpt.committed_steps() == [1]
        assert not list(mount.rglob("*.tmp")), "no half-written file left behind"
        ckpt.save(3, state={"x": torch.full((1000,), 3.0)})  # training goes on
        ckpt.wait()
        restored: dict = {}
        assert ckpt.load_latest(state=restored) == 3 and restored["x"][0] == 3.0
        ckpt.close()



@pytest.fixture
def direct_streams(monkeypatch):
    """Large-object writes for small objects: several direct streams of 64 KiB chunks."""
    monkeypatch.setattr(storage, "DIRECT_MIN", 0)
    monkeypatch.setattr(storage, "CHUNK", 64 << 10)


@pytest.mark.parametrize("source", ["staging mapping", "bytes"])
def test_direct_streams_write_every_byte_in_place(tmp_path, direct_streams, source):
    """Chunks written by several O_DIRECT streams at once, from page-aligned memory as it
    is or (bytes: no address to align) copied first, and an unaligned tail: the file holds
    exactly the data, and nothing else is left."""
    payload = os.urandom((1 << 20) + 123)
    if source == "bytes":
        data = payload
    else:
        data = mmap.mmap(-1, len(payload))
        data[:] = payload
    assert storage._write_direct(tmp_path / "probe", memoryview(data)), "O_DIRECT refused"
    PosixStorage(str(tmp_path)).write("step/rank_0.bin", memoryview(data))
    assert (tmp_path / "step/rank_0.bin").read_bytes() == payload
    assert not list(tmp_path.rglob("*.tmp"))


def test_a_full_disk_fails_a_direct_write_clearly_and_leaves_nothing(tmp_path, direct_streams):
    with _small_tmpfs(tmp_path / "small", "256k") as mount:
        target = PosixStorage(str(mount))
        with pytest.raises(OSError) as failed:
            target.write("big.bin", memoryview(os.urandom(1 << 20)))
        assert failed.value.errno == errno.ENOSPC
        assert not list(mount.iterdir()), "no half-written file left behind"
        target.write("small.bin", b"fits")  # the storage goes on working
        assert (mount / "small.bin").read_bytes() == b"fits"

SAVER = textwrap.dedent("""
    import os, signal, sys, threading, torch
    from trainer_shim.checkpoint import AsyncCheckpointer
    ckpt = AsyncCheckpointer(sys.argv[1], keep_last=3, staging_dir=sys.argv[2] or None)
    target, delay = int(sys.argv[3]), float(sys.argv[4])
    for step in range(1, 101):
        ckpt.save(step, state={"x": torch.full((1 << 16,), float(step)), "step": step})
        if step == target:  # SIGKILL anywhere inside the saves that follow
            threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
    ckpt.wait()
""")


@pytest.mark.parametrize("owned", [False, True], ids=["private-staging", "agent-staging"])
def test_kill9_at_random_instants_never_tears_the_latest_checkpoint(tmp_path, owned):
    """A rank (and its writer) SIGKILLed mid-save, again and again: the latest step always
    loads whole, with exactly the values of its step, from storage or from the staging an
    agent owns (which a kill can interrupt mid-copy too)."""
    shm = ""
    if owned:
        shm = str(tmp_path / "shm")
        os.mkdir(shm)
    rng = random.Random(4 + owned)
    last = 0
    for _ in range(5):  # killed after a random number of saves, mid-write
        target, delay = rng.randrange(5, 60), rng.random() * 0.01
        saver = torch_procs.Script(SAVER, [str(tmp_path / "ck"), shm, str(target), str(delay)],
                                   tmp_path / "saver.out")
        assert saver.wait(60) == -signal.SIGKILL
        restored: dict = {}
        loader = AsyncCheckpointer(tmp_path / "ck", staging_dir=shm or None)
        step = loader.load_latest(state=restored)
        loader.close()  # it may persist what it restored from staging: one process per rank
        assert step >= 1
        assert restored["step"] == step and torch.all(restored["x"] == float(step))
        last = step
        assert not [n for n in os.listdir("/dev/shm") if n.startswith("ftlaunch-stage-")], \
            "staging memory leaked"
    assert last > 0


# --- agent-owned staging: survives the rank, restores in place, persisted by the agent ----------


def test_a_replacement_restores_from_staging_without_touching_storage(tmp_path):
    """A rank's staged copy outlives its process: the next process of that rank restores
    from it (storage never had it), then makes it durable."""
    staging_dir = tmp_path / "shm"
    staging_dir.mkdir()
    model, opt = _model_and_optimizer()
    first = AsyncCheckpointer(tmp_path / "ckpt", staging_dir=str(staging_dir), persist_every=100)
    first.save(7, model=model, optim=opt)  # staged only: 7 is not a multiple of 100
    first.wait()
    assert first.committed_steps() == []
    del first  # the process dies; its staging files stay

    replacement = AsyncCheckpointer(tmp_path / "ckpt", staging_dir=str(staging_dir))
    model2, opt2 = _model_and_optimizer(seed=1)
    assert replacement.load_latest(model=model2, optim=opt2) == 7
    assert replacement.restored_from == "shared memory"
    assert _same(model.state_dict(), model2.state_dict())
    assert _same(opt.state_dict(), opt2.state_dict())
    replacement.save(8, model=model2, optim=opt2)  # must not overwrite 7 while it persists
    replacement.wait()
    assert replacement.committed_steps() == [7, 8], "the restored step was made durable"
    assert AsyncCheckpointer(tmp_path / "ckpt").load_latest(model=model2, optim=opt2) == 8
    replacement.close()


def test_two_writers_of_one_object_at_once_each_leave_it_whole(tmp_path):
    """At a job's end every agent persists its copy of a staged shard not yet durable: on a
    shared file system two may write one object at once (chaos seed 1806: one's rename
    found the temporary file the other had renamed). Whichever lands last, it is whole."""
    store = PosixStorage(str(tmp_path))
    size = 16 << 20
    payloads = [bytes([1]) * size, bytes([2]) * size]
    errors: list[BaseException] = []

    def write(data: bytes) -> None:
        try:
            for _ in range(4):
                store.write("step_000000001/rank_0.bin", data)
        except BaseException as e:  # noqa: BLE001 - reported by the assert below
            errors.append(e)
    writers = [threading.Thread(target=write, args=(p,)) for p in payloads]
    for w in writers:
        w.start()
    for w in writers:
        w.join(timeout=120)
    assert not errors, errors
    assert store.read("step_000000001/rank_0.bin") in payloads, "torn: a mix of the two"
    assert [p.name for p in (tmp_path / "step_000000001").iterdir()] == ["rank_0.bin"]


def test_a_staged_shard_that_cannot_be_persisted_is_reported_not_fatal(tmp_path, caplog):
    """A write that fails once the shard's mapping is in use (here its rename: the name is
    taken by a directory) is logged and the others are persisted: the error once closed
    the agent (BufferError: the mapping could not close while the failure's traceback held
    views of it)."""
    from ftlaunch_contract import staging

    staging_dir = tmp_path / "shm"
    staging_dir.mkdir()
    for rank in (0, 1):
        c = AsyncCheckpointer(tmp_path / "ckpt", rank=rank, world_size=2,
                              staging_dir=str(staging_dir), persist_every=1000)
        c.save(10, state={"x": torch.full((1 << 20,), float(rank))})
    taken = tmp_path / "ckpt" / shards.data_name(10, 0)
    taken.mkdir(parents=True)
    (taken / "in-the-way").write_text("x")
    assert staging.flush(staging_dir) == [(1, 10)]
    assert "could not persist rank 0's staged step 10" in caplog.text


def test_the_agent_persists_what_dead_ranks_staged(tmp_path):
    from ftlaunch_contract import staging

    staging_dir = tmp_path / "shm"
    staging_dir.mkdir()
    for rank in (0, 1):
        c = AsyncCheckpointer(tmp_path / "ckpt", rank=rank, world_size=2,
                              staging_dir=str(staging_dir), persist_every=1000)
        for step in (10, 20):
            c.save(step, state={"x": torch.full((100,), float(step + rank))})
    assert not (tmp_path / "ckpt").exists() or not list((tmp_path / "ckpt").iterdir())
    assert sorted(staging.flush(staging_dir)) == [(0, 10), (0, 20), (1, 10), (1, 20)]
    assert staging.flush(staging_dir) == [], "already durable: nothing written twice"
    loaded = [{}, {}]
    for rank in (0, 1):
        c = AsyncCheckpointer(tmp_path / "ckpt", rank=rank, world_size=2)
        assert c.committed_steps() == [10, 20]
        assert c.load_latest(state=loaded[rank]) == 20
        assert loaded[rank]["x"][0] == 20 + rank


def test_full_staging_memory_is_a_clear_error_and_training_goes_on(tmp_path):
    with _small_tmpfs(tmp_path / "shm", "1m") as mount:
        ckpt = AsyncCheckpointer(tmp_path / "ckpt", staging_dir=str(mount))
        with pytest.raises(CheckpointError, match=r"enlarge /dev/shm.*--shm-size"):
            ckpt.save(1, state={"x": torch.ones(1 << 20)})  # 4 MiB into 1 MiB
        ckpt.save(2, state={"x": torch.ones(1000)})
        ckpt.wait()
        assert ckpt.committed_steps() == [2]
        ckpt.close()


def test_keep_every_mth_step_beside_the_last_k(tmp_path):
    ckpt = AsyncCheckpointer(tmp_path, keep_last=2, keep_every=4)
    for step in range(1, 10):
        ckpt.save(step, state={"x": torch.zeros(4)})
    ckpt.wait()
    assert ckpt.committed_steps() == [4, 8, 9]
    ckpt.close()


def test_staging_left_by_a_killed_agent_is_adopted_by_an_agent_of_its_job_only(tmp_path):
    """An agent SIGKILLed (a pod after its grace period) leaves its staged shards: the next
    agent of the same job on the host moves them into its own staging (held in memory,
    flushed at exit) and removes the rest. Another job's are removed, never adopted: they
    would be counted as held by this node under the same (world, rank, step) as its own,
    and no rank of this job can restore them (a later job then restored nothing)."""
    from ftlaunch_contract import staging

    def left_by_a_dead_agent(name, job):
        dead = subprocess.Popen(["true"])
        dead.wait()
        stale = os.path.join("/dev/shm", f"ftlaunch-staging-{dead.pid}-{name}")
        os.makedirs(os.path.join(stale, "replicas"))
        for file, body in ((staging.JOB_FILE, job.encode()),
                           ("rank_0.0.data", name.encode() * 10), ("rank_0.0.meta", b"m"),
                           ("rank_1.1.data", b"orphan data, no meta: never adopted"),
                           ("replicas/rank_5.0.data", b"y"), ("replicas/rank_5.0.meta", b"n")):
            with open(os.path.join(stale, file), "wb") as f:
                f.write(body)
        return stale

    same_job = left_by_a_dead_agent("same", "job@10.0.0.1:29400")
    other_job = left_by_a_dead_agent("other", "job@10.0.0.9:29400")  # newer: it would win
    os.utime(os.path.join(other_job, "rank_0.0.meta"), (time.time() + 60,) * 2)
    mine = staging.create_dir("job@10.0.0.1:29400")
    try:
        assert not os.path.exists(same_job) and not os.path.exists(other_job)
        assert mine.is_dir() and oct(mine.stat().st_mode & 0o777) == "0o700"
        assert (mine / "rank_0.0.data").read_bytes() == b"same" * 10
        assert (mine / "replicas" / "rank_5.0.meta").read_bytes() == b"n"
        assert not (mine / "rank_1.1.data").exists()
    finally:
        shutil.rmtree(mine)


def test_a_gone_agents_staging_deleted_while_another_agent_walks_it_is_passed_over(
        tmp_path, monkeypatch):
    """Two agents of a host exit at once and each adopts what gone agents left: one deletes
    a directory while the other walks it (a netns test's survivor exited 1 on it). The walk
    ends where the directory did; the adopter goes on."""
    from ftlaunch_contract import staging

    gone = tmp_path / "ftlaunch-staging-1-gone"
    (gone / "replicas").mkdir(parents=True)
    for name in ("rank_0.0.meta", "rank_0.0.data", "replicas/rank_1.0.meta",
                 "replicas/rank_1.0.data"):
        (gone / name).write_bytes(b"x")
    (gone / staging.JOB_FILE).write_text("job")
    walk = Path.rglob

    def adopted_meanwhile(self, pattern):
        for i, found in enumerate(walk(self, pattern)):
            yield found
            if i == 0:  # the other agent takes it now: the walk's next directory is gone
                shutil.rmtree(gone)

    monkeypatch.setattr(Path, "rglob", adopted_meanwhile)
    monkeypatch.setattr(staging, "_owner_gone", lambda entry: True)
    mine = tmp_path / "ftlaunch-staging-2-mine"
    mine.mkdir()
    assert staging.adopt_stale(mine, "job") == []
    assert not gone.exists()


def test_a_live_agents_staging_is_never_taken_for_a_dead_ones(tmp_path):
    """Ownership is a lock, not a pid: an agent in another PID namespace (a container on
    this host sharing /dev/shm) has a pid that means nothing here, yet is alive."""
    from ftlaunch_contract import staging

    other = os.path.join("/dev/shm", "ftlaunch-staging-999999999-otherns")
    os.makedirs(other)
    with open(os.path.join(other, "rank_0.0.data"), "wb") as f:
        f.write(b"live")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_CREAT"
         " | os.O_RDWR); fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); "
         "sys.stdin.read()", os.path.join(other, staging.OWNER_LOCK)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        mine = staging.create_dir("a job of its own")
        shutil.rmtree(mine)
        assert os.path.exists(os.path.join(other, "rank_0.0.data"))
    finally:
        holder.stdin.close()
        holder.wait(10)
        shutil.rmtree(other, ignore_errors=True)


AGREE = textwrap.dedent("""
    import json, os, sys, torch, torch.distributed as dist
    from trainer_shim.checkpoint import AsyncCheckpointer
    rank, phase, root, port = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    one_node = phase.endswith("-one-node")  # both ranks' staging in one node's memory
    phase = phase.removesuffix("-one-node")
    ckpt = AsyncCheckpointer(os.path.join(root, "ckpt"), rank=rank, world_size=2,
                             staging_dir=os.path.join(root, "shm" if one_node else f"shm{rank}"),
                             persist_every=2)
    if phase == "save":
        for step in (2, 4, 5):  # 5 is staged only
            ckpt.save(step, state={"x": torch.full((10,), float(step * 10 + rank))})
        ckpt.wait()
    else:
        metas, read = set(), ckpt.storage.read
        def counted_read(name):  # whose shard metas it reads from storage
            if name.endswith(".meta"):
                metas.add(name)
            return read(name)
        ckpt.storage.read = counted_read
        listings, listing = [], ckpt.storage.list
        def counted(prefix=""):  # who lists storage (rank 0 alone: it tells the others)
            listings.append(prefix)
            if phase == "load-unlistable":
                raise OSError("listing refused")
            return listing(prefix)
        ckpt.storage.list = counted
        state = {}
        try:
            step = ckpt.load_latest(state=state)
        except Exception as e:
            print(json.dumps({"error": f"{type(e).__name__}: {e}", "listings": len(listings)}))
        else:
            print(json.dumps({"step": step, "x": state["x"][0].item() if state else None,
                              "source": ckpt.restored_from, "listings": len(listings),
                              "metas": sorted(metas)}))
    dist.destroy_process_group()
""")


def _two_ranks(phase, root, script=AGREE):
    return _processes(script, [[str(r), phase, str(root)] for r in (0, 1)], root)


def _processes(script, argvs, root):
    """Each argv's process, a rank of one gloo group (its port appended): their last lines."""
    import json

    from ports import free_port

    port = free_port()
    ran = torch_procs.run_all(script, [[*argv, str(port)] for argv in argvs],
                              Path(root) / ".stdout", timeout=180)
    assert [code for code, _ in ran] == [0] * len(argvs), ran
    return [json.loads(out.strip().splitlines()[-1]) if out.strip() else None for _, out in ran]


def test_ranks_agree_on_the_newest_step_every_rank_holds(tmp_path):
    """Staged on every node -> restored from shared memory (and then made durable); one
    rank's staging gone -> the newest step both hold; a shard damaged -> an older one, for
    every rank alike although only one rank's shard is bad."""
    import shutil

    for r in (0, 1):
        (tmp_path / f"shm{r}").mkdir()
    _two_ranks("save", tmp_path)
    both = _two_ranks("load", tmp_path)
    assert [(b["step"], b["x"], b["source"]) for b in both] == [
        (5, 50.0, "shared memory"), (5, 51.0, "shared memory")]
    assert [b["listings"] for b in both] == [1, 0], "rank 0 alone lists storage"

    shutil.rmtree(tmp_path / "shm1")  # rank 1 now runs on another node
    (tmp_path / "shm1").mkdir()
    both = _two_ranks("load", tmp_path)
    assert [(b["step"], b["x"], b["source"]) for b in both] == [
        (5, 50.0, "shared memory"), (5, 51.0, "storage")], "step 5 was persisted on restore"

    shutil.rmtree(tmp_path / "ckpt" / "step_000000005")
    shutil.rmtree(tmp_path / "shm1")
    (tmp_path / "shm1").mkdir()
    both = _two_ranks("load", tmp_path)
    assert [(b["step"], b["x"]) for b in both] == [(4, 40.0), (4, 41.0)], \
        "rank 0 still holds 5, rank 1 does not: both take 4"

    shard = tmp_path / "ckpt" / "step_000000004" / "rank_1.bin"
    shard.write_bytes(b"\xff" + shard.read_bytes()[1:])
    shutil.rmtree(tmp_path / "shm0")
    (tmp_path / "shm0").mkdir()
    both = _two_ranks("load", tmp_path)
    assert [(b["step"], b["x"]) for b in both] == [(2, 20.0), (2, 21.0)], \
        "rank 0's shard of step 4 is fine, but rank 1's is not: both fall back"


def test_a_rank_checks_its_own_copies_in_memory_against_storage_not_its_nodes_every_copy(
        tmp_path):
    """Two ranks on one node: each restores its own staged step 5, having checked against
    storage only its own copies (steps 4 and 5: step 5 is not persisted); a copy of another
    rank is checked when it is read from. Each rank checking every copy its node holds
    (~32 on a node of 8 GPUs with replicas) was 4 M object-store requests a restore at
    16,384 nodes."""
    (tmp_path / "shm").mkdir()
    _two_ranks("save-one-node", tmp_path)
    both = _two_ranks("load-one-node", tmp_path)
    assert [(b["step"], b["x"], b["source"]) for b in both] == [
        (5, 50.0, "shared memory"), (5, 51.0, "shared memory")]
    for rank, b in enumerate(both):
        assert b["metas"] and all(name.endswith(f"/rank_{rank}.meta") for name in b["metas"]), \
            (rank, b["metas"])


def test_a_listing_of_storage_that_fails_on_rank_0_fails_every_ranks_restore_clearly(tmp_path):
    """Only rank 0 lists storage; if it cannot, no rank waits for it nor guesses: each
    says why its restore failed."""
    for r in (0, 1):
        (tmp_path / f"shm{r}").mkdir()
    _two_ranks("save", tmp_path)
    both = _two_ranks("load-unlistable", tmp_path)
    assert both[0]["error"].startswith("CheckpointError: cannot list checkpoints in ") \
        and both[0]["error"].endswith(": listing refused"), both[0]
    assert both[1]["error"].endswith(": rank 0 could not list them"), both[1]
    assert [b["listings"] for b in both] == [1, 0]


FSDP = textwrap.dedent("""
    import json, os, sys, torch, torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    import trainer_shim as ft
    rank, phase, root, port = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    torch.manual_seed(0 if phase == "save" else 1)  # the loader starts from other weights
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    for layer in (model[0], model[2], model):
        fully_shard(layer)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    def train_step(seed):
        g = torch.Generator().manual_seed(seed * 10 + rank)
        loss = model(torch.randn(4, 8, generator=g)).square().mean()
        loss.backward(); opt.step(); opt.zero_grad()
        return loss.item()
    ckpt = ft.AsyncCheckpointer(os.path.join(root, "ckpt"), rank=rank, world_size=2,
                                staging_dir=os.path.join(root, f"shm{rank}"))
    if phase == "save":
        train_step(1)
        ckpt.save(1, train=ft.DistributedState(model, opt))
        ckpt.wait()
    else:
        assert ckpt.load_latest(train=ft.DistributedState(model, opt)) == 1
    local = {k: v.to_local().sum().item() for k, v in model.state_dict().items()}
    losses = [train_step(2), train_step(3)]  # the third depends on the optimizer's state
    print(json.dumps({"local": local, "next_loss": losses, "source": ckpt.restored_from,
                      "type": type(model[0].weight).__name__}))
    ckpt.close()
    dist.destroy_process_group()
""")


@pytest.mark.parametrize("source", ["shared memory", "storage"])
def test_fsdp_sharded_state_is_saved_and_restored_per_rank(tmp_path, source):
    """FSDP2 (DTensor shards) on two gloo ranks: each rank saves its shard; a fresh model
    and optimizer restored from them train on exactly as the original did."""
    import shutil

    for r in (0, 1):
        (tmp_path / f"shm{r}").mkdir()
    saved = _two_ranks("save", tmp_path, FSDP)
    if source == "storage":
        for r in (0, 1):
            shutil.rmtree(tmp_path / f"shm{r}")
            (tmp_path / f"shm{r}").mkdir()
    loaded = _two_ranks("load", tmp_path, FSDP)
    for s, ld in zip(saved, loaded, strict=True):
        assert ld["type"] == "DTensor" and ld["source"] == source
        assert ld["local"] == s["local"], "this rank's shard of every parameter"
        assert ld["next_loss"] == s["next_loss"], "optimizer and weights restored exactly"
    assert saved[0]["local"] != saved[1]["local"], "each rank holds a different shard"


RESHARD = textwrap.dedent("""
    import hashlib, json, os, sys, torch, torch.distributed as dist
    from torch.distributed.checkpoint import state_dict as dcp
    from torch.distributed.fsdp import fully_shard
    import trainer_shim as ft
    rank, world, phase, root, port = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3],
                                      sys.argv[4], sys.argv[5])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    phase, *how = phase.split("-")  # e.g. save-hsdp: how the model is laid out
    from torch.distributed.device_mesh import init_device_mesh
    mesh, tp_mesh, data_rank = None, None, rank
    hidden = 32 if "even" in how else 13 if "odd" in how else 33
    if "hsdp" in how:  # HSDP: 2 replicas of world / 2 shards
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    elif "dp" in how:  # FSDP over the "dp" dimension of a (dp, tp) mesh: ranks 0, 2 and 1, 3
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))["dp"]
        data_rank = rank // 2  # (no TP here) a "tp" group's ranks see the same data
    elif "tp" in how:  # FSDP2 over "dp" of tensor parallelism over "tp": both shard dimension
        from torch.distributed.tensor.parallel import (  # 0 of the first layer's weight
            ColwiseParallel, RowwiseParallel, parallelize_module)  # (a strided shard)
        tp_mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        mesh, data_rank = tp_mesh["dp"], rank // 2
    torch.manual_seed(0 if phase == "save" else 1)  # the loader starts from other weights
    model = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.GELU(),
                                torch.nn.Linear(hidden, 5))
    if tp_mesh is not None and "odd" in how:  # (torch's RowwiseParallel needs even rows)
        from torch.distributed.tensor import Replicate
        model = parallelize_module(model, tp_mesh["tp"],
                                   {"0": ColwiseParallel(output_layouts=Replicate())})
    elif tp_mesh is not None:
        model = parallelize_module(model, tp_mesh["tp"], {"0": ColwiseParallel(),
                                                          "2": RowwiseParallel()})
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    staging = os.path.join(root, f"shm{world}_{rank}")  # each its own node: no staged copy
    os.makedirs(staging, exist_ok=True)
    ckpt = ft.AsyncCheckpointer(os.path.join(root, "ckpt"), rank=rank, world_size=world,
                                staging_dir=staging)
    if phase == "save":
        loss = model(torch.randn(4, 8, generator=torch.Generator().manual_seed(data_rank))).sum()
        loss.backward(); opt.step(); opt.zero_grad()
        ckpt.save(7, train=ft.DistributedState(model, opt))
        ckpt.wait()
    metas, read = set(), ckpt.storage.read
    def counted(name):  # whose shard metas this rank reads
        if name.endswith(".meta"):
            metas.add(int(name.rsplit("rank_", 1)[1].split(".")[0]))
        return read(name)
    ckpt.storage.read = counted
    from trainer_shim import collective
    gathered, gather = [], collective.all_gather_ints
    def gather_counted(ints):  # how many integers each rank gives each gather
        gathered.append(len(ints))
        return gather(ints)
    collective.all_gather_ints = gather_counted
    if phase == "load":
        try:
            step = ckpt.load_latest(train=ft.DistributedState(model, opt))
        except ft.CheckpointError as e:  # for the test to read
            print(json.dumps({"error": str(e)}))
            sys.exit(0)
    full = {}
    for part, states in zip(("model", "optim"), dcp.get_state_dict(model, opt)):
        flat = states if part == "model" else {
            f"{k}.{n}": v for k, s in states["state"].items() for n, v in s.items()}
        for name, value in sorted(flat.items()):
            value = value.full_tensor() if hasattr(value, "full_tensor") else value
            full[f"{part}.{name}"] = hashlib.sha256(value.detach().numpy().tobytes()).hexdigest()
    print(json.dumps({"full": full, "source": ckpt.restored_from, "read": ckpt.restored_bytes,
                      "metas": sorted(metas), "gathered": gathered,
                      "step": step if phase == "load" else 7}))
    ckpt.close()
    dist.destroy_process_group()
""")


def _ranks(world, phase, root, script):
    return _processes(script, [[str(r), str(world), phase, str(root)] for r in range(world)],
                      root)


def test_fsdp_state_resumes_on_fewer_and_on_more_ranks(tmp_path):
    """FSDP2 saved by 3 ranks (33 rows: uneven chunks) restores on 2 ranks (a node lost) and
    on 4 (a node more): every parameter and optimizer state, gathered, equals the saved
    one bit for bit. Where each saved part sits follows from the layout saved with it: the
    ranks gather 3 integers each ([ok, the save's CRC, whether the metas fit the layout]),
    not every saved part's box (at 131,072 ranks and a few hundred sharded tensors, tens
    of millions of integers a rank)."""
    saved = _ranks(3, "save", tmp_path, RESHARD)
    assert len(saved[0]["full"]) == 16  # 4 parameters, each with exp_avg, exp_avg_sq, step
    stored = sum(f.stat().st_size for f in (tmp_path / "ckpt").rglob("*.bin"))
    # Whose metas each new rank reads: its old rank's (or rank 0's), its share of the saved
    # ranks' (every new-world-th from its rank: they check them against the layout), and
    # those of the parts its new shards overlap (33 rows in 3 parts of 11; on 2 ranks
    # 17 + 16, on 4: 9 + 9 + 9 + 6; 5 rows: 2 + 2 + 1 -> 3 + 2, 2 + 2 + 1 + 0). Not every
    # saved rank's: that was W^2 reads in all, 16.7 M at 4,096 ranks.
    metas = {2: [[0, 1, 2], [1, 2]], 4: [[0], [0, 1], [1, 2], [0, 2]]}
    for world in (2, 4):
        loaded = _ranks(world, "load", tmp_path, RESHARD)
        for ld in loaded:
            assert ld["source"] == "storage, resharded from 3 ranks"
            assert ld["full"] == saved[0]["full"], f"on {world} ranks"
            # only the blocks its new shards overlap (here each shard is one 4 MiB block:
            # never all three; test_shards checks ranges within big shards)
            assert ld["read"]["storage"] < stored, ld["read"]
        assert [ld["metas"] for ld in loaded] == metas[world]
        assert [ld["gathered"] for ld in loaded] == [[3]] * world

    _drop_layouts(tmp_path / "ckpt")  # as saved before layouts were: every box gathered
    loaded = _ranks(2, "load", tmp_path, RESHARD)
    assert [ld["full"] for ld in loaded] == [saved[0]["full"]] * 2
    assert [ld["metas"] for ld in loaded] == metas[2]
    # A saved rank's row: its rank, the count, then per box its dimensions, offsets and
    # shape (2 weights, 2 biases, each with exp_avg and exp_avg_sq). New rank 0 read saved
    # ranks 0 and 2 in its share, rank 1 saved rank 1.
    row = 2 + 3 * (2 * (1 + 2 + 2) + 2 * (1 + 1 + 1))
    assert [ld["gathered"] for ld in loaded] == [[3, 2 * row], [3, row]]


def test_hsdp_state_resumes_on_a_world_of_another_shape(tmp_path):
    """HSDP saved by 4 ranks (2 replicas of 2 shards: each part saved twice) restores on 3
    ranks of plain FSDP, bit for bit: the layout saved says which mesh dimension replicates,
    and each new rank reads each part it overlaps once, from the replica of its old rank."""
    import msgpack

    from ftlaunch_contract import shards

    saved = _ranks(4, "save-hsdp", tmp_path, RESHARD)
    meta = msgpack.unpackb((tmp_path / "ckpt" / shards.meta_name(7, 3)).read_bytes(),
                           raw=False, strict_map_key=False)
    assert "[[33, 8], [2, 2], [-1, 0]]" in repr(meta["tree"]), "saved rank 3: its weight's layout"
    loaded = _ranks(3, "load", tmp_path, RESHARD)
    for ld in loaded:
        assert ld["source"] == "storage, resharded from 4 ranks"
        assert ld["full"] == saved[0]["full"]
        assert ld["gathered"] == [3]
    # 33 rows saved as 17 + 16 by ranks 0 and 1 (replica 0) and again by 2 and 3. A new
    # rank's 11 rows: rank 0's within its own part (and saved rank 3's meta read in its
    # share), rank 1's straddle saved parts 0 and 1, rank 2's lie in part 1 of its old
    # rank's replica: saved rank 3's
    assert [ld["metas"] for ld in loaded] == [[0, 3], [0, 1], [2, 3]]


def test_state_sharded_over_a_sub_mesh_resumes_from_its_layout_in_the_world_mesh(tmp_path):
    """FSDP over the "dp" dimension of a (dp, tp) mesh (as under tensor parallelism): each
    tensor's mesh holds ranks 0, 2 or 1, 3, a slice of the world's (2, 2) mesh, so its
    layout is saved on that one, "tp" replicating it (each part is saved twice, once by
    each "dp" group). On 3 ranks the state restores bit for bit, each rank reading its old
    rank's replica, with one gather."""
    import msgpack

    from ftlaunch_contract import shards

    saved = _ranks(4, "save-dp", tmp_path, RESHARD)
    assert [s["full"] for s in saved[1:]] == [saved[0]["full"]] * 3, "one state, held twice"
    meta = msgpack.unpackb((tmp_path / "ckpt" / shards.meta_name(7, 1)).read_bytes(),
                           raw=False, strict_map_key=False)
    assert "[[33, 8], [2, 2], [0, -1]]" in repr(meta["tree"]), "saved rank 1: its weight's"
    loaded = _ranks(3, "load", tmp_path, RESHARD)
    for ld in loaded:
        assert ld["full"] == saved[0]["full"]
        assert ld["gathered"] == [3], "[ok, CRC, fits] alone"
    # New rank 0's rows lie in saved part (dp 0) of its old rank's replica (tp 0): rank 0's
    # (and saved rank 3's meta read in its share); rank 1's straddle dp 0 and 1 of tp 1:
    # ranks 1 and 3; rank 2's lie in dp 1 of tp 0: rank 2's.
    assert [ld["metas"] for ld in loaded] == [[0, 3], [1, 3], [2]]


def test_fsdp_over_tensor_parallelism_resumes_on_another_world_size(tmp_path):
    """FSDP2 over tensor parallelism, both sharding the first layer's rows (32 on 2 x 2
    ranks: torch marks FSDP's a strided shard; its layout cuts by "tp" first): on its own
    world the step restores bit for bit, and on 2 ranks of plain FSDP too, every saved
    part found from the saved layouts."""
    saved = _ranks(4, "save-tp-even", tmp_path, RESHARD)  # (TP: an even split)
    again = _ranks(4, "load-tp-even", tmp_path, RESHARD)
    assert [(ld["step"], ld["full"]) for ld in again] == [(7, saved[0]["full"])] * 4
    resized = _ranks(2, "load-even", tmp_path, RESHARD)
    assert [(ld["step"], ld["full"]) for ld in resized] == [(7, saved[0]["full"])] * 2
    assert [len(ld["gathered"]) for ld in resized] == [1, 1], "[ok, CRC, fits] alone"


def test_fsdp_over_tensor_parallelism_restores_rows_that_do_not_divide(tmp_path):
    """FSDP2 over TP on 3 x 2 ranks, 13 rows in the first layer: its TP parts (7 and 6 rows)
    are cut in 3 (3, 3, 1 and 2, 2, 2). Torch's offsets for such a strided shard are not
    where its rows are (it says (2, 0) holds rows 6-7; it holds row 6, and (2, 1) rows
    11-12): saved where they are, the state restores bit for bit on its own 6 ranks and on 4
    of plain FSDP, every saved part found from the saved layouts (one gather). A saved box
    that is not its tensor's shape (torch's for (2, 0), as the shim saved them before
    2026-12-07) is refused on 4 ranks, saying so, even where the boxes tile the rows (as
    torch's do for 7 rows on 3 x 2): the shim used to read past such a part's end, into the
    next tensor's bytes, and restore wrong weights without a word."""
    saved = _ranks(6, "save-tp-odd", tmp_path, RESHARD)
    assert [s["full"] for s in saved[1:]] == [saved[0]["full"]] * 5
    again = _ranks(6, "load-tp-odd", tmp_path, RESHARD)
    assert [(ld["step"], ld["full"]) for ld in again] == [(7, saved[0]["full"])] * 6
    resized = _ranks(4, "load-odd", tmp_path, RESHARD)
    assert [(ld["step"], ld["full"]) for ld in resized] == [(7, saved[0]["full"])] * 4
    assert [len(ld["gathered"]) for ld in resized] == [1] * 4, "[ok, CRC, fits] alone"
    doctored = tmp_path / "doctored"  # no layouts; rank 4's box torch's (rows 6-7), rank 1's
    shutil.copytree(tmp_path / "ckpt", doctored / "ckpt")  # row 8: the boxes tile the 13 rows
    _without_layouts(doctored / "ckpt", {4: (6, 2), 1: (8, 1)})
    refused = _ranks(4, "load-odd", doctored, RESHARD)
    assert all("exist but none could be restored" in ld["error"] for ld in refused), refused
    assert any(re.search(r"saved rank 4's part of a sharded tensor holds \[1(, 8)?\] where "
                         r"its saved position says \[2(, 8)?\]", ld["error"])
               for ld in refused), refused
    (tmp_path / "plain").mkdir()  # and the other way: each TP rank's rows are cut right
    saved = _ranks(4, "save-odd", tmp_path / "plain", RESHARD)
    resized = _ranks(6, "load-tp-odd", tmp_path / "plain", RESHARD)
    assert [(ld["step"], ld["full"]) for ld in resized] == [(7, saved[0]["full"])] * 6


def _without_layouts(root, rows):
    """Rewrite 3 x 2 ranks' metas of 13-row FSDP2-over-TP shards without their layouts (a
    resized restore then reads each saved part where its box says) and each box of the ranks
    in ``rows`` {rank: (first row, rows)} moved along the first dimension."""
    import msgpack

    def rewrite(value, rank):
        if isinstance(value, dict) and len(value.get("layout", ())) == 4:  # a strided shard
            del value["layout"]
            if rank in rows:
                value["box"][0][0], value["box"][1][0] = rows[rank]
        for inner in value.values() if isinstance(value, dict) else \
                value if isinstance(value, list) else ():
            rewrite(inner, rank)

    for rank in range(6):
        meta = root / shards.meta_name(7, rank)
        fields = msgpack.unpackb(meta.read_bytes(), raw=False, strict_map_key=False)
        rewrite(fields["tree"], rank)
        meta.write_bytes(msgpack.packb(fields))


def test_the_order_a_meshs_dimensions_cut_in_is_read_from_the_placements():
    """FSDP2 over TP (a _StridedShard whose split factor is the TP dimensions' size) cuts by
    TP first, as does HSDP over TP; placements this cannot say where the parts sit for
    (a split factor that is not the later dimensions', a Partial) have no layout."""
    from types import SimpleNamespace

    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from trainer_shim.checkpoint import _cuts

    def cuts(mesh, *placements):
        return _cuts(SimpleNamespace(placements=placements,
                                     device_mesh=SimpleNamespace(shape=mesh)))

    assert cuts((4,), Shard(0)) == ((0,), ())
    assert cuts((2, 2), Replicate(), Shard(1)) == ((-1, 1), ())
    assert cuts((3, 2), _StridedShard(0, split_factor=2), Shard(0)) == ((0, 0), (1, 0))
    assert cuts((2, 3, 2), Replicate(), _StridedShard(0, split_factor=2), Shard(0)) == \
        ((-1, 0, 0), (0, 2, 1))
    assert cuts((2, 2), _StridedShard(1, split_factor=2), Shard(0)) is None  # another dim
    assert cuts((3, 2), _StridedShard(0, split_factor=3), Shard(0)) is None
    assert cuts((2, 2), Shard(0), Partial()) is None


@pytest.mark.parametrize("saved", [
    None, [], [[33, 8], [2, 2]], [[33, 8], [2, 2], [-1, 2]], [[33, 8], [0], [0]],
    [[33, 8], [2], [0, -1]], [[33, 8.0], [2], [0]], [[33, 8], [2], [True]], "[[33],[2],[0]]",
    [[-1, 8], [2], [0]], [[33, 8], [2, 2], [0, 0], [0, 0]], [[33, 8], [2, 2], [0, 0], [2, 0]],
    [[33, 8], [2, 2], [0, 0], [1, 0], []],
])
def test_a_layout_that_is_not_one_is_taken_for_none(saved):
    """A meta's layout, read back: anything but shape, mesh and splits (and the order the
    mesh's dimensions cut in, a permutation of them) that fit each other is no layout (the
    restore gathers every part's box instead of failing on it)."""
    from trainer_shim.checkpoint import _saved_layout

    assert _saved_layout(saved) is None
    assert _saved_layout([[33, 8], [2, 2], [-1, 0]]) is not None
    assert _saved_layout([[33, 8], [2, 2], [0, 0], [1, 0]]).order == (1, 0)


def _drop_layouts(root):
    import msgpack

    def bare(tree):
        if isinstance(tree, dict):
            return {k: bare(v) for k, v in tree.items() if k != "layout"}
        return [bare(v) for v in tree] if isinstance(tree, list) else tree
    for meta in root.rglob("*.meta"):
        fields = msgpack.unpackb(meta.read_bytes(), raw=False, strict_map_key=False)
        assert "layout" in repr(fields["tree"])
        meta.write_bytes(msgpack.packb({**fields, "tree": bare(fields["tree"])}))


def test_plain_state_resumes_on_another_world_size_from_its_old_rank_or_rank_0(tmp_path):
    """Replicated (DDP-style) state saved by 3 ranks: a restore on 2 or 4 ranks takes each
    rank's own old shard where it had one, else rank 0's."""
    for r in range(3):
        ckpt = AsyncCheckpointer(tmp_path, rank=r, world_size=3, staging_dir=None)
        ckpt.save(4, state={"w": torch.full((2,), float(r)), "step": 4})
        ckpt.close()
    for world, rank, expected in ((2, 1, 1.0), (4, 3, 0.0)):
        got = {}
        ckpt = AsyncCheckpointer(tmp_path, rank=rank, world_size=world, staging_dir=None)
        assert ckpt.load_latest(state=got) == 4
        assert got["w"].tolist() == [expected] * 2 and got["step"] == 4
        assert ckpt.restored_from == "storage, resharded from 3 ranks"
        ckpt.close()


def test_a_staged_copy_from_an_abandoned_history_is_not_restored(tmp_path):
    """Step 5 staged here, then the job went back and another world saved a different step 5:
    storage's step 5 is restored, not this node's stale copy of the same step number."""
    for name in ("shm_a", "shm_b"):
        (tmp_path / name).mkdir()
    first = AsyncCheckpointer(tmp_path / "ck", staging_dir=str(tmp_path / "shm_a"))
    first.save(5, state={"x": torch.zeros(2)})
    first.close()
    other = AsyncCheckpointer(tmp_path / "ck", staging_dir=str(tmp_path / "shm_b"))
    other.save(5, state={"x": torch.ones(2)})  # the same step, of the history that went on
    other.close()
    got = {}
    again = AsyncCheckpointer(tmp_path / "ck", staging_dir=str(tmp_path / "shm_a"))
    assert again.load_latest(state=got) == 5
    assert got["x"].tolist() == [1.0, 1.0] and again.restored_from == "storage"
    again.close()


HISTORY = textwrap.dedent("""
    import json, os, sys, torch, torch.distributed as dist
    import trainer_shim as ft
    rank, phase, root, port = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    os.environ["FTLAUNCH_ROUND"] = "7" if phase == "resave" else "3"
    ckpt = ft.AsyncCheckpointer(os.path.join(root, "ckpt"), rank=rank, world_size=2,
                                staging_dir=None)
    if phase == "save":
        for step in (4, 5):
            ckpt.save(step, state={"x": torch.full((2,), float(step * 10 + rank))})
    elif phase == "resave" and rank == 1:  # another history reached step 5 on rank 1 only
        ckpt.save(5, state={"x": torch.full((2,), -1.0)})
    elif phase == "load":
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=2)
        got = {}
        step = ckpt.load_latest(state=got)
        print(json.dumps({"step": step, "x": got["x"][0].item()}))
        dist.destroy_process_group()
    ckpt.close()
""")


def test_a_step_whose_shards_come_from_different_histories_is_not_restored(tmp_path):
    """Rank 1's shard of step 5 was overwritten by a history that went back and never
    committed step 5 on rank 0: both ranks restore step 4, never a mix."""
    _two_ranks("save", tmp_path, HISTORY)
    _two_ranks("resave", tmp_path, HISTORY)
    loaded = _two_ranks("load", tmp_path, HISTORY)
    assert [(ld["step"], ld["x"]) for ld in loaded] == [(4, 40.0), (4, 41.0)]


RESHARDED_LOAD = textwrap.dedent("""
    import json, sys, torch, torch.distributed as dist
    from trainer_shim.checkpoint import AsyncCheckpointer
    rank, phase, root, port = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    ckpt = AsyncCheckpointer(root, rank=rank, world_size=2, staging_dir=None)
    got = {}
    print(json.dumps({"step": ckpt.load_latest(state=got), "w": got["w"].tolist()}))
    dist.destroy_process_group()
""")


@pytest.mark.parametrize("doctored", [1, 2])
def test_a_resharded_step_whose_shards_come_from_different_saves_is_not_restored(tmp_path,
                                                                                  doctored):
    """Steps 4 and 5 saved by 3 ranks, restored on 2: the ranks read a share of the saved
    metas each, so a shard of another save is found by whichever rank reads it: saved rank
    1's by new rank 1 as its own (the ranks then disagree on the save), saved rank 2's by
    new rank 0 in its share. Either way both ranks restore step 4, never a mix."""
    import msgpack

    from ftlaunch_contract import shards

    for r in range(3):
        ckpt = AsyncCheckpointer(tmp_path, rank=r, world_size=3, staging_dir=None)
        for step in (4, 5):
            ckpt.save(step, state={"w": torch.full((2,), float(10 * step + r))})
        ckpt.close()
    meta = tmp_path / shards.meta_name(5, doctored)
    fields = msgpack.unpackb(meta.read_bytes(), raw=False, strict_map_key=False)
    meta.write_bytes(msgpack.packb({**fields, "history": [[9, 9]]}))  # a world that went back
    loaded = _two_ranks("load", tmp_path, RESHARDED_LOAD)
    assert [(ld["step"], ld["w"]) for ld in loaded] == [(4, [40.0, 40.0]), (4, [41.0, 41.0])]


class CountingStorage(PosixStorage):
    """A real directory that counts the shard bytes read from it."""

    def __init__(self, path):
        super().__init__(path)
        self.bytes_read = 0

    def read_range(self, name, offset, nbytes):
        data = super().read_range(name, offset, nbytes)
        self.bytes_read += len(data)
        return data


def test_a_byte_range_is_read_and_verified_in_its_blocks_only(tmp_path):
    """A shard of 5 blocks and a bit: reading 100 bytes inside block 2 reads that block
    alone, verified; a flipped byte in another block does not stop it, one in block 2 does."""
    storage = CountingStorage(str(tmp_path))
    data = os.urandom(5 * shards.BLOCK + 1000)
    meta = {"step": 3, "rank": 0, "world_size": 1, "nbytes": len(data), "tree": {},
            "tensors": []}
    shards.persist(storage, meta, memoryview(data))
    meta = shards.read_meta(storage, 3, 0)
    assert meta["format"] == 2 and len(meta["block_sha256"]) == 6
    at = 2 * shards.BLOCK + 500
    assert shards.read_blocks(storage, meta, 2, 1)[500:600] == data[at:at + 100]
    assert storage.bytes_read == shards.BLOCK
    assert shards.read_blocks(storage, meta, 5, 1) == data[5 * shards.BLOCK:]  # the short tail
    path = tmp_path / shards.data_name(3, 0)
    with open(path, "r+b") as f:  # damage block 4
        f.seek(4 * shards.BLOCK + 7)
        f.write(bytes([data[4 * shards.BLOCK + 7] ^ 1]))
    assert shards.read_blocks(storage, meta, 1, 3)[:10] == data[shards.BLOCK:shards.BLOCK + 10]
    with pytest.raises(shards.ShardError, match="checksum"):
        shards.read_blocks(storage, meta, 3, 2)
    with pytest.raises(shards.ShardError, match="checksum"):
        shards.read(storage, 3, 0)


def test_committed_steps_none_of_which_can_be_restored_are_an_error_not_a_fresh_start(tmp_path):
    """Every committed step damaged (or of a layout that cannot be resharded): load_latest
    says so instead of returning 0, which would train from scratch over them and, as new
    steps are kept, delete them. One good step left is restored, as ever."""
    from ftlaunch_contract import shards

    for where in ("shm", "shm-after"):
        (tmp_path / where).mkdir()
    ckpt = AsyncCheckpointer(tmp_path / "ck", staging_dir=str(tmp_path / "shm"))
    for step in (1, 2):
        ckpt.save(step, state={"w": torch.full((1000,), float(step))})
        ckpt.wait()
    ckpt.close()

    def damage(step):
        path = tmp_path / "ck" / shards.data_name(step, 0)
        data = bytearray(path.read_bytes())
        data[7] ^= 1
        path.write_bytes(bytes(data))

    def restore():  # a restarted node's: nothing of ours in memory
        state = {"w": torch.zeros(1000)}
        again = AsyncCheckpointer(tmp_path / "ck", staging_dir=str(tmp_path / "shm-after"))
        try:
            return again.load_latest(state=state), state["w"][0].item()
        finally:
            again.close()

    damage(2)
    assert restore() == (1, 1.0), "the newest damaged: the one before"
    damage(1)
    with pytest.raises(CheckpointError, match=r"committed steps \[1, 2\] in .* exist but none "
                                              r"could be restored \(.*checksum"):
        restore()


def test_staging_is_reserved_before_the_first_save(tmp_path):
    """After load_latest (nothing to restore) both staging slots are sized for the state in
    the background, so the first save finds its memory mapped and only copies."""
    (tmp_path / "shm").mkdir()
    state = {"w": torch.randn(1 << 20), "m": torch.randn(1 << 19)}
    ckpt = AsyncCheckpointer(tmp_path / "ck", staging_dir=str(tmp_path / "shm"))
    assert ckpt.load_latest(state=state) == 0
    assert ckpt.reserve(state=state).wait(timeout=60)
    needed = (1 << 20) * 4 + (1 << 19) * 4
    mapped = [slot.buffer for slot in ckpt._slots]
    assert all(b is not None and len(b) >= needed for b in mapped)
    ckpt.save(1, state=state)
    assert all(slot.buffer is b for slot, b in zip(ckpt._slots, mapped, strict=True))  # no re-sizing
    ckpt.close()
