"""Real multi-machine faults: each node is a network namespace with its own address
(10.200.0.K on a private bridge), hostname (nodeK) and hosts file (scripts/netns.py).
Partitions and packet loss are iptables rules inside one node's namespace. The checkpoint
directory is one host directory, shared like an FSx/EFS mount. Skipped without root,
``ip`` or ``iptables`` (scripts/test.sh installs them where it can)."""

from __future__ import annotations

import importlib.util
import json
import queue
import secrets
import subprocess
import sys
import threading
import time

import pytest
from conftest import ROOT, SCRIPTS, TAG_VAR, Launch, wait_no_tagged

_spec = importlib.util.spec_from_file_location("ftlaunch_netns", SCRIPTS / "netns.py")
netns = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = netns  # dataclasses look their module up by name
_spec.loader.exec_module(netns)

_WHY_NOT = netns.missing_requirements()
pytestmark = pytest.mark.skipif(_WHY_NOT is not None, reason=f"netns tests: {_WHY_NOT}")

TRAIN = str(SCRIPTS / "train_gpt.py")
PORT = 29400
NODE_TIMEOUT = 2.0
# How long after a partition the survivors must have acted: the node timeout, the
# coordinator's 50 ms tick, the recover message, and slack for two busy cores.
ACT_WITHIN = NODE_TIMEOUT + 4.0


class NodeLaunch(Launch):
    """``ftlaunch ARGS`` on one namespace node; output awaited like conftest's ``Launch``."""

    def __init__(self, node, args: list[str], cwd, env: dict[str, str]):
        self.node = node
        self.proc = subprocess.Popen(
            node.command([sys.executable, "-m", "launcher", *args]), cwd=cwd, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()


@pytest.fixture
def cluster():
    """Three fresh "machines"; stale ones of crashed earlier runs are removed first."""
    netns.clean_stale()
    with netns.Cluster(3) as c:
        yield c  # torn down (processes killed, veths, namespaces, bridge deleted) always


@pytest.fixture
def nodes(cluster, launcher_env, tmp_path):
    """Start ftlaunch on node K. Set up after ``cluster`` so that, at teardown, the orphan
    check of ``launcher_env`` runs before the cluster's teardown kills what is left."""
    started: list[NodeLaunch] = []
    env = {**launcher_env, "GLOO_SOCKET_IFNAME": "eth0",
           "FTLAUNCH_SECRET": secrets.token_hex(16)}

    def start(k: int, *, nnodes: str = "2:3", steps: int = 30, last_call: float = 3,
              node_timeout: float = NODE_TIMEOUT) -> NodeLaunch:
        node = cluster.node(k)
        args = ["--nnodes", nnodes, "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{cluster.node(1).addr}:{PORT}", "--rdzv-id", "job",
                "--node-timeout", f"{node_timeout:g}", "--heartbeat-interval", "0.2",
                "--rdzv-conf", f"last_call_timeout={last_call:g},join_timeout=60",
                "--log-dir", str(tmp_path / "logs" / node.hostname),
                TRAIN, "--steps", str(steps), "--ckpt-every", "10", "--step-time", "0.03",
                "--log-every", "5", "--ckpt-dir", str(tmp_path / "ckpt"),
                "--out", str(tmp_path / "out.json")]
        run = NodeLaunch(node, args, ROOT, env)
        started.append(run)
        if k == 1:  # the agent that can bind the endpoint hosts the coordinator
            _wait_listening(run, PORT)
        return run

    yield start
    for run in started:
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait(10)
        # What each machine printed, for a post-mortem (lines awaited so far).
        (tmp_path / f"{run.node.hostname}.log").write_text(run.output + "\n")


def _wait_listening(run: NodeLaunch, port: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not run.node.listening(port):
        if run.proc.poll() is not None:
            pytest.fail(f"{run.node.hostname}'s agent exited ({run.proc.returncode}) before "
                        f"listening on {port}:\n" + run.finish())
        if time.monotonic() > deadline:
            pytest.fail(f"nothing listened on {run.node.addr}:{port} within {timeout}s")
        time.sleep(0.05)  # polling the namespace's socket table: there is no event to wait on


def _three_nodes(nodes, **kw) -> list[NodeLaunch]:
    return [nodes(k, **kw) for k in (1, 2, 3)]


def _events(tmp_path, run: NodeLaunch) -> list[dict]:
    """The node's job events (``--log-dir``/<run id>/events.jsonl)."""
    paths = list((tmp_path / "logs" / run.node.hostname).glob("*/events.jsonl"))
    assert len(paths) == 1, paths
    return [json.loads(line) for line in paths[0].read_text().splitlines()]


def _result(tmp_path) -> dict:
    return json.loads((tmp_path / "out.json").read_text())


@pytest.mark.timeout(120)
def test_three_machines_form_one_job_and_finish(nodes, tmp_path):
    runs = _three_nodes(nodes, steps=20)
    for run in runs:
        assert run.finish(timeout=90) == 0, run.output
    everything = "\n".join(run.output for run in runs)
    for k, run in enumerate(runs, 1):
        assert "world size 3" in run.output, run.output
        assert f"start rank {k - 1} world 3 " in run.output, everything
    assert _result(tmp_path) == {**_result(tmp_path), "final_step": 20, "restart_count": 0}
    # Each node had its own identity: node ids are hostname:pid, and the coordinator saw all.
    started = [e for run in runs for e in _events(tmp_path, run) if e["event"] == "started"]
    assert [e["world_size"] for e in started] == [3, 3, 3], started


@pytest.mark.timeout(120)
def test_partitioned_node_is_dropped_and_survivors_finish(nodes, cluster, launcher_env,
                                                          tmp_path):
    steps = 80
    first, second, third = _three_nodes(nodes, steps=steps)
    for run in (first, second, third):
        run.wait_for(r"\[rank\d\]: step 15 ", timeout=60)
    partitioned_at = time.monotonic()
    cluster.node(3).partition()  # INPUT and OUTPUT on its eth0: the machine is unreachable
    lost = r"node node3:\d+ lost \(no heartbeat for 2s\) -> cold restart 1/3"
    for run in (first, second):
        run.wait_for(lost, timeout=ACT_WITHIN + 10)
        acted_after = time.monotonic() - partitioned_at
        assert acted_after < ACT_WITHIN, f"{run.node.hostname} acted after {acted_after:.1f}s"
    assert "ftlaunch.coordinator: node node3:" in first.output  # the coordinator's own log
    first.wait_for(r"\[rank0\]: start rank 0 world 2 ", timeout=30)
    second.wait_for(r"\[rank1\]: start rank 1 world 2 ", timeout=30)
    assert first.finish(timeout=60) == 0, first.output
    assert second.finish(timeout=30) == 0, second.output
    result = _result(tmp_path)
    assert result["final_step"] == steps and result["restart_count"] == 1, result
    assert result["resumed_from"] >= 10, result  # from the shared checkpoint, not from scratch

    # The cut-off machine never hears the end of the job; it may wait forever. Kill it
    # like a dead machine, and nothing it started may be left running.
    third.proc.kill()
    third.finish(timeout=10)
    assert wait_no_tagged(launcher_env[TAG_VAR]) == []
    assert not cluster.node(3).pids(), "processes left in the partitioned namespace"


@pytest.mark.timeout(120)
def test_packet_loss_on_one_node_does_not_stop_the_job(nodes, cluster, tmp_path):
    steps = 30
    cluster.node(2).drop_output(0.2)  # from rendezvous on: heartbeats, store, gloo
    runs = _three_nodes(nodes, steps=steps)
    for run in runs:
        assert run.finish(timeout=90) == 0, run.output
    assert _result(tmp_path)["final_step"] == steps
    drops = cluster.node(2).run("iptables", "-w", "5", "-nvxL", "OUTPUT")
    assert int(drops.splitlines()[2].split()[0]) > 0, f"no packet was dropped:\n{drops}"
