"""Recovery policies end to end: real ranks, real gloo, real faults, the rank template, the shim.

Each fault hits a rank drawn at random (seeded per test, printed on failure) at a random
step; the job must finish, resume from one consistent step, and end with exactly the
weights of a fault-free run.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import psutil
import pytest
from conftest import SCRIPTS, TAG_VAR, tagged_processes

TRAIN = str(SCRIPTS / "train_gpt.py")
STEPS, CKPT_EVERY = 24, 4
NPROC = 2
"""Two ranks (two cores). More are bit-identical too since train_gpt.py's DDP keeps its first
bucket layout (by default the first step after a resume reduced in another layout, and only
a sum of two gradients is the same in every order)."""


def _events(log_dir):
    path = next(log_dir.glob("*/events.jsonl"))
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Final weights of a fault-free run (plain torchrun-style training, no launcher state)."""
    import os

    import torch.distributed.run  # noqa: F401 - only to be sure torch is importable here

    tmp = tmp_path_factory.mktemp("reference")
    out = tmp / "ref.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "FTLAUNCH_", "TRAIN_"))}
    env["PYTHONPATH"] = str(SCRIPTS.parent)
    subprocess.run([sys.executable, "-m", "launcher", "--standalone", "--nproc-per-node",
                    str(NPROC), "--no-warm-pool", TRAIN, "--steps", str(STEPS), "--out", str(out)],
                   env=env, cwd=tmp, check=True, timeout=180, capture_output=True)
    return json.loads(out.read_text())


def _run(launch, tmp_path, *flags, shim=True, env=None, extra=()):
    """Start the job (ranks forked from the rank template unless the flags say otherwise)."""
    out, logs = tmp_path / "result.json", tmp_path / "logs"
    args = ["--standalone", "--nproc-per-node", str(NPROC), "--log-dir", str(logs), *flags,
            TRAIN, "--steps", str(STEPS), "--ckpt-every", str(CKPT_EVERY),
            "--ckpt-dir", str(tmp_path / "ckpt"), "--out", str(out), *extra]
    if shim:
        args.append("--shim")
    return launch(*args, env=env or {}), out, logs


def _committed_so_far(log_dir):
    """Steps committed so far, from the events written so far (whole lines only)."""
    steps = set()
    for path in log_dir.glob("*/events.jsonl"):
        for line in path.read_text().splitlines(keepends=True):
            if line.endswith("\n") and '"checkpoint_committed"' in line:
                steps.add(json.loads(line)["step"])
    return steps


def _fault(request, kind):
    """A random (rank, step) for this test, reproducible from its name."""
    rng = random.Random(zlib.crc32(request.node.nodeid.encode()))
    rank, step = rng.randrange(NPROC), rng.randrange(CKPT_EVERY + 1, STEPS - 2)
    return rank, step, {"TRAIN_FAULT_RANK": str(rank), "TRAIN_FAULT_STEP": str(step),
                        "TRAIN_FAULT_KIND": kind}


def _pids(run, restart):
    """pid of each rank as printed by its `start` line of the given attempt (0 = first)."""
    seen: dict[int, list[int]] = {}
    for line in run.lines:
        m = re.search(r"start rank (\d+) world \d+ pid (\d+)", line)
        if m:
            seen.setdefault(int(m.group(1)), []).append(int(m.group(2)))
    return {rank: pids[restart] for rank, pids in seen.items() if len(pids) > restart}


def _is_template(p) -> bool:
    """The rank template (a process that just exited is none: it cannot be asked)."""
    try:
        return "launcher.template_process" in " ".join(p.cmdline())
    except psutil.Error:
        return False


def _check_result(out, reference, fault_step, context):
    result = json.loads(out.read_text())
    assert result["final_step"] == STEPS, context
    assert result["weights_sha256"] == reference["weights_sha256"], context
    expected = (fault_step - 1) // CKPT_EVERY * CKPT_EVERY
    assert result["resumed_from"] == expected, f"resumed from the last checkpoint; {context}"
    return result


SHIM_FAULTS = ["kill", "segv", "exception", "exit"]
HANG_FAULTS = ["stop", "hang", "spin"]


@pytest.mark.parametrize("kind", SHIM_FAULTS + HANG_FAULTS)
def test_rank_policy_replaces_only_the_failed_rank(kind, request, tmp_path, launch, reference):
    """Default policy with the shim: survivors re-enter in place (same pid), only a dead or
    hung rank's process is replaced, forked from the rank template."""
    rank, step, env = _fault(request, kind)
    # Not tighter: on 2 loaded cores a healthy step can stall for seconds (CI saw 2.3 s
    # while a warm pool refilled), and would be taken for a hang.
    flags = ["--hang-timeout", "5"] if kind in HANG_FAULTS else []
    if kind == "spin":  # the fallback: faulthandler answers even while the rank holds the GIL
        flags += ["--stack-dump", "faulthandler"]
    run, out, logs = _run(launch, tmp_path, *flags, env=env)
    assert run.finish(180) == 0, run.output
    context = f"fault {kind} rank {rank} step {step}\n{run.output}"
    _check_result(out, reference, step, context)

    before, after = _pids(run, 0), _pids(run, 1)
    recovered = [e for e in _events(logs) if e["event"] == "recovered"]
    assert [e["policy"] for e in recovered] == ["rank"], context
    survivors = [r for r in range(NPROC) if r != rank]
    if kind == "exception":  # a rank that raised is alive and healthy: it re-enters too
        assert after == before and sorted(recovered[0]["resumed"]) == list(range(NPROC)), context
    elif kind != "hang":  # dead, or frozen (stopped, or spinning with the GIL held)
        assert after[rank] != before[rank], context
        assert all(after[r] == before[r] for r in survivors), f"survivors kept their process; {context}"
        assert sorted(recovered[0]["resumed"]) == survivors, context
        assert recovered[0]["forked"] == [rank], f"the replacement was forked; {context}"
    else:  # asleep for good: its peer blocked in a collective on it looks the same; both go
        assert after[rank] != before[rank] and rank in recovered[0]["forked"], context
        assert not recovered[0]["fresh"], context
    if kind in HANG_FAULTS:
        hung = [e["rank"] for e in _events(logs) if e["event"] == "rank_hung"]
        assert rank in hung, context
        assert hung == [rank] or kind == "hang", f"only the frozen rank is killed; {context}"
        stacks = next(logs.glob(f"*/attempt_0/{rank}/stacks.txt")).read_text()
        assert "maybe_inject_fault" in stacks, f"stacks of the hung rank captured; {context}"


@pytest.mark.parametrize("kind", ["kill", "exception"])
def test_job_policy_replaces_every_rank_by_forks(kind, request, tmp_path, launch, reference):
    rank, step, env = _fault(request, kind)
    run, out, logs = _run(launch, tmp_path, "--restart-policy", "job", env=env)
    assert run.finish(180) == 0, run.output
    context = f"fault {kind} rank {rank} step {step}\n{run.output}"
    _check_result(out, reference, step, context)
    recovered = [e for e in _events(logs) if e["event"] == "recovered"]
    assert [e["policy"] for e in recovered] == ["job"], context
    assert sorted(recovered[0]["forked"]) == list(range(NPROC)), context
    before, after = _pids(run, 0), _pids(run, 1)
    assert all(after[r] != before[r] for r in range(NPROC)), context


def test_unmodified_script_restarts_forked_from_the_template(request, tmp_path, launch,
                                                            launcher_env, reference):
    """No shim at all (a plain torchrun script): the default policy replaces every rank by
    forks of the node's one rank template, which is gone when the job ends (the fixture
    checks)."""
    rank, step, env = _fault(request, "kill")
    run, out, logs = _run(launch, tmp_path, shim=False, env=env)
    run.wait_for(r"started 2 ranks", timeout=120)
    templates = [p for p in tagged_processes(launcher_env[TAG_VAR])
                 if _is_template(p) and p.ppid() == run.proc.pid]  # not a rank forked just now
    assert len(templates) == 1, "one rank template per node"
    assert run.finish(180) == 0, run.output
    context = f"fault kill rank {rank} step {step}\n{run.output}"
    _check_result(out, reference, step, context)
    started = [e for e in _events(logs) if e["event"] == "started"]
    assert started, context
    recovered = [e for e in _events(logs) if e["event"] == "recovered"]
    assert sorted(recovered[0]["forked"]) == list(range(NPROC)), context
    assert recovered[0]["resumed"] == [], context


def test_cold_policy_starts_fresh_interpreters(request, tmp_path, launch, reference):
    rank, step, env = _fault(request, "kill")
    run, out, logs = _run(launch, tmp_path, "--restart-policy", "cold", env=env)
    assert run.finish(180) == 0, run.output
    _check_result(out, reference, step, run.output)
    recovered = [e for e in _events(logs) if e["event"] == "recovered"]
    assert sorted(recovered[0]["fresh"]) == list(range(NPROC)), run.output


def test_no_progress_escalates_up_the_ladder_then_stops_do_not_requeue(tmp_path, launch):
    """A fault that recurs at the same step: rank -> job -> cold, then exit 3."""
    env = {"TRAIN_FAULT_RANK": "1", "TRAIN_FAULT_STEP": "6", "TRAIN_FAULT_KIND": "exception",
           "TRAIN_FAULT_EVERY_ATTEMPT": "1"}
    run, _, logs = _run(launch, tmp_path, "--max-restarts", "10", "--restart-backoff", "0",
                        "--max-stalled-recoveries", "3", env=env)
    assert run.finish(240) == 3, run.output
    policies = [e["policy"] for e in _events(logs) if e["event"] == "recovering"]
    assert policies == ["rank", "job", "cold"], run.output
    failed = [e for e in _events(logs) if e["event"] == "job_failed"]
    assert "no progress" in failed[0]["reason"], run.output


@pytest.mark.parametrize("policy", ["rank", "job"])
def test_survivor_that_cannot_leave_its_training_function_is_replaced(tmp_path, launch,
                                                                       reference, policy):
    """Rank 0 is blocked in a C call (deaf to the shim's abort) when rank 1 dies: its shim
    finds the training thread idle in native code and says so, and the agent replaces that
    rank too at once, not after --stop-timeout (60 s here). Under the `job` rung too, where
    every rank is replaced: it used to get only SIGTERM, and the handler its shim armed
    (ft.preempted()) cannot run in a C call, so it lived until the stop timeout (2 s by
    default: a chaos run's partition met it); it is told to leave first, as in a `rank`
    restart."""
    env = {"TRAIN_FAULT_RANK": "1", "TRAIN_FAULT_STEP": "10", "TRAIN_FAULT_KIND": "kill",
           "TRAIN_STUCK_RANK": "0"}
    run, out, logs = _run(launch, tmp_path, "--restart-policy", policy, "--stop-timeout", "60",
                          env=env)
    assert run.finish(180) == 0, run.output
    _check_result(out, reference, 10, run.output)
    escalated = [e for e in _events(logs) if e["event"] == "escalated"]
    assert escalated and escalated[0]["ranks"] == [0], run.output
    assert escalated[0]["blocked_in"][0].startswith("maybe_inject_fault (scripts/train_gpt.py:"), \
        run.output
    recovered = [e for e in _events(logs) if e["event"] == "recovered"]
    assert recovered[0]["policy"] == policy and recovered[0]["resumed"] == [], run.output
    assert sorted(recovered[0]["forked"]) == [0, 1], run.output


def test_a_survivor_late_for_no_known_reason_has_its_stacks_taken_before_it_is_killed(
        tmp_path, launch):
    """Rank 0 is busy in one long C call (no abort reaches it, and busy is not stuck) when
    rank 1 raises: it is late at --stop-timeout. Where it was is written before the kill and
    named by the escalated event (chaos runs met survivors late like this with no clue)."""
    script = tmp_path / "busy.py"
    script.write_text(
        "import os, time\n"
        "import trainer_shim as ft\n"
        "@ft.restartable\n"
        "def train(ctx):\n"
        "    if ctx.attempt == 0 and ctx.rank == 1:\n"
        "        ft.heartbeat(1)\n"
        "        time.sleep(0.3)\n"
        "        raise RuntimeError('boom')\n"
        "    while ctx.attempt == 0:\n"
        "        ft.heartbeat(1)\n"
        "        sum(range(10 ** 9))  # seconds in one C call, busy\n"
        "    print('attempt', ctx.attempt, 'rank', ctx.rank, flush=True)\n"
        "train()\n")
    logs = tmp_path / "logs"
    run = launch("--standalone", "--nproc-per-node", "2", "--stop-timeout", "0.5",
                 "--log-dir", str(logs), str(script))
    assert run.finish(120) == 0, run.output
    escalated = [e for e in _events(logs) if e["event"] == "escalated"]
    assert [(e["ranks"], e["blocked_in"]) for e in escalated] == [([0], [""])], run.output
    stacks = escalated[0]["stacks"][0]
    assert stacks and "train" in Path(stacks).read_text(), run.output


def test_a_frozen_survivor_is_replaced_at_once(tmp_path, launch, reference):
    """Rank 1 is SIGSTOPped (frozen: not even its shim's thread runs, so it can neither
    leave nor say where it is blocked) when rank 0 dies: the agent replaces it at once, not
    after --stop-timeout (60 s here). The chaos campaign met it across two nodes: the
    stopped rank's peers on the other node were blamed first, and it was waited for."""
    from launcher.hang_detection import FROZEN_AFTER, TICK_INTERVAL

    env = {"TRAIN_FAULT_RANK": "1", "TRAIN_FAULT_STEP": "10", "TRAIN_FAULT_KIND": "stop"}
    run, out, logs = _run(launch, tmp_path, "--stop-timeout", "60", "--hang-timeout", "60",
                          env=env)
    pids = dict(tuple(map(int, run.wait_for(r"start rank (\d) world 2 pid (\d+)").groups()))
                for _ in range(2))
    run.wait_for("injecting fault stop rank 1 step 10")
    deadline = time.monotonic() + 30
    while psutil.Process(pids[1]).status() != psutil.STATUS_STOPPED:
        assert time.monotonic() < deadline, run.output
        time.sleep(0.01)
    time.sleep(FROZEN_AFTER + TICK_INTERVAL)  # the agent sees it frozen: no tick for this long
    os.kill(pids[0], signal.SIGKILL)
    assert run.finish(180) == 0, run.output
    _check_result(out, reference, 10, run.output)
    escalated = [e for e in _events(logs) if e["event"] == "escalated"]
    assert [e["ranks"] for e in escalated] == [[1]], run.output
    assert escalated[0]["blocked_in"][0].startswith("a frozen process"), run.output


def test_a_survivor_waiting_in_a_collective_for_a_rank_that_raised_is_replaced_at_once(
        tmp_path, launch):
    """FSDP2 on gloo: rank 1 raises while rank 0 waits for it in the step's first all-gather.
    Rank 1 parks, but its process group outlives destroy_process_group (DTensor's caches
    hold its mesh), so its connections stay open and rank 0's all-gather never returns: an
    abort cannot reach it, gloo has no abort. Its shim reports it blocked there, and only
    it is replaced (forked); the rank that raised re-enters in place. --stop-timeout is 60 s:
    the job would wait that long without the report."""
    step = 10
    env = {"TRAIN_FAULT_RANK": "1", "TRAIN_FAULT_STEP": str(step),
           "TRAIN_FAULT_KIND": "exception", "TRAIN_FAULT_DELAY": "1"}
    run, out, logs = _run(launch, tmp_path, "--stop-timeout", "60", env=env,
                          extra=["--fsdp", "--async-ckpt"])
    assert run.finish(180) == 0, run.output
    result = json.loads(out.read_text())
    assert result["final_step"] == STEPS, run.output
    assert result["resumed_from"] == (step - 1) // CKPT_EVERY * CKPT_EVERY, run.output
    escalated = [e for e in _events(logs) if e["event"] == "escalated"]
    assert [e["ranks"] for e in escalated] == [[0]], run.output
    assert escalated[0]["blocked_in"][0].startswith("all_gather"), run.output
    recovered = [e for e in _events(logs) if e["event"] == "recovered"]
    assert recovered[0]["resumed"] == [1] and recovered[0]["forked"] == [0], run.output


def test_shim_is_a_no_op_without_an_agent(tmp_path):
    """The same --shim script under plain python: no agent, nothing to talk to, same result."""
    out = tmp_path / "plain.json"
    start = time.monotonic()
    subprocess.run([sys.executable, TRAIN, "--steps", "3", "--shim", "--out", str(out)],
                   check=True, timeout=120, cwd=tmp_path, capture_output=True,
                   env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(SCRIPTS.parent)})
    assert json.loads(out.read_text())["final_step"] == 3
    assert time.monotonic() - start < 120  # hang guard only


def test_a_rank_that_finished_training_is_no_hang_however_slow_its_exit(tmp_path, launch):
    """After its last heartbeat a rank closes checkpoints and its interpreter shuts down:
    longer than --hang-timeout on a loaded machine. The shim says it is leaving; the rank
    is not killed as hung (which would restart a job that was done)."""
    script = tmp_path / "slow_exit.py"
    script.write_text(
        "import atexit, time\n"
        "atexit.register(time.sleep, 3)  # runs after trainer_shim's own exit (newest first)\n"
        "import trainer_shim as ft\n"
        "for step in range(1, 6):\n"
        "    ft.heartbeat(step)\n"
        "    time.sleep(0.05)\n"
        "print('trained', flush=True)\n")
    run = launch("--standalone", "--nproc-per-node", "1", "--no-warm-pool",
                 "--hang-timeout", "1", str(script))
    assert run.finish(120) == 0, run.output
    assert "trained" in run.output and "hung" not in run.output, run.output


PROFILED = """\
import cProfile, os, time
import torch, torch.distributed as dist
import trainer_shim as ft

@ft.restartable
def train(ctx):
    profiler = cProfile.Profile()  # the user profiles their training
    profiler.enable()
    try:
        dist.init_process_group("gloo")
        print(f"entered rank {ctx.rank} attempt {ctx.attempt} pid {os.getpid()}", flush=True)
        for step in range(1, 9):
            if ctx.attempt == 0 and ctx.rank == 1 and step == 4:
                os.kill(os.getpid(), 9)
            dist.all_reduce(torch.ones(1))
            ft.heartbeat(step)
            time.sleep(0.02)
    finally:
        profiler.disable()

if __name__ == "__main__":
    train()
"""


def _assert_rank0_re_entered_in_place(output: str) -> None:
    entries = re.findall(r"entered rank 0 attempt (\d) pid (\d+)", output)
    assert [attempt for attempt, _ in entries] == ["0", "1"], output
    assert entries[0][1] == entries[1][1], f"rank 0 re-entered in place\n{output}"


def test_a_survivor_under_a_profiler_re_enters(tmp_path, launch):
    """The abort raised in a survivor is cleared as it leaves without leaving CPython 3.11's
    flag for one set: with a profiler on (cProfile, coverage, a debugger), the re-entered
    function's first call spun there for ever until hang detection replaced the rank."""
    script = tmp_path / "profiled.py"
    script.write_text(PROFILED)
    run = launch("--standalone", "--nproc-per-node", "2", "--hang-timeout", "30", str(script))
    assert run.finish(120) == 0, run.output
    _assert_rank0_re_entered_in_place(run.output)
    assert "hung" not in run.output, run.output


def test_the_abort_goes_to_the_thread_running_the_training_function(tmp_path, launch):
    """A script that trains in a thread of its own: the survivor's abort is raised there,
    not in the main thread waiting for it (which would die of it once the thread ended)."""
    (tmp_path / "profiled.py").write_text(PROFILED)
    script = tmp_path / "threaded.py"
    script.write_text("import threading\nfrom profiled import train\n"
                      "worker = threading.Thread(target=train)\nworker.start()\nworker.join()\n"
                      "print('main thread done', flush=True)\n")
    run = launch("--standalone", "--nproc-per-node", "2", "--hang-timeout", "30", str(script),
                 env={"PYTHONPATH": f"{tmp_path}:{SCRIPTS.parent}"})
    assert run.finish(120) == 0, run.output
    _assert_rank0_re_entered_in_place(run.output)
    assert run.output.count("main thread done") == 2, run.output


def test_rank_policy_across_two_nodes(request, tmp_path, launch, reference):
    """Two agents (nodes) on loopback, one rank each, shim script: rank 1's process is killed;
    the other node's rank re-enters in place and both resume from one checkpoint."""
    from ports import free_port
    from test_multinode import _wait_listening

    port, out = free_port(), tmp_path / "result.json"
    env = {"TRAIN_FAULT_RANK": "1", "TRAIN_FAULT_STEP": "10", "TRAIN_FAULT_KIND": "kill"}
    nodes = []
    for _ in range(2):
        nodes.append(launch("--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "job",
                            "--node-timeout", "5", TRAIN, "--steps", str(STEPS),
                            "--ckpt-every", str(CKPT_EVERY), "--ckpt-dir", str(tmp_path / "ckpt"),
                            "--out", str(out), "--shim", env=env))
        if len(nodes) == 1:
            _wait_listening(port)
    codes = [node.finish(180) for node in nodes]
    both = "\n".join(n.output for n in nodes)
    assert codes == [0, 0], both
    _check_result(out, reference, 10, both)
    restarts = [re.search(r"restart 1 \(rank\): .*ranks (resumed|forked) \[(\d)\]", n.output)
                for n in nodes]
    assert all(restarts), both
    assert {(m.group(1), m.group(2)) for m in restarts} == {("resumed", "0"), ("forked", "1")}, both


def test_replacement_resumes_from_shared_memory_and_the_agent_persists_on_exit(
        request, tmp_path, launch, reference):
    """--async-ckpt with nothing persisted during training (--persist-every 1000): the killed
    rank's replacement restores from the staging the agent owns, the survivor from its own,
    both at the last save before the fault, bit-exactly; when the job ends, the agent makes
    the ranks' last staged steps durable, then frees the staging memory."""
    rank, step, env = _fault(request, "kill")
    run, out, logs = _run(launch, tmp_path, env=env,
                          extra=["--async-ckpt", "--persist-every", "1000"])
    assert run.finish(180) == 0, run.output
    context = f"fault kill rank {rank} step {step}\n{run.output}"
    _check_result(out, reference, step, context)
    expected = (step - 1) // CKPT_EVERY * CKPT_EVERY
    resumed = re.findall(r"start rank (\d) world \d+ pid \d+ resume_from (\d+) \(([^)]+)\)",
                         run.output)
    assert sorted(resumed[NPROC:]) == [(str(r), str(expected), "shared memory")
                                       for r in range(NPROC)], context
    persisted = [e for e in _events(logs) if e["event"] == "checkpoint_persisted"]
    assert persisted and all([r, STEPS] in persisted[0]["shards"] for r in range(NPROC)), context
    steps = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert steps[-1] == f"step_{STEPS:09d}", context
    assert not [d for d in os.listdir("/dev/shm")
                if d.startswith(f"ftlaunch-staging-{run.proc.pid}-")], "staging memory freed"


@pytest.mark.parametrize("to", ["agent", "every process"])
def test_sigterm_checkpoints_within_the_grace_period(tmp_path, launch, to):
    """Preemption: SIGTERM to the agent reaches the ranks, ``ft.preempted()`` turns true on
    both at the same step, they save and leave; the step is committed when ftlaunch exits
    with 128+15, although nothing else was ever persisted (--persist-every 1000). ``every
    process``: as SLURM signals a step (scancel --signal=TERM, its time limit): the rank
    template and the store must not die of it under the ranks."""
    import signal

    out = tmp_path / "result.json"
    run = launch("--standalone", "--nproc-per-node", str(NPROC), "--log-dir",
                 str(tmp_path / "logs"), TRAIN, "--shim", "--steps", "100000",
                 "--step-time", "0.05", "--async-ckpt", "--ckpt-every", "1000",
                 "--persist-every", "1000", "--ckpt-dir", str(tmp_path / "ckpt"),
                 "--out", str(out))
    run.wait_for(r"step 5 loss", timeout=120)
    agent = psutil.Process(run.proc.pid)
    for process in [agent, *(agent.children(recursive=True) if to == "every process" else [])]:
        process.send_signal(signal.SIGTERM)
    assert run.finish(120) == 128 + signal.SIGTERM, run.output
    stops = {int(m.group(1)) for m in re.finditer(r"preempted at step (\d+)", run.output)}
    assert len(stops) == 1 and len(re.findall("preempted at step", run.output)) == NPROC, \
        f"both ranks stop at one step\n{run.output}"
    (step,) = stops
    committed = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert committed == [f"step_{step:09d}"], run.output
    assert all((tmp_path / "ckpt" / committed[0] / f"rank_{r}.meta").exists()
               for r in range(NPROC)), run.output
    assert not out.exists(), "a preempted run does not report itself finished"


def test_commits_are_announced_once_every_rank_is_durable(request, tmp_path, launch, reference):
    """--async-ckpt, every save persisted: each rank's writer reports its durable shard,
    agents relay, the coordinator announces a step once both ranks hold it; a replacement
    starts knowing the newest one (RestartContext.resume_step)."""
    rank, step, env = _fault(request, "kill")
    expected = (step - 1) // CKPT_EVERY * CKPT_EVERY
    gate = tmp_path / "gate"  # the fault waits for it: until the step before it is committed
    run, out, logs = _run(launch, tmp_path, env={**env, "TRAIN_FAULT_GATE": str(gate)},
                          extra=["--async-ckpt"])
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and expected not in _committed_so_far(logs):
        time.sleep(0.05)  # polling a file another process appends to
    gate.touch()
    assert run.finish(180) == 0, run.output
    context = f"fault kill rank {rank} step {step}\n{run.output}"
    _check_result(out, reference, step, context)
    committed = [e["step"] for e in _events(logs) if e["event"] == "checkpoint_committed"]
    assert committed == sorted(set(committed)) and committed[-1] == STEPS, context
    assert set(committed) <= set(range(CKPT_EVERY, STEPS + 1, CKPT_EVERY)), context
    for s in committed:
        assert all((tmp_path / "ckpt" / f"step_{s:09d}" / f"rank_{r}.meta").exists()
                   for r in range(NPROC)) or s < committed[-1] - 2 * CKPT_EVERY, context
    known = re.findall(rf"start rank {rank} world \d+ pid \d+ resume_from {expected} "
                       r"\([^)]+\) agents_committed (\S+)", run.output)
    assert known and known[-1] == str(expected), \
        f"the replacement knew the newest committed step; {context}"


FAILS_AFTER = """
import os, sys, time
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
if attempt >= int(os.environ["FAILING_ATTEMPTS"]):
    sys.exit(0)
time.sleep(float(os.environ["UP_FOR"]))
if os.environ["RANK"] == "1":
    sys.exit(1)  # the fault
time.sleep(120)  # rank 0 is stopped by the recovery
"""


@pytest.mark.parametrize("up_for, delays", [(1.5, [0.0, 0.0, 0.0]), (0.0, [0.0, 0.4, 0.8])],
                         ids=["failures spread over healthy training", "crash loop"])
def test_backoff_only_for_failures_in_a_row_without_healthy_training(
        up_for, delays, tmp_path, launch):
    """Unmodified ranks (no shim: health is time up, --healthy-interval): three failures
    each after healthy training are all restarted at once; three at start-up back off."""
    script = tmp_path / "fails_after.py"
    script.write_text(FAILS_AFTER)
    logs = tmp_path / "logs"
    run = launch("--standalone", "--nproc-per-node", "2", "--no-warm-pool", "--log-dir",
                 str(logs), "--healthy-interval", "1", "--restart-backoff", "0.4",
                 "--max-restarts", "5", str(script),
                 env={"FAILING_ATTEMPTS": "3", "UP_FOR": str(up_for)})
    assert run.finish(120) == 0, run.output
    recovering = [e for e in _events(logs) if e["event"] == "recovering"]
    assert [e["delay"] for e in recovering] == delays, run.output
    recovered = [e for e in _events(logs) if e["event"] == "recovered"]
    assert len(recovered) == 3, run.output
