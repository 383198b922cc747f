"""Pods of our JobSet (configs/k8s/jobset.yaml) emulated from the kernel pieces a kubelet and
a container runtime use, running real ftlaunch agents and real ranks. There is no API server
and no controller: this module plays them, on the manifest as shipped, rendered by
tests/k8s_render.py (the renderer test_configs.py checks detection with).

What is emulated, and how:

- A pod's sandbox is a network namespace (scripts/netns.py: its own eth0 and address on a
  private bridge; no DNS server). Its DNS is its hosts file, ``/etc/netns/<ns>/hosts``, which
  ``ip netns exec`` bind-mounts over /etc/hosts: the kubelet's line for the pod itself
  (address, FQDN, hostname) and the records of the JobSet's headless service for every pod
  that has an address (publishNotReadyAddresses), under
  ``<jobset>-<replicatedjob>-<jobidx>-<podidx>.<subdomain>.<namespace>.svc.cluster.local``
  and under the name the pods' DNS search path resolves, ``<...>-<podidx>.<subdomain>``.
- Its container: ``unshare --pid --fork --mount-proc --uts`` in that sandbox: ftlaunch is
  PID 1 of its own PID namespace, under the pod's hostname, with a /dev/shm of its own (a
  tmpfs of the emptyDir's sizeLimit, mounted in the pod's own mount namespace before
  ftlaunch is exec'ed, as an emptyDir with medium: Memory is), in the env and with the
  command line the kubelet renders from the manifest: the JobSet controller's annotations
  through the downward API, the secret, the Job controller's JOB_COMPLETION_INDEX,
  ``$(VAR)`` expansion. The image's own env (ftlaunch on PATH, ...) is this machine's.
- The FSx volume is a directory of the test, seen by every sandbox (network namespaces share
  the file system): checkpoints and logs there are shared as on FSx (the manifest gives each
  pod a log directory of its own, by its name); the args name it for /fsx.
- A node's GPUs: CPU ranks (gloo); where a test needs GPU health, a fake NVML
  (``FTLAUNCH_FAKE_NVML``, launcher/gpu_health.py) in the env of the pod on that node.
- Deleting a pod is what the kubelet does: SIGTERM to PID 1, SIGKILL once the pod's
  terminationGracePeriodSeconds are over. The exit code then goes through the manifest's
  podFailurePolicy (``k8s_render.pod_failure_action``), and the Job controller's verdict is
  carried out: a failed pod is re-created once the old one is gone (podReplacementPolicy:
  Failed) with the same index and hostname, in a fresh sandbox (a new address: its DNS
  record moves) with a fresh /dev/shm; FailJob fails the Job, whose other pods are then
  deleted, and the JobSet's failurePolicy judges the failed Job
  (``k8s_render.jobset_failure_action``).
- Not emulated: scheduling, images, readiness, resource limits, the doctor init container
  (its smoke test wants 8 GPUs and NCCL), the API server's records (a pod's conditions and
  the Job's failure count are this module's bookkeeping).

Sized for a 2-core machine, each patch of the manifest said where it is made: 2 pods of one
CPU rank each, short grace periods, a small /dev/shm, a short training run. Skipped without
root, ``ip``, ``iptables``, ``unshare``, ``nsenter``, ``mount`` or PID namespaces.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest
from conftest import CLUSTER_VARS, ROOT, SCRIPTS, TAG_VAR, Launch, wait_no_tagged
from k8s_render import (
    JOB_INDEX_KEY,
    agent_container,
    container_argv,
    container_env,
    hostname_and_fqdn,
    jobset_failure_action,
    jobset_pod,
    jobset_subdomain,
    one,
    pod_failure_action,
)

from launcher import exit_codes

if "ftlaunch_netns" in sys.modules:  # test_netns.py loaded it already
    netns = sys.modules["ftlaunch_netns"]
else:
    _spec = importlib.util.spec_from_file_location("ftlaunch_netns", SCRIPTS / "netns.py")
    netns = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = netns  # dataclasses look their module up by name
    _spec.loader.exec_module(netns)


def _why_not() -> str | None:
    why = netns.missing_requirements()
    if why is not None:
        return why
    if shutil.which("mount") is None or shutil.which("nsenter") is None:
        return "missing mount or nsenter (util-linux)"
    done = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "--uts", "true"],
                          capture_output=True, timeout=30)
    return None if done.returncode == 0 else "unshare --pid --mount-proc --uts does not work here"


_WHY_NOT = _why_not()
pytestmark = pytest.mark.skipif(_WHY_NOT is not None, reason=f"pod emulation: {_WHY_NOT}")

VENV_BIN = ROOT / ".venv" / "bin"
# The manifest's terminationGracePeriodSeconds (600) and --grace-period (570), shortened for
# a test whose ranks save a tiny model: --grace-period still ends well before the kubelet's
# SIGKILL, leaving the agent time to persist what is staged and exit.
POD_GRACE = 20
FTLAUNCH_GRACE = 10
SHM_SIZE = "512Mi"  # the emptyDir's sizeLimit (112Gi in the manifest): a 512m tmpfs here
STEPS = 60
# The training script and its args in place of the manifest's `train.py --cuda --fsdp ...`:
# CPU ranks (gloo), a short run, checkpoints every 10 steps through trainer_shim, which
# saves and stops at ft.preempted() once a SIGTERM came.
TRAIN_ARGS = ["--shim", "--async-ckpt", "--steps", str(STEPS), "--step-time", "0.05",
              "--ckpt-every", "10", "--log-every", "5"]
# ftlaunch as PID 1 of a PID namespace, with its own mounts (/proc, /dev/shm) and hostname:
# sh sets the hostname, mounts the pod's /dev/shm and exec's the container's command.
CONTAINER = ("unshare", "--pid", "--fork", "--mount-proc", "--uts")
POD_INIT = ('hostname "$0" && mount -t tmpfs -o "size=$1,mode=1777" dshm /dev/shm && shift '
            '&& exec "$@"')
WAIT = 120  # hang guard of one wait for an agent or a rank; each takes seconds here


def _quantity_for_mount(size: str) -> str:
    """A Kubernetes quantity (512Mi) as a tmpfs size= option (512m)."""
    m = re.fullmatch(r"(\d+)([KMG])i", size)
    assert m, f"sizeLimit {size!r}: not rendered by this test"
    return f"{m.group(1)}{m.group(2).lower()}"


def jobset_for_test(fsx: Path, *, extra_flags: tuple[str, ...] = ()) -> dict:
    """Our JobSet, patched for this machine; every patch is on the manifest as the JobSet
    controller would get it, so the pods are still rendered from it."""
    js = copy.deepcopy(one("jobset.yaml", "JobSet"))
    job = js["spec"]["replicatedJobs"][0]["template"]["spec"]
    job["parallelism"] = job["completions"] = 2  # two pods (nodes) on two cores
    spec = job["template"]["spec"]
    spec["terminationGracePeriodSeconds"] = POD_GRACE
    (shm,) = [v for v in spec["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
    shm["emptyDir"]["sizeLimit"] = SHM_SIZE
    agent = agent_container(spec)
    (nnodes,) = [v for v in agent["env"] if v["name"] == "PET_NNODES"]
    # "2", not the manifest's "3:4" (N-1:N): at a fixed size the job pauses when a pod goes
    # and resumes at the same world size once its replacement joins, so the data each rank
    # sees, and the final weights, are those of a fault-free run; with 1:2 the survivor
    # would carry on alone on another split of the data.
    nnodes["value"] = "2"
    script = agent["args"].index("train.py")
    flags = {a.split("=", 1)[0]: a for a in agent["args"][:script]}
    assert set(flags) == {"--nproc-per-node", "--grace-period", "--ckpt-replicas",
                          "--log-dir"}, f"the manifest's flags changed: {flags}"
    flags["--nproc-per-node"] = "--nproc-per-node=1"  # one CPU rank per pod, not 8 GPUs
    flags["--grace-period"] = f"--grace-period={FTLAUNCH_GRACE}"
    # The FSx volume is the test's directory: logs (one directory per pod) and checkpoints.
    flags["--log-dir"] = flags["--log-dir"].replace("=/fsx/", f"={fsx}/")
    (ckpt,) = [a for a in agent["args"][script:] if a.startswith("--ckpt-dir=/fsx/")]
    agent["args"] = [*flags.values(), *extra_flags, "train.py", *TRAIN_ARGS,
                     ckpt.replace("=/fsx/", f"={fsx}/"), f"--out={fsx}/result.json"]
    return js


def _image_env(tag: str) -> dict[str, str]:
    """What the image gives every container before the pod's env: this machine's env (no
    scheduler's, no launch's), ftlaunch on PATH, and the tag that finds every process."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith((*CLUSTER_VARS, "FTLAUNCH_", "TRAIN_"))}
    env.update({TAG_VAR: tag, "PYTHONPATH": str(ROOT), "PATH": f"{VENV_BIN}:{env['PATH']}",
                "FTLAUNCH_STRICT": "1"})  # an agent's illegal phase transition is an error
    return env


class Pod(Launch):
    """One pod, running: its container's ftlaunch as PID 1 in ``sandbox``; its output awaited
    like conftest's ``Launch``."""

    def __init__(self, manifest: dict, sandbox, container: str):
        self.manifest, self.sandbox, self.container = manifest, sandbox, container
        self.hostname, self.fqdn = hostname_and_fqdn(manifest)
        self.index = int(manifest["metadata"]["annotations"][JOB_INDEX_KEY])
        self.grace = manifest["spec"]["terminationGracePeriodSeconds"]
        self.killed = False
        self.deleted_code: int | None = None

    def start(self, image_env: dict[str, str], workdir: Path, node_env: dict[str, str]) -> None:
        """Its container: ``node_env`` is the node's share of the env (a fake NVML for its
        GPUs), before the pod's own."""
        spec = self.manifest["spec"]
        (agent,) = [c for c in spec["containers"] if c["name"] == self.container]
        mounts = {m["name"]: m["mountPath"] for m in agent["volumeMounts"]}
        (shm,) = [v for v in spec["volumes"]
                  if v.get("emptyDir", {}).get("medium") == "Memory"]
        assert mounts[shm["name"]] == "/dev/shm"
        self.env = {**image_env, **node_env, **container_env(self.manifest, self.container)}
        self.argv = container_argv(self.manifest, self.container, self.env)
        assert self.argv[0] == "ftlaunch"
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", self.sandbox.ns, *CONTAINER, "sh", "-c", POD_INIT,
             self.hostname, _quantity_for_mount(shm["emptyDir"]["sizeLimit"]), *self.argv],
            cwd=workdir, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, bufsize=1)
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    @property
    def name(self) -> str:
        return self.manifest["metadata"]["name"]

    def pid1(self, timeout: float = 30) -> int:
        """The host's pid of the container's PID 1, once it is ftlaunch (not the sh before
        it): unshare's child."""
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(psutil.Error):
                for child in psutil.Process(self.proc.pid).children():
                    status = Path(f"/proc/{child.pid}/status").read_text()
                    nspid = re.search(r"^NSpid:\s+(.*)$", status, re.MULTILINE)[1].split()
                    if nspid[-1] == "1" and any("ftlaunch" in a for a in child.cmdline()[:2]):
                        return child.pid
            if time.monotonic() > deadline or self.proc.poll() is not None:
                pytest.fail(f"{self.name}: ftlaunch never became PID 1:\n{self.output}")
            time.sleep(0.02)  # a process exec'ing: no event to wait on

    def delete(self) -> int:
        """What the kubelet does with a deleted pod: SIGTERM to PID 1, SIGKILL after the
        pod's grace period. Returns the container's exit code."""
        if self.proc.poll() is not None:  # its container ended already
            return self.exit_code()
        init = self.pid1()
        os.kill(init, signal.SIGTERM)
        try:
            self.proc.wait(timeout=self.grace)
        except subprocess.TimeoutExpired:
            self.killed = True
            os.kill(init, signal.SIGKILL)  # PID 1 gone: the kernel kills the whole namespace
        return self.exit_code()

    def exit_code(self, timeout: float = WAIT) -> int:
        """The container's exit code, as the runtime reports it (128 + N when killed by N)."""
        code = self.finish(timeout)
        # util-linux's unshare exits with PID 1's code, but 1 for a PID 1 that SIGKILL ended
        # (it cannot re-raise SIGKILL on itself): what we SIGKILLed we know.
        return 128 + signal.SIGKILL if self.killed else code

    def drain(self, timeout: float = 10) -> str:
        """All it printed, up to the end of its output (it has exited): a post-mortem."""
        deadline = time.monotonic() + timeout
        with contextlib.suppress(queue.Empty):
            while (line := self._queue.get(timeout=max(0.01, deadline - time.monotonic()))) \
                    is not None:
                self.lines.append(line)
            self._queue.put(None)
        return self.output

    def in_pod(self, *argv: str) -> str:
        """A command in the running pod's namespaces (network, mount, UTS, PID)."""
        return subprocess.run(["nsenter", "-t", str(self.pid1()), "-n", "-m", "-u", "-p",
                               *argv], capture_output=True, text=True, check=True,
                              timeout=30).stdout

    def dry_run(self, workdir: Path) -> dict:
        """``ftlaunch --dry-run`` with this pod's command line, env and hostname, in its
        sandbox: how its agent resolves the launch."""
        done = subprocess.run(
            ["ip", "netns", "exec", self.sandbox.ns, "unshare", "--uts", "sh", "-c",
             'hostname "$0" && exec "$@"', self.hostname, self.argv[0], "--dry-run",
             *self.argv[1:]], cwd=workdir, env=self.env, capture_output=True, text=True,
            timeout=60)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)


class JobSet:
    """The JobSet and Job controllers and the kubelets of one run of ``js``: pods made in
    fresh sandboxes, deleted as a kubelet does, failed pods judged by the podFailurePolicy."""

    def __init__(self, js: dict, cluster, root: Path, tag: str):
        self.js, self.cluster, self.root = js, cluster, root
        self.rjob = js["spec"]["replicatedJobs"][0]
        self.job = self.rjob["template"]["spec"]
        self.policy = self.job["podFailurePolicy"]
        self.container = agent_container(self.job["template"]["spec"])["name"]
        self.image_env = _image_env(tag)
        self.free = list(cluster.nodes)  # sandboxes no pod had yet
        self.live: dict[int, Pod] = {}  # by completion index
        self.created: list[Pod] = []
        self.failed = 0  # pod failures counted against backoffLimit
        self.failure: str | None = None  # the Job's failure reason, once failed
        self.workdir = root / "workspace"  # the image's /workspace: train.py is there
        self.workdir.mkdir(parents=True)
        shutil.copy(SCRIPTS / "train_gpt.py", self.workdir / "train.py")  # as the Dockerfile

    def create(self, index: int, node_env: dict[str, str] | None = None) -> Pod:
        """The Job controller makes pod ``index`` of job 0; it gets a sandbox (a new
        address, published in DNS), then its container starts."""
        assert self.failure is None and index not in self.live
        manifest = jobset_pod(self.js, self.rjob["name"], 0, index)
        hostname = manifest["spec"]["hostname"]
        manifest["metadata"]["name"] = f"{hostname}-{uuid.uuid4().hex[:5]}"  # generateName
        pod = Pod(manifest, self.free.pop(0), self.container)
        self.live[index] = pod
        self.publish_dns()  # it has an address, in DNS, before its container starts
        pod.start(self.image_env, self.workdir, node_env or {})
        self.created.append(pod)
        return pod

    def publish_dns(self) -> None:
        """Every sandbox's hosts file: the kubelet's line for its own pod, then the headless
        service's records of every pod that has an address."""
        subdomain = jobset_subdomain(self.js)
        records = [(p.sandbox.addr, [p.fqdn, f"{p.hostname}.{subdomain}"])
                   for p in self.live.values()]
        for sandbox in self.cluster.nodes:
            own = [(p.sandbox.addr, [p.fqdn, p.hostname]) for p in self.live.values()
                   if p.sandbox is sandbox]
            sandbox.write_hosts(own + records)

    def gone(self, pod: Pod, code: int, conditions: frozenset[str] = frozenset()) -> str:
        """The pod ended with ``code`` (and the API server's ``conditions`` on it): the Job
        controller's verdict, carried out: Count and Ignore leave the pod to ``replace``
        unless the Job failed (past backoffLimit); FailJob fails the Job, which deletes its
        other pods. Returns the verdict ("Succeeded" for exit 0)."""
        self._terminated(pod)
        if code == 0:
            return "Succeeded"
        verdict = pod_failure_action(self.policy, {self.container: code}, conditions)
        if verdict == "Count":
            self.failed += 1
            if self.failed > self.job["backoffLimit"]:
                self._fail("BackoffLimitExceeded")
        elif verdict == "FailJob":
            self._fail("PodFailurePolicy")
        return verdict

    def replace(self, pod: Pod, node_env: dict[str, str] | None = None) -> Pod:
        """A failed pod's replacement: once the old one is gone (podReplacementPolicy:
        Failed), same index, hence same hostname and env."""
        assert self.failure is None, f"the Job failed ({self.failure}): no replacement"
        assert pod.proc.poll() is not None and not pod.sandbox.pids()
        return self.create(pod.index, node_env)

    def _terminated(self, pod: Pod) -> None:
        assert pod.proc.poll() is not None
        deadline = time.monotonic() + 10
        while pod.sandbox.pids():  # PID 1 gone: the kernel kills and reaps the rest
            assert time.monotonic() < deadline, f"{pod.name}: processes outlived PID 1"
            time.sleep(0.05)  # the namespace's process list: no event to wait on
        if self.live.get(pod.index) is pod:
            del self.live[pod.index]
            self.publish_dns()

    def _fail(self, reason: str) -> None:
        """The Job failed: it deletes its remaining pods (each with the kubelet's grace)."""
        self.failure = reason
        for pod in list(self.live.values()):
            pod.deleted_code = pod.delete()
            self._terminated(pod)

    def kill_all(self) -> None:
        """A failed test's pods: everything in their sandboxes SIGKILLed, as a node's loss."""
        for pod in self.created:
            if pod.proc.poll() is None:
                pod.killed = True
                netns.kill_namespace(pod.sandbox.ns)
                pod.proc.wait(10)


def _leftovers(cluster) -> list[str]:
    """What of ``cluster`` is still on this host: namespaces, links, /etc/netns dirs."""
    names = netns.sh("ip", "netns", "list") + netns.sh("ip", "-o", "link", "show")
    left = sorted(set(re.findall(rf"\b\S*{cluster.id}\S*", names)))
    left += [str(p) for p in netns.NETNS_ETC.glob(f"*{cluster.id}*")]
    return left + ([str(cluster.record)] if cluster.record.exists() else [])


@contextlib.contextmanager
def emulated(root: Path, sandboxes: int, js: dict):
    """A JobSet run on ``sandboxes`` fresh sandboxes; afterwards none of its processes,
    namespaces, links or /etc/netns dirs may be left (not checked when the run failed: its
    error is the one to see)."""
    netns.clean_stale()
    tag = uuid.uuid4().hex
    cluster = netns.Cluster(sandboxes).up()
    run = None
    try:
        run = JobSet(js, cluster, root, tag)
        yield run
    finally:
        if run is not None:
            run.kill_all()
            for pod in run.created:  # what each pod printed, for a post-mortem
                (root / f"{pod.name}.log").write_text(pod.drain() + "\n")
        orphans = wait_no_tagged(tag)
        for p in orphans:
            p.kill()
        cluster.down()
    assert not orphans, f"processes left behind: {orphans}"
    assert not _leftovers(cluster), f"left on this host: {_leftovers(cluster)}"


def _wait_step(pods: list[Pod], step: int) -> None:
    for pod in pods:
        pod.wait_for(rf"\[rank\d\]: step {step} ", timeout=WAIT)


def _result(fsx: Path) -> dict:
    return json.loads((fsx / "result.json").read_text())


def _in_pod_facts(pod: Pod) -> dict:
    """What the container sees of itself: PID 1, hostname, /dev/shm, its staging there."""
    init = pod.pid1()
    shm_dir = Path(f"/proc/{init}/root/dev/shm")  # the pod's /dev/shm, through its root
    mountinfo = Path(f"/proc/{init}/mountinfo").read_text()
    shm = [line for line in mountinfo.splitlines() if line.split()[4] == "/dev/shm"]
    return {"pid1_cmdline": Path(f"/proc/{init}/cmdline").read_bytes().split(b"\0")[1:3],
            "hostname": pod.in_pod("hostname").strip(),
            "shm": shm[-1].split(" - ", 1)[1] if shm else "",
            "own_shm": shm_dir.stat().st_dev != Path("/dev/shm").stat().st_dev,
            "staging": sorted(p.name for p in shm_dir.glob("ftlaunch-staging-*")),
            "resolves": pod.in_pod("getent", "hosts", "fsdp-train-workers-0-0.fsdp-train")}


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory):
    """Scenario 1, run once for the module: a 2-pod job trains to the end."""
    root = tmp_path_factory.mktemp("fault-free")
    fsx = root / "fsx"
    with emulated(root, 2, jobset_for_test(fsx)) as run:
        pods = [run.create(0), run.create(1)]
        reports = [pod.dry_run(run.workdir) for pod in pods]
        _wait_step(pods, 5)
        facts = [_in_pod_facts(pod) for pod in pods]
        codes = [pod.exit_code() for pod in pods]
        verdicts = [run.gone(pod, code) for pod, code in zip(pods, codes, strict=True)]
        outputs = [pod.output for pod in pods]
        addrs = [pod.sandbox.addr for pod in pods]
    return {"codes": codes, "verdicts": verdicts, "reports": reports, "facts": facts,
            "outputs": outputs, "addrs": addrs, "result": _result(fsx),
            "created": len(run.created), "fsx": fsx, "names": [pod.name for pod in pods]}


def test_a_two_pod_jobset_trains_to_the_end(fault_free):
    """Both pods' agents find each other from what the manifest gives them (pod 0 of job 0
    is the coordinator, by its DNS name), train one job of world size 2, and exit 0."""
    assert fault_free["codes"] == [0, 0], "\n".join(fault_free["outputs"])
    assert fault_free["verdicts"] == ["Succeeded", "Succeeded"]
    for index, report in enumerate(fault_free["reports"]):
        settings = {k: (v["value"], v["source"]) for k, v in report["settings"].items()}
        assert report["scheduler"] == "kubernetes" and report["scheduler_restart_count"] == 0
        assert settings["node_rank"] == (index, "kubernetes JOB_COMPLETION_INDEX")
        assert settings["nnodes"] == ("2", "env PET_NNODES")
        assert settings["rdzv_id"] == ("fsdp-train", "kubernetes JOBSET_NAME")
        assert report["torchrun"]["rdzv_endpoint"] == "fsdp-train-workers-0-0.fsdp-train:29400"
        assert settings["nproc_per_node"] == ("1", "flag")
        assert settings["grace_period"] == (FTLAUNCH_GRACE, "flag")
        # On the shared volume, a directory of its own, by its pod's name.
        assert settings["log_dir"][0] == \
            f"{fault_free['fsx']}/ftlaunch-logs/fsdp-train/{fault_free['names'][index]}"
    for index, facts in enumerate(fault_free["facts"]):
        assert facts["hostname"] == f"fsdp-train-workers-0-{index}"
        assert b"ftlaunch" in facts["pid1_cmdline"][0], facts  # .venv/bin/ftlaunch
        assert facts["shm"].startswith("tmpfs dshm ") and "size=524288k" in facts["shm"], facts
        assert facts["own_shm"] and len(facts["staging"]) == 1, facts  # staging in its own
        assert facts["resolves"].split() == [fault_free["addrs"][0],
                                             "fsdp-train-workers-0-0.fsdp-train.ml.svc.cluster"
                                             ".local", "fsdp-train-workers-0-0.fsdp-train"]
    both = "\n".join(fault_free["outputs"])
    assert "start rank 0 world 2 " in both and "start rank 1 world 2 " in both, both
    result = fault_free["result"]
    assert result["final_step"] == STEPS and result["restart_count"] == 0, result
    assert result["resumed_from"] == 0 and fault_free["created"] == 2


@pytest.mark.parametrize("evicted, when", [(1, "at once"), (0, "at once"),
                                            (0, "after the takeover")],
                         ids=["pod 1", "pod 0, replaced at once", "pod 0, after the takeover"])
def test_an_evicted_pod_is_recreated_joins_and_the_weights_equal_a_fault_free_run(
        tmp_path, fault_free, evicted, when):
    """A pod evicted mid-run (a node drain: DisruptionTarget, then the kubelet's SIGTERM to
    PID 1): ftlaunch saves and exits 143, the policy ignores it (a plain delete would count
    it), the Job re-creates it with the same hostname in a fresh sandbox; its agent joins
    the paused job, which finishes with the fault-free run's weights, bit for bit. Pod 0 is
    the rendezvous endpoint and hosts the coordinator: its replacement binds the endpoint
    again, and must join the job it finds there (replaced at once: the other pod reconnects
    to the name before missing the old coordinator) or under the successor the other pod
    started meanwhile ("after the takeover": it redirects the new pod 0's agent)."""
    fsx = tmp_path / "fsx"
    with emulated(tmp_path, 3, jobset_for_test(fsx)) as run:
        pods = [run.create(0), run.create(1)]
        _wait_step(pods, 10)
        gone, stays = pods[evicted], pods[1 - evicted]
        started = time.monotonic()
        code = gone.delete()
        assert time.monotonic() - started < FTLAUNCH_GRACE + 5 and not gone.killed
        assert code == exit_codes.SIGNAL_BASE + signal.SIGTERM, gone.output
        assert "got SIGTERM: forwarded to ranks" in gone.output, gone.output
        preempted = re.search(r"preempted at step (\d+) rank \d", gone.output)
        assert preempted, gone.output
        assert pod_failure_action(run.policy, {run.container: code}) == "Count"  # a delete
        # An eviction: the API server put DisruptionTarget on the pod before the kubelet
        # stopped it.
        assert run.gone(gone, code, frozenset({"DisruptionTarget"})) == "Ignore"
        assert run.failed == 0 and run.failure is None
        stays.wait_for(r"left: the others go on", timeout=WAIT)  # the job waits for a node
        if when == "after the takeover":
            stays.wait_for(r"coordinator node \S+ lost: following this node", timeout=WAIT)
        assert stays.proc.poll() is None
        new = run.replace(gone)
        assert new.hostname == gone.hostname and new.index == evicted
        assert new.sandbox.addr != gone.sandbox.addr  # a new pod, a new address
        name = f"fsdp-train-workers-0-{evicted}.fsdp-train"
        assert stays.sandbox.run("getent", "hosts", name).split()[0] == new.sandbox.addr, \
            "its DNS record moved with it"
        report = new.dry_run(run.workdir)
        assert report["settings"]["node_rank"]["value"] == evicted
        assert report["torchrun"]["rdzv_endpoint"] == "fsdp-train-workers-0-0.fsdp-train:29400"
        resumed = new.wait_for(r"\[rank\d\]: start rank \d world 2 pid \d+ resume_from "
                               r"(\d+) \((.*?)\)", timeout=WAIT)
        assert int(resumed.group(1)) == int(preempted.group(1)), resumed.group(0)
        # Not from "shared memory": its /dev/shm is new, the old pod's staging went with it.
        assert resumed.group(2) == "storage" or resumed.group(2).startswith(
            f"peer memory (node fsdp-train-workers-0-{1 - evicted}:"), resumed.group(0)
        assert stays.exit_code() == 0, stays.output
        assert new.exit_code() == 0, new.output
        assert run.gone(stays, 0) == run.gone(new, 0) == "Succeeded"
    result = _result(fsx)
    assert result["final_step"] == STEPS and result["resumed_from"] == \
        int(preempted.group(1)), result
    assert result["weights_sha256"] == fault_free["result"]["weights_sha256"], \
        (result, fault_free["result"])


def test_a_pod_whose_gpu_is_fatal_exits_3_and_fails_the_jobset(tmp_path):
    """Pod 1's GPU falls off the bus mid-run (a fake NVML): its ftlaunch stops its ranks and
    exits 3; the podFailurePolicy says FailJob, the Job deletes pod 0 (which leaves with
    143) and re-creates nothing; the JobSet fails without a restart."""
    fsx = tmp_path / "fsx"
    gate = tmp_path / "gpu-lost"
    healthy, lost = tmp_path / "nvml-healthy.json", tmp_path / "nvml-lost.json"
    healthy.write_text(json.dumps({"gpus": 1}))
    lost.write_text(json.dumps({"gpus": 1, "events": [
        {"when": str(gate), "gpu": 0, "set": {"lost": True, "xids": [79]}}]}))
    # A health reading every 0.2 s instead of 5 s, so the loss is seen at once.
    js = jobset_for_test(fsx, extra_flags=("--health-interval=0.2",))
    with emulated(tmp_path, 2, js) as run:
        first = run.create(0, {"FTLAUNCH_FAKE_NVML": str(healthy)})
        second = run.create(1, {"FTLAUNCH_FAKE_NVML": str(lost)})
        _wait_step([first, second], 5)
        gate.touch()  # the node's GPU is gone now
        code = second.exit_code()
        assert code == exit_codes.DO_NOT_REQUEUE, second.output
        assert re.search(r"node unhealthy: GPU 0: GPU is lost.*do not requeue", second.output), \
            second.output
        assert run.gone(second, code) == "FailJob"
        assert run.failure == "PodFailurePolicy" and not run.live
        # Pod 0's rank, parked after pod 1 was excluded, leaves on the SIGTERM at once (it
        # has nothing left to save), not after --grace-period.
        assert first.deleted_code == exit_codes.SIGNAL_BASE + signal.SIGTERM, first.output
        assert not first.killed, "pod 0 outlived its grace period"
        assert "grace period over" not in first.output, first.output
        with pytest.raises(AssertionError, match="no replacement"):
            run.replace(second)
        assert [p.index for p in run.created] == [0, 1]
    assert jobset_failure_action(js, run.failure) == "FailJobSet"
    assert not fsx.joinpath("result.json").exists()
