"""Where the agent runs: what SLURM and Kubernetes tell a job step or a pod, read as launch
settings, each with the variable it came from.

Pure: the environment and the host's names in, settings out. They rank below the command
line, ``PET_*``/``FTLAUNCH_*`` variables and a --config file, and above the defaults
(``cli.resolve``). Nothing here shells out (no ``scontrol``) or asks an API server.

SLURM (inside ``srun``): ``SLURM_STEP_NUM_NODES`` (else ``SLURM_NNODES``) nodes, this
node's rank ``SLURM_NODEID``, the coordinator on the first host of the step's node list at
``MASTER_PORT`` or 29400 + job id % 1000 (two jobs whose first node is shared differ), run
id ``SLURM_JOB_ID``, one rank per GPU of ``SLURM_GPUS_ON_NODE``. Kubernetes: Kubeflow's
PyTorchJob and Trainer set ``PET_*`` (read as torchrun's flags), ``PET_N_PROC_PER_NODE``
(PyTorchJob's spelling) and ``MASTER_ADDR``/``MASTER_PORT``; an indexed Job's or JobSet's
pod has ``JOB_COMPLETION_INDEX`` and, through the downward API in our manifests, the
JobSet's labels (``JOBSET_NAME``, ``JOBSET_REPLICATED_JOB``, ``JOBSET_RESTART_ATTEMPT``):
the coordinator is pod 0 under the pods' headless service.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from launcher import UsageError

DEFAULT_PORT = 29400  # torchrun's c10d default


@dataclass(frozen=True)
class Setting:
    value: Any
    source: str  # e.g. "SLURM_NNODES"
    env_level: bool = False  # a PET_* spelling: ranks with the environment, not below files


@dataclass(frozen=True)
class Cluster:
    scheduler: str  # "slurm", "kubernetes" or "" (neither)
    settings: dict[str, Setting] = field(default_factory=dict)
    restart_count: int = 0  # the scheduler's restarts of this job (requeues, JobSet attempts)


def detect(env: Mapping[str, str], hostname: str = "", fqdn: str = "") -> Cluster:
    """The settings SLURM or Kubernetes give this process (``hostname``/``fqdn``: this
    host's, for a pod's siblings under the same headless service)."""
    if env.get("SLURM_JOB_ID") and env.get("SLURM_STEP_ID") is not None:
        return _slurm(env)
    if env.get("JOB_COMPLETION_INDEX") is not None or env.get("JOBSET_NAME") \
            or env.get("PET_N_PROC_PER_NODE") or env.get("KUBERNETES_SERVICE_HOST"):
        return _kubernetes(env, hostname, fqdn)
    return Cluster("")


def _slurm(env: Mapping[str, str]) -> Cluster:
    s: dict[str, Setting] = {}
    nodes_var = "SLURM_STEP_NUM_NODES" if env.get("SLURM_STEP_NUM_NODES") else "SLURM_NNODES"
    nodelist_var = "SLURM_STEP_NODELIST" if env.get("SLURM_STEP_NODELIST") else \
        "SLURM_JOB_NODELIST"
    job_id = env["SLURM_JOB_ID"]
    if env.get(nodes_var):
        nnodes = _int(env, nodes_var)
        s["nnodes"] = Setting(str(nnodes), nodes_var)
        tasks = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS")
        if tasks and tasks.isdigit() and int(tasks) > nnodes:
            raise UsageError(f"srun started {tasks} tasks on {nnodes} nodes; ftlaunch starts "
                             "the ranks itself: run one per node (srun --ntasks-per-node=1)")
    if env.get("SLURM_NODEID"):
        s["node_rank"] = Setting(_int(env, "SLURM_NODEID"), "SLURM_NODEID")
    if env.get(nodelist_var):
        hosts = expand_nodelist(env[nodelist_var])
        s["master_addr"] = Setting(hosts[0], f"{nodelist_var} (first host)")
    _master_port(env, s, DEFAULT_PORT + int(job_id) % 1000 if job_id.isdigit() else
                 DEFAULT_PORT, "SLURM_JOB_ID (29400 + id % 1000)")
    s["rdzv_id"] = Setting(job_id, "SLURM_JOB_ID")
    gpus = env.get("SLURM_GPUS_ON_NODE", "")
    if gpus.isdigit() and int(gpus) > 0:
        s["nproc_per_node"] = Setting(gpus, "SLURM_GPUS_ON_NODE")
    restarts = env.get("SLURM_RESTART_COUNT", "0")
    return Cluster("slurm", s, int(restarts) if restarts.isdigit() else 0)


def _kubernetes(env: Mapping[str, str], hostname: str, fqdn: str) -> Cluster:
    s: dict[str, Setting] = {}
    if env.get("PET_N_PROC_PER_NODE") and not env.get("PET_NPROC_PER_NODE"):
        s["nproc_per_node"] = Setting(env["PET_N_PROC_PER_NODE"], "PET_N_PROC_PER_NODE",
                                      env_level=True)
    index_var = "JOB_COMPLETION_INDEX" if env.get("JOB_COMPLETION_INDEX") else \
        "JOBSET_JOB_GLOBAL_INDEX"
    if env.get(index_var):
        s["node_rank"] = Setting(_int(env, index_var), index_var)
    if env.get("JOBSET_NAME"):
        name = env["JOBSET_NAME"]
        replicated = env.get("JOBSET_REPLICATED_JOB", "workers")
        subdomain = env.get("JOBSET_SUBDOMAIN") or name
        s["master_addr"] = Setting(f"{name}-{replicated}-0-0.{subdomain}",
                                   "JOBSET_NAME, JOBSET_REPLICATED_JOB (pod 0 of job 0)")
        s["rdzv_id"] = Setting(name, "JOBSET_NAME")
    elif env.get("JOB_COMPLETION_INDEX") and hostname:
        pod0 = first_pod(hostname, fqdn, env["JOB_COMPLETION_INDEX"])
        if pod0:
            s["master_addr"] = Setting(pod0, "JOB_COMPLETION_INDEX, hostname (pod 0 of the "
                                       "indexed Job)")
            s["rdzv_id"] = Setting(pod0.split(".")[0].rsplit("-", 1)[0],
                                   "hostname (the indexed Job's name)")
    if env.get("MASTER_ADDR"):
        s["master_addr"] = Setting(env["MASTER_ADDR"], "MASTER_ADDR")
    _master_port(env, s, DEFAULT_PORT, "default c10d port")
    restarts = env.get("JOBSET_RESTART_ATTEMPT", "0")
    return Cluster("kubernetes", s, int(restarts) if restarts.isdigit() else 0)


def _master_port(env: Mapping[str, str], s: dict[str, Setting], default: int,
                 why: str) -> None:
    if "master_addr" not in s:
        return
    if env.get("MASTER_PORT"):
        s["master_port"] = Setting(_int(env, "MASTER_PORT"), "MASTER_PORT")
    else:
        s["master_port"] = Setting(default, why)


def first_pod(hostname: str, fqdn: str, index: str) -> str | None:
    """Pod 0's DNS name from this pod's: an indexed Job names its pods ``<job>-<index>``
    and, with a headless service as their subdomain, ``<job>-<index>.<service>...``."""
    suffix = f"-{index}"
    if not hostname.endswith(suffix):
        return None
    domain = fqdn[len(hostname):] if fqdn.startswith(hostname + ".") else ""
    return f"{hostname[:-len(suffix)]}-0{domain}"


def expand_nodelist(text: str) -> list[str]:
    """SLURM's compressed host list, in order: ``gpu-[01-03,07],login1`` ->
    gpu-01, gpu-02, gpu-03, gpu-07, login1 (zero padding kept; several bracket groups in
    one name multiply out, as SLURM's own ``scontrol show hostnames`` does)."""
    hosts: list[str] = []
    for item in _split_top_level(text.strip()):
        if not item:
            continue
        names = [""]
        for literal, bracket in re.findall(r"([^\[]*)(\[[^\]]*\])?", item):
            choices = _expand_ranges(bracket[1:-1], text) if bracket else [""]
            names = [n + literal + c for n in names for c in choices]
        hosts.extend(names)
    if not hosts:
        raise UsageError(f"SLURM node list {text!r} names no host; run ftlaunch inside srun")
    return hosts


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets."""
    items: list[str] = []
    current: list[str] = []
    depth = 0
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            items.append("".join(current))
            current = []
        else:
            current.append(ch)
    if depth != 0:
        raise UsageError(f"SLURM node list {text!r} has unbalanced brackets")
    items.append("".join(current))
    return items


def _expand_ranges(spec: str, text: str) -> list[str]:
    out = []
    for part in spec.split(","):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise UsageError(f"SLURM node list {text!r}: {part!r} is not N or N-M")
        if not sep:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise UsageError(f"SLURM node list {text!r}: range {part!r} runs backwards")
        out.extend(str(i).zfill(len(lo)) for i in range(int(lo), int(hi) + 1))
    return out


def _int(env: Mapping[str, str], name: str) -> int:
    value = env[name].strip()
    if not value.isdigit():
        raise UsageError(f"{name}={value!r} is not a number; unset it or fix the job script")
    return int(value)
