"""The real console command on bad input: exit 2, one ``ftlaunch: error:`` line, nothing started."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

import launcher
from launcher.cli import main

WORKDIR_FILES = {
    "train.py": "raise SystemExit('the script must never run')\n",
    "unknown_key.yaml": "max_restart: 2\n",
    "syntax.yaml": "nnodes: [1,\nmax_restarts: 2\n",
    "wrong_type.yaml": 'max_restarts: "many"\n',
}


@dataclass
class Run:
    workdir: Path
    returncode: int
    stdout: str
    stderr: str


def _start(workdir: Path, args: list[str], env_extra: dict[str, str]) -> subprocess.Popen:
    for name, text in WORKDIR_FILES.items():
        (workdir / name).write_text(text)
    (workdir / "tmp").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "FTLAUNCH_"))}
    env["TMPDIR"] = str(workdir / "tmp")  # anything started would leave a trace here
    env.update(env_extra)
    return subprocess.Popen([sys.executable, "-m", "launcher", *args], cwd=workdir, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def assert_usage_error(result: Run, *fragments: str) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    line = lines[0]
    assert line.startswith("ftlaunch: error: ")
    assert line[len("ftlaunch: error: "):].strip()
    for fragment in fragments:
        assert fragment in line, (fragment, line)
    return line


def assert_nothing_started(result: Run) -> None:
    assert not (result.workdir / "logs").exists(), "a usage error must not create the log dir"
    assert list((result.workdir / "tmp").iterdir()) == [], "a usage error must not create temp dirs"


# Run through the real console command: name -> (argv, fragments the error line must contain).
CASES = {
    "unknown flag": (["--bogus-flag", "train.py"], ["--bogus-flag"]),
    "bad nnodes": (["--nnodes", "abc", "train.py"], ["--nnodes", "abc"]),
    "bad nproc": (["--nproc-per-node", "many", "train.py"], ["--nproc-per-node", "many"]),
    "module and no-python": (["-m", "--no-python", "train.py"], ["--module", "--no-python"]),
    "missing script": (["missing.py"], ["missing.py", "not found"]),
    "missing executable": (["--no-python", "ftlaunch-no-such-executable-xyz"],
                           ["ftlaunch-no-such-executable-xyz"]),
    "no script": ([], ["TRAINING_SCRIPT"]),
    "yaml unknown key": (["--config", "unknown_key.yaml", "train.py"],
                         ["max_restart", "did you mean 'max_restarts'"]),
    "yaml syntax": (["--config", "syntax.yaml", "train.py"], ["syntax.yaml", "YAML"]),
    "config not found": (["--config", "nope.yaml", "train.py"], ["nope.yaml"]),
    "yaml wrong type": (["--config", "wrong_type.yaml", "train.py"], ["max_restarts", "many"]),
    "bad redirects": (["--redirects", "5", "train.py"], ["--redirects"]),
    "bad signals": (["--signals-to-handle", "SIGTERM,SIGFOO", "train.py"], ["SIGFOO"]),
    "bad choice": (["--rdzv-backend", "zookeeper", "train.py"], ["zookeeper"]),
    "int flag not int": (["--max-restarts", "lots", "train.py"], ["lots"]),
}

# Checked in-process through cli.main (same code path, no interpreter start-up per case).
MORE_CASES = {
    "zero nnodes": (["--nnodes", "0", "train.py"], ["--nnodes"]),
    "inverted nnodes": (["--nnodes", "4:2", "train.py"], ["--nnodes"]),
    "zero nproc": (["--nproc_per_node=0", "train.py"], ["--nproc-per-node"]),
    "bad tee": (["-t", "0:9", "train.py"], ["--tee"]),
    "bad local ranks filter": (["--local-ranks-filter", "3", "train.py"],
                               ["--local-ranks-filter"]),
    "unhandleable signal": (["--signals-to-handle", "SIGKILL", "train.py"], ["SIGKILL"]),
    "bad rdzv conf": (["--rdzv-conf", "timeout", "train.py"], ["--rdzv-conf"]),
    "negative restarts": (["--max-restarts", "-1", "train.py"], ["--max-restarts"]),
    "bad port": (["--master-port", "70000", "train.py"], ["--master-port"]),
    "float flag not float": (["--grace-period", "soon", "train.py"], ["soon"]),
    "flag missing value": (["--nnodes"], ["--nnodes"]),
    "bad-endpoint": (["--nnodes", "2", "--rdzv-endpoint", "host:port", "train.py"], ["--rdzv-endpoint"]),
}


OUTPUT_SPEC_CASES = {"redirects": ["--redirects", "5"], "tee": ["--tee", "x"],
                     "filter": ["--local-ranks-filter", "3"]}

# name -> (argv, extra environment); all are started at once to keep the module fast.
RUNS: dict[str, tuple[list[str], dict[str, str]]] = {
    **{f"case {name}": (["--log-dir", "logs", *args], {}) for name, (args, _) in CASES.items()},
    "help": (["--help"], {}),
    "version": (["--version"], {}),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Run]:
    started = {}
    for i, (name, (args, env_extra)) in enumerate(RUNS.items()):
        workdir = tmp_path_factory.mktemp(f"run{i}")
        started[name] = (workdir, _start(workdir, args, env_extra))
    results = {}
    for name, (workdir, proc) in started.items():
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        results[name] = Run(workdir, proc.returncode, out, err)
    return results


@pytest.mark.parametrize("name", list(CASES))
def test_usage_error(name, runs):
    result = runs[f"case {name}"]
    assert_usage_error(result, *CASES[name][1])
    assert_nothing_started(result)


def test_help(runs):
    result = runs["help"]
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert result.stdout.startswith("Usage: ftlaunch")
    assert "Torchrun-compatible options:" in result.stdout
    assert "Fault tolerance:" in result.stdout
    assert "--nproc-per-node" in result.stdout and "--restart-backoff" in result.stdout
    assert_nothing_started(result)


def test_version(runs):
    result = runs["version"]
    assert result.returncode == 0
    assert result.stdout.strip() == f"ftlaunch {launcher.__version__}"
    assert result.stderr == ""


@pytest.mark.parametrize("args, fragments", [*CASES.values(), *MORE_CASES.values()],
                         ids=[*CASES, *MORE_CASES])
def test_usage_error_in_process(args, fragments, in_process):
    result = in_process("--log-dir", "logs", *args)
    assert_usage_error(result, *fragments)
    assert_nothing_started(result)


def test_help_in_process_lists_groups(capsys):
    with pytest.raises(SystemExit) as info:
        main(["-h"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "Torchrun-compatible options:" in out and "Fault tolerance:" in out


@pytest.fixture
def in_process(tmp_path, monkeypatch, capsys):
    """Runs cli.main in tmp_path with a private TMPDIR; returns a Run."""
    for key in list(os.environ):
        if key.startswith(("PET_", "FTLAUNCH_")):
            monkeypatch.delenv(key)
    for name, text in WORKDIR_FILES.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    monkeypatch.chdir(tmp_path)

    def run(*args: str) -> Run:
        with pytest.raises(SystemExit) as info:
            main(list(args))
        out, err = capsys.readouterr()
        return Run(tmp_path, info.value.code, out, err)

    return run


def test_bad_env_var_is_a_usage_error(in_process, monkeypatch):
    monkeypatch.setenv("PET_NNODES", "abc")
    result = in_process("--log-dir", "logs", "train.py")
    assert_usage_error(result, "--nnodes", "abc")
    assert_nothing_started(result)


@pytest.mark.parametrize("name", list(OUTPUT_SPEC_CASES))
def test_output_spec_error_without_log_dir_creates_nothing(name, in_process):
    result = in_process(*OUTPUT_SPEC_CASES[name], "train.py")
    assert_usage_error(result)
    assert_nothing_started(result)
