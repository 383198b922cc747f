"""What we ship in configs/ for Kubernetes (EKS) and SLURM, checked offline.

- Manifests: core kinds (and the Job / pod templates inside the CRDs) against Kubernetes'
  own OpenAPI schemas (PyPI kubernetes-validate, strict), the CRDs against our schemas of
  their fields (configs/schemas), and the rules the API server and the controllers enforce
  that no schema says (podFailurePolicy needs restartPolicy Never, ...).
- The env a manifest gives a pod is what our detection reads: each pod is rendered as its
  controller and the kubelet would (the controller's labels, annotations, hostname and env;
  downward-API values, secrets, ``$(VAR)`` expansion: tests/k8s_render.py, which
  test_pods.py runs real pods from), then fed to ``cluster_env.detect`` and ``cli.resolve``.
- The SLURM batch script runs under stand-ins for srun and scontrol: its srun line, its
  exit-code mapping and its USR1 trap, for real.
- The Dockerfile, parsed.
"""

from __future__ import annotations

import configparser
import copy
import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
from conftest import ROOT
from k8s_render import (
    CONFIGS,
    NAMESPACE,
    SECRETS,
    agent_container,
    container_argv,
    container_env,
    expand,
    hostname_and_fqdn,
    indexed_job_pod,
    jobset_pod,
    load,
    one,
    pod_failure_action,
    pod_spec,
    pytorchjob_pod,
)

from launcher import cluster_env, doctor, exit_codes
from launcher.cli import Resolved, dry_run_report, resolve

SBATCH = CONFIGS / "slurm" / "train.sbatch"
K8S_VERSION = "1.33.0"
GIB = 1024 ** 3


# --- a pod's ftlaunch command line through detection -------------------------------------------

def resolve_in_pod(pod: dict, container: str, monkeypatch, workdir: Path) -> tuple[
        Resolved, cluster_env.Cluster, dict[str, str], list[str]]:
    """Run the pod's ftlaunch command line through detection and resolve(), with the pod's
    environment, hostname and FQDN (click reads PET_*/FTLAUNCH_* from os.environ)."""
    env = container_env(pod, container)
    argv = container_argv(pod, container, env)
    assert argv[0] == "ftlaunch"
    hostname, fqdn = hostname_and_fqdn(pod)
    cluster = cluster_env.detect(env, hostname, fqdn)
    with monkeypatch.context() as m:
        for name in list(os.environ):
            if name.startswith(("PET_", "FTLAUNCH_")):
                m.delenv(name)
        for name, value in env.items():
            m.setenv(name, value)
        m.setattr(socket, "gethostname", lambda: hostname)
        m.setattr(socket, "getfqdn", lambda *_: fqdn)
        m.chdir(workdir)
        resolved = resolve(argv[1:], env)
    return resolved, cluster, env, argv


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """The container's working directory: the training script is there (/workspace)."""
    (tmp_path / "train.py").write_text("")
    return tmp_path


def _grace_margin_ok(doc: dict, r: Resolved) -> None:
    spec = pod_spec(doc)
    assert r.config.grace_period + 30 <= spec["terminationGracePeriodSeconds"], \
        "--grace-period must end (and the agent exit) before the kubelet's SIGKILL"
    # The coordinator's port is one the agent's container declares.
    endpoint = r.config.coordinator_endpoint()
    assert endpoint is not None
    assert endpoint[1] in {p["containerPort"] for p in agent_container(spec)["ports"]}


# --- the env a manifest gives a pod is what our detection reads -------------------------------

def check_jobset_pods(js: dict, monkeypatch, workdir: Path, restarts: int = 0) -> None:
    rjob = js["spec"]["replicatedJobs"][0]
    n = rjob["template"]["spec"]["parallelism"]
    assert rjob["template"]["spec"]["completions"] == n and rjob.get("replicas", 1) == 1
    pod0 = jobset_pod(js, rjob["name"], 0, 0, restarts)
    host0, _ = hostname_and_fqdn(pod0)
    pod0_dns = f"{host0}.{pod0['spec']['subdomain']}"  # what the pods' DNS search resolves
    container = agent_container(pod_spec(js))["name"]
    ranks = []
    for i in range(n):
        pod = jobset_pod(js, rjob["name"], 0, i, restarts)
        r, cluster, env, _ = resolve_in_pod(pod, container, monkeypatch, workdir)
        assert cluster.scheduler == "kubernetes" and cluster.restart_count == restarts
        assert r.cluster.restart_count == restarts
        assert (r.config.nnodes, r.sources["nnodes"]) == ("3:4", "env PET_NNODES")
        assert (r.config.node_rank, r.sources["node_rank"]) == \
            (i, "kubernetes JOB_COMPLETION_INDEX")
        assert r.config.coordinator_endpoint() == (pod0_dns, 29400), \
            f"pod {i} looks for the coordinator elsewhere than pod 0 ({pod0_dns})"
        report = dry_run_report(r)
        assert report["torchrun"]["rdzv_endpoint"] == f"{pod0_dns}:29400"
        assert report["scheduler"] == "kubernetes"
        assert (r.config.rdzv_id, r.sources["rdzv_id"]) == \
            (js["metadata"]["name"], "kubernetes JOBSET_NAME")
        assert (r.config.nproc_per_node, r.sources["nproc_per_node"]) == ("8", "flag")
        # On the shared FSx volume, a directory of each pod's own (no two agents' files meet).
        assert r.config.log_dir == f"/fsx/ftlaunch-logs/{js['metadata']['name']}/" \
            f"{pod['metadata']['name']}"
        assert f"--ckpt-dir=/fsx/checkpoints/{js['metadata']['name']}" in r.script_args
        assert env["FTLAUNCH_SECRET"] == SECRETS[("ftlaunch-secret", "secret")]
        _grace_margin_ok(js, r)
        ranks.append(r.config.node_rank)
    assert sorted(ranks) == list(range(n))


@pytest.mark.parametrize("restarts", [0, 2])
def test_jobset_pods_resolve_to_one_job_with_pod_zero_as_coordinator(monkeypatch, workdir,
                                                                     restarts):
    check_jobset_pods(one("jobset.yaml", "JobSet"), monkeypatch, workdir, restarts)


def test_jobset_with_a_subdomain_needs_jobset_subdomain_in_the_env(monkeypatch, workdir):
    """No annotation carries network.subdomain to the pod: without JOBSET_SUBDOMAIN the
    agents would dial <pod0>.<jobset name>, a name nothing answers."""
    js = one("jobset.yaml", "JobSet")
    js["spec"]["network"]["subdomain"] = "fsdp-net"
    with pytest.raises(AssertionError, match="coordinator elsewhere"):
        check_jobset_pods(js, monkeypatch, workdir)
    agent_container(pod_spec(js))["env"].append({"name": "JOBSET_SUBDOMAIN",
                                                 "value": "fsdp-net"})
    check_jobset_pods(js, monkeypatch, workdir)


def test_a_misspelt_downward_api_key_is_caught(monkeypatch, workdir):
    """A fieldRef to an annotation the controller does not set renders as "": detection
    then finds no JobSet, and the pods would not agree on a coordinator."""
    js = one("jobset.yaml", "JobSet")
    for var in agent_container(pod_spec(js))["env"]:
        if var["name"] == "JOBSET_NAME":
            var["valueFrom"]["fieldRef"]["fieldPath"] = \
                "metadata.annotations['jobset.sigs.k8s.io/jobset']"
    with pytest.raises(AssertionError):
        check_jobset_pods(js, monkeypatch, workdir)


def test_indexed_job_pods_find_pod_zero_under_the_headless_service(monkeypatch, workdir):
    service, job = one("indexed-job.yaml", "Service"), one("indexed-job.yaml", "Job")
    name, n = job["metadata"]["name"], job["spec"]["completions"]
    assert job["spec"]["parallelism"] == n
    pod0 = indexed_job_pod(name, job["spec"], 0)
    _, fqdn0 = hostname_and_fqdn(pod0)
    assert fqdn0 == f"{name}-0.{service['metadata']['name']}.{NAMESPACE}.svc.cluster.local"
    # The Service selects the Job's pods and publishes them before they are ready.
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"].items() <= pod0["metadata"]["labels"].items()
    assert pod0["spec"]["subdomain"] == service["metadata"]["name"]
    container = agent_container(pod_spec(job))["name"]
    for i in range(n):
        pod = indexed_job_pod(name, job["spec"], i)
        r, cluster, env, _ = resolve_in_pod(pod, container, monkeypatch, workdir)
        assert env["JOB_COMPLETION_INDEX"] == str(i)
        assert cluster.scheduler == "kubernetes"
        assert (r.config.nnodes, r.sources["nnodes"]) == ("3:4", "env PET_NNODES")
        assert (r.config.node_rank, r.sources["node_rank"]) == \
            (i, "kubernetes JOB_COMPLETION_INDEX")
        assert r.config.coordinator_endpoint() == (fqdn0, 29400)
        assert dry_run_report(r)["torchrun"]["rdzv_endpoint"] == f"{fqdn0}:29400"
        assert r.config.rdzv_id == name
        assert r.config.nproc_per_node == "8"
        _grace_margin_ok(job, r)
    assert {p["port"] for p in service["spec"]["ports"]} == {29400}


def test_pytorchjob_pods_read_the_operators_torchrun_env(monkeypatch, workdir):
    pj = one("pytorchjob.yaml", "PyTorchJob")
    name = pj["metadata"]["name"]
    workers = pj["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"]
    pod0_service = pytorchjob_pod(pj, "Worker", 0)["metadata"]["name"]  # pod 0's own Service
    endpoints = set()
    for i in range(workers):
        pod = pytorchjob_pod(pj, "Worker", i)
        r, cluster, env, _ = resolve_in_pod(pod, "pytorch", monkeypatch, workdir)
        assert cluster.scheduler == "kubernetes"
        assert (r.config.nnodes, r.sources["nnodes"]) == ("3:4", "env PET_NNODES")
        assert (r.config.nproc_per_node, r.sources["nproc_per_node"]) == \
            ("8", "env PET_NPROC_PER_NODE")
        assert (r.config.rdzv_backend, r.sources["rdzv_backend"]) == \
            ("c10d", "env PET_RDZV_BACKEND")
        assert r.config.coordinator_endpoint() == (pod0_service, 29400)
        assert (r.config.rdzv_id, r.sources["rdzv_id"]) == (name, "env PET_RDZV_ID")
        assert (r.config.max_restarts, r.sources["max_restarts"]) == \
            (10, "env PET_MAX_RESTARTS")
        assert r.config.rdzv_timeouts()[1] == 900.0  # join_timeout from rdzvConf
        report = dry_run_report(r)
        assert report["torchrun"]["node_rank"] is None  # c10d: the coordinator assigns ranks
        assert report["torchrun"]["rdzv_endpoint"] == f"{pod0_service}:29400"
        assert env["FTLAUNCH_SECRET"] == SECRETS[("ftlaunch-secret", "secret")]
        _grace_margin_ok(pj, r)
        endpoints.add(r.config.coordinator_endpoint())
    assert len(endpoints) == 1


def test_rendering_follows_kubernetes_expansion_rules():
    env = {"A": "x"}
    assert expand("$(A)/$(B)/$$(A)/$A/$$", env) == "x/$(B)/$(A)/$A/$"
    # The Job controller appends JOB_COMPLETION_INDEX after the template's env: a template
    # variable referring to it stays unexpanded (a reason our manifests never do).
    job = copy.deepcopy(one("indexed-job.yaml", "Job"))
    c = agent_container(job["spec"]["template"]["spec"])
    c["env"].append({"name": "RANK_COPY", "value": "$(JOB_COMPLETION_INDEX)"})
    pod = indexed_job_pod(job["metadata"]["name"], job["spec"], 3)
    got = container_env(pod, c["name"])
    assert got["RANK_COPY"] == "$(JOB_COMPLETION_INDEX)" and got["JOB_COMPLETION_INDEX"] == "3"


# --- core kinds against Kubernetes' schemas ----------------------------------------------------

def core_documents() -> list[tuple[str, dict]]:
    """Every core-kind object we ship, and those inside the CRDs as their own kinds."""
    docs = [(f"indexed-job.yaml {d['kind']}", d) for d in load("indexed-job.yaml")]
    js = one("jobset.yaml", "JobSet")
    for rjob in js["spec"]["replicatedJobs"]:
        docs.append((f"jobset.yaml {rjob['name']} Job", {
            "apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": f"{js['metadata']['name']}-{rjob['name']}-0"},
            "spec": rjob["template"]["spec"]}))
        docs.append((f"jobset.yaml {rjob['name']} Pod",
                     jobset_pod(js, rjob["name"], 0, 1)))
    pj = one("pytorchjob.yaml", "PyTorchJob")
    for rtype, rspec in pj["spec"]["pytorchReplicaSpecs"].items():
        docs.append((f"pytorchjob.yaml {rtype} PodTemplate", {
            "apiVersion": "v1", "kind": "PodTemplate",
            "metadata": {"name": f"{pj['metadata']['name']}-{rtype.lower()}"},
            "template": rspec["template"]}))
        docs.append((f"pytorchjob.yaml {rtype} Pod", pytorchjob_pod(pj, rtype, 1)))
    docs.append(("indexed-job.yaml Pod",
                 indexed_job_pod("fsdp-train", one("indexed-job.yaml", "Job")["spec"], 2)))
    return docs


CORE = core_documents()


@pytest.mark.parametrize("doc", [d for _, d in CORE], ids=[w for w, _ in CORE])
def test_core_kinds_are_valid_kubernetes(doc):
    assert kubernetes_validate.validate(doc, K8S_VERSION, strict=True) == "1.33"


def _job() -> dict:
    return copy.deepcopy(one("indexed-job.yaml", "Job"))


@pytest.mark.parametrize("doctor_it", [
    lambda d: d["spec"]["podFailurePolicy"]["rules"][0]["onExitCodes"].update(
        operater="In"),                                               # a typo'd key
    lambda d: d["spec"]["podFailurePolicy"]["rules"][1]["onPodConditions"][0].update(
        status=True),                                                 # YAML's unquoted True
    lambda d: d["spec"]["template"]["spec"]["volumes"][1]["emptyDir"].update(
        sizelimit="112Gi"),
    lambda d: d["spec"].update(parallelism="4"),                      # a string, not a number
    lambda d: d["spec"]["template"]["spec"]["containers"][0].update(
        env=[{"name": "PET_NNODES", "value": 4}]),                    # env values are strings
], ids=["typo-operator", "status-bool", "typo-sizelimit", "parallelism-string", "env-int"])
def test_kubernetes_validate_rejects_a_doctored_job(doctor_it):
    doc = _job()
    doctor_it(doc)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_kubernetes_validate_skips_crds_so_we_keep_schemas():
    for name, kind in (("jobset.yaml", "JobSet"), ("pytorchjob.yaml", "PyTorchJob")):
        with pytest.raises(kubernetes_validate.SchemaNotFoundError):
            kubernetes_validate.validate(one(name, kind), K8S_VERSION, strict=True)


# --- CRDs against our schemas of their fields ---------------------------------------------------

CRDS = {"JobSet": ("jobset.yaml", "jobset.v1alpha2.json"),
        "PyTorchJob": ("pytorchjob.yaml", "pytorchjob.v1.json")}


def crd_validator(kind: str) -> jsonschema.Draft202012Validator:
    schema = json.loads((CONFIGS / "schemas" / CRDS[kind][1]).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


@pytest.mark.parametrize("kind", sorted(CRDS))
def test_crds_match_our_schemas(kind):
    doc = one(CRDS[kind][0], kind)
    errors = [f"{list(e.absolute_path)}: {e.message}"
              for e in crd_validator(kind).iter_errors(doc)]
    assert not errors


def _set(path: list, value: Any):
    def doctor_it(doc: dict) -> None:
        node = doc
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return doctor_it


def _rename(path: list, old: str, new: str):
    def doctor_it(doc: dict) -> None:
        node = doc
        for key in path:
            node = node[key]
        node[new] = node.pop(old)
    return doctor_it


@pytest.mark.parametrize("kind, doctor_it", [
    ("JobSet", _rename(["spec", "replicatedJobs", 0], "replicas", "replica")),
    ("JobSet", _rename(["spec", "network"], "enableDNSHostnames", "enableDnsHostnames")),
    ("JobSet", _set(["spec", "failurePolicy", "rules", 0, "action"], "FailJobset")),
    ("JobSet", _set(["spec", "failurePolicy", "rules", 0, "onJobFailureReasons"],
                    ["PodFailurePolicies"])),
    ("JobSet", _set(["spec", "failurePolicy", "rules", 0, "name"], "fail on 2/3")),
    ("JobSet", _set(["spec", "failurePolicy", "maxRestarts"], "3")),
    ("JobSet", _set(["apiVersion"], "jobset.x-k8s.io/v1")),
    ("PyTorchJob", _rename(["spec", "elasticPolicy"], "minReplicas", "minReplica")),
    ("PyTorchJob", _set(["spec", "elasticPolicy", "rdzvBackend"], "c10")),
    ("PyTorchJob", _set(["spec", "nprocPerNode"], 8)),
    ("PyTorchJob", _rename(["spec", "pytorchReplicaSpecs"], "Worker", "Workers")),
    ("PyTorchJob", _set(["spec", "pytorchReplicaSpecs", "Worker", "restartPolicy"],
                        "Exitcode")),
    ("PyTorchJob", _rename(["spec"], "runPolicy", "runpolicy")),
], ids=["replica", "enableDnsHostnames", "FailJobset", "unknown-reason", "rule-name",
        "maxRestarts-string", "apiVersion", "minReplica", "c10", "nproc-int", "Workers",
        "Exitcode", "runpolicy"])
def test_our_schemas_reject_a_doctored_crd(kind, doctor_it):
    doc = copy.deepcopy(one(CRDS[kind][0], kind))
    doctor_it(doc)
    assert list(crd_validator(kind).iter_errors(doc))


# --- what the API server and controllers enforce beyond the schemas ---------------------------

def jobs() -> list[tuple[str, dict]]:
    return [("indexed-job.yaml", one("indexed-job.yaml", "Job")["spec"]),
            ("jobset.yaml", one("jobset.yaml", "JobSet")["spec"]["replicatedJobs"][0]
             ["template"]["spec"])]


@pytest.mark.parametrize("job", [j for _, j in jobs()], ids=[w for w, _ in jobs()])
def test_jobs_satisfy_the_api_servers_rules(job):
    spec = job["template"]["spec"]
    assert job["completionMode"] == "Indexed"
    assert job["completions"] == job["parallelism"] >= 2
    assert spec["restartPolicy"] == "Never"  # required with a podFailurePolicy
    assert job.get("podReplacementPolicy", "Failed") == "Failed"  # the only one allowed then
    for rule in job["podFailurePolicy"]["rules"]:
        req = rule.get("onExitCodes")
        assert (req is None) != (not rule.get("onPodConditions"))  # exactly one of the two
        if req and req["operator"] == "In":
            assert 0 not in req["values"]
        if req:
            assert req["values"] == sorted(set(req["values"]))


@pytest.mark.parametrize("job", [j for _, j in jobs()], ids=[w for w, _ in jobs()])
def test_pod_failure_policy_acts_on_ftlaunchs_exit_codes(job):
    policy = job["podFailurePolicy"]
    agent = agent_container(job["template"]["spec"])["name"]
    verdict = {code: pod_failure_action(policy, {agent: code})
               for code in (exit_codes.JOB_FAILED, exit_codes.USAGE, exit_codes.DO_NOT_REQUEUE,
                            exit_codes.SIGNAL_BASE + signal.SIGTERM,
                            exit_codes.SIGNAL_BASE + signal.SIGKILL)}
    assert verdict == {1: "Count", 2: "FailJob", 3: "FailJob", 143: "Count", 137: "Count"}
    # Preempted or drained: the pod is re-created without counting, whatever it exited with.
    assert pod_failure_action(policy, {agent: 143}, {"DisruptionTarget"}) == "Ignore"
    # The doctor init container's own verdicts fail the Job the same way.
    assert pod_failure_action(policy, {"doctor": 3}) == "FailJob"
    assert pod_failure_action(policy, {"doctor": 1}) == "Count"


def test_jobset_failure_policy_fails_on_the_jobs_failjob():
    js = one("jobset.yaml", "JobSet")
    rules = js["spec"]["failurePolicy"]["rules"]
    assert len({r["name"] for r in rules}) == len(rules)
    by_reason = {reason: r["action"] for r in rules for reason in r["onJobFailureReasons"]}
    # A Job failed by its podFailurePolicy (exit 2/3) must not be restarted as a whole.
    assert by_reason["PodFailurePolicy"] == "FailJobSet"
    assert by_reason["BackoffLimitExceeded"] == "RestartJobSet"
    assert js["spec"]["failurePolicy"]["maxRestarts"] >= 1
    names = {r["name"] for r in js["spec"]["replicatedJobs"]}
    assert all(set(r.get("targetReplicatedJobs", [])) <= names for r in rules)


def test_pytorchjob_satisfies_the_operator():
    pj = one("pytorchjob.yaml", "PyTorchJob")
    spec, worker = pj["spec"], pj["spec"]["pytorchReplicaSpecs"]["Worker"]
    containers = worker["template"]["spec"]["containers"]
    assert any(c["name"] == "pytorch" for c in containers)  # the webhook requires it
    assert all(c.get("image") for c in containers)
    elastic = spec["elasticPolicy"]
    assert elastic["minReplicas"] <= worker["replicas"] <= elastic["maxReplicas"]
    assert "nProcPerNode" not in elastic  # deprecated, and forbidden with spec.nprocPerNode
    assert "restartPolicy" not in worker["template"]["spec"]  # the operator sets it
    # ExitCode: 1-127 permanent, 128-255 retried (training-operator's IsRetryableExitCode).
    assert worker["restartPolicy"] == "ExitCode"
    for code in (exit_codes.USAGE, exit_codes.DO_NOT_REQUEUE):
        assert code < 128  # never retried
    assert exit_codes.SIGNAL_BASE + signal.SIGTERM >= 128  # a preempted pod is re-created


def _args(container: dict) -> list[str]:
    return container.get("command", [])[1:] + container.get("args", [])


def _flag(args: list[str], flag: str) -> str:
    for i, arg in enumerate(args):
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
        if arg == flag:
            return args[i + 1]
    raise AssertionError(f"{flag} not in {args}")


def _quantity(text: str) -> float:
    units = {"Ki": 1024, "Mi": 1024 ** 2, "Gi": GIB, "Ti": 1024 ** 4, "": 1}
    m = re.fullmatch(r"([0-9.]+)(Ki|Mi|Gi|Ti|)", str(text))
    assert m, f"quantity {text!r}: not rendered by this test"
    return float(m.group(1)) * units[m.group(2)]


@pytest.mark.parametrize("name, kind", [("jobset.yaml", "JobSet"),
                                        ("indexed-job.yaml", "Job"),
                                        ("pytorchjob.yaml", "PyTorchJob")])
def test_pods_have_shm_staging_a_doctor_and_gpus_that_agree(name, kind, monkeypatch):
    spec = pod_spec(one(name, kind))
    agent = agent_container(spec)
    (check,) = [c for c in spec["initContainers"] if c["command"][:2] == ["ftlaunch", "doctor"]]
    assert check["image"] == agent["image"]
    (shm,) = [v for v in spec["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
    for c in (agent, check):  # the doctor must see the /dev/shm the agent will use
        assert {"name": shm["name"], "mountPath": "/dev/shm"} in c["volumeMounts"]
    staging = float(_flag(_args(check), "--staging-gib"))
    replicas = int(_flag(_args(check), "--ckpt-replicas"))
    assert replicas == int(_flag(_args(agent), "--ckpt-replicas"))
    size = _quantity(shm["emptyDir"]["sizeLimit"])

    def statvfs_of_size(total: float):
        blocks = int(total // 4096)
        return lambda path: os.statvfs_result((4096, 4096, blocks, blocks, blocks, 0, 0, 0, 0,
                                               255))
    # The doctor's own check, on a /dev/shm of the sizeLimit: room for the staging.
    monkeypatch.setattr(os, "statvfs", statvfs_of_size(size))
    assert doctor.check_shm(staging, replicas=replicas).status == "ok"
    monkeypatch.setattr(os, "statvfs", statvfs_of_size(2 * staging * (1 + replicas) * GIB - GIB))
    assert doctor.check_shm(staging, replicas=replicas).status == "fail"
    monkeypatch.undo()
    # tmpfs pages count against the container's memory limit.
    assert _quantity(agent["resources"]["limits"]["memory"]) >= size
    gpus = int(agent["resources"]["limits"]["nvidia.com/gpu"])
    assert check["resources"]["limits"]["nvidia.com/gpu"] == gpus
    nproc = _flag(_args(agent), "--nproc-per-node") if kind != "PyTorchJob" \
        else one(name, kind)["spec"]["nprocPerNode"]
    assert int(nproc) == gpus == int(_flag(_args(check), "--nproc"))
    assert spec.get("shareProcessNamespace", False) is False  # ftlaunch stays PID 1
    assert agent["workingDir"] == "/workspace"  # where configs/Dockerfile puts train.py


# --- SLURM ---------------------------------------------------------------------------------------

def test_sbatch_script_parses():
    assert subprocess.run(["bash", "-n", str(SBATCH)]).returncode == 0


def sbatch_options() -> dict[str, str | None]:
    options: dict[str, str | None] = {}
    for line in SBATCH.read_text().splitlines():
        if line.startswith("#SBATCH"):
            for opt in line.split()[1:]:
                key, sep, value = opt.partition("=")
                options[key] = value if sep else None
        elif line.strip() and not line.startswith("#"):
            break  # sbatch reads directives only before the first command
    return options


def test_sbatch_directives():
    o = sbatch_options()
    assert o["--nodes"] == "2" and o["--ntasks-per-node"] == "1"
    assert "--requeue" in o
    assert o["--signal"] == "B:USR1@120"


FAKE_SRUN = r"""#!/bin/bash
# Stand-in for srun: records its argv, then runs the command as one local task.
printf '%s\n' "$@" > "$FAKE_LOG/srun.$(date +%s%N).args"
while [[ $1 == -* ]]; do shift; done
SLURM_STEP_ID=0 SLURM_NODEID=0 SLURMD_NODENAME=gpu-07 "$@"
"""
FAKE_SCONTROL = r"""#!/bin/bash
printf '%s\n' "$*" >> "$FAKE_LOG/scontrol"
"""
FAKE_FTLAUNCH = r"""#!/bin/bash
# Stand-in for the agent: records its secret; exits $FAKE_RC, or on SIGTERM with 143.
printf '%s\n' "$FTLAUNCH_SECRET" >> "$FAKE_LOG/secrets"
if [[ -n ${FAKE_WAIT:-} ]]; then
    trap 'echo TERM >> "$FAKE_LOG/ftlaunch.signals"; exit 143' TERM
    touch "$FAKE_LOG/ftlaunch.ready"
    for _ in $(seq 200); do sleep 0.05; done
    exit 99
fi
exit "${FAKE_RC:-0}"
"""


@pytest.fixture
def slurm(tmp_path: Path) -> dict[str, str]:
    """A PATH with srun, scontrol and ftlaunch stand-ins, and the batch job's env."""
    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    log.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL),
                       ("ftlaunch", FAKE_FTLAUNCH)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "PET_", "FTLAUNCH_"))}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", FAKE_LOG=str(log), SLURM_JOB_ID="4242",
               SLURM_JOB_NAME="ftlaunch-train", SLURM_JOB_NUM_NODES="2", SLURM_NNODES="2",
               FTLAUNCH_AGENT_PIDFILE=str(tmp_path / "agent.pid"))
    return env


def run_sbatch(env: dict[str, str], **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SBATCH)], cwd=ROOT, env={**env, **extra},
                          capture_output=True, text=True, timeout=30)


def srun_calls(env: dict[str, str]) -> list[list[str]]:
    files = sorted(Path(env["FAKE_LOG"]).glob("srun.*.args"))
    return [f.read_text().splitlines() for f in files]


def requeues(env: dict[str, str]) -> list[str]:
    path = Path(env["FAKE_LOG"]) / "scontrol"
    return path.read_text().splitlines() if path.exists() else []


@pytest.mark.parametrize("code, requeued", [(0, False), (1, True), (2, False), (3, False),
                                            (143, True), (137, True), (4, False)])
def test_sbatch_maps_exit_codes_to_requeue(slurm, code, requeued):
    done = run_sbatch(slurm, FAKE_RC=str(code))
    assert done.returncode == code, done.stderr
    assert requeues(slurm) == (["requeue 4242"] if requeued else [])


def test_sbatch_stops_requeueing_after_the_limit(slurm):
    done = run_sbatch(slurm, FAKE_RC="1", SLURM_RESTART_COUNT="10")
    assert done.returncode == 1 and requeues(slurm) == []
    assert "requeued 10 times already" in done.stderr


def test_sbatch_verdicts_when_sourced(slurm):
    """The mapping is a function other scripts can source; sourcing runs no job."""
    codes = [0, 1, 2, 3, 137, 143, 4]
    out = subprocess.run(["bash", "-c", f'source "{SBATCH}"; for c in {" ".join(map(str, codes))}'
                          '; do ftlaunch_verdict $c; done'], env=slurm, capture_output=True,
                         text=True, check=True).stdout.split()
    assert dict(zip(codes, out, strict=True)) == {0: "done", 1: "requeue", 2: "stop",
                                                  3: "stop", 137: "requeue", 143: "requeue",
                                                  4: "stop"}
    assert srun_calls(slurm) == []


def test_sbatch_runs_one_agent_per_node_without_rendezvous_flags(slurm, monkeypatch):
    assert run_sbatch(slurm).returncode == 0
    (call,) = srun_calls(slurm)
    srun_opts = call[:next(i for i, a in enumerate(call) if not a.startswith("-"))]
    assert "--ntasks-per-node=1" in srun_opts and "--overlap" not in srun_opts
    assert call.count("ftlaunch") == 1
    argv = call[call.index("ftlaunch") + 1:]
    script = next(a for a in argv if a.endswith(".py"))
    flags = argv[:argv.index(script)]
    assert not [f for f in flags if f.startswith(("--rdzv", "--master", "--nnodes",
                                                  "--node-rank", "--standalone"))]
    secrets = (Path(slurm["FAKE_LOG"]) / "secrets").read_text().split()
    assert len(secrets) == 1 and re.fullmatch(r"[0-9a-f]{64}", secrets[0])
    # What each node's agent resolves inside the step (srun's env for 2 nodes):
    lead = int(sbatch_options()["--signal"].rsplit("@", 1)[1])
    step = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_NNODES": "2",
            "SLURM_STEP_NUM_NODES": "2", "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2",
            "SLURM_JOB_NODELIST": "gpu-[07-08]", "SLURM_STEP_NODELIST": "gpu-[07-08]",
            "SLURM_GPUS_ON_NODE": "8", "SLURM_RESTART_COUNT": "1"}
    for node in range(2):
        env = {**step, "SLURM_NODEID": str(node)}
        with monkeypatch.context() as m:
            for name in list(os.environ):
                if name.startswith(("PET_", "FTLAUNCH_")):
                    m.delenv(name)
            m.chdir(ROOT)
            r = resolve(argv, env)
        assert r.cluster.scheduler == "slurm" and r.cluster.restart_count == 1
        assert (r.config.nnodes, r.sources["nnodes"]) == ("2", "slurm SLURM_STEP_NUM_NODES")
        assert (r.config.node_rank, r.sources["node_rank"]) == (node, "slurm SLURM_NODEID")
        assert r.config.coordinator_endpoint() == ("gpu-07", 29400 + 4242 % 1000)
        assert r.config.rdzv_id == "4242" and r.config.nproc_per_node == "8"
        assert dry_run_report(r)["torchrun"]["rdzv_endpoint"] == "gpu-07:29642"
        # The ranks' grace ends, and the agent exits, before the time limit.
        assert r.config.grace_period + 20 <= lead
        assert "SIGTERM" in r.config.signals_to_handle  # what the USR1 trap sends


def test_sbatch_secret_is_new_for_every_run(slurm):
    run_sbatch(slurm)
    run_sbatch(slurm)
    secrets = (Path(slurm["FAKE_LOG"]) / "secrets").read_text().split()
    assert len(secrets) == 2 and secrets[0] != secrets[1]


def test_sbatch_usr1_stops_the_agents_with_sigterm_and_requeues(slurm):
    """SLURM's USR1 (time limit near) reaches the batch shell; the trap sends SIGTERM to the
    agent's pid through an overlapping step; the agent leaves with 143; the job requeues."""
    batch = subprocess.Popen(["bash", str(SBATCH)], cwd=ROOT, env={**slurm, "FAKE_WAIT": "1"},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ready = Path(slurm["FAKE_LOG"]) / "ftlaunch.ready"
    deadline = time.monotonic() + 10
    while not ready.exists():
        assert time.monotonic() < deadline and batch.poll() is None, batch.communicate()
        time.sleep(0.02)
    batch.send_signal(signal.SIGUSR1)
    _, err = batch.communicate(timeout=10)
    assert batch.returncode == 143, err
    assert (Path(slurm["FAKE_LOG"]) / "ftlaunch.signals").read_text().split() == ["TERM"]
    _step, stop = srun_calls(slurm)
    assert "--overlap" in stop and "kill -TERM" in " ".join(stop)
    assert requeues(slurm) == ["requeue 4242"]


# --- Dockerfile ----------------------------------------------------------------------------------

def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments), continuation lines joined, comments dropped."""
    out, current = [], ""
    for raw in (CONFIGS / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        word, _, rest = current.partition(" ")
        out.append((word.upper(), rest.strip()))
        current = ""
    return out


def test_dockerfile_installs_from_source_with_ftlaunch_as_entrypoint():
    steps = dockerfile()
    args = dict(a.split("=", 1) for kind, a in steps if kind == "ARG" and "=" in a)
    (base,) = [re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], a) for k, a in steps
               if k == "FROM"]
    assert base.startswith(("pytorch/pytorch:", "nvcr.io/nvidia/pytorch:"))
    assert "cuda" in base or base.startswith("nvcr.io/")  # NGC's images are all CUDA
    (entry,) = [json.loads(a) for k, a in steps if k == "ENTRYPOINT"]
    assert entry == ["ftlaunch"]  # exec form: ftlaunch is PID 1 and reaps orphans
    assert not [a for _, a in steps if "tini" in a]
    # Everything the package needs is copied in, from paths that exist.
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    copied = set()
    for kind, a in steps:
        if kind == "COPY":
            *sources, _dest = a.split()
            for src in sources:
                assert (ROOT / src).exists(), f"COPY {src}: not in the build context"
                copied.add(src)
    packages = {p.strip() for p in setup["options.packages.find"]["include"].split()
                if p.strip() and "*" not in p}
    assert packages | {"setup.cfg", "pyproject.toml"} <= copied
    (install,) = [a for k, a in steps if k == "RUN" and "pip install" in a]
    extras = re.search(r'pip install "?\.\[([\w,]+)\]"?', install)
    assert extras, "pip install of the copied source (.[extras])"
    assert set(extras.group(1).split(",")) == {"s3", "stacks"}
    assert {"s3", "stacks"} <= set(setup["options.extras_require"])
    # The example script lands where the manifests run it from.
    workdirs = [a for k, a in steps if k == "WORKDIR"]
    assert workdirs[-1] == "/workspace"
    assert ("COPY", "scripts/train_gpt.py ./train.py") in steps
    for name, kind in (("jobset.yaml", "JobSet"), ("indexed-job.yaml", "Job"),
                       ("pytorchjob.yaml", "PyTorchJob")):
        agent = agent_container(pod_spec(one(name, kind)))
        assert agent["workingDir"] == workdirs[-1] and "train.py" in agent["args"]


def _rendered_pods(name: str) -> list[dict]:
    """Pods 0 and 1 of a manifest, as their controllers make them."""
    if name == "jobset.yaml":
        js = one(name, "JobSet")
        return [jobset_pod(js, js["spec"]["replicatedJobs"][0]["name"], 0, i) for i in (0, 1)]
    if name == "indexed-job.yaml":
        job = one(name, "Job")
        return [indexed_job_pod(job["metadata"]["name"], job["spec"], i) for i in (0, 1)]
    return [pytorchjob_pod(one(name, "PyTorchJob"), "Worker", i) for i in (0, 1)]


@pytest.mark.parametrize("name", ["jobset.yaml", "indexed-job.yaml", "pytorchjob.yaml"])
def test_every_pod_logs_to_a_directory_of_its_own(name):
    """Logs sit on the shared volume; an agent writes events.jsonl and each local rank's
    error file under the same relative paths, so two pods must never share a --log-dir."""
    dirs = []
    for pod in _rendered_pods(name):
        container = agent_container(pod["spec"])["name"]
        argv = container_argv(pod, container, container_env(pod, container))
        (log_dir,) = [a.split("=", 1)[1] for a in argv if a.startswith("--log-dir=")]
        assert "$(" not in log_dir, f"{log_dir}: a variable the pod's env does not define"
        dirs.append(log_dir)
    assert len(set(dirs)) == 2, dirs
