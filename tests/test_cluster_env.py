"""What SLURM and Kubernetes tell a process, read as launch settings (pure, no cluster),
and their rank among the other sources (``ftlaunch --dry-run``)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT
from hypothesis import given, settings
from hypothesis import strategies as st

from launcher import UsageError
from launcher.cli import resolve
from launcher.cluster_env import detect, expand_nodelist, first_pod

SRUN = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_NNODES": "4",
        "SLURM_STEP_NUM_NODES": "4", "SLURM_NODEID": "2", "SLURM_NTASKS": "4",
        "SLURM_JOB_NODELIST": "gpu-[01-03,07]", "SLURM_STEP_NODELIST": "gpu-[01-03,07]"}


@pytest.mark.parametrize("text, hosts", [
    ("n1", ["n1"]),
    ("n[1-3]", ["n1", "n2", "n3"]),
    ("gpu-[01-03,07]", ["gpu-01", "gpu-02", "gpu-03", "gpu-07"]),
    ("gpu-[098-101]", ["gpu-098", "gpu-099", "gpu-100", "gpu-101"]),
    ("a[1-2],b7,c[09-10]", ["a1", "a2", "b7", "c09", "c10"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
])
def test_slurm_node_lists_expand_as_slurm_does(text, hosts):
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize("text", ["n[1-", "n[3-1]", "n[a-b]", ""])
def test_a_malformed_node_list_is_a_clear_error(text):
    with pytest.raises(UsageError, match="SLURM node list"):
        expand_nodelist(text)


_groups = st.lists(st.tuples(st.integers(0, 120), st.integers(0, 5), st.integers(1, 3)),
                   min_size=1, max_size=4)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["n", "gpu-", "r1-x"]), _groups), min_size=1,
                max_size=3))
def test_node_list_expansion_property(names):
    """Compress host names as SLURM writes them (runs of numbers of one width in one
    bracket group), then expand: the same hosts, in the same order."""
    parts, expected = [], []
    for prefix, runs in names:
        items = []
        for start, length, width in runs:
            numbers = [str(i).zfill(width) for i in range(start, start + length + 1)]
            if len({len(n) for n in numbers}) > 1:  # a run crossing a width: write singly
                items += numbers
            else:
                items.append(numbers[0] if length == 0 else f"{numbers[0]}-{numbers[-1]}")
            expected += [prefix + n for n in numbers]
        parts.append(f"{prefix}[{','.join(items)}]")
    assert expand_nodelist(",".join(parts)) == expected


def test_srun_gives_nodes_node_rank_first_host_and_run_id():
    cluster = detect({**SRUN, "SLURM_RESTART_COUNT": "2", "SLURM_GPUS_ON_NODE": "8"})
    got = {name: s.value for name, s in cluster.settings.items()}
    assert cluster.scheduler == "slurm" and cluster.restart_count == 2
    assert got == {"nnodes": "4", "node_rank": 2, "master_addr": "gpu-01",
                   "master_port": 29400 + 4242 % 1000, "rdzv_id": "4242",
                   "nproc_per_node": "8"}


def test_srun_with_several_tasks_per_node_is_refused():
    with pytest.raises(UsageError, match="--ntasks-per-node=1"):
        detect({**SRUN, "SLURM_NTASKS": "8"})


def test_a_batch_script_outside_srun_is_not_taken_for_a_step():
    assert detect({k: v for k, v in SRUN.items() if k != "SLURM_STEP_ID"}).scheduler == ""


def test_pytorchjob_spelling_and_master_addr():
    cluster = detect({"KUBERNETES_SERVICE_HOST": "10.0.0.1", "PET_N_PROC_PER_NODE": "8",
                      "MASTER_ADDR": "train-worker-0", "MASTER_PORT": "23456"})
    assert cluster.scheduler == "kubernetes"
    assert cluster.settings["nproc_per_node"].value == "8"
    assert cluster.settings["nproc_per_node"].env_level  # a PET_* variable: env's rank
    assert (cluster.settings["master_addr"].value, cluster.settings["master_port"].value) == \
        ("train-worker-0", 23456)


def test_kubeflow_trainer_v2_pod_resolves_from_its_pet_variables(tmp_path, monkeypatch):
    """Trainer v2 (TrainJob) sets torchrun's own PET_* names, pod 0's name as the master and
    the node rank from the completion index: read at the environment's rank, as torchrun."""
    script = tmp_path / "train.py"
    script.write_text("")
    env = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "JOB_COMPLETION_INDEX": "1",
           "PET_NNODES": "2", "PET_NPROC_PER_NODE": "8", "PET_NODE_RANK": "1",
           "PET_MASTER_ADDR": "llama-node-0-0.llama", "PET_MASTER_PORT": "29500"}
    for name, value in env.items():  # click reads PET_* from the process environment
        monkeypatch.setenv(name, value)
    r = resolve([str(script)], env)
    assert (r.config.nnodes, r.config.nproc_per_node, r.config.node_rank) == ("2", "8", 1)
    assert (r.config.master_addr, r.config.master_port) == ("llama-node-0-0.llama", 29500)
    assert r.sources["node_rank"] == "env PET_NODE_RANK"
    assert r.sources["master_addr"] == "env PET_MASTER_ADDR"


def test_jobset_pod_finds_pod_zero_and_its_restart_attempt():
    cluster = detect({"JOB_COMPLETION_INDEX": "3", "JOBSET_NAME": "llama",
                      "JOBSET_REPLICATED_JOB": "nodes", "JOBSET_RESTART_ATTEMPT": "1"})
    got = {name: s.value for name, s in cluster.settings.items()}
    assert got == {"node_rank": 3, "master_addr": "llama-nodes-0-0.llama",
                   "master_port": 29400, "rdzv_id": "llama"}
    assert cluster.restart_count == 1


def test_indexed_job_pod_zero_under_the_headless_service():
    assert first_pod("train-5", "train-5.train-svc.ns.svc.cluster.local", "5") == \
        "train-0.train-svc.ns.svc.cluster.local"
    assert first_pod("train-5", "train-5", "5") == "train-0"
    assert first_pod("other", "other", "5") is None
    cluster = detect({"JOB_COMPLETION_INDEX": "5"}, "train-5", "train-5.svc1.ns.svc")
    assert cluster.settings["master_addr"].value == "train-0.svc1.ns.svc"
    assert cluster.settings["rdzv_id"].value == "train"


def test_flags_env_and_file_outrank_the_cluster(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    config = tmp_path / "c.yaml"
    config.write_text("master_port: 5555\n")
    r = resolve(["--config", str(config), "--nnodes", "2:4", str(script)], SRUN)
    assert r.sources["nnodes"] == "flag" and r.config.nnodes == "2:4"
    assert r.sources["master_port"] == f"file {config}" and r.config.master_port == 5555
    assert r.sources["node_rank"] == "slurm SLURM_NODEID" and r.config.node_rank == 2
    assert r.sources["max_restarts"] == "default"


def test_standalone_ignores_the_cluster(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    r = resolve(["--standalone", str(script)], SRUN)
    assert r.cluster.scheduler == "" and r.config.nnodes == "1:1"


def test_dry_run_prints_the_resolved_launch_and_starts_nothing(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), **SRUN, "PET_MAX_RESTARTS": "7"}
    out = subprocess.run([sys.executable, "-m", "launcher", "--dry-run", "--nproc-per-node", "2",
                          "train.py", "--lr", "1"], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["scheduler"] == "slurm"
    assert {k: report["torchrun"][k] for k in ("nnodes", "nproc_per_node", "node_rank",
                                           "rdzv_endpoint", "rdzv_id", "max_restarts")} == {
        "nnodes": "4", "nproc_per_node": "2", "node_rank": 2, "rdzv_endpoint": "gpu-01:29642",
        "rdzv_id": "4242", "max_restarts": 7}
    assert report["settings"]["max_restarts"]["source"] == "env PET_MAX_RESTARTS"
    assert report["settings"]["nproc_per_node"]["source"] == "flag"
    assert report["script_args"] == ["--lr", "1"]
    assert not list(tmp_path.iterdir())  # no log dir, nothing started
