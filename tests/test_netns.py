"""Real multi-machine faults: each node is a network namespace with its own address
(10.200.0.K on a private bridge), hostname (nodeK), hosts file and resolver
(scripts/netns.py). Partitions and packet loss are iptables rules inside one node's
namespace. The checkpoint directory is one host directory, shared like an FSx/EFS mount.
Skipped without root, ``ip`` or ``iptables`` (scripts/test.sh installs them where it can)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import queue
import re
import secrets
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import (
    ROOT,
    SCRIPTS,
    TAG_VAR,
    Launch,
    faults_over,
    held_before_last_step,
    kill_unfinished,
    wait_no_tagged,
)

_spec = importlib.util.spec_from_file_location("ftlaunch_netns", SCRIPTS / "netns.py")
netns = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = netns  # dataclasses look their module up by name
_spec.loader.exec_module(netns)

_WHY_NOT = netns.missing_requirements()
pytestmark = pytest.mark.skipif(_WHY_NOT is not None, reason=f"netns tests: {_WHY_NOT}")

TRAIN = str(SCRIPTS / "train_gpt.py")
PORT = 29400
# ftlaunch's default. (At 2-3 s, a coordinator agent whose store thread imported torch under
# the GIL stalled past it on a busy 2-core machine; stores are now forked from the rank
# template or run in their own process, and these tests no longer forgive that failure.)
NODE_TIMEOUT = 5.0
# How long after a partition the survivors must have acted: the node timeout, the
# coordinator's 50 ms tick, the recover message, stopping the ranks, slack for two busy cores.
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

    def start(k: int, *, steps: int, nnodes: str = "2:3", held: bool = False) -> NodeLaunch:
        """``held``: the ranks hold before their last step until ``faults_over``."""
        node = cluster.node(k)
        # last_call is long on purpose: rounds close at once with MAX=3 nodes, or once the
        # survivors are back, so it only matters if a node is slow to start (no scale-up).
        args = ["--nnodes", nnodes, "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{cluster.node(1).addr}:{PORT}", "--rdzv-id", "job",
                "--node-timeout", f"{NODE_TIMEOUT:g}", "--heartbeat-interval", "0.2",
                "--rdzv-conf", "last_call_timeout=10,join_timeout=30",
                "--log-dir", str(tmp_path / "logs" / node.hostname),
                TRAIN, "--steps", str(steps), "--ckpt-every", "10", "--step-time", "0.03",
                "--log-every", "5", "--ckpt-dir", str(tmp_path / "ckpt"),
                "--out", str(tmp_path / "out.json")]
        run = NodeLaunch(node, args, ROOT,
                         {**env, **(held_before_last_step(tmp_path) if held else {})})
        started.append(run)
        if k == 1:  # the agent that can bind the endpoint hosts the coordinator
            _wait_listening(run, PORT)
        return run

    yield start
    kill_unfinished(started)
    for run in started:  # what each machine printed, for a post-mortem
        (tmp_path / f"{run.node.hostname}.log").write_text(run.drain() + "\n")


def _wait_listening(run: NodeLaunch, port: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not run.node.listening(port):
        if run.proc.poll() is not None:
            run.finish(timeout=10)
            pytest.fail(f"{run.node.hostname}'s agent exited ({run.proc.returncode}) before "
                        f"listening on {port}:\n{run.output}")
        if time.monotonic() > deadline:
            pytest.fail(f"nothing listened on {run.node.addr}:{port} within {timeout}s")
        time.sleep(0.05)  # polling the namespace's socket table: there is no event to wait on


@contextlib.contextmanager
def _three_nodes(nodes, steps: int, held: bool = False):
    """Start nodes 1 (coordinator), 2 and 3."""
    yield [nodes(k, steps=steps, held=held) for k in (1, 2, 3)]


def _events(tmp_path, run: NodeLaunch) -> list[dict]:
    """The node's job events (``--log-dir``/<run id>/events.jsonl)."""
    paths = list((tmp_path / "logs" / run.node.hostname).glob("*/events.jsonl"))
    assert len(paths) == 1, paths
    return [json.loads(line) for line in paths[0].read_text().splitlines()]


def _result(tmp_path) -> dict:
    return json.loads((tmp_path / "out.json").read_text())


@pytest.mark.timeout(150)
def test_three_machines_form_one_job_and_finish(nodes, tmp_path):
    with _three_nodes(nodes, steps=20) as runs:
        for run in runs:
            assert run.finish(timeout=90) == 0, run.output
        for k, run in enumerate(runs, 1):
            assert f"[rank{k - 1}]: start rank {k - 1} world 3 " in run.output, run.output
            started = [e for e in _events(tmp_path, run) if e["event"] in ("started",
                                                                             "recovered")]
            assert [e.get("world_size") for e in started] == [3], started  # no restart
        result = _result(tmp_path)
        assert result["final_step"] == 20 and result["restart_count"] == 0, result


@pytest.mark.timeout(150)
def test_partitioned_node_is_dropped_and_survivors_finish(nodes, cluster, launcher_env,
                                                          tmp_path):
    steps = 60
    with _three_nodes(nodes, steps=steps) as runs:
        first, second, third = runs
        for run in (first, second, third):
            run.wait_for(r"\[rank\d\]: step 15 ", timeout=90)
        partitioned_at = time.monotonic()
        cluster.node(3).partition()  # INPUT and OUTPUT on its eth0: the machine is unreachable
        # Its heartbeats stop and its connection goes unanswered at once: the coordinator's
        # liveness check and the kernel's (keepalive, TCP_USER_TIMEOUT) both expire at the node
        # timeout, and whichever comes first names the loss.
        why = rf"(no heartbeat for {NODE_TIMEOUT:g}s|nothing from its machine for {NODE_TIMEOUT:g}s)"
        lost = rf"node node3:\d+ lost \({why}\) -> rank restart 1/3"
        for run in (first, second):
            run.wait_for(lost, timeout=ACT_WITHIN + 10)
            acted_after = time.monotonic() - partitioned_at
            assert acted_after < ACT_WITHIN, f"{run.node.hostname} acted after {acted_after:.1f}s"
        assert re.search(rf"ftlaunch\.coordinator: node node3:\d+ lost(: no heartbeat| \({why}\))",
                         first.output), first.output  # the coordinator's own log line
        first.wait_for(r"\[rank0\]: start rank 0 world 2 ", timeout=60)
        second.wait_for(r"\[rank1\]: start rank 1 world 2 ", timeout=60)
        assert first.finish(timeout=60) == 0, first.output
        assert second.finish(timeout=30) == 0, second.output
        result = _result(tmp_path)
        assert result["final_step"] == steps and result["restart_count"] == 1, result
        assert result["resumed_from"] >= 10, result  # the shared checkpoint, not from scratch

        # The cut-off machine never hears the end of the job and may wait for its own
        # rendezvous forever: kill it like a dead machine. Nothing it started may survive.
        third.proc.kill()
        third.finish(timeout=10)
        assert wait_no_tagged(launcher_env[TAG_VAR]) == []
        # A SIGKILLed process with a large address space (a warm-pool interpreter) can
        # still be in the namespace's list while the kernel tears it down: bounded wait.
        deadline = time.monotonic() + 10
        while cluster.node(3).pids() and time.monotonic() < deadline:
            time.sleep(0.05)  # the namespace's process list: there is no event to wait on
        assert cluster.node(3).pids() == [], "processes left in the partitioned namespace"


def _elastic_pair(nodes, steps: int) -> tuple[NodeLaunch, NodeLaunch]:
    """Nodes 1 and 2 of a --nnodes 1:2 job, both training, held before their last step."""
    first, second = (nodes(k, steps=steps, nnodes="1:2", held=True) for k in (1, 2))
    for run in (first, second):
        run.wait_for(r"\[rank\d\]: step 15 ", timeout=90)
    return first, second


@pytest.mark.timeout(150)
def test_a_two_machine_job_cut_in_two_trains_on_one_side_only(nodes, cluster, tmp_path):
    """--nnodes 1:2 and the two machines cut apart: each side alone is enough for MIN, and
    without a majority rule both would train on, each in a world of 1, the successor writing
    checkpoints of the same steps into the same directory. The coordinator's side (half the
    round, and the side that ran it) goes on; the successor's holds its round until the
    partition heals, then stands down and joins the job, which grows back to two."""
    steps = 40
    first, second = _elastic_pair(nodes, steps)
    cluster.node(2).partition()
    try:
        first.wait_for(r"\[rank0\]: start rank 0 world 1 ", timeout=ACT_WITHIN + 30)
        second.wait_for(r"rendezvous round held: 1 of the last round's 2 nodes here, 1 may "
                        r"go on", timeout=ACT_WITHIN + 30)
        first.wait_for(r"\[rank0\]: step \d+ ", timeout=30)  # it trains on meanwhile
    finally:
        cluster.node(2).heal()
    second.wait_for(r"\[rank1\]: start rank 1 world 2 ", timeout=60)
    faults_over(tmp_path)
    assert first.finish(timeout=90) == 0, first.output
    assert second.finish(timeout=30) == 0, second.output
    assert not re.search(r"start rank \d world 1 ", second.output), second.output
    assert _result(tmp_path)["final_step"] == steps


@pytest.mark.timeout(150)
def test_a_spare_outvotes_the_coordinators_machine_cut_off(nodes, cluster, tmp_path):
    """--nnodes 1:2 with a spare, and the coordinator's machine cut off: the successor and
    the spare are two of the round's three voters and go on as a world of two; the cut-off
    coordinator, MIN on its own, holds its round (without the spare's vote it would win the
    tie and train alone, the others held). Healed, it joins the job as a spare."""
    steps = 40
    first, second = _elastic_pair(nodes, steps)
    third = nodes(3, steps=steps, nnodes="1:2", held=True)
    third.wait_for(r"waiting as a spare", timeout=60)
    # A spare votes on the rounds after one that closed while it waited: a rank killed on
    # node 2, and the round that restarts it has node 3 idle.
    pid = int(re.findall(r"start rank 1 world 2 pid (\d+)", second.output)[-1])
    os.kill(pid, signal.SIGKILL)
    second.wait_for(r"\[rank1\]: start rank 1 world 2 ", timeout=30)
    cluster.node(1).partition()
    try:
        third.wait_for(r"start rank \d world 2 ", timeout=ACT_WITHIN + 30)
        first.wait_for(r"rendezvous round held: 1 of the last round's 3 nodes here, 2 may "
                       r"go on", timeout=ACT_WITHIN + 30)
    finally:
        cluster.node(1).heal()
    first.wait_for(r"waiting as a spare", timeout=60)
    faults_over(tmp_path)
    for run in (second, third, first):
        assert run.finish(timeout=90) == 0, run.output
    cut_at = first.output.index("rendezvous round held")
    assert not re.search(r"start rank \d world 1 ", first.output[cut_at:]), first.output
    assert _result(tmp_path)["final_step"] == steps


@pytest.mark.timeout(150)
def test_packet_loss_on_one_node_does_not_stop_the_job(nodes, cluster, tmp_path):
    steps = 30
    cluster.node(2).drop_output(0.2)  # from rendezvous on: heartbeats, store, gloo
    with _three_nodes(nodes, steps=steps) as runs:
        for run in runs:
            assert run.finish(timeout=90) == 0, run.output
        assert _result(tmp_path)["final_step"] == steps
    assert cluster.node(2).dropped() > 0, "nothing was dropped"


class StillDropped(AssertionError):
    """The paused node neither re-joined nor left cleanly."""


@pytest.mark.timeout(150)
def test_paused_node_rejoins_or_leaves_cleanly(nodes, tmp_path):
    """A machine frozen past --node-timeout (VM pause, swap storm, the GIL stall above) is
    dropped and the others carry on; once it thaws it must learn that it was dropped and
    re-join (nnodes 2:3 leaves room) or leave with exit 0, not fail the job later."""
    # Held: still training when node2 thaws (at 80 steps and no hold, a fast machine
    # finished first, and node2 thawed after the job had ended).
    steps = 40
    with _three_nodes(nodes, steps=steps, held=True) as runs:
        first, second, third = runs
        for run in runs:
            run.wait_for(r"\[rank\d\]: step 10 ", timeout=90)
        os.kill(second.proc.pid, signal.SIGSTOP)  # the agent only; its rank runs on
        try:
            first.wait_for(rf"node node2:\d+ lost \(no heartbeat for {NODE_TIMEOUT:g}s\) "
                           r"-> rank restart 1/3", timeout=ACT_WITHIN + 10)
            # The fault's length, not a wait: frozen ~1 s beyond the coordinator's verdict,
            # so the agent cannot miss that it was silent for longer than the node timeout.
            time.sleep(1.0)
        finally:
            os.kill(second.proc.pid, signal.SIGCONT)
        faults_over(tmp_path)
        assert first.finish(timeout=60) == 0, first.output
        assert third.finish(timeout=30) == 0, third.output
        assert _result(tmp_path)["final_step"] == steps
    try:
        code = second.proc.wait(timeout=8)
    except subprocess.TimeoutExpired:
        code = None
    if code != 0:
        raise StillDropped(f"node2 {'still runs' if code is None else f'exited {code}'} "
                           f"after the job finished:\n{second.drain()}")


_REPLICA_NODE = r'''
import hashlib, json, os, sys, time
from pathlib import Path
import zmq
sys.path.insert(0, sys.argv[1])
from ftlaunch_contract.messages import Held, Peer
from ftlaunch_contract.staging import Slot
from launcher.replica_service import FetchDone, ReplicaService
role, directory, addr = sys.argv[2], Path(sys.argv[3]), sys.argv[4]
secret = os.environ["FTLAUNCH_SECRET"].encode()
service = ReplicaService(zmq.Context(), secret, role, addr, directory, reply_timeout=60)
if role == "source":  # a rank staged 5 MiB (two chunks) here
    data = os.urandom(5 << 20)
    slot = Slot(str(directory), 1, 0)
    slot.ensure(len(data))
    slot.buffer[:len(data)] = data
    slot.seal({"step": 5, "rank": 1, "world_size": 2, "save_id": "s", "history": "round 1",
               "dest": "/ckpt", "tree": {}, "tensors": [], "nbytes": len(data)})
    print(json.dumps({"port": service.port, "sha": hashlib.sha256(data).hexdigest()}), flush=True)
    sys.stdin.read()  # serve until the test is done
else:
    source, port = sys.argv[5], int(sys.argv[6])
    started = time.monotonic()
    service.fetch([(Held(2, 1, 5), Peer("source", source, port))])
    done = None
    while done is None:
        zmq.select([service.fd], [], [], 1.0)
        done = next((n for n in service.news() if isinstance(n, FetchDone)), None)
    copy = directory / "replicas" / "rank_1.0.data"
    data = copy.read_bytes()[:5 << 20] if done.pulled else b""
    print(json.dumps({"pulled": done.pulled, "seconds": time.monotonic() - started,
                      "sha": hashlib.sha256(data).hexdigest()}), flush=True)
service.close()
'''


def test_a_replica_transfer_completes_under_20_percent_packet_loss(cluster, launcher_env,
                                                                   tmp_path):
    """A shard pulled from a peer whose every sent packet has a 20% chance to be dropped
    arrives whole (TCP retransmits; the transfer only gives up when a peer stops answering)."""
    env = {**launcher_env, "FTLAUNCH_SECRET": secrets.token_hex(16)}
    source_node, puller_node = cluster.node(1), cluster.node(2)
    dirs = {}
    for name in ("source", "puller"):
        dirs[name] = tmp_path / name
        dirs[name].mkdir()
    source = subprocess.Popen(source_node.command(
        [sys.executable, "-c", _REPLICA_NODE, str(ROOT), "source", str(dirs["source"]),
         source_node.addr]), env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        offered = json.loads(source.stdout.readline())
        source_node.drop_output(0.2)
        pulled = subprocess.run(puller_node.command(
            [sys.executable, "-c", _REPLICA_NODE, str(ROOT), "puller", str(dirs["puller"]),
             puller_node.addr, source_node.addr, str(offered["port"])]),
            env=env, capture_output=True, text=True, timeout=240)
        assert pulled.returncode == 0, pulled.stderr
        result = json.loads(pulled.stdout.splitlines()[-1])
        assert result["pulled"] == 1 and result["sha"] == offered["sha"], result
    finally:
        source.stdin.close()
        source.wait(timeout=30)
