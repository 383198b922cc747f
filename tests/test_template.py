"""The rank template: ranks forked from one interpreter that imported torch once.

A forked rank must be indistinguishable from a fresh one to its script; an unsafe template
is never forked; the template dies with its agent and is started again if it dies alone.
"""

from __future__ import annotations

import json
import signal
import sys
import textwrap
import time

import psutil
from conftest import TAG_VAR, tagged_processes, wait_no_tagged

PROBE = """
    import atexit, gc, json, os, random, signal, sys
    import torch
    rank = os.environ["RANK"]
    atexit.register(lambda: open(os.path.join(sys.argv[1], "atexit_" + rank), "w").close())
    with open("/proc/self/cmdline", "rb") as f:
        cmdline = f.read().replace(b"\\0", b" ").decode().strip()
    with open("/proc/self/comm") as f:
        comm = f.read().strip()
    seen = {
        "name": __name__, "file": __file__, "argv": sys.argv, "cwd": os.getcwd(),
        "path0": sys.path[0], "rank": rank, "local_rank": os.environ["LOCAL_RANK"],
        "omp": os.environ.get("OMP_NUM_THREADS"), "threads": torch.get_num_threads(),
        "random": random.random(), "torch_rand": torch.rand(3).tolist(),
        "own_group": os.getpgid(0) == os.getpid(),
        "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
        "sigterm": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
        "sigchld": signal.getsignal(signal.SIGCHLD) == signal.SIG_DFL,
        "wakeup_fd": signal.set_wakeup_fd(-1),
        "cmdline": cmdline, "comm": comm,
        "cuda_visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "frozen": gc.get_freeze_count(), "gc_enabled": gc.isenabled(),
    }
    with open(os.path.join(sys.argv[1], "seen_" + rank + ".json"), "w") as f:
        json.dump(seen, f)
    print("probe of rank", rank, "done")
"""


def _write(path, text):
    path.write_text(textwrap.dedent(text))
    return str(path)


def _events(tmp_path):
    path = next((tmp_path / "logs").glob("*/events.jsonl"))
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_forked_rank_is_what_a_fresh_interpreter_would_be(tmp_path, launch):
    script = _write(tmp_path / "probe.py", PROBE)
    run = launch("--standalone", "--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"),
                 script, str(tmp_path), "--flag")
    assert run.finish(120) == 0, run.output
    assert "[rank1]: probe of rank 1 done" in run.output, "the rank's stdout is its own"
    started = [e for e in _events(tmp_path) if e["event"] == "recovered" or e["event"] == "started"]
    assert started and any(e["event"] == "rank_template_ready" for e in _events(tmp_path))
    seen = [json.loads((tmp_path / f"seen_{r}.json").read_text()) for r in (0, 1)]
    for rank, s in enumerate(seen):
        assert s["name"] == "__main__" and s["file"] == script, s
        assert s["argv"] == [script, str(tmp_path), "--flag"], s
        assert s["cwd"] == str(tmp_path) and s["path0"] == str(tmp_path), s
        assert s["rank"] == s["local_rank"] == str(rank), s
        assert s["omp"] == "1" and s["threads"] == 1, "OMP_NUM_THREADS honoured"
        assert s["own_group"], "its own process group"
        assert s["sigint"] and s["sigterm"] and s["sigchld"] and s["wakeup_fd"] == -1, \
            "signal dispositions as a fresh interpreter's"
        assert s["cmdline"].startswith(f"ftlaunch rank {rank}: ") and "probe.py" in s["cmdline"]
        assert s["comm"] == f"rank{rank}-probe.py"[:15]
        assert (tmp_path / f"atexit_{rank}").exists(), "the script's atexit handlers ran"
        # One difference, on purpose: what the template imported is frozen (its collections
        # would traverse, and copy, the template's pages); collecting is on, as fresh.
        assert s["frozen"] > 100_000 and s["gc_enabled"], s
    assert seen[0]["random"] != seen[1]["random"], "Python's random state is not shared"
    assert seen[0]["torch_rand"] != seen[1]["torch_rand"], "nor torch's (seeded as fresh)"
    forked = [e for e in _events(tmp_path) if e["event"] == "started"]
    assert forked, run.output


THREAD_STARTER = """
    import threading, time
    threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
"""

HELLO = """
    import os
    print("hello from rank", os.environ["RANK"])
"""


def test_a_template_that_started_a_thread_is_never_forked(tmp_path, launch):
    """A --preload module that starts a thread: said once, ranks start fresh, job runs."""
    _write(tmp_path / "starts_a_thread.py", THREAD_STARTER)
    run = launch("--standalone", "--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"),
                 "--preload", "starts_a_thread", _write(tmp_path / "hello.py", HELLO),
                 env={"PYTHONPATH": f"{tmp_path}:{sys.path[0]}"})
    assert run.finish(120) == 0, run.output
    unsafe = [e for e in _events(tmp_path) if e["event"] == "rank_template_unsafe"]
    assert len(unsafe) == 1 and "2 threads" in unsafe[0]["why"], run.output
    assert "ranks start as fresh interpreters" in run.output
    assert "[rank1]: hello from rank 1" in run.output


SLEEPER = """
    import os, time
    print("up", os.environ["RANK"], os.getpid(), flush=True)
    time.sleep(600)
"""


def _template(tag, agent):
    """The template: the agent's child with that command line (a rank forked a moment ago
    has it too, until it takes its own)."""
    found = [p for p in tagged_processes(tag) if p.ppid() == agent.pid
             and "launcher.template_process" in " ".join(p.cmdline())]
    assert len(found) == 1, found
    return found[0]


def test_the_template_dies_with_its_agent(tmp_path, launch, launcher_env):
    run = launch("--standalone", "--nproc-per-node", "2", _write(tmp_path / "s.py", SLEEPER))
    run.wait_for(r"\[rank1\]: up 1")
    template = _template(launcher_env[TAG_VAR], run.proc)
    # It holds none of a rank's resources: no network socket, no staging mapping, no file.
    assert template.net_connections(kind="inet") == []
    assert not [m.path for m in template.memory_maps() if "ftlaunch-staging" in m.path]
    assert [f.path for f in template.open_files()] == []
    run.proc.kill()
    run.finish()
    # PR_SET_PDEATHSIG queues a SIGKILL when the agent dies; the template is gone once it
    # is next scheduled (on a loaded machine it can still show "running" for a moment).
    deadline = time.monotonic() + 10
    while template.is_running() and template.status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the template outlived its agent by 10 s"
        time.sleep(0.02)  # another process's death, not our child's: nothing to wait on
    assert wait_no_tagged(launcher_env[TAG_VAR]) == []


def test_a_template_that_dies_is_started_again(tmp_path, launch, launcher_env):
    """SIGKILL the template mid-job: its ranks die with it (they are its children), the
    agent starts a new template and recovers by forking from it."""
    script = _write(tmp_path / "s.py", """
        import os, sys, time
        print("up", os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"], flush=True)
        if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
            time.sleep(600)
    """)
    run = launch("--standalone", "--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"),
                 "--restart-backoff", "0", script)
    run.wait_for(r"\[rank1\]: up 1 0")
    first = _template(launcher_env[TAG_VAR], run.proc)
    first.send_signal(signal.SIGKILL)
    assert run.finish(120) == 0, run.output
    events = _events(tmp_path)
    assert [e["event"] for e in events if e["event"].startswith("rank_template")] == [
        "rank_template_ready", "rank_template_died", "rank_template_ready"], run.output
    recovered = [e for e in events if e["event"] == "recovered"]
    assert recovered and sorted(recovered[0]["forked"]) == [0, 1], run.output


def test_start_method_spawn_starts_fresh_interpreters(tmp_path, launch, launcher_env):
    run = launch("--standalone", "--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"),
                 "--start-method", "spawn", _write(tmp_path / "s.py", SLEEPER))
    run.wait_for(r"\[rank1\]: up 1")
    procs = tagged_processes(launcher_env[TAG_VAR])
    assert not [p for p in procs if "launcher.template_process" in " ".join(p.cmdline())]
    ranks = sorted(rank for p in procs if (rank := p.environ().get("RANK")))
    assert ranks == ["0", "1"], "two ranks, whose /proc/PID/environ says who they are"
    run.proc.send_signal(signal.SIGTERM)
    run.finish(60)
