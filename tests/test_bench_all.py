"""scripts/bench_all.py stays in step with the benchmarks it runs (running them is not a test)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import bench_all
import pytest
from conftest import ROOT, SCRIPTS


@pytest.mark.parametrize("bench", bench_all.BENCHES, ids=lambda b: b.name)
def test_every_flag_bench_all_passes_is_one_its_script_takes(bench):
    for args in (bench.args, bench.quick):
        script, *flags = args
        done = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        for flag in (f for f in flags if f.startswith("--")):
            assert flag in done.stdout, f"{script} takes no {flag}"


def test_an_unknown_benchmark_is_refused_with_the_names_to_choose_from():
    done = subprocess.run([sys.executable, str(SCRIPTS / "bench_all.py"), "--only", "speed"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "unknown benchmark(s) ['speed']: choose from recovery, hang" in done.stderr


def test_goodput_counts_no_stall_for_saves_that_cost_nothing_and_each_saves_extra_time():
    """bench_goodput's stall estimate: noisy steps whose saves cost nothing lose nothing to
    checkpointing (clipping each step at the median counted the slow half's noise), and a
    save that adds 5 ms loses 5 ms a save."""
    import random

    import bench_goodput

    def run(extra):
        rng, t, events = random.Random(0), 0.0, []
        for step in range(1, 401):
            t += 0.1 + rng.uniform(0, 0.01) + (extra if (step - 1) % 2 == 0 else 0.0)
            events.append((t, "step", 0, step))
        return bench_goodput.account(0.0, t, events, ckpt_every=2)

    assert run(0.0)["lost_s"]["ckpt stalls"] < 0.05  # the old estimate: 0.27 s of noise
    assert run(0.005)["lost_s"]["ckpt stalls"] == pytest.approx(199 * 0.005, rel=0.2)


def test_goodput_counts_an_attempts_first_step_from_its_start_line():
    """A step line marks a step's end: an attempt's first step trained from the script's start
    line on, and is productive, not start-up or restart (launch 0, start 2.0, kill 2.3)."""
    import bench_goodput

    events = [(2.0, "start", 0, 11), (2.05, "step", 0, 1), (2.15, "step", 0, 2),
              (2.25, "step", 0, 3), (2.3, "kill", 1, 12), (2.32, "step", 0, 4),  # before it knew
              (2.5, "start", 0, 11), (2.55, "step", 0, 3), (2.65, "step", 0, 4)]
    acc = bench_goodput.account(0.0, 2.7, events, ckpt_every=1)
    lost = acc["lost_s"]
    assert lost["start-up"] == pytest.approx(2.0)
    assert lost["restart"] == pytest.approx(0.2)
    assert acc["recoveries_s"] == [pytest.approx(0.2)]
    assert lost["re-computed"] == pytest.approx(0.05 + 0.1)  # in flight at the kill; step 3
    assert acc["productive_s"] == pytest.approx(0.05 + 0.1 + 0.05 + 0.1)
    assert lost["tail"] == pytest.approx(0.05)
    assert acc["unaccounted_s"] == pytest.approx(0.0, abs=1e-9)


def test_torchft_goodput_counts_each_kept_step_by_its_share_of_the_batch():
    """bench_goodput's TorchFT account: two groups in step at 0.1 s; group 1 killed at 0.5:
    group 0 stalls to 1.0, trains 2 steps alone (half the batch each), group 1 heals in.
    Then a kill crashes both (as TorchFT 0.2.0's gloo DDP did) and they start again from
    step 1: every step trained before is lost, not productive until trained again."""
    import bench_goodput

    def both(t, step, p=2):
        return [(t, "step", 0, (step, p)), (t + 0.001, "step", 1, (step, p))]

    events = [e for i in range(1, 5) for e in both(0.1 * i, i)]  # 0.1 .. 0.4
    events += [(0.5, "kill", 1, 7), (1.0, "step", 0, (5, 1)), (1.1, "step", 0, (6, 1))]
    events += both(1.2, 7) + both(1.3, 8)
    acc = bench_goodput.account_replicas(0.0, 1.4, events, groups=2)
    lost = acc["lost_s"]
    assert acc["step_median_s"] == pytest.approx(0.1)
    assert lost["start-up"] == pytest.approx(0.0, abs=1e-9)  # step 1 began at 0.0
    assert acc["productive_s"] == pytest.approx(0.1 * (6 + 2 * 0.5))
    assert lost["fewer replicas"] == pytest.approx(0.1 * 2 * 0.5)  # steps 5 and 6
    assert lost["restart"] == pytest.approx(0.5)  # group 0 stalled from 0.5 to 1.0
    assert lost["tail"] == pytest.approx(0.1)
    assert acc["recoveries_s"] == [pytest.approx(0.5)]
    assert acc["whole_again_s"] == [pytest.approx(0.7)]

    events += [(1.35, "kill", 0, 8)] + both(2.1, 1) + both(2.2, 2)
    acc = bench_goodput.account_replicas(0.0, 2.3, events, groups=2)
    lost = acc["lost_s"]
    assert acc["productive_s"] == pytest.approx(0.2)  # steps 1 and 2, again
    assert lost["re-computed"] == pytest.approx(0.1 * (6 + 2 * 0.5))  # all of the first run
    assert lost["fewer replicas"] == 0.0
    assert acc["productive_s"] + sum(lost.values()) == pytest.approx(2.3)
    assert acc["whole_again_s"] == [pytest.approx(0.7), pytest.approx(0.75)]
    assert acc["steps_final"] == 2


# bench_coordinator.py gives the coordinator a CPU of its own and the agents the rest: under a
# cpuset of one CPU (taskset, a small container) it refuses to run, as it says.
needs_two_cpus = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2,
                                    reason="bench_coordinator.py needs 2 CPUs or more")


@needs_two_cpus
def test_the_coordinator_bench_runs_its_smallest_job_through():
    """bench_coordinator.py drives a real Coordinator through private hooks (a timing
    wrapper around _complete_round): one that drifted from the code broke the bench
    unseen for a day. 32 agents, one second of heartbeats and a takeover, two I/O threads
    (the device check's shape)."""
    done = subprocess.run([sys.executable, str(SCRIPTS / "bench_coordinator.py"), "--nodes", "32",
                           "--window", "1", "--io-threads", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| 32 | " in done.stdout and "Traceback" not in done.stderr, done.stderr[-2000:]


@needs_two_cpus
@pytest.mark.parametrize("intakes", [0, 1])
def test_the_coordinator_bench_can_queue_the_joins_before_the_successor_serves(intakes):
    """--joins-first: the survivors' joins wait on the standby socket (a small job's
    successor then acks each, finding those whose connections closed), and the times count
    from the successor's start: the joins were sent before it, and every assign arrives;
    with --intakes, through an intake process, whose CPU is reported too."""
    done = subprocess.run([sys.executable, str(SCRIPTS / "bench_coordinator.py"), "--nodes", "32",
                           "--takeover-only", "--joins-first", "--intakes", str(intakes)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    row = next(line for line in done.stdout.splitlines() if line.startswith("| 32 | "))
    cells = row.strip("| ").split(" | ")
    joins_sent, _, _, first, last = (float(cell) for cell in cells[4:9])
    cpu = re.fullmatch(r"([\d.]+) \+ ([\d.]+)(?: \(\+ ([\d.]+)\))?", cells[10])
    assert cpu and (cpu[3] is not None) == bool(intakes), row
    assert joins_sent < 0 < first <= last and min(map(float, cpu.groups("0"))) >= 0, row


@needs_two_cpus
def test_the_coordinator_bench_times_a_job_forming_through_an_intake():
    """--formation: a fresh coordinator and all N agents joining (N of N), through an
    intake as at an endpoint served by intakes: the round closes once the last join is in,
    and every agent's assign comes after it."""
    done = subprocess.run([sys.executable, str(SCRIPTS / "bench_coordinator.py"), "--nodes", "32",
                           "--formation", "--intakes", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "formation: joins sent s" in done.stdout
    row = next(line for line in done.stdout.splitlines() if line.startswith("| 32 | "))
    cells = row.strip("| ").split(" | ")
    assert cells[1:4] == ["-", "-", "-"], row  # no heartbeats
    joins_sent, closed, queued, first, last, after = (float(cell) for cell in cells[4:10])
    assert 0 <= joins_sent <= closed <= queued and closed <= first <= last, row
    assert after == pytest.approx(last - joins_sent, abs=0.011), row


@needs_two_cpus
def test_the_coordinator_benchs_socket_floor_answers_every_join():
    """--socket-floor: the joins read and one assign's encoding sent to each, as the
    receivers check it (each its own sequence): every survivor gets it (the survivors wait
    up to 120 s for theirs, the test no longer)."""
    done = subprocess.run([sys.executable, str(SCRIPTS / "bench_coordinator.py"), "--nodes", "32",
                           "--socket-floor"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    row = next(line for line in done.stdout.splitlines() if line.startswith("| 32 | "))
    read, sent, first, last = (float(cell) for cell in row.strip("| ").split(" | ")[5:9])
    assert 0 <= read <= sent and 0 <= first <= last, row


def test_the_coordinator_benchs_decider_seats_every_survivor():
    """--decider-only: a takeover's joins handled and its round decided with no socket; the
    bench refuses a round that did not seat every survivor, and reports each share."""
    done = subprocess.run([sys.executable, str(SCRIPTS / "bench_coordinator.py"), "--nodes", "32",
                           "--decider-only"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    row = next(line for line in done.stdout.splitlines() if line.startswith("| 32 | "))
    handled, decided, encoded = (float(cell.split(" (")[1].rstrip(")"))
                                 for cell in row.strip("| ").split(" | ")[1:])
    assert min(handled, decided, encoded) > 0, row  # µs a node


@pytest.mark.parametrize("intakes", [0, 1])
def test_the_rendezvous_bench_runs_every_fault_through_at_24_agents(tmp_path, intakes):
    """bench_rendezvous.py simulates agents with real ControlPlanes, which must keep what an
    agent keeps (its seats: past the 16 an assign names, a successor counts by them):
    drifted, its coordinator failover was held unseen. 24 agents, a 2 s node timeout (a
    margin for a loaded machine): form, heartbeat, a silent node, a dead one, then the
    coordinator's process killed and its successor's machine silenced (with joins that say
    no earlier seat: held, 61 s). With an intake: the job forms at the endpoint through it,
    the killed coordinator's dies with it, and the successor's stops with its machine."""
    import json

    out = tmp_path / "rendezvous.json"
    done = subprocess.run([sys.executable, str(SCRIPTS / "bench_rendezvous.py"), "--sizes", "24",
                           "--procs", "2", "--node-timeout", "2", "--heartbeat-interval", "0.1",
                           "--cpu-window", "1", "--torch-max", "0", "--out-json", str(out),
                           "--intakes", str(intakes)],
                          cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    (row,) = [r["ftlaunch"] for r in json.loads(out.read_text())["rows"]]
    assert row.get("ok"), row
    assert {"formed_s", "dead_loss_s", "failover_dead_s", "failover_silent_s"} <= row.keys()
