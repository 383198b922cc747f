"""What Kubernetes' controllers and the kubelet make of our manifests (configs/k8s), rendered
offline for the tests: the pods a JobSet, an indexed Job or a PyTorchJob gets (names,
hostnames, subdomains, the controllers' labels and annotations, the env they append), the
process environment and command line the kubelet gives a container (downward-API values,
secrets, ``$(VAR)`` expansion), and the Job controller's podFailurePolicy verdict on a failed
pod. One renderer for test_configs.py (detection, offline) and test_pods.py (pods emulated
from kernel pieces, real agents).
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
K8S = CONFIGS / "k8s"
NAMESPACE = "ml"
SECRETS = {("ftlaunch-secret", "secret"): "0123456789abcdef" * 4}


def load(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def one(name: str, kind: str) -> dict:
    (doc,) = [d for d in load(name) if d["kind"] == kind]
    return doc


# --- what the controllers put in a pod -------------------------------------------------------

JOB_INDEX_KEY = "batch.kubernetes.io/job-completion-index"


def indexed_job_pod(job_name: str, job_spec: dict, index: int) -> dict:
    """A pod of an indexed Job, as the Job controller makes it: hostname <job>-<index>, the
    completion index as annotation and label, JOB_COMPLETION_INDEX appended to every
    container's env (after the template's own, so the template cannot $(...) it)."""
    assert job_spec.get("completionMode") == "Indexed"
    template = copy.deepcopy(job_spec["template"])
    meta = template.setdefault("metadata", {})
    meta.setdefault("annotations", {})[JOB_INDEX_KEY] = str(index)
    meta.setdefault("labels", {}).update({"batch.kubernetes.io/job-name": job_name,
                                          "job-name": job_name, JOB_INDEX_KEY: str(index)})
    meta["name"], meta["namespace"] = f"{job_name}-{index}-x7k2p", NAMESPACE
    spec = template["spec"]
    spec["hostname"] = f"{job_name}-{index}"
    for c in spec.get("initContainers", []) + spec["containers"]:
        c["env"] = c.get("env", []) + [{"name": "JOB_COMPLETION_INDEX", "valueFrom": {
            "fieldRef": {"fieldPath": f"metadata.annotations['{JOB_INDEX_KEY}']"}}}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def jobset_subdomain(js: dict) -> str:
    return js["spec"].get("network", {}).get("subdomain") or js["metadata"]["name"]


def jobset_pod(js: dict, rjob_name: str, job_index: int, pod_index: int,
               restarts: int = 0) -> dict:
    """A pod of a JobSet: the controller names the child Job <jobset>-<rjob>-<jobidx>, puts
    its labels and annotations on the Job's pod template and its subdomain in the pod spec;
    then the Job controller makes the pod (jobset_controller.go: labelAndAnnotateObject)."""
    name = js["metadata"]["name"]
    rjobs = js["spec"]["replicatedJobs"]
    rjob = next(r for r in rjobs if r["name"] == rjob_name)
    before = sum(r.get("replicas", 1) for r in rjobs[:rjobs.index(rjob)])
    marks = {"jobset.sigs.k8s.io/jobset-name": name,
             "jobset.sigs.k8s.io/jobset-uid": "7d1c6a1e-5b1f-4a57-9c1e-2f4a6b8c9d0e",
             "jobset.sigs.k8s.io/replicatedjob-name": rjob_name,
             "jobset.sigs.k8s.io/restart-attempt": str(restarts),
             "jobset.sigs.k8s.io/replicatedjob-replicas": str(rjob.get("replicas", 1)),
             "jobset.sigs.k8s.io/global-replicas": str(sum(r.get("replicas", 1) for r in rjobs)),
             "jobset.sigs.k8s.io/job-index": str(job_index),
             "jobset.sigs.k8s.io/job-global-index": str(before + job_index),
             "jobset.sigs.k8s.io/group-name": rjob.get("groupName", "default")}
    job_spec = copy.deepcopy(rjob["template"]["spec"])
    job_spec.setdefault("completionMode", "Indexed")  # the JobSet webhook's default
    meta = job_spec["template"].setdefault("metadata", {})
    meta.setdefault("labels", {}).update(marks)
    meta.setdefault("annotations", {}).update(marks)
    if js["spec"].get("network", {}).get("enableDNSHostnames", True):
        job_spec["template"]["spec"]["subdomain"] = jobset_subdomain(js)
    return indexed_job_pod(f"{name}-{rjob_name}-{job_index}", job_spec, pod_index)


def pytorchjob_pod(pj: dict, rtype: str, index: int) -> dict:
    """A pod of a PyTorchJob (training-operator v1.9: pytorch_defaults.go, envvar.go,
    elastic.go, master.go): named <job>-<type>-<index> (also its hostname and the name of
    the headless Service the operator makes for it); torchrun's PET_* env appended."""
    name, spec = pj["metadata"]["name"], copy.deepcopy(pj["spec"])
    specs = {k[0].upper() + k[1:].lower(): v for k, v in spec["pytorchReplicaSpecs"].items()}
    template = copy.deepcopy(specs[rtype]["template"])
    pod_name = f"{name}-{rtype.lower()}-{index}"

    def port(rt: str) -> int:
        pytorch = next(c for c in specs[rt]["template"]["spec"]["containers"]
                       if c["name"] == "pytorch")
        ports = [p["containerPort"] for p in pytorch.get("ports", [])
                 if p.get("name") == "pytorchjob-port"]
        return ports[0] if ports else 23456  # the default the operator adds

    elastic = spec.get("elasticPolicy")
    if elastic is not None:  # setElasticPolicy: min/max default to each other, or replicas
        workers = specs["Worker"].get("replicas", 1)
        elastic.setdefault("minReplicas", elastic.get("maxReplicas", workers))
        elastic.setdefault("maxReplicas", elastic["minReplicas"])
    if elastic is None or "nProcPerNode" not in elastic:
        spec.setdefault("nprocPerNode", "auto")
    total = sum(s.get("replicas", 1) for s in specs.values())
    added = [("PYTHONUNBUFFERED", "1")]
    if "Master" in specs:
        master = f"{name}-master-0"
        rank = index + (1 if rtype == "Worker" else 0)
        nproc = spec.get("nprocPerNode", "1")
        added += [("MASTER_PORT", str(port("Master"))), ("PET_MASTER_PORT", str(port("Master"))),
                  ("MASTER_ADDR", master), ("PET_MASTER_ADDR", master),
                  ("WORLD_SIZE", str(total * (int(nproc) if nproc.isdigit() else 1))),
                  ("RANK", str(rank)), ("PET_NODE_RANK", str(rank))]
    if "nprocPerNode" in spec:
        added.append(("PET_NPROC_PER_NODE", spec["nprocPerNode"]))
    if elastic is not None:
        host = elastic.get("rdzvHost", f"{name}-worker-0")
        added += [("PET_RDZV_ENDPOINT", f"{host}:{elastic.get('rdzvPort') or port('Worker')}"),
                  ("PET_RDZV_BACKEND", elastic.get("rdzvBackend", "c10d")),
                  ("PET_NNODES", f"{elastic['minReplicas']}:{elastic['maxReplicas']}")]
        if "maxRestarts" in elastic:
            added.append(("PET_MAX_RESTARTS", str(elastic["maxRestarts"])))
        if "nProcPerNode" in elastic:
            added.append(("PET_NPROC_PER_NODE", str(elastic["nProcPerNode"])))
        if "rdzvId" in elastic:
            added.append(("PET_RDZV_ID", elastic["rdzvId"]))
        if elastic.get("rdzvConf"):
            added.append(("PET_RDZV_CONF",
                          ",".join(f"{c['key']}={c['value']}" for c in elastic["rdzvConf"])))
        if elastic.get("standalone"):
            added.append(("PET_STANDALONE", ""))
    else:
        added.append(("PET_NNODES", str(total)))
    for c in template["spec"]["containers"]:
        c["env"] = c.get("env", []) + [{"name": k, "value": v} for k, v in added]
    meta = template.setdefault("metadata", {})
    meta.setdefault("labels", {}).update({
        "training.kubeflow.org/job-name": name, "training.kubeflow.org/operator-name":
        "pytorchjob-controller", "training.kubeflow.org/replica-type": rtype.lower(),
        "training.kubeflow.org/replica-index": str(index)})
    meta["name"], meta["namespace"] = pod_name, NAMESPACE
    restart = specs[rtype].get("restartPolicy", "OnFailure")
    template["spec"]["restartPolicy"] = "Never" if restart == "ExitCode" else restart
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": template["spec"]}


# --- what the kubelet makes of a pod's container -----------------------------------------------

_REF = re.compile(r"\$(\$|\(([^)]*)\))")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: defined names are replaced, $$ is a literal $, anything
    else stays as written."""
    def sub(m: re.Match) -> str:
        if m.group(1) == "$":
            return "$"
        return env.get(m.group(2), m.group(0))
    return _REF.sub(sub, text)


def _field(pod: dict, path: str) -> str:
    m = re.fullmatch(r"metadata\.(annotations|labels)\['([^']+)'\]", path)
    if m:
        return pod["metadata"].get(m.group(1), {}).get(m.group(2), "")  # missing key: ""
    simple = {"metadata.name": pod["metadata"]["name"],
              "metadata.namespace": pod["metadata"]["namespace"]}
    if path not in simple:
        raise AssertionError(f"fieldRef {path!r}: not rendered by this test")
    return simple[path]


def hostname_and_fqdn(pod: dict) -> tuple[str, str]:
    spec = pod["spec"]
    hostname = spec.get("hostname", pod["metadata"]["name"])
    if spec.get("subdomain"):
        return hostname, f"{hostname}.{spec['subdomain']}.{NAMESPACE}.svc.cluster.local"
    return hostname, hostname


def container_env(pod: dict, container: str) -> dict[str, str]:
    """The process environment the kubelet gives ``container``: the API server's service
    variables, then the env list in order, each value expanded against what came before."""
    env = {"KUBERNETES_SERVICE_HOST": "10.100.0.1", "KUBERNETES_SERVICE_PORT": "443",
           "HOSTNAME": hostname_and_fqdn(pod)[0]}
    spec = pod["spec"]
    (c,) = [c for c in spec.get("initContainers", []) + spec["containers"]
            if c["name"] == container]
    for var in c.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(str(var["value"]), env)
        elif "fieldRef" in var.get("valueFrom", {}):
            env[var["name"]] = _field(pod, var["valueFrom"]["fieldRef"]["fieldPath"])
        elif "secretKeyRef" in var.get("valueFrom", {}):
            ref = var["valueFrom"]["secretKeyRef"]
            env[var["name"]] = SECRETS[(ref["name"], ref["key"])]  # missing: pod never starts
        else:
            raise AssertionError(f"env {var['name']}: a source this test does not render")
    return env


def container_argv(pod: dict, container: str, env: dict[str, str]) -> list[str]:
    spec = pod["spec"]
    (c,) = [c for c in spec.get("initContainers", []) + spec["containers"]
            if c["name"] == container]
    return [expand(a, env) for a in c.get("command", []) + c.get("args", [])]


def pod_spec(doc: dict) -> dict:
    """The pod spec a manifest's pods start from."""
    if doc["kind"] == "Job":
        return doc["spec"]["template"]["spec"]
    if doc["kind"] == "JobSet":
        return doc["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    return doc["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]


def agent_container(spec: dict) -> dict:
    (c,) = [c for c in spec["containers"] if c.get("command", [""])[0] == "ftlaunch"]
    return c



def pod_failure_action(policy: dict, exit_codes_by_container: dict[str, int],
                       conditions: set[str] = frozenset()) -> str:
    """The Job controller's verdict on a failed pod: the first matching rule's action, else
    Count. Containers that exited 0 never match onExitCodes."""
    for rule in policy["rules"]:
        if "onExitCodes" in rule:
            req = rule["onExitCodes"]
            codes = [code for name, code in exit_codes_by_container.items()
                     if code != 0 and req.get("containerName") in (None, name)]
            inside = [code in req["values"] for code in codes]
            if (req["operator"] == "In" and any(inside)) or \
                    (req["operator"] == "NotIn" and not all(inside) and codes):
                return rule["action"]
        for cond in rule.get("onPodConditions", []):
            if cond["type"] in conditions and cond["status"] == "True":
                return rule["action"]
    return "Count"


def jobset_failure_action(js: dict, job_failure_reason: str) -> str:
    """The JobSet controller's verdict on a failed child Job: the first failurePolicy rule
    whose onJobFailureReasons lists the Job's reason (PodFailurePolicy, BackoffLimitExceeded,
    ...; a rule without reasons matches any), else RestartJobSet (the default, bounded by
    maxRestarts)."""
    for rule in js["spec"].get("failurePolicy", {}).get("rules", []):
        reasons = rule.get("onJobFailureReasons")
        if not reasons or job_failure_reason in reasons:
            return rule["action"]
    return "RestartJobSet"
