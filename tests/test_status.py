"""``ftlaunch status`` against a running 2-node loopback job, both forms (this node's
runtime records; another node's endpoint with the job secret), and without a job."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import psutil
import pytest
from conftest import ROOT, SCRIPTS
from ports import free_port

from launcher.status import local_jobs

TRAIN = str(SCRIPTS / "train_gpt.py")


def _status(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launcher", "status", *args],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env})


@pytest.fixture
def runtime(tmp_path, monkeypatch):
    path = tmp_path / "runtime"
    monkeypatch.setenv("FTLAUNCH_RUNTIME_DIR", str(path))  # the launch fixture passes it on
    return {"FTLAUNCH_RUNTIME_DIR": str(path)}


def test_status_shows_every_node_and_rank_of_a_running_job(tmp_path, launch, runtime):
    port = free_port()
    secret = {"FTLAUNCH_SECRET": "status-test-secret"}
    args = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "statusjob",
            "--node-timeout", "2", "--heartbeat-interval", "0.2",
            TRAIN, "--steps", "2000", "--step-time", "0.02", "--shim", "--log-every", "50"]
    nodes = [launch(*args, env={**runtime, **secret})]
    nodes.append(launch(*args, env={**runtime, **secret}))
    for run in nodes:
        run.wait_for(r"step 100 ", timeout=120)
    mine = _status("--json", env=runtime)
    assert mine.returncode == 0, mine.stderr
    seen = json.loads(mine.stdout)
    assert seen["run_id"] == "statusjob" and seen["round_phase"] == "running", seen
    assert seen["final"] == "" and seen["restart_count"] == 0 and len(seen["nodes"]) == 2
    assert {n["phase"] for n in seen["nodes"]} == {"running"}
    assert sorted(n["group_rank"] for n in seen["nodes"]) == [0, 1]
    assert sorted(r["rank"] for r in seen["ranks"]) == [0, 1]
    assert all(r["step"] >= 50 and 0 <= r["beat_age_ms"] < 10_000 for r in seen["ranks"]), seen
    here = seen["goodput_here"]  # this node's account so far, from its agent's event log
    assert here["known"] and 0 < here["goodput"] <= 1 and here["steps"] >= 50, here
    # From "another node": the endpoint and the secret, no runtime records.
    theirs = _status("--endpoint", f"127.0.0.1:{port}",
                     env={**secret, "FTLAUNCH_RUNTIME_DIR": str(tmp_path / "elsewhere")})
    assert theirs.returncode == 0, theirs.stderr
    assert theirs.stdout.startswith("run statusjob: running, coordinator ")
    assert theirs.stdout.count("    rank ") == 2 and "heartbeat" in theirs.stdout
    assert "this node so far" not in theirs.stdout  # no log of it here
    wrong = _status("--endpoint", f"127.0.0.1:{port}", "--timeout", "1",
                    env={"FTLAUNCH_SECRET": "not-the-jobs"})
    assert wrong.returncode == 1 and "no ftlaunch coordinator answered" in wrong.stderr
    for run in nodes:
        assert run.proc.poll() is None, "a status query harmed the job"
        psutil.Process(run.proc.pid).terminate()
    for run in nodes:
        run.finish(60)
    assert local_jobs() == [], "the runtime records are removed at exit"
    gone = _status(env=runtime)
    assert gone.returncode == 1 and gone.stdout == ""
    assert gone.stderr.startswith("ftlaunch status: error: no running ftlaunch job on this node")
