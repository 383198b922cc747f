"""ftlaunch as a container's entrypoint: PID 1 of its own PID namespace (``unshare --pid
--fork --mount-proc``, the kernel piece a container runtime uses). Orphans become its
children and must be reaped; the signals a kubelet or ``scancel`` send to PID 1 must
reach the ranks, and the ranks' fate must be the container's exit code."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

import psutil
import pytest

# A rank that daemonizes three short-lived helpers (double fork): once their parents
# exit, the helpers are re-parented to PID 1, which must reap them when they exit.
DAEMONIZER = """
import os, sys, time
d = sys.argv[1]
for i in range(3):
    if os.fork() == 0:
        if os.fork() == 0:
            time.sleep(0.3)
            open(os.path.join(d, f"helper{i}"), "w").close()
            os._exit(0)
        os._exit(0)
    os.wait()
print("helpers started", flush=True)
deadline = time.monotonic() + 60
while not os.path.exists(os.path.join(d, "finish")) and time.monotonic() < deadline:
    time.sleep(0.05)  # the test's go-ahead: a file
"""


def _pid_namespaces_work() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"],
                          capture_output=True, timeout=30).returncode == 0


pytestmark = pytest.mark.skipif(not _pid_namespaces_work(),
                                reason="needs root and unshare --pid (util-linux)")
AS_PID1 = ("unshare", "--pid", "--fork", "--mount-proc")


def _pid1(run) -> psutil.Process:
    """ftlaunch's process, PID 1 inside the namespace (unshare's child outside)."""
    deadline = time.monotonic() + 30
    while not (children := psutil.Process(run.proc.pid).children()):
        if time.monotonic() > deadline:
            pytest.fail("unshare started no child")
        time.sleep(0.02)  # a process appearing: no event to wait on
    return children[0]


def _zombies(parent: psutil.Process) -> list[psutil.Process]:
    found = []
    for child in parent.children():
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                found.append(child)
        except psutil.NoSuchProcess:
            continue
    return found


def test_as_pid1_it_reaps_orphans_and_returns_the_jobs_exit_code(tmp_path, launch):
    script = tmp_path / "daemonizer.py"
    script.write_text(DAEMONIZER)
    run = launch("--standalone", "--nproc-per-node", "1", str(script), str(tmp_path),
                 prefix=AS_PID1)
    run.wait_for("helpers started")
    init = _pid1(run)
    deadline = time.monotonic() + 30
    while len(list(tmp_path.glob("helper*"))) < 3:  # each writes its file, then exits
        assert time.monotonic() < deadline, "the helpers never ran"
        time.sleep(0.02)
    deadline = time.monotonic() + 10
    while zombies := _zombies(init):
        assert time.monotonic() < deadline, f"PID 1 left {len(zombies)} zombies unreaped"
        time.sleep(0.02)
    (tmp_path / "finish").touch()
    assert run.finish() == 0, run.output


def test_sigterm_to_pid1_reaches_the_ranks_and_sets_the_exit_code(tmp_path, launch):
    script = tmp_path / "daemonizer.py"
    script.write_text(DAEMONIZER)
    run = launch("--standalone", "--nproc-per-node", "2", "--grace-period", "10",
                 str(script), str(tmp_path), prefix=AS_PID1)
    run.wait_for("helpers started")
    _pid1(run).send_signal(signal.SIGTERM)  # as a kubelet deleting the pod does
    assert run.finish() == 128 + signal.SIGTERM, run.output
    assert "got SIGTERM: forwarded to ranks" in run.output
