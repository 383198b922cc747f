"""End-to-end: real agents, real ranks, real gloo, real signals."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
from conftest import SCRIPTS, wait_no_tagged

TRAIN = str(SCRIPTS / "train_gpt.py")
TRAIN_ARGS = ["--steps", "30", "--ckpt-every", "5", "--log-every", "1"]


def _train(launch, tmp_path, name, *flags, env=None, nproc=2, extra=()):
    ckpt, out = tmp_path / f"ckpt_{name}", tmp_path / f"{name}.json"
    run = launch("--standalone", "--nproc-per-node", str(nproc), *flags, TRAIN, *TRAIN_ARGS,
                 "--ckpt-dir", str(ckpt), "--out", str(out), *extra, env=env)
    return run, out


def _write(path, text):
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_ranks_get_torchruns_environment(tmp_path, launcher_env):
    """Same command under torchrun and ftlaunch: every variable torchrun sets, same meaning."""
    script = _write(tmp_path / "dump_env.py", """
        import json, os, sys
        with open(os.path.join(sys.argv[1], "env_%s.json" % os.environ["RANK"]), "w") as f:
            json.dump(dict(os.environ), f)
    """)
    results = {}
    for tool in ("torchrun", "ftlaunch"):
        out = tmp_path / tool
        out.mkdir()
        exe = [shutil.which("torchrun", path=os.path.dirname(sys.executable))] \
            if tool == "torchrun" else [sys.executable, "-m", "launcher"]
        subprocess.run([*exe, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                        script, str(out)], env=launcher_env, cwd=tmp_path, check=True,
                       timeout=120, capture_output=True)
        results[tool] = [json.loads((out / f"env_{r}.json").read_text()) for r in (0, 1)]
    for rank in (0, 1):
        theirs, ours = results["torchrun"][rank], results["ftlaunch"][rank]
        added = {k for k in theirs if launcher_env.get(k) != theirs[k]}
        assert added - set(ours) == set(), "variables torchrun sets that ftlaunch does not"
        differing = {k for k in added if theirs[k] != ours[k]}
        # Per-run values: an id, a free port, a path; everything else is identical.
        assert differing <= {"TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT",
                             "TORCHELASTIC_ERROR_FILE"}, {k: (theirs[k], ours[k]) for k in differing}
        assert ours["RANK"] == str(rank) and ours["TORCHELASTIC_MAX_RESTARTS"] == "1"


def test_kill9_of_a_rank_recovers_and_resumes_from_checkpoint(tmp_path, launch):
    """An external kill -9 mid-run: the job restarts, resumes from its checkpoint, and ends
    with exactly the weights of a fault-free run."""
    clean, clean_out = _train(launch, tmp_path, "clean", "--max-restarts", "0")
    assert clean.finish() == 0, clean.output

    run, out = _train(launch, tmp_path, "faulty", extra=["--step-time", "0.05"])
    pid = int(run.wait_for(r"\[rank1\]: start rank 1 .*pid (\d+)").group(1))
    run.wait_for(r"\[rank1\]: step 12 ")
    os.kill(pid, signal.SIGKILL)
    run.wait_for(r"rank 1 was killed by SIGKILL")
    run.wait_for(r"rank restart 1/3")
    assert run.finish() == 0, run.output

    result, reference = json.loads(out.read_text()), json.loads(clean_out.read_text())
    assert result["restart_count"] == 1
    assert 10 <= result["resumed_from"] <= 15, "resumed from the last checkpoint before the kill"
    assert result["final_step"] == reference["final_step"]
    assert result["weights_sha256"] == reference["weights_sha256"]


def test_a_job_whose_committed_steps_are_all_damaged_fails_saying_so(tmp_path, launch):
    """Every committed step's shards fail their checksums: the job ends with exit 1 and
    the steps named, instead of training from step 0 over them (and pruning them)."""
    import torch

    from ftlaunch_contract import shards
    from trainer_shim.checkpoint import AsyncCheckpointer

    ckpt = tmp_path / "ckpt_damaged"
    savers = [AsyncCheckpointer(ckpt, rank=r, world_size=2) for r in (0, 1)]
    for step in (5, 10):
        for saver in savers:
            saver.save(step, state={"x": torch.ones(64)})
            saver.wait()
    for saver in savers:
        saver.close()
    for data in (ckpt / shards.data_name(step, r) for step in (5, 10) for r in (0, 1)):
        damaged = bytearray(data.read_bytes())
        damaged[-1] ^= 1
        data.write_bytes(bytes(damaged))
    run, _ = _train(launch, tmp_path, "damaged", "--max-restarts", "1", extra=["--shim",
                                                                             "--async-ckpt"])
    assert run.finish() == 1, run.output
    assert re.search(r"job failed: .*CheckpointError: committed steps \[5, 10\] in \S+ "
                     r"exist but none could be restored", run.output), run.output
    assert "step 1 loss" not in run.output, "it trained from step 0"


@pytest.mark.parametrize("kind", ["exception", "segv", "exit"])
def test_failed_rank_is_restarted(tmp_path, launch, kind):
    fault = {"TRAIN_FAULT_RANK": "0", "TRAIN_FAULT_STEP": "7", "TRAIN_FAULT_KIND": kind}
    run, out = _train(launch, tmp_path, kind, "--log-dir", str(tmp_path / "logs"), env=fault)
    assert run.finish() == 0, run.output
    assert json.loads(out.read_text())["restart_count"] == 1
    assert "rank 0 " in run.output and "rank restart 1/3" in run.output
    (events_file,) = (tmp_path / "logs").glob("*/events.jsonl")
    events = {e["event"]: e for e in map(json.loads, events_file.read_text().splitlines())}
    assert events["rank_failed"]["rank"] == 0
    assert events["recovering"]["cause"].startswith("rank 0 ")
    recovered = events["recovered"]
    assert recovered["policy"] == "rank" and recovered["restart_count"] == 1
    assert list(recovered["phases"]) == ["decide", "stop", "backoff", "rendezvous", "spawn"]
    assert recovered["seconds"] == pytest.approx(sum(recovered["phases"].values()), abs=0.01)
    assert events["job_finished"]["exit_code"] == 0


def test_exception_writes_error_file_and_root_cause(tmp_path, launch):
    fault = {"TRAIN_FAULT_RANK": "1", "TRAIN_FAULT_STEP": "3", "TRAIN_FAULT_KIND": "exception"}
    run, _ = _train(launch, tmp_path, "boom", "--max-restarts", "0", "--log-dir",
                    str(tmp_path / "logs"), env=fault)
    assert run.finish() == 1, run.output
    assert "root cause: rank 1 (local rank 1" in run.output
    assert "RuntimeError: injected fault at step 3" in run.output
    assert "Traceback" in run.output
    (error_file,) = (tmp_path / "logs").glob("*/attempt_0/1/error.json")
    recorded = json.loads(error_file.read_text())["message"]
    assert "injected fault" in recorded["message"]


def test_restart_budget_exhausted_exits_1(tmp_path, launch):
    script = _write(tmp_path / "always_fails.py", """
        import os, sys
        sys.exit(7 if os.environ["RANK"] == "1" else 0)
    """)
    run = launch("--standalone", "--nproc-per-node", "2", "--max-restarts", "2",
                 "--restart-backoff", "0.05", "--log-dir", str(tmp_path / "logs"), script)
    assert run.finish() == 1, run.output
    assert "restart budget spent (2/2)" in run.output
    assert "root cause: rank 1" in run.output and "exited with code 7" in run.output
    attempts = sorted(p.name for p in (tmp_path / "logs").glob("*/attempt_*"))
    assert attempts == ["attempt_0", "attempt_1", "attempt_2"]


SLEEPER = """
    import os, signal, subprocess, sys, time
    child = subprocess.Popen(["sleep", "1000"])
    def on_term(signum, frame):
        print("got", signal.Signals(signum).name, flush=True)
        if os.environ.get("IGNORE_TERM"):
            return
        child.kill()
        sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
    print("ready", os.environ["RANK"], flush=True)
    while True:
        time.sleep(1)
"""


def _ready(run, n=2):
    for _ in range(n):
        run.wait_for(r"\[rank\d\]: ready \d")


def test_sigterm_is_forwarded_and_agent_exits_128_plus_signal(tmp_path, launch):
    run = launch("--standalone", "--nproc-per-node", "2", _write(tmp_path / "s.py", SLEEPER))
    _ready(run)
    run.proc.send_signal(signal.SIGTERM)
    assert run.finish() == 128 + signal.SIGTERM
    assert run.output.count("got SIGTERM") == 3  # the agent's event and both ranks


def test_grace_period_is_honoured_then_sigkill(tmp_path, launch, launcher_env):
    run = launch("--standalone", "--nproc-per-node", "2", "--grace-period", "1.5",
                 _write(tmp_path / "s.py", SLEEPER), env={"IGNORE_TERM": "1"})
    _ready(run)
    run.proc.send_signal(signal.SIGTERM)
    run.wait_for(r"\[rank\d\]: got SIGTERM")
    run.wait_for(r"grace period over: SIGKILL")
    assert run.finish(timeout=30) == 128 + signal.SIGTERM
    assert wait_no_tagged(launcher_env["FTLAUNCH_TEST_TAG"]) == []


def test_agent_sigkill_leaves_no_orphan(tmp_path, launch, launcher_env):
    run = launch("--standalone", "--nproc-per-node", "2", _write(tmp_path / "s.py", SLEEPER))
    _ready(run)
    run.proc.kill()
    run.finish()
    assert wait_no_tagged(launcher_env["FTLAUNCH_TEST_TAG"]) == []  # ranks and their `sleep`s


def test_staging_a_killed_agent_of_the_job_left_on_this_host_is_freed_when_the_job_ends(
        tmp_path, launch):
    """An agent of the job SIGKILLed on this host while the job runs (its node lost, no
    agent started here after it) leaves its staging in /dev/shm: the agent that ends the
    job adopts it (persisting what it staged) and frees it. (Chaos seed 110 before f1771ef:
    a job that failed after a node loss left it.)"""
    script = _write(tmp_path / "leave.py", """
        import os, subprocess
        from pathlib import Path
        mine = Path(os.environ["FTLAUNCH_STAGING"])
        dead = subprocess.Popen(["true"])
        dead.wait()
        left = mine.parent / f"ftlaunch-staging-{dead.pid}-killed"
        left.mkdir()
        (left / ".job").write_text((mine / ".job").read_text())
        (left / "rank_0.0.data").write_bytes(b"staged")
        print("left", left, flush=True)
    """)
    run = launch("--standalone", "--nproc-per-node", "1", script)
    assert run.finish() == 0, run.output
    left = re.search(r"left (\S+)", run.output)
    assert left and not os.path.exists(left.group(1)), run.output


def test_module_mode(tmp_path, launch):
    _write(tmp_path / "hello_mod.py", """
        import os
        print("module rank", os.environ["RANK"], "of", os.environ["WORLD_SIZE"])
    """)
    run = launch("--standalone", "--nproc-per-node", "2", "-m", "hello_mod",
                 env={"PYTHONPATH": str(tmp_path)})
    assert run.finish() == 0, run.output
    assert "[rank1]: module rank 1 of 2" in run.output


def test_no_python_mode(tmp_path, launch):
    script = tmp_path / "hello.sh"
    _write(script, """\
        #!/bin/sh
        echo "shell rank $RANK args $*"
    """)
    script.chmod(0o755)
    run = launch("--standalone", "--nproc-per-node", "2", "--no-python", str(script), "a", "b")
    assert run.finish() == 0, run.output
    assert "[rank0]: shell rank 0 args a b" in run.output


def test_tee_redirect_and_filter(tmp_path, launch):
    script = _write(tmp_path / "talk.py", """
        import os, sys
        print("out from", os.environ["LOCAL_RANK"])
        print("err from", os.environ["LOCAL_RANK"], file=sys.stderr)
    """)
    logs = tmp_path / "logs"
    run = launch("--standalone", "--nproc-per-node", "3", "--log-dir", str(logs),
                 "--tee", "0:3", "--redirects", "1:3", "--local-ranks-filter", "0,1", script)
    assert run.finish() == 0, run.output
    (run_dir,) = logs.iterdir()
    attempt = run_dir / "attempt_0"
    assert (attempt / "0" / "stdout.log").read_text() == "out from 0\n"  # tee: file and console
    assert "[rank0]: out from 0" in run.output
    assert (attempt / "1" / "stderr.log").read_text() == "err from 1\n"  # redirect: file only
    assert "out from 1" not in run.output
    assert "from 2" not in run.output  # filtered from the console
    assert (run_dir / "events.jsonl").exists()


def test_master_port_in_use_is_a_usage_error(tmp_path, launch):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        run = launch("--standalone", "--master-port", str(port), _write(tmp_path / "x.py", "pass\n"))
        assert run.finish() == 2
    (line,) = [ln for ln in run.lines if "error" in ln]
    assert line.startswith("ftlaunch: error: cannot serve torch's store") and str(port) in line
