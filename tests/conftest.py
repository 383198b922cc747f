"""Shared helpers for tests that launch real agents and real ranks."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
TAG_VAR = "FTLAUNCH_TEST_TAG"

sys.path.insert(0, str(SCRIPTS))  # the runners tests drive (chaos, benches) and their helpers
from ports import take_share  # noqa: E402  (on the path just above)

# each xdist worker picks ports from its own share: the other's picks never meet its own
take_share(int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0),
           int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


class Launch:
    """A running ``ftlaunch`` whose merged output can be awaited line by line."""

    def __init__(self, args: list[str], cwd: Path, env: dict[str, str],
                 prefix: tuple[str, ...] = ()):
        """``prefix``: a command ftlaunch runs under (e.g. ``unshare ...``)."""
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "launcher", *args], cwd=cwd, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_for(self, pattern: str, timeout: float = 60) -> re.Match:
        """Block until a line matches ``pattern``; fail on EOF or timeout."""
        deadline = time.monotonic() + timeout
        regex = re.compile(pattern)
        while True:
            try:
                line = self._queue.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"no line matching {pattern!r} within {timeout}s:\n" + self.output)
            if line is None:
                self._queue.put(None)
                pytest.fail(f"ftlaunch ended before a line matched {pattern!r}:\n" + self.output)
            self.lines.append(line)
            match = regex.search(line)
            if match:
                return match

    def finish(self, timeout: float = 120) -> int:
        """Wait for exit (hang guard), collect all output, return the exit code."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail(f"ftlaunch did not exit within {timeout}s:\n" + self.output)
        while (line := self._queue.get(timeout=10)) is not None:
            self.lines.append(line)
        self._queue.put(None)
        return code

    def drain(self) -> str:
        """Take in every line printed so far without waiting; return all output."""
        with contextlib.suppress(queue.Empty):
            while (line := self._queue.get_nowait()) is not None:
                self.lines.append(line)
            self._queue.put(None)
        return self.output

    @property
    def output(self) -> str:
        return "\n".join(self.lines)


needs_iptables = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("iptables") is None,
                                    reason="silencing a connection needs root and iptables")
needs_ss_kill = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ss") is None,
                                   reason="ending live connections (ss -K) needs root and ss")


def end_connections_to(port: int) -> str:
    """Have the kernel abort every local TCP connection to ``port`` (ss -K: both processes
    live and both ends see the connection close, as TCP_USER_TIMEOUT under packet loss
    does); returns what ss listed. A connection to it is a socket whose peer has that port
    and whose own port is no listening one: a server's socket whose client's ephemeral
    port has that number is another test's (see silenced)."""
    def local_ports(*query: str) -> list[int]:
        listed = subprocess.run(["ss", "-tnH", *query], capture_output=True, text=True,
                                check=True).stdout.split("\n")
        return [int(cols[-2].rpartition(":")[2]) for cols in map(str.split, listed)
                if len(cols) >= 4]
    listening = set(local_ports("state", "listening"))
    ended = ""
    for local in local_ports("state", "established", "dst", "127.0.0.1", "dport", "=",
                             f":{port}"):
        if local not in listening:
            ended += subprocess.run(["ss", "-K", "dst", "127.0.0.1", "dport", "=", f":{port}",
                                     "sport", "=", f":{local}"],
                                    capture_output=True, text=True, check=True).stdout
    return ended


@contextlib.contextmanager
def silenced(ports: list[int]) -> Iterator[None]:
    """Nothing in or out of the connections to these listening TCP ports (loopback: as if
    the machine behind them were gone), until the block ends: each connection of this
    test's processes to one, by both ends' ports, and any new one (its SYN). A rule on the
    port number alone also dropped every connection whose own ephemeral port had that
    number, the other test worker's among them (test_intake.py's dead agent, its join or
    its probe dropped, was not lost in time: 1 suite run in 2); conntrack's original
    destination cannot stand in (its hooks start with the first rule that needs them, and
    pick up a live connection from whichever end speaks first)."""
    me = psutil.Process()
    ends = set()
    for proc in [me, *me.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            for c in proc.net_connections("tcp"):
                if c.raddr and c.laddr.port in ports:  # the listener's end: (port, peer's)
                    ends.add((c.laddr.port, c.raddr.port))
                elif c.raddr and c.raddr.port in ports:  # the client's end
                    ends.add((c.raddr.port, c.laddr.port))
    rules = [["-p", "tcp", "--syn", "--dport", str(port)] for port in ports]
    for port, peer in sorted(ends):
        rules += [["-p", "tcp", "--sport", str(port), "--dport", str(peer)],
                  ["-p", "tcp", "--sport", str(peer), "--dport", str(port)]]
    for rule in rules:
        subprocess.run(["iptables", "-I", "INPUT", *rule, "-j", "DROP"], check=True)
    try:
        yield
    finally:
        for rule in rules:
            subprocess.run(["iptables", "-D", "INPUT", *rule, "-j", "DROP"])


def tagged_processes(tag: str) -> list[psutil.Process]:
    """Live processes carrying this test's tag in their environment (ranks, their children)."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and p.environ().get(TAG_VAR) == tag \
                    and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def wait_no_tagged(tag: str, timeout: float = 10) -> list[psutil.Process]:
    """Processes still alive after ``timeout``: a test asserts this is empty."""
    deadline = time.monotonic() + timeout
    while (left := tagged_processes(tag)) and time.monotonic() < deadline:
        psutil.wait_procs(left, timeout=max(0.01, min(0.5, deadline - time.monotonic())))
    return tagged_processes(tag)


def held_before_last_step(tmp_path: Path) -> dict[str, str]:
    """Environment under which train_gpt.py's ranks hold before their last step until
    ``faults_over(tmp_path)``: a fault the test still watches (a heal, a spare taking over)
    finds the job running however fast it trained, with no step count guessed as a time
    budget. (scripts/chaos.py's fault directory; only its file ``unpaced`` is used.)"""
    path = tmp_path / "chaos"
    path.mkdir(exist_ok=True)
    return {"TRAIN_CHAOS_DIR": str(path)}


def faults_over(tmp_path: Path) -> None:
    """Held ranks take their last step (and train unpaced from here)."""
    (Path(held_before_last_step(tmp_path)["TRAIN_CHAOS_DIR"]) / "unpaced").touch()


CLUSTER_VARS = ("SLURM_", "JOB_COMPLETION_INDEX", "JOBSET_", "KUBERNETES_SERVICE_",
                "MASTER_ADDR", "MASTER_PORT", "PET_")


@pytest.fixture(autouse=True)
def not_in_a_cluster(monkeypatch):
    """Tests run as on a laptop, even where CI runs in a pod or a SLURM job: what a
    scheduler tells ftlaunch is given by the tests that test it."""
    for name in list(os.environ):
        if name.startswith(CLUSTER_VARS):
            monkeypatch.delenv(name)


@pytest.fixture
def launcher_env(tmp_path):
    """Environment for launches: a unique tag to find every process they start."""
    tag = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "FTLAUNCH_", "TRAIN_"))}
    env[TAG_VAR] = tag
    env["PYTHONPATH"] = str(ROOT)
    env["FTLAUNCH_STRICT"] = "1"  # an agent's illegal phase transition is an error
    env["TMPDIR"] = str(tmp_path)  # a launch without --log-dir logs there, not in /tmp
    yield env
    leftovers = wait_no_tagged(tag)
    for p in leftovers:
        p.kill()
    assert not leftovers, f"orphan processes left behind: {leftovers}"


@pytest.fixture
def launch(tmp_path, launcher_env):
    """Start ``ftlaunch ARGS`` in tmp_path; every launch is killed at teardown."""
    started: list[Launch] = []

    def _launch(*args: str, env: dict[str, str] | None = None,
                prefix: tuple[str, ...] = ()) -> Launch:
        run = Launch(without_torch_preload(list(args), tmp_path), tmp_path,
                     {**launcher_env, **(env or {})}, prefix)
        started.append(run)
        return run

    yield _launch
    kill_unfinished(started)


def without_torch_preload(args: list[str], cwd: Path) -> list[str]:
    """A script that never mentions torch runs with ``--preload=``: its ranks would not
    import torch, yet they wait for the rank template to (3 s of a 2-core machine a launch,
    against 0.4 s in all). Left as given when the launch names its own --preload."""
    if any(a.startswith("--preload") for a in args):
        return args
    script = next((a for a in args if a.endswith(".py")), None)
    path = Path(cwd, script) if script else None
    if path is None or not path.is_file() or "torch" in path.read_text():
        return args
    at = args.index(script)  # type: ignore[arg-type]
    return [*args[:at], "--preload=", *args[at:]]


def kill_unfinished(runs: list[Launch]) -> None:
    """Teardown: SIGKILL every launch still running (the orphan check then sees its ranks)."""
    for run in runs:
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait(10)


def group_of(path: str) -> str:
    """The tests that run on one pytest-xdist worker, one after another: a file's (module
    fixtures, e.g. a SLURM cluster or a reference run, are made once), and the files that
    build "machines" on the one host bridge (netns, pods), which must never run at once."""
    module = Path(path.split("::")[0]).stem
    return "host-bridge" if module in ("test_netns", "test_pods") else module


LONGEST_GROUPS = ["host-bridge", "test_recovery", "test_multinode", "test_chaos", "test_slurm",
                  "test_gpu_health", "test_launch", "test_bench_all", "test_doctor", "test_exit",
                  "test_checkpoint"]
"""Groups that take longest, longest first (seconds on 2 vCPUs, 2026-12-06: 181, 178, 109,
89, 59, 40, 35, 34, 26, 23, 20; the rest 15 or less). A worker takes the next group when
it is done with one: handed out in file order (or by their number of tests, xdist's
default), the long ones with few tests came last and one worker ran them alone."""


def pytest_collection_modifyitems(config, items):
    """The longest groups first (scripts/test.sh keeps this order: --no-loadscope-reorder)."""
    order = {group: i for i, group in enumerate(LONGEST_GROUPS)}
    items.sort(key=lambda item: order.get(group_of(item.nodeid), len(order)))


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` by group_of. xdist's own marks a test's group by renaming its
    node id, which pytest 9 ignores (its ids are structured): every test was handed out on
    its own, a netns and a pods test ran at once, and each worker made the module fixtures."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)
    return ByGroup(config, log)


# An agent that joins at the coordinator on 127.0.0.1:argv[1] (secret argv[2], its standby port
# argv[3]) and dies at once, or when its stdin ends with argv[4] "when told": its connection
# closes as the process ends.
JOIN_AND_DIE = """
import sys, zmq
from ftlaunch_contract.messages import CONTROL
from ftlaunch_contract.protocol import Codec
port, secret, standby = sys.argv[1], bytes.fromhex(sys.argv[2]), int(sys.argv[3])
peer = zmq.Context().socket(zmq.DEALER)
peer.connect(f"tcp://127.0.0.1:{port}")
peer.send_multipart(Codec(secret).encode(CONTROL["join"](
    node_id="s", local_world_size=1, addr="127.0.0.1", standby_port=standby, rank_hint=-1,
    replica_port=0, held=(), restart_count=0, seated_earlier=(), settled_below=-1,
    group_rank=-1, seated_epoch=-1, electorate_epoch=-1), 0))
if sys.argv[4:] == ["when told"]:
    sys.stdin.read()
    import os
    os._exit(0)  # its connection closes as the process ends
peer.close(linger=5000)
"""
