"""Checkpoints to S3 through s3torchconnector's client, against a real local S3 server
(moto_server, started here): commit, retention, checksums, the agent's flush."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from ports import free_port

from ftlaunch_contract import staging
from trainer_shim.checkpoint import AsyncCheckpointer, CheckpointError

BUCKET = "ftlaunch-ckpt"


@pytest.fixture(scope="module")
def s3_server():
    server = str(Path(sys.executable).with_name("moto_server"))  # this environment's
    if not os.path.exists(server):
        pytest.fail("moto_server missing: pip install -e '.[test]'")
    port = free_port()
    proc = subprocess.Popen([server, "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail("moto_server did not start")
            time.sleep(0.05)
    endpoint = f"http://127.0.0.1:{port}"
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                          aws_access_key_id="test", aws_secret_access_key="test")
    client.create_bucket(Bucket=BUCKET)
    yield endpoint, client
    proc.kill()
    proc.wait(10)


@pytest.fixture
def s3(s3_server, monkeypatch, request):
    endpoint, client = s3_server
    for key, value in {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "test",
                       "AWS_SECRET_ACCESS_KEY": "test", "AWS_REGION": "us-east-1"}.items():
        monkeypatch.setenv(key, value)
    return f"s3://{BUCKET}/{request.node.name}", client


def test_round_trip_commit_and_retention_on_s3(s3):
    uri, _ = s3
    model = torch.nn.Linear(64, 32)
    ckpt = AsyncCheckpointer(uri, keep_last=2)
    for step in (1, 2, 3):
        with torch.no_grad():
            model.weight.fill_(step)
        ckpt.save(step, model=model, extra={"step": step})
    ckpt.wait()
    assert ckpt.committed_steps() == [2, 3]
    restored, extra = torch.nn.Linear(64, 32), {}
    assert AsyncCheckpointer(uri).load_latest(model=restored, extra=extra) == 3
    assert torch.equal(restored.weight, model.weight) and extra == {"step": 3}
    ckpt.close()


def test_a_corrupted_object_is_detected_and_the_previous_step_used(s3, caplog):
    uri, client = s3
    ckpt = AsyncCheckpointer(uri)
    for step in (1, 2):
        ckpt.save(step, state={"x": torch.full((256,), float(step))})
    ckpt.close()
    key = f"{uri.split('/', 3)[3]}/step_000000002/rank_0.bin"
    data = bytearray(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    data[100] ^= 0xFF
    client.put_object(Bucket=BUCKET, Key=key, Body=bytes(data))
    restored: dict = {}
    assert AsyncCheckpointer(uri).load_latest(state=restored) == 1
    assert torch.all(restored["x"] == 1.0)
    assert "fails its checksum" in caplog.text


def test_the_agent_flushes_staged_shards_to_s3(s3, tmp_path):
    uri, _ = s3
    for rank in (0, 1):
        c = AsyncCheckpointer(uri, rank=rank, world_size=2, staging_dir=str(tmp_path),
                              persist_every=100)
        c.save(5, state={"x": torch.full((10,), float(rank))})
    assert AsyncCheckpointer(uri, rank=0, world_size=2).committed_steps() == []
    assert sorted(staging.flush(tmp_path)) == [(0, 5), (1, 5)]
    restored: dict = {}
    assert AsyncCheckpointer(uri, rank=1, world_size=2).load_latest(state=restored) == 5
    assert torch.all(restored["x"] == 1.0)


def test_a_missing_bucket_is_a_clear_error(s3, tmp_path):
    ckpt = AsyncCheckpointer("s3://no-such-bucket-here/x")
    ckpt.save(1, state={"x": torch.ones(4)})
    with pytest.raises(CheckpointError, match="no-such-bucket-here"):
        ckpt.wait()


def test_blocks_are_read_with_ranged_gets_and_verified(s3):
    """What a resharding rank does on S3: one ranged GET per run of blocks it needs."""
    import os

    from ftlaunch_contract import shards
    from ftlaunch_contract.storage import open_storage

    uri, _ = s3
    storage = open_storage(uri)
    data = os.urandom(2 * shards.BLOCK + 333)
    meta = {"step": 1, "rank": 0, "world_size": 1, "nbytes": len(data), "tree": {},
            "tensors": []}
    shards.persist(storage, meta, memoryview(data))
    meta = shards.read_meta(storage, 1, 0)
    assert shards.read_blocks(storage, meta, 1, 2) == data[shards.BLOCK:]
    assert shards.read_blocks(storage, meta, 0, 1) == data[:shards.BLOCK]
    assert storage.read_range(shards.data_name(1, 0), 5, 10) == data[5:15]
