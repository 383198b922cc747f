"""trainer_shim.checkpoint (first slice of #5): bitwise round trips, commits only when every
rank's shard is durable, damage detected, kill -9 at any instant never tears the latest."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

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
    assert ckpt.load_latest(state=restored) == 1
    assert restored["x"].tolist() == [1.0] * 64
    assert "fails its checksum" in caplog.text
    ckpt.close()


def test_unsupported_values_get_a_clear_error(tmp_path):
    ckpt = AsyncCheckpointer(tmp_path)
    with pytest.raises(CheckpointError, match="cannot checkpoint a object"):
        ckpt.save(1, state={"x": object()})
    ckpt.close()


def test_a_full_disk_fails_the_save_clearly_and_commits_nothing(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        ckpt = AsyncCheckpointer(mount)
        ckpt.save(1, state={"x": torch.ones(1000)})
        ckpt.wait()
        ckpt.save(2, state={"x": torch.ones(1 << 20)})  # 4 MiB: does not fit
        with pytest.raises(CheckpointError, match="previous committed step stands"):
            ckpt.wait()
        assert ckpt.committed_steps() == [1]
        assert not list(mount.rglob("*.tmp")), "no half-written file left behind"
        ckpt.save(3, state={"x": torch.full((1000,), 3.0)})  # training goes on
        ckpt.wait()
        restored: dict = {}
        assert ckpt.load_latest(state=restored) == 3 and restored["x"][0] == 3.0
        ckpt.close()
    finally:
        subprocess.run(["umount", str(mount)], check=False)


SAVER = textwrap.dedent("""
    import sys, torch
    from trainer_shim.checkpoint import AsyncCheckpointer
    ckpt = AsyncCheckpointer(sys.argv[1], keep_last=3)
    for step in range(1, 101):
        ckpt.save(step, state={"x": torch.full((1 << 16,), float(step)), "step": step})
        print(step, flush=True)
    ckpt.wait()
""")


def test_kill9_at_random_instants_never_tears_the_latest_checkpoint(tmp_path):
    """A writer SIGKILLed mid-save, again and again: the latest committed step always loads,
    whole, with exactly the values of its step."""
    rng = random.Random(4)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    last = 0
    for _ in range(5):
        proc = subprocess.Popen([sys.executable, "-c", SAVER, str(tmp_path)], env=env,
                                stdout=subprocess.PIPE, text=True)
        target = rng.randrange(5, 60)
        for line in proc.stdout:  # kill after a random number of saves, mid-write
            if int(line) >= target:
                time.sleep(rng.random() * 0.01)  # land anywhere inside the next save
                break
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        restored: dict = {}
        step = AsyncCheckpointer(tmp_path).load_latest(state=restored)
        assert step >= 1
        assert restored["step"] == step and torch.all(restored["x"] == float(step))
        last = step
        assert not [n for n in os.listdir("/dev/shm") if n.startswith("ftlaunch-stage")], \
            "staging memory leaked"
    assert last > 0
