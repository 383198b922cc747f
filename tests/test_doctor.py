"""``ftlaunch doctor`` as a user runs it: real processes, GPUs from the fake NVML backend."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
from conftest import TAG_VAR, tagged_processes

from launcher import exit_codes
from launcher.doctor import Check, check_shm, exit_code
from launcher.gpu_health import FAKE_ENV


def run_doctor(env: dict[str, str], cwd, *args: str, scenario: dict | None = None,
               timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m launcher doctor ARGS`` in cwd; ``scenario`` is the fake NVML's machine."""
    if scenario is not None:
        (cwd / "nvml.json").write_text(json.dumps(scenario))
        env = {**env, FAKE_ENV: str(cwd / "nvml.json")}
    return subprocess.run([sys.executable, "-m", "launcher", "doctor", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def checks_of(proc: subprocess.CompletedProcess) -> dict[str, dict]:
    """The --json rows by name; stdout must be exactly one JSON object."""
    report = json.loads(proc.stdout)
    assert report["exit_code"] == proc.returncode
    assert report["healthy"] == (proc.returncode == 0)
    return {c["name"]: c for c in report["checks"]}


# --- the exit-code decision (pure) -----------------------------------------------------------


@pytest.mark.parametrize("checks, expected", [
    ([], exit_codes.OK),
    ([Check("a", "ok", ""), Check("b", "info", ""), Check("c", "warn", "")], exit_codes.OK),
    ([Check("a", "warn", ""), Check("b", "fail", "")], exit_codes.JOB_FAILED),
    ([Check("smoke", "fail", "", hardware=True)], exit_codes.DO_NOT_REQUEUE),
    ([Check("smoke", "ok", "", hardware=True)], exit_codes.OK),
    ([Check("GPU 0", "drain", "")], exit_codes.DO_NOT_REQUEUE),
    ([Check("GPU 0", "fatal", "")], exit_codes.DO_NOT_REQUEUE),
    ([Check("/dev/shm", "fail", ""), Check("GPU 1", "fatal", "")], exit_codes.DO_NOT_REQUEUE),
    ([Check("GPU 0", "warn", ""), Check("rdzv", "fail", "")], exit_codes.JOB_FAILED),
])
def test_exit_code(checks, expected):
    assert exit_code(checks) == expected


def test_shm_missing_warns_and_small_staging_room_fails(tmp_path):
    assert check_shm(0, str(tmp_path / "missing")).status == "warn"
    tight = check_shm(1e9, str(tmp_path))
    assert tight.status == "fail" and "emptyDir medium: Memory" in tight.detail
    assert check_shm(1e-9, str(tmp_path)).status == "ok"
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize / (1 << 30)
    assert check_shm(free / 3, str(tmp_path)).status == "ok"  # 2x staging fits
    with_copy = check_shm(free / 3, str(tmp_path), replicas=1)  # 4x does not
    assert with_copy.status == "fail" and "1 peer copy" in with_copy.detail


# --- GPUs (fake NVML) ------------------------------------------------------------------------


def test_no_gpu_is_fine(launcher_env, tmp_path):
    proc = run_doctor(launcher_env, tmp_path, "--no-smoke", scenario={"gpus": 0})
    assert proc.returncode == exit_codes.OK, proc.stderr
    assert "no NVIDIA GPU" in proc.stdout and "healthy" in proc.stdout


def test_two_healthy_gpus(launcher_env, tmp_path):
    scenario = {"gpus": 2, "driver": "570.1.2", "cuda": "12.8"}
    proc = run_doctor(launcher_env, tmp_path, "--json", "--no-smoke", scenario=scenario)
    assert proc.returncode == exit_codes.OK, proc.stderr
    rows = checks_of(proc)
    assert rows["NVIDIA driver"] == {"name": "NVIDIA driver", "status": "ok", "detail": "570.1.2"}
    assert "12.8" in rows["CUDA driver"]["detail"]
    for i in (0, 1):
        assert rows[f"GPU {i}"]["status"] == "ok"
        assert f"GPU-fake-{i}" in rows[f"GPU {i}"]["detail"]
    assert "GPU 2" not in rows
    assert rows["torch"]["status"] == "warn"  # NVML sees GPUs, the CPU build of torch does not


def test_failed_row_remap_is_fatal(launcher_env, tmp_path):
    scenario = {"gpus": 2, "events": [{"after": 0, "gpu": 1, "set": {"remap_failed": True}}]}
    proc = run_doctor(launcher_env, tmp_path, "--json", "--no-smoke", scenario=scenario)
    assert proc.returncode == exit_codes.DO_NOT_REQUEUE, proc.stderr
    rows = checks_of(proc)
    assert rows["GPU 0"]["status"] == "ok"
    assert rows["GPU 1"]["status"] == "fatal"
    assert "row remapping failed" in rows["GPU 1"]["detail"]


def test_thermal_slowdown_warns(launcher_env, tmp_path):
    scenario = {"events": [{"after": 0, "gpu": 0, "set": {"slowdown": ["thermal (hardware)"]}}]}
    proc = run_doctor(launcher_env, tmp_path, "--json", "--no-smoke", scenario=scenario)
    assert proc.returncode == exit_codes.OK, proc.stderr
    gpu = checks_of(proc)["GPU 0"]
    assert gpu["status"] == "warn" and "thermal (hardware) slowdown" in gpu["detail"]


# --- smoke test ------------------------------------------------------------------------------


def test_smoke_gloo_two_ranks(launcher_env, tmp_path):
    proc = run_doctor(launcher_env, tmp_path, "--json", "--nproc", "2")
    assert proc.returncode == exit_codes.OK, proc.stdout + proc.stderr
    smoke = checks_of(proc)["smoke (2 x gloo)"]
    assert smoke["status"] == "ok" and "on 2 ranks in" in smoke["detail"], smoke


def test_smoke_timeout_kills_ranks(launcher_env, tmp_path):
    """The ranks are still importing torch at the deadline: killed and reaped before exit."""
    proc = run_doctor(launcher_env, tmp_path, "--json", "--nproc", "2", "--timeout", "0.5")
    assert tagged_processes(launcher_env[TAG_VAR]) == []  # at once, not after a grace period
    assert proc.returncode == exit_codes.JOB_FAILED, proc.stdout + proc.stderr  # CPU: not hardware
    smoke = checks_of(proc)["smoke (2 x gloo)"]
    assert smoke["status"] == "fail" and "timed out after 0.5 s" in smoke["detail"], smoke


# --- network ---------------------------------------------------------------------------------


def test_unresolvable_rdzv_endpoint_fails(launcher_env, tmp_path):
    proc = run_doctor(launcher_env, tmp_path, "--json", "--no-smoke",
                      "--rdzv-endpoint", "no-such-host.invalid:29400")
    assert proc.returncode == exit_codes.JOB_FAILED, proc.stderr
    row = checks_of(proc)["rdzv no-such-host.invalid:29400"]
    assert row["status"] == "fail"
    assert "cannot resolve 'no-such-host.invalid'" in row["detail"], row


def test_ports_in_use_warn_and_listener_connects(launcher_env, tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as rdzv, \
            socket.create_server(("0.0.0.0", 0)) as master:
        rdzv_port, master_port = rdzv.getsockname()[1], master.getsockname()[1]
        proc = run_doctor(launcher_env, tmp_path, "--json", "--no-smoke",
                          "--rdzv-endpoint", f"127.0.0.1:{rdzv_port}",
                          "--master-port", str(master_port))
    assert proc.returncode == exit_codes.OK, proc.stderr
    rows = checks_of(proc)
    assert rows["rdzv port"]["status"] == "warn" and "in use" in rows["rdzv port"]["detail"]
    assert rows[f"rdzv 127.0.0.1:{rdzv_port}"]["status"] == "ok"
    assert rows["master port"]["status"] == "warn"


def test_free_local_rdzv_endpoint_is_bindable_but_not_listening(launcher_env, tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]  # closed again before the doctor binds it
    proc = run_doctor(launcher_env, tmp_path, "--json", "--no-smoke",
                      "--rdzv-endpoint", f"localhost:{port}", "--staging-gib", "1e9")
    assert proc.returncode == exit_codes.JOB_FAILED, proc.stderr  # the staging, not the port
    rows = checks_of(proc)
    assert rows["rdzv port"] == {"name": "rdzv port", "status": "ok",
                                 "detail": f"127.0.0.1:{port} free"}
    assert rows[f"rdzv localhost:{port}"]["status"] == "warn"
    assert "nothing listening yet" in rows[f"rdzv localhost:{port}"]["detail"]
    assert rows["/dev/shm"]["status"] == "fail"


# --- usage -----------------------------------------------------------------------------------


@pytest.mark.parametrize("args, named", [
    (["--bogus"], "--bogus"),
    (["--nproc", "0"], "--nproc"),
    (["--staging-gib", "-1"], "--staging-gib"),
    (["--rdzv-endpoint", "node0:port"], "HOST[:PORT]"),
    (["--master-port", "70000"], "--master-port"),
])
def test_bad_option_is_one_line(launcher_env, tmp_path, args, named):
    proc = run_doctor(launcher_env, tmp_path, *args, timeout=60)
    assert proc.returncode == exit_codes.USAGE
    assert proc.stdout == ""
    assert proc.stderr.startswith("ftlaunch doctor: error: ") and proc.stderr.count("\n") == 1
    assert named in proc.stderr and "--help" in proc.stderr


def test_help(launcher_env, tmp_path):
    proc = run_doctor(launcher_env, tmp_path, "--help", timeout=60)
    assert proc.returncode == exit_codes.OK
    assert "--staging-gib" in proc.stdout and "Exit codes" in proc.stdout
