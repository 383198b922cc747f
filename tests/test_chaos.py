"""The chaos runner (scripts/chaos.py): its schedule, each invariant failing on a doctored
run, and a small seeded campaign against the real launcher."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import types

import chaos
import pytest
from conftest import ROOT, SCRIPTS

from ftlaunch_contract import shards
from ftlaunch_contract.storage import open_storage

T0 = 1000.0


def test_a_seed_draws_the_same_schedule_and_one_node_draws_no_node_loss():
    assert chaos.draw_schedule(7, 6, chaos.KINDS, 4, 2) == chaos.draw_schedule(7, 6, chaos.KINDS, 4, 2)
    assert chaos.draw_schedule(7, 6, chaos.KINDS, 4, 2) != chaos.draw_schedule(8, 6, chaos.KINDS, 4, 2)
    single = chaos.draw_schedule(3, 40, chaos.KINDS, 2, 1)
    assert not {f.kind for f in single} & set(chaos.NODE_KINDS)
    assert all(0 <= f.target < 2 for f in single)
    assert [f.step for f in single] == sorted({f.step for f in single})  # one at a time


def good_run() -> tuple[chaos.Run, chaos.Reference]:
    """Two ranks, 20 steps, a kill of rank 1 at step 12 after step 10 was committed; it
    resumed at 10 and trained 11, 12 again with the same losses."""
    losses = {(step, rank): repr(5.0 - step / 100 - rank / 1000)
              for step in range(1, 21) for rank in (0, 1)}
    ref = chaos.Reference(losses=losses, weights="w")
    seen = [(T0 + step, step, rank, losses[step, rank]) for step in range(1, 13) for rank in (0, 1)]
    seen += [(T0 + 20 + step, step, rank, losses[step, rank])
             for step in range(11, 21) for rank in (0, 1)]
    fault = chaos.Fault("kill", 12, 1)
    events = [
        {"ts": T0 + 10.5, "event": "checkpoint_committed", "step": 10},
        {"ts": T0 + 12.1, "event": "recovering", "restart_count": 1, "policy": "rank",
         "cause": "rank 1 (node vm:1) was killed by SIGKILL"},
        {"ts": T0 + 12.2, "event": "recovered", "restart_count": 1, "seconds": 0.1},
    ]
    run = chaos.Run(steps=20, injected=[chaos.Injected(fault, T0 + 12.05, "pid 9")],
                    exit_codes=[[0]], expected_exit=0,
                    out={"final_step": 20, "weights_sha256": "w"}, losses=seen,
                    resumes=[(T0, 0, 0), (T0, 1, 0), (T0 + 20, 0, 10), (T0 + 20, 1, 10)],
                    events=events)
    return run, ref


def test_the_campaign_table_times_each_faults_recovery_by_kind():
    """A slow path shows as its fault kind's time (how the 4 s FSDP survivor was seen)."""
    run, ref = good_run()
    second = chaos.Injected(chaos.Fault("exception", 16, 0), T0 + 16.0, "rank 0")
    later = [{"ts": T0 + 20.1, "event": "recovered", "restart_count": 2, "seconds": 4.0},
             {"ts": T0 + 20.2, "event": "recovered", "restart_count": 2, "seconds": 4.1}]
    run = dataclasses.replace(run, injected=[*run.injected, second], events=run.events + later)
    assert chaos.recovery_by_fault(run) == [("kill", 0.1), ("exception", 4.1)]
    rejoined = {"ts": T0 + 20.3, "event": "recovered", "restart_count": 2, "seconds": 9.0}
    assert chaos.recovery_by_fault(dataclasses.replace(run, events=run.events + [
        rejoined])) == [("kill", 0.1), ("exception", 4.1)], \
        "a node cut off before the fault timed its wait to rejoin, not this recovery"
    table = chaos.campaign_table([(None, run, chaos.check(run, ref))])
    assert "| exception | 1 | 4.10 / 4.10 |" in table and "| kill | 1 | 0.10 / 0.10 |" in table
    run = dataclasses.replace(run, events=[rejoined, *run.events])  # its log read first
    table = chaos.campaign_table([(None, run, chaos.check(run, ref))])
    assert "| 2.10 / 4.10 |" in table, "the campaign's median / p95 are its faults' recoveries"


def test_a_good_run_holds_every_invariant():
    run, ref = good_run()
    assert chaos.check(run, ref) == dict.fromkeys(chaos.INVARIANTS)


def doctored(**changes) -> dict:
    run, ref = good_run()
    return chaos.check(dataclasses.replace(run, **changes), ref)


def broken(verdict: dict) -> set[str]:
    return {name for name, problem in verdict.items() if problem is not None}


def test_completes_fails_when_a_node_exits_non_zero_or_the_job_stops_short():
    assert broken(doctored(exit_codes=[[0, 1]])) == {"completes"}
    assert broken(doctored(exit_codes=[[0], [0]])) == {"completes"}  # a preemption exited 0
    assert "completes" in broken(doctored(out={"final_step": 19, "weights_sha256": "w"}))


def test_weights_fails_when_the_final_weights_differ():
    assert broken(doctored(out={"final_step": 20, "weights_sha256": "other"})) == {"weights"}


def test_no_lost_fails_when_a_rank_resumes_before_the_committed_step():
    run, _ = good_run()
    resumes = [*run.resumes[:3], (T0 + 20, 1, 5)]
    assert broken(doctored(resumes=resumes)) == {"no_lost"}


def test_no_redo_fails_when_a_step_is_trained_against_other_weights():
    run, _ = good_run()
    t, step, rank, _ = run.losses[-3]
    losses = [*run.losses[:-3], (t, step, rank, "4.2"), *run.losses[-2:]]
    assert broken(doctored(losses=losses)) == {"no_redo"}


def test_untorn_finds_a_shard_whose_bytes_do_not_match_its_checksum(tmp_path):
    storage = open_storage(tmp_path)
    data = bytearray(os.urandom(1 << 16))
    for step in (5, 10):
        shards.persist(storage, {"rank": 0, "step": step, "world_size": 1, "nbytes": len(data)},
                       memoryview(data))
    assert chaos.torn_shards(tmp_path) == []
    path = tmp_path / shards.data_name(10, 0)
    torn = bytearray(path.read_bytes())
    torn[100] ^= 0xFF
    path.write_bytes(torn)
    (problem,) = chaos.torn_shards(tmp_path)
    assert "step 10" in problem and "checksum" in problem
    assert broken(doctored(torn=[problem])) == {"untorn"}


def test_clean_finds_what_the_run_left_behind(tmp_path):
    job = types.SimpleNamespace(tag="no-such-tag", agents=[], work=tmp_path)
    for sub in ("tmp", "runtime"):
        (tmp_path / sub).mkdir()
    (tmp_path / "tmp" / "torchinductor_root").mkdir()  # torch's cache: not ours
    assert chaos.leftovers(job, timeout=0.1) == []
    (tmp_path / "runtime" / "chaos.123.json").write_text("{}")
    assert chaos.leftovers(job, timeout=0.1) == [str(tmp_path / "runtime" / "chaos.123.json")]
    assert broken(doctored(leftovers=["process 1"])) == {"clean"}


def test_recoveries_fails_on_none_two_or_one_that_names_another_cause():
    run, _ = good_run()
    without = [e for e in run.events if e["event"] != "recovering"]
    assert broken(doctored(events=without)) == {"recoveries"}
    twice = [*run.events, {"ts": T0 + 13, "event": "recovering", "restart_count": 2,
                           "policy": "job", "cause": "rank 0 (node vm:1) was killed by SIGKILL"}]
    assert broken(doctored(events=twice)) == {"recoveries"}
    other = [{**e, "cause": "rank 1 (node vm:1) was killed by SIGSEGV"}
             if e["event"] == "recovering" else e for e in run.events]
    assert broken(doctored(events=other)) == {"recoveries"}


def test_a_coordinator_loss_counts_once_however_many_survivors_log_it():
    events = [{"ts": T0 + 1, "event": "coordinator_lost", "lost": "vm:1", "successor": "vm:2"},
              {"ts": T0 + 1.01, "event": "coordinator_lost", "lost": "vm:1", "successor": "vm:2"},
              {"ts": T0 + 5, "event": "coordinator_lost", "lost": "vm:2", "successor": ""}]
    (only,) = chaos.recoveries(events)
    assert only["policy"] == "failover" and "vm:1" in only["cause"]


def test_a_coordinator_lost_again_later_is_another_recovery():
    """Chaos (2 nodes, seed 1634): vm:1 lost as the coordinator, healed, the coordinator again
    later (a successor), and lost again: two recoveries, not one."""
    events = [{"ts": T0 + 1, "node": "agent1", "event": "coordinator_lost", "lost": "vm:1",
               "successor": "vm:2"},
              {"ts": T0 + 1, "node": "agent1", "event": "recovering", "restart_count": 1,
               "policy": "rank", "cause": "coordinator node vm:1 lost"},
              {"ts": T0 + 9, "node": "agent3", "event": "coordinator_lost", "lost": "vm:1",
               "successor": "vm:3"},
              {"ts": T0 + 9, "node": "agent3", "event": "recovering", "restart_count": 4,
               "policy": "rank", "cause": "coordinator node vm:1 lost"},
              {"ts": T0 + 9.1, "node": "agent4", "event": "coordinator_lost", "lost": "vm:1",
               "successor": "vm:3"}]
    assert [r["ts"] for r in chaos.recoveries(events)] == [T0 + 1, T0 + 9]


def test_the_coordinators_host_is_found_among_the_jobs_latest_start(tmp_path):
    """Chaos (seeds 3110, 3113): before a preemption the coordinator failed over to the
    third agent; the requeued job's first agent hosts again, and only its start's events say
    where the coordinator went since."""
    agents = [types.SimpleNamespace(pid=pid) for pid in (11, 12, 13, 21, 22, 23)]
    job = object.__new__(chaos.Job)
    job.work, job.agents, job.placed, job.cuts = tmp_path, agents, {}, []
    job.starts = [agents[:3], agents[3:]]
    host = socket.gethostname()

    def lost(agent: int, successor: int, at: float) -> None:
        log = tmp_path / "logs" / f"agent{agent}" / "chaos" / "events.jsonl"
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("a") as f:
            f.write(json.dumps({"ts": at, "event": "coordinator_lost", "lost": "x",
                                "successor": f"{host}:{successor}"}) + "\n")

    lost(1, 13, T0)  # the first start: 11 lost, 13 took over
    assert job.coordinator() is agents[3], "the requeued job's first agent hosts"
    lost(5, 22, T0 + 9)  # the latest start: 21 lost, 22 took over
    assert job.coordinator() is agents[4]
    lost(5, 23, T0 + 12)  # 23 failed over to itself, then stood down: it waits under 22
    with (tmp_path / "logs" / "agent5" / "chaos" / "events.jsonl").open("a") as f:
        f.write(json.dumps({"ts": T0 + 12.1, "event": "spare", "coordinator": f"{host}:22"}) + "\n")
    assert job.coordinator() is agents[4], "the one that stood down taken for the host"


def network_run(kind: str, **fault) -> chaos.Run:
    """good_run with its kill replaced by ``kind`` of node2 (agent1's log) at step 12."""
    run, _ = good_run()
    cut = chaos.Cut("agent1", T0 + 12.05) if kind in chaos.PARTITIONS else None
    injected = [chaos.Injected(chaos.Fault(kind, 12, 1, **fault), T0 + 12.05, "node2:7", cut)]
    events = [{**e, "node": "agent0"} for e in run.events]
    if kind == "loss":
        events = [e for e in events if e["event"] not in ("recovering", "recovered")]
    else:
        events = [{**e, "cause": "node node2:7 lost (no heartbeat for 2s)"}
                  if e["event"] == "recovering" else e for e in events]
    return dataclasses.replace(run, injected=injected, events=events)


def recoveries_verdict(run: chaos.Run, **changes) -> str | None:
    return chaos.check_recoveries(dataclasses.replace(run, **changes), good_run()[1])


def test_a_partition_needs_one_recovery_naming_the_cut_off_node_as_lost():
    run = network_run("partition")
    # Cut off, node2 sees the coordinator lost and fails over to itself: its own view.
    ghost = [{"ts": T0 + 14, "event": "coordinator_lost", "node": "agent1", "lost": "node1:5",
              "successor": "node2:7"},
             {"ts": T0 + 14, "event": "recovering", "node": "agent1", "restart_count": 1,
              "policy": "rank", "cause": "coordinator node node1:5 lost"}]
    assert recoveries_verdict(run, events=[*run.events, *ghost]) is None
    assert "0 recoveries" in recoveries_verdict(
        run, events=[e for e in run.events if e["event"] != "recovering"])
    named = recoveries_verdict(run, events=[
        {**e, "cause": "node node3:8 lost (no heartbeat for 2s)"} if e["event"] == "recovering"
        else e for e in run.events])
    assert "does not name it" in named
    gone = recoveries_verdict(run, events=[  # a dead agent's connection, not a partition
        {**e, "cause": "node node2:7 lost (its connection closed)"}
        if e["event"] == "recovering" else e for e in run.events])
    assert "does not name it" in gone
    twice = [*run.events, {**ghost[1], "node": "agent0", "restart_count": 2}]
    assert "2 recoveries" in recoveries_verdict(run, events=twice)


def test_a_coordinator_cut_off_that_kept_the_job_on_the_tie_needs_one_recovery_of_its_own():
    """A round of two, its coordinator's node (node2, agent1) cut off: the other side's
    successor holds its round (half, no tie), node2 goes on with a spare. The other side's
    view until it stood down and re-joined is set aside; node2's recovery, finding the other
    node silent, is the job's."""
    run = network_run("coordinator-partition")
    run.injected[0].cut.kept, run.injected[0].cut.until = True, T0 + 16
    kept = [{**e, "node": "agent1", "cause": "node node3:9 lost (nothing from its machine "
             "for 2s)"} if e["event"] == "recovering" else e for e in run.events]
    held = [{"ts": T0 + 14, "event": "coordinator_lost", "node": "agent0", "lost": "node2:7",
             "successor": "node3:9"},
            {"ts": T0 + 14, "event": "recovering", "node": "agent0", "restart_count": 1,
             "policy": "rank", "cause": "coordinator node node2:7 lost"},
            {"ts": T0 + 15.5, "event": "recovering", "node": "agent0", "restart_count": 1,
             "policy": "rank", "cause": "node node3:9 was dropped from the job; re-joining"}]
    assert recoveries_verdict(run, events=[*kept, *held]) is None
    late = [*kept, {**held[2], "ts": T0 + 16.5}]  # after it re-joined: the job's, and wrong
    assert "2 recoveries" in recoveries_verdict(run, events=late)
    itself = [{**e, "cause": "node node2:7 lost (nothing from its machine for 2s)"}
              if e["event"] == "recovering" else e for e in kept]
    assert "does not name it" in recoveries_verdict(run, events=itself)
    run.injected[0].cut.kept = False  # not kept: the other side's failover is the job's
    assert "2 recoveries" in recoveries_verdict(run, events=[*kept, *held])


def test_a_cut_off_node_back_in_the_job_speaks_for_it_again():
    """Chaos (2 nodes, seed 1620): both nodes of the round had been cut off once and had
    re-joined; a rank killed later on one of them was recovered, but its events were still
    set aside as a cut-off view: "0 recoveries". A view is set aside only until its side
    re-joined."""
    cut = chaos.Cut("agent1", T0 + 12, until=T0 + 16)
    at = {"node": "agent1", "event": "recovering"}
    assert cut.hides({**at, "ts": T0 + 14}) and not cut.hides({**at, "ts": T0 + 17})
    assert not cut.hides({**at, "node": "agent0", "ts": T0 + 14})
    kept = chaos.Cut("agent1", T0 + 12, until=T0 + 16, kept=True)
    assert kept.hides({**at, "node": "agent0", "ts": T0 + 14})
    assert not kept.hides({**at, "ts": T0 + 14}) and not kept.hides({**at, "node": "agent0",
                                                                     "ts": T0 + 17})


def test_the_next_fault_waits_for_a_step_since_the_recoverys_ranks_started():
    """Chaos seed 5701: the job trained up to its hold before the last step while the runner
    waited for a healed node to rejoin; waiting for a step printed after that (none comes
    from a holding job), the runner timed out. It counts the steps since the ranks the
    recovery started, and since the fault's injection when no rank started (seed 27116: a
    lossy link ridden out, the job at its hold by the loss's end)."""
    out = chaos.Lines(verbose=False)
    out.lines = [(T0, 0, "[rank0]: step 40 loss 4.1 rank 0"),  # before the fault
                 (T0 + 1, 0, "[rank0]: start rank 0 world 2 pid 7 resume_from 35 (shared "
                             "memory) agents_committed 35"),
                 (T0 + 2, 0, "[rank0]: step 99 loss 2.7 rank 0")]  # then it held
    job = types.SimpleNamespace(out=out)
    assert chaos.restarted_since(job, 1) == 1
    _, m = out.wait_step(48, chaos.restarted_since(job, 1), timeout=0)
    assert m[1] == "99"
    assert chaos.restarted_since(job, 2) == 2, "no rank started: from the injection"
    _, m = out.wait_step(60, chaos.restarted_since(job, 2), timeout=0)
    assert m[1] == "99"


def test_the_job_holds_ahead_of_the_next_fault_until_the_runner_moves_the_hold_on(
        tmp_path, monkeypatch):
    """Chaos seed 6538: while the runner watched a heal, the job trained to its last step's
    hold, and the next fault (a writer's kill) waited for a save a held job never makes.
    The job may run HOLD_AHEAD steps past the next fault's step until it is injected: each
    hold is past its fault, the last lets the job finish, and train_gpt.py's ranks read it
    (a rank at the hold waits, beating, until the runner moves it on)."""
    import train_gpt

    opts = chaos.Options(seed=6538, faults=5, nodes=3, nproc=2)
    plan = opts.schedule()
    holds = [chaos.hold_before(plan, i, opts.steps()) for i in range(len(plan) + 1)]
    assert holds == [*(fault.step + chaos.HOLD_AHEAD for fault in plan), opts.steps()]
    assert holds == sorted(holds)

    job = types.SimpleNamespace(work=tmp_path)
    (tmp_path / "chaos").mkdir()
    monkeypatch.setenv("TRAIN_CHAOS_DIR", str(tmp_path / "chaos"))
    chaos.hold_at(job, holds[0])
    assert train_gpt.chaos_hold(opts.steps()) == holds[0]
    beats: list[int] = []
    beating, done = threading.Event(), threading.Event()

    def beat(step: int) -> None:
        beats.append(step)
        beating.set()

    def rank(step: int) -> None:
        train_gpt.hold_for_chaos(step, opts.steps(), beat)
        done.set()

    rank(holds[0] - 1)  # below the hold: trains on at once
    assert done.is_set() and not beats
    done.clear()
    held = threading.Thread(target=rank, args=(holds[0],), daemon=True)
    held.start()
    assert beating.wait(10) and not done.is_set(), "held at the hold, beating"
    assert set(beats) == {holds[0] - 1}
    chaos.hold_at(job, holds[1])  # the fault injected: the next one's hold
    assert done.wait(10), "moved on with the hold"
    held.join(10)


def test_after_a_preemption_the_next_fault_waits_for_the_new_jobs_ranks():
    """Chaos seed 6630: the old job trained on after its SIGTERM (to step 60); the runner,
    back from starting the job again before any of its ranks had, counted steps from the
    injection, found the old job's step 60, and aimed the next fault (a writer's kill) at a
    rank of the old job (its pid gone: ProcessLookupError; or reused: someone else's)."""
    out = chaos.Lines(verbose=False)
    out.lines = [(T0, 0, "[rank0]: step 48 loss 4.1 rank 0"),
                 (T0 + 1, 0, "[rank0]: step 60 loss 4.2 rank 0")]  # after the SIGTERM
    at = 1  # the injection's line

    def start() -> None:  # the new job's ranks start a while after its agents
        out.followed.add(1)

        def ranks() -> None:
            with out.cond:
                out.lines += [(T0 + 9, 1, "[rank0]: start rank 0 world 2 pid 8 resume_from 60 "
                                          "(storage) agents_committed 60"),
                              (T0 + 9, 1, "[rank0]: step 61 loss 4.3 rank 0")]
                out.cond.notify_all()
        threading.Timer(0.2, ranks).start()

    job = types.SimpleNamespace(out=out, starts=[[]], start=start)
    fault = chaos.Fault("sigterm", 48, 0)
    chaos.wait_recovered(job, chaos.Injected(fault, T0 + 0.5), timeout=30)
    _, m = out.wait_step(60, chaos.restarted_since(job, at), timeout=0)
    assert m[1] == "61", "a step of the new job's ranks"
    assert job.out.lines[chaos.restarted_since(job, at)][1] == 1


def test_a_run_the_runner_cannot_complete_leaves_the_stacks_of_every_process(tmp_path):
    """Chaos seed 6802: a job that never trained again after a restart was killed at the
    runner's timeout with no trace of where it stood. Now every live process of the job
    (an agent and what it started) is dumped first, one file each."""
    waiter = ("import time\n"
              "def waiting_in_the_grandchild():\n"
              "    print('ready', flush=True)\n"
              "    time.sleep(120)\n"
              "waiting_in_the_grandchild()\n")
    agent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                              f"subprocess.Popen([sys.executable, '-c', {waiter!r}]); "
                              "time.sleep(120)"],
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        ready = select.select([agent.stdout], [], [], 60)[0]
        assert ready and agent.stdout.readline() == "ready\n"
        where = chaos.dump_stacks(types.SimpleNamespace(work=tmp_path, alive=lambda: [agent]))
    finally:
        os.killpg(agent.pid, signal.SIGKILL)
        agent.wait()
    dumps = {p.name: p.read_text() for p in where.iterdir()}
    assert len(dumps) == 2, dumps.keys()
    assert any("waiting_in_the_grandchild" in text for text in dumps.values()), dumps


def test_packet_loss_needs_no_recovery():
    run = network_run("loss", percent=20)
    assert recoveries_verdict(run) is None
    recovered = [*run.events, {"ts": T0 + 13, "event": "recovering", "node": "agent0",
                               "restart_count": 1, "policy": "rank",
                               "cause": "node node2:7 lost (no heartbeat for 2s)"}]
    assert "loss at step 12: recoveries" in recoveries_verdict(run, events=recovered)


def test_completes_fails_when_a_healed_node_neither_rejoins_nor_leaves():
    stranded = ["node2:7 neither re-joined nor left within 12s of the heal"]
    assert broken(doctored(stranded=stranded)) == {"completes"}


def test_network_kinds_are_left_out_with_a_reason_where_namespaces_cannot_be_built(
        monkeypatch, capsys):
    monkeypatch.setattr(chaos.netns, "missing_requirements", lambda: "network namespaces need root")
    assert chaos.usable_kinds(("kill", "partition", "loss"), False) == ("kill",)
    err = capsys.readouterr().err
    assert "not drawing partition: network namespaces: network namespaces need root" in err
    with pytest.raises(SystemExit, match="--netns: network namespaces need root"):
        chaos.usable_kinds(("kill",), True)


@pytest.mark.parametrize("args", [
    ["--seed", "3", "--faults", "4", "--nodes", "1", "--nproc", "2",
     "--kinds", "kill,segv,exception,stop,writer,disk", "--overlap-ckpt"],  # segv, exception,
    # disk, writer; the saves overlapped with training
    ["--seed", "110", "--faults", "4", "--nodes", "2", "--nproc", "1", "--fsdp",
     "--kinds", "exception,spin,node,coordinator,sigterm"],  # coordinator twice, node, sigterm
    # (the round after two coordinator losses waited for a dead node until f1771ef)
], ids=["one-node-ddp", "two-nodes-fsdp"])
def test_a_seeded_campaign_holds_every_invariant(tmp_path, args):
    """The real thing: the runner's job under ftlaunch with faults of most kinds drawn by
    a fixed seed; it exits 0 only if every invariant held."""
    done = subprocess.run([sys.executable, str(SCRIPTS / "chaos.py"), *args,
                           "--work", str(tmp_path / "run")], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("  ok   ") == len(chaos.INVARIANTS), done.stdout


# A healed node that neither re-joins nor leaves (a cut-off coordinator that never stands
# down, its agent waiting for a round of its own): what partitions have broken before.
STRANDED = re.compile(r"FAIL completes: after the heal: \['node\d:\d+ neither re-joined nor left")


@pytest.mark.skipif(chaos.netns.missing_requirements() is not None,
                    reason=f"network faults: {chaos.netns.missing_requirements()}")
def test_a_seeded_campaign_with_partitions_and_loss_holds_every_invariant(tmp_path):
    """2 nodes + spare in network namespaces: the coordinator's node lost twice in a row,
    then its own node cut off (the others fail over, the tie not theirs; healed, it must
    follow them; the first round, whose nodes both died, held them until 729e115), 10% loss
    on a node for 3 s (no recovery), then a node cut off past the node timeout and healed
    (one recovery; it must re-join or leave)."""
    args = ["--seed", "27116", "--faults", "5", "--nodes", "2", "--nproc", "1", "--kinds",
            "kill,exception,partition,loss,node,coordinator,segv,coordinator-partition"]
    done = subprocess.run([sys.executable, str(SCRIPTS / "chaos.py"), *args,
                           "--work", str(tmp_path / "run")], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    out = done.stdout + done.stderr
    assert re.search(r"faults: coordinator@12 coordinator@24 coordinator-partition@36 "
                     r"loss@48 \(10% on node\d:\d+, [1-9]\d* packets dropped\) partition@60$",
                     out, re.MULTILINE), out
    assert not STRANDED.search(out), "a healed node must re-join (or leave)"
    assert done.returncode == 0, out
    assert done.stdout.count("  ok   ") == len(chaos.INVARIANTS), out


def test_a_fault_past_the_restart_budget_is_answered_by_the_jobs_end():
    run, ref = good_run()
    ended = [e for e in run.events if e["event"] not in ("recovering", "recovered")] + [
        {"ts": T0 + 12.1, "event": "job_failed", "exit_code": 1,
         "reason": "rank 1 (node vm:1) was killed by SIGKILL; restart budget spent (0/0)"}]
    verdict = chaos.check(dataclasses.replace(run, events=ended, expected_exit=1,
                                              exit_codes=[[1]], out=None), ref)
    assert verdict == dict.fromkeys(chaos.INVARIANTS)
    assert broken(doctored(events=ended)) == {"recoveries"}  # not when the budget was left
