"""ftlaunch under a real SLURM (slurmctld and two slurmd on this machine, ``slurm_cluster``):
``sbatch`` a 2-node job whose batch script runs ``srun ftlaunch ...`` with no rendezvous
flags at all, and what the scheduler sees when a rank, a node or the whole job is lost or
preempted. Real daemons, real steps, real agents and ranks; nothing mocked.

The batch script requeues on ftlaunch's exit code as ``configs/slurm/train.sbatch`` does:
0 done, 2 usage error, 3 do not requeue -> exit; 1 (failed after restarts) or 128+N (stopped
by a signal) -> ``scontrol requeue``. A requeued job waits PENDING (reason BeginTime) for
SLURM's credential lifetime before it runs again: 120 s by default, 5 s in this cluster
(``AuthInfo=cred_expire=5``; moving the job's StartTime to now instead makes the relaunch
fail with "Job credential revoked" on the node that ran it).
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
import uuid
from pathlib import Path

import psutil
import pytest
from conftest import CLUSTER_VARS, ROOT, SCRIPTS, TAG_VAR, wait_no_tagged
from slurm_cluster import FINAL_STATES, SlurmCluster, SlurmError, missing

TRAIN = SCRIPTS / "train_gpt.py"
VENV_BIN = ROOT / ".venv" / "bin"
JOB_TIMEOUT = 120  # hang guard for one run of a job; a run takes seconds here

# The tests' copy of configs/slurm/train.sbatch's exit-code mapping (keep them in step).
BATCH = """#!/bin/bash
R=${{SLURM_RESTART_COUNT:-0}}
echo "batch job $SLURM_JOB_ID restart $R"
export FTLAUNCH_SECRET=slurm-test-{tag}
export PYTHONPATH={root}
export PATH={venv_bin}:$PATH
D={out_dir}
{dry_run}
srun --ntasks-per-node=1 --kill-on-bad-exit=0 --output="$D/run$R-node%t.log" \\
    ftlaunch --nproc-per-node 1 --node-timeout 2 --heartbeat-interval 0.2 \\
    --rdzv-conf join_timeout=5 \\
    {train} {train_args}
rc=$?
echo "srun exit $rc"
case $rc in
  0|2|3) exit $rc ;;  # done, usage error, do not requeue
  *) scontrol requeue "$SLURM_JOB_ID"; exit $rc ;;  # failed after restarts, or a signal
esac
"""

DRY_RUN = ('srun --ntasks-per-node=1 --output="$D/dry-node%t.json" '
           'ftlaunch --dry-run --nproc-per-node 1 {train}')


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """One cluster for the module: 2 fake nodes, requeued jobs eligible again after 5 s."""
    why = missing()
    if why:
        pytest.skip(why)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"), cred_expire=5)
    try:
        cluster.start()
    except SlurmError as e:
        pytest.skip(f"SLURM is installed but would not start here: {e}")
    yield cluster
    leftovers = cluster.stop()
    assert not leftovers, f"SLURM processes left behind: {leftovers}"


def _job_env() -> dict[str, str]:
    """A job's environment (sbatch exports the submitter's): this machine's, with nothing
    from an enclosing scheduler or launch, and a tag that finds every process it starts."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith((*CLUSTER_VARS, "FTLAUNCH_", "TRAIN_", "SBATCH_", "SRUN_"))}
    env[TAG_VAR] = uuid.uuid4().hex
    env["FTLAUNCH_STRICT"] = "1"  # an agent's illegal phase transition is an error
    return env


class Job:
    """One sbatch job of this module's batch script, its files under ``out``."""

    def __init__(self, slurm: SlurmCluster, out: Path, train_args: list[str], *,
                 dry_run: bool = False, env: dict[str, str] | None = None):
        self.slurm, self.out = slurm, out
        self.env = {**_job_env(), **(env or {})}
        script = out / "job.sbatch"
        script.write_text(BATCH.format(
            tag=self.env[TAG_VAR], root=ROOT, venv_bin=VENV_BIN, out_dir=out, train=TRAIN,
            train_args=" ".join(train_args),
            dry_run=DRY_RUN.format(train=TRAIN) if dry_run else ""))
        self.id = slurm.sbatch(script, "--nodes=2", "--ntasks-per-node=1", "--requeue",
                               "--open-mode=append", f"--output={out}/batch.log",
                               f"--chdir={out}", env=self.env)

    def log(self, name: str) -> str:
        path = self.out / name
        return path.read_text(errors="replace") if path.exists() else ""

    def logs(self) -> str:
        """Every log of the job (batch script, each run's nodes) for a failure message."""
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')}"
                         for p in sorted(self.out.glob("*.log")))

    def run_logs(self, run: int) -> str:
        return self.log(f"run{run}-node0.log") + self.log(f"run{run}-node1.log")

    def wait_line(self, name: str, pattern: str, timeout: float = JOB_TIMEOUT) -> re.Match:
        """Block until a line of log ``name`` (written by a task) matches ``pattern``."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        for polls in range(1 << 30):
            match = regex.search(self.log(name))
            if match:
                return match
            if time.monotonic() > deadline or polls % 20 == 19 and \
                    self.slurm.job(self.id).get("JobState") in FINAL_STATES:
                break
            time.sleep(0.05)  # a file other processes write: no event to wait on
        pytest.fail(f"no line matching {pattern!r} in {name}:\n{self.logs()}")

    def wait_done(self) -> dict[str, str]:
        return self.slurm.wait_done(self.id, JOB_TIMEOUT)

    def node_processes(self, node: int) -> list[psutil.Process]:
        """A fake node's share of the job's step: its agent, rank template, ranks."""
        found = []
        for p in psutil.process_iter():
            try:
                env = p.environ()
                if env.get(TAG_VAR) == self.env[TAG_VAR] and "SLURM_STEP_ID" in env \
                        and env.get("SLURM_NODEID") == str(node):
                    found.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return found

    def assert_no_orphans(self) -> None:
        leftovers = wait_no_tagged(self.env[TAG_VAR])
        for p in leftovers:
            p.kill()
        assert not leftovers, f"processes of job {self.id} left behind: {leftovers}"


@pytest.fixture
def job(slurm, tmp_path):
    """Submit a job (``job(train_args, ...)``); at teardown it is cancelled if still there,
    and none of its processes may be left."""
    jobs: list[Job] = []

    def _submit(train_args: list[str], **kw) -> Job:
        jobs.append(Job(slurm, tmp_path, train_args, **kw))
        return jobs[-1]

    yield _submit
    for j in jobs:
        if slurm.job(j.id).get("JobState") not in FINAL_STATES:
            slurm.scancel(str(j.id))
        j.assert_no_orphans()


def _train(out: Path, steps: int, step_time: float = 0.02, log_every: int = 5) -> list[str]:
    return ["--steps", str(steps), "--step-time", str(step_time), "--ckpt-every", "10",
            "--log-every", str(log_every), "--shim", "--async-ckpt",
            "--ckpt-dir", str(out / "ckpt"), "--out", str(out / "out.json")]


def _committed_steps(ckpt_dir: Path, world: int = 2) -> list[int]:
    """Steps every rank of a ``world``-rank job made durable (each rank's meta is in)."""
    return sorted(int(d.name.split("_")[1]) for d in ckpt_dir.glob("step_*")
                  if all((d / f"rank_{r}.meta").exists() for r in range(world)))


def test_sbatch_two_nodes_form_one_job_from_slurms_variables(job, tmp_path):
    """No rendezvous flag anywhere: each agent reads its node rank, the node count and the
    coordinator's host from the step; the two form one job of world size 2."""
    j = job(_train(tmp_path, steps=20), dry_run=True)
    record = j.wait_done()
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", \
        f"{record}\n{j.logs()}"
    nodes = [j.log("run0-node0.log"), j.log("run0-node1.log")]
    assert all("started 1 ranks (world size 2" in out for out in nodes), j.logs()
    assert "start rank 0 world 2" in nodes[0] and "start rank 1 world 2" in nodes[1], j.logs()
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["final_step"] == 20 and result["restart_count"] == 0, result

    port = 29400 + j.id % 1000
    for node in (0, 1):
        report = json.loads(j.log(f"dry-node{node}.json"))
        settings = {k: (v["value"], v["source"]) for k, v in report["settings"].items()}
        assert report["scheduler"] == "slurm" and report["scheduler_restart_count"] == 0
        assert settings["nnodes"] == ("2", "slurm SLURM_STEP_NUM_NODES")
        assert settings["node_rank"] == (node, "slurm SLURM_NODEID")
        assert settings["master_addr"] == ("ftl-n1", "slurm SLURM_STEP_NODELIST (first host)")
        assert settings["master_port"] == (port, "slurm SLURM_JOB_ID (29400 + id % 1000)")
        assert settings["rdzv_id"] == (str(j.id), "slurm SLURM_JOB_ID")
        assert report["torchrun"]["rdzv_endpoint"] == f"ftl-n1:{port}"


def test_a_killed_rank_is_recovered_in_place_and_slurm_never_knows(job, tmp_path):
    j = job(_train(tmp_path, steps=30), env={
        "TRAIN_FAULT_RANK": "1", "TRAIN_FAULT_STEP": "12", "TRAIN_FAULT_KIND": "kill"})
    record = j.wait_done()
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", \
        f"{record}\n{j.logs()}"
    assert record["Restarts"] == "0", record  # no requeue: SLURM_RESTART_COUNT never set
    assert f"batch job {j.id} restart 0" in j.log("batch.log") and \
        "srun exit 0" in j.log("batch.log"), j.logs()
    assert "injecting fault kill rank 1 step 12" in j.run_logs(0), j.logs()
    assert "was killed by SIGKILL -> rank restart 1/3" in j.run_logs(0), j.logs()
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["final_step"] == 30 and result["restart_count"] == 1, result
    assert not list(tmp_path.glob("run1-*")), "the batch script ran twice"


def test_a_lost_node_requeues_the_job_which_resumes_from_its_checkpoint(slurm, job, tmp_path):
    """Node 1's agent and ranks SIGKILLed at once (the node is gone): the survivor waits
    join_timeout (5 s) for a replacement, then exits 1; the batch script requeues on it, the job runs again with
    SLURM_RESTART_COUNT=1 and resumes from the newest committed checkpoint."""
    j = job(_train(tmp_path, steps=40, step_time=0.05))
    j.wait_line("run0-node1.log", r"step 15 ")
    committed = _committed_steps(tmp_path / "ckpt")
    assert committed, f"no checkpoint committed by step 15\n{j.logs()}"
    victims = j.node_processes(1)
    assert victims, "found no process of node 1"
    for p in victims:  # all at once: nothing on the node gets to react
        p.send_signal(signal.SIGKILL)
    slurm.wait_job(j.id, lambda f: f.get("Restarts") == "1" and f.get("JobState") == "PENDING",
                   JOB_TIMEOUT, "requeued")
    first = int(re.search(r"srun exit (\d+)", j.log("batch.log"))[1])
    assert first == 1 or first >= 128, j.logs()  # what the batch script requeues on
    record = j.wait_done()
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", \
        f"{record}\n{j.logs()}"
    assert record["Restarts"] == "1", record
    assert f"batch job {j.id} restart 1" in j.log("batch.log"), j.logs()
    resumed = [int(n) for n in re.findall(r"start rank \d world 2 pid \d+ resume_from (\d+)",
                                          j.run_logs(1))]
    assert len(resumed) == 2 and min(resumed) >= committed[-1], (committed, j.logs())
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["final_step"] == 40 and result["resumed_from"] >= committed[-1], result


@pytest.fixture(scope="module")
def preempted(slurm, tmp_path_factory):
    """A job whose steps get ``scancel --signal=TERM`` mid-training (what a preemption or
    the time limit sends); requeued on its exit code, then cancelled for good."""
    out = tmp_path_factory.mktemp("preempted")
    j = Job(slurm, out, _train(out, steps=400, step_time=0.05, log_every=1))
    try:
        for node in (0, 1):  # just past a multiple of 10: the next preemption check is ahead
            j.wait_line(f"run0-node{node}.log", r"step 12 ")
        slurm.scancel("--signal=TERM", str(j.id))
        requeued = slurm.wait_job(j.id, lambda f: f.get("Restarts") == "1", JOB_TIMEOUT,
                                  "requeued")
    finally:
        slurm.scancel(str(j.id))
    slurm.wait_done(j.id, JOB_TIMEOUT)
    j.assert_no_orphans()
    return j, requeued


def test_scancel_term_ends_ftlaunch_with_143_and_the_job_is_requeued(preempted):
    j, requeued = preempted
    batch = j.log("batch.log")
    for task in (0, 1):  # srun's report of each node's ftlaunch
        assert f"task {task}: Exited with exit code 143" in batch, j.logs()
    assert "srun exit 143" in batch and requeued["Restarts"] == "1", j.logs()
    assert "got SIGTERM: forwarded to ranks" in j.run_logs(0), j.logs()


def test_scancel_term_lets_every_rank_commit_a_preemption_checkpoint(preempted):
    j, _ = preempted
    logs = j.run_logs(0)
    steps = {int(s) for s in re.findall(r"preempted at step (\d+) rank \d", logs)}
    assert len(steps) == 1, f"no preemption seen by the ranks:\n{j.logs()}"
    assert steps.pop() in _committed_steps(j.out / "ckpt"), j.logs()
