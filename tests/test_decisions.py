"""Pure decisions: rank assignment, recovery, failure reports, rank environment and command."""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from launcher import failures, recovery
from launcher.membership import (
    Assignment,
    Electorate,
    Member,
    assign_ranks,
    from_named,
    has_quorum,
    named,
    seats_to_report,
    settled,
)
from launcher.node_policy import Survivor, park_or_stop, to_abort
from launcher.rank_env import Attempt, rank_command, rank_env

# --- membership.assign_ranks ----------------------------------------------------------------


def members(*spec: tuple[str, int]) -> list[Member]:
    return [Member(node_id, lws, f"10.0.0.{i}") for i, (node_id, lws) in enumerate(spec)]


def test_assign_ranks_contiguous_blocks_in_node_id_order():
    result = assign_ranks(members(("b", 2), ("a", 4), ("c", 1)))
    assert result == [
        Assignment("a", 0, 3, 0, 7),
        Assignment("b", 1, 3, 4, 7),
        Assignment("c", 2, 3, 6, 7),
    ]


def test_assign_ranks_empty():
    assert assign_ranks([]) == []


def test_assign_ranks_keeps_previous_group_ranks():
    previous = {"c": 0, "a": 1, "b": 2}
    result = assign_ranks(members(("a", 1), ("b", 2), ("c", 3)), previous)
    assert {a.node_id: a.group_rank for a in result} == previous
    assert [(a.node_id, a.rank_offset) for a in result] == [("c", 0), ("a", 3), ("b", 4)]


def test_assign_ranks_newcomers_after_old_members():
    previous = {"z": 0, "y": 1}
    result = assign_ranks(members(("a", 1), ("y", 1), ("b", 1), ("z", 1)), previous)
    assert [a.node_id for a in result] == ["z", "y", "a", "b"]
    assert [a.group_rank for a in result] == [0, 1, 2, 3]


def test_assign_ranks_departed_members_seat_goes_to_a_newcomer():
    """A spare replacing a lost node takes its seat: the survivors keep theirs (and restore
    from their own memory) where closing the gap moved every node above it."""
    previous = {"a": 0, "b": 1, "c": 2}
    result = assign_ranks(members(("c", 2), ("a", 2), ("d", 2)), previous)
    assert [(a.node_id, a.group_rank, a.rank_offset) for a in result] == [
        ("a", 0, 0), ("d", 1, 2), ("c", 2, 4)]
    assert all(a.group_world_size == 3 and a.world_size == 6 for a in result)


def test_assign_ranks_departed_member_closes_the_gap_when_no_one_fills_it():
    previous = {"a": 0, "b": 1, "c": 2, "d": 3}
    result = assign_ranks(members(("d", 1), ("a", 1), ("c", 1), ("e", 1)), previous | {"x": 4})
    assert [a.node_id for a in result] == ["a", "e", "c", "d"]  # e fills 1; x's 4 was last
    result = assign_ranks(members(("d", 1), ("a", 1)), previous)
    assert [(a.node_id, a.group_rank) for a in result] == [("a", 0), ("d", 1)]


def _seats_kept_and_holes_filled(group: list[Member], previous: dict[str, int],
                                 result: list[Assignment]) -> None:
    """The rule, said another way than assign_ranks does it: a member keeps its seat less
    the empty seats below it that newcomers could not fill; newcomers take the other places
    in ``--node-rank``, then node-id order. (Of two claiming one seat, the lower id keeps it.)"""
    claims: dict[int, str] = {}
    for m in sorted(group, key=lambda m: m.node_id):
        if previous.get(m.node_id, -1) >= 0:
            claims.setdefault(previous[m.node_id], m.node_id)
    kept = {node: seat for seat, node in claims.items()}
    newcomers = sorted((m for m in group if m.node_id not in kept),
                       key=lambda m: (m.rank_hint if m.rank_hint >= 0 else 1 << 30, m.node_id))
    got = {a.node_id: a.group_rank for a in result}
    for node, seat in kept.items():
        holes_below = sum(1 for s in range(seat) if s not in claims)
        assert got[node] == seat - max(0, holes_below - len(newcomers)), (node, seat, got)
    rest = sorted(set(range(len(group))) - {got[n] for n in kept})
    assert [got[m.node_id] for m in newcomers] == rest
    assert sorted(got.values()) == list(range(len(group)))


node_ids = st.lists(st.text(alphabet="abcdefgh", min_size=1, max_size=3), min_size=0, max_size=8,
                    unique=True)


@settings(max_examples=60, deadline=None)
@given(node_ids, st.data())
def test_assign_ranks_properties(ids, data):
    group = [Member(n, data.draw(st.integers(1, 8)), "x") for n in ids]
    result = assign_ranks(group)
    # deterministic, whatever order the members arrive in
    shuffled = data.draw(st.permutations(group))
    assert assign_ranks(list(shuffled)) == result
    # contiguous, non-overlapping rank blocks covering 0..world_size-1
    sizes = {m.node_id: m.local_world_size for m in group}
    world = sum(sizes.values())
    offset = 0
    for i, a in enumerate(result):
        assert (a.group_rank, a.group_world_size, a.world_size) == (i, len(group), world)
        assert a.rank_offset == offset
        offset += sizes[a.node_id]
    assert offset == world
    assert sorted(a.node_id for a in result) == sorted(ids)

    # next round: some leave, newcomers join: survivors keep their seats, newcomers fill
    # the departed's first
    previous = {a.node_id: a.group_rank for a in result}
    survivors = [m for m in group if data.draw(st.booleans())]
    newcomers = [Member(n, 1, "y") for n in data.draw(node_ids) if n not in sizes]
    second = assign_ranks(random.Random(0).sample(survivors + newcomers,
                                                  len(survivors) + len(newcomers)), previous)
    _seats_kept_and_holes_filled(survivors + newcomers, previous, second)
    if len(newcomers) >= len(group) - len(survivors):  # as many arrived as left
        assert all(a.group_rank == previous[a.node_id] for a in second if a.node_id in previous)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.text(alphabet="abcdef", min_size=1, max_size=2), st.integers(-1, 3)),
                max_size=10, unique_by=lambda t: t[0]),
       st.dictionaries(st.text(alphabet="abcdef", min_size=1, max_size=2), st.integers(0, 12),
                       max_size=6))
def test_assign_ranks_keeps_seats_and_fills_holes_by_node_rank_then_node_id(spec, previous):
    """The order every node computes alike, with seats claimed twice and seats of nodes
    gone: kept seats, then ``--node-rank``, then the node id for those who fill the rest."""
    group = [Member(n, 1, "x", hint) for n, hint in spec]
    result = assign_ranks(group, previous)
    _seats_kept_and_holes_filled(group, previous, result)
    assert assign_ranks(group[::-1], previous) == result


# --- recovery ------------------------------------------------------------------------------


def test_backoff_delay_schedule():
    delays = [recovery.backoff_delay(n, 1.5, 10.0) for n in range(1, 8)]
    assert delays == [0.0, 1.5, 3.0, 6.0, 10.0, 10.0, 10.0]
    assert recovery.backoff_delay(0, 1.5, 10.0) == 0.0
    assert recovery.backoff_delay(2, 0.0, 10.0) == 0.0
    assert recovery.backoff_delay(5, 1.0, 0.5) == 0.5


def test_decide_restarts_while_budget_lasts_then_fails():
    count, decisions, progress = 0, [], recovery.Progress()
    while True:  # a crash loop: every attempt dies 0.1 s after its start, steps unknown
        progress = progress.after_failure(-1, uptime=0.1, healthy_after=10.0)
        d = recovery.decide(count, 4, "cold", "rank 0 died", backoff=2.0, backoff_max=5.0,
                            progress=progress)
        decisions.append(d)
        if d.action == "fail":
            break
        assert d.restart_count == count + 1
        count = d.restart_count
        assert len(decisions) < 10
    assert [d.action for d in decisions] == ["restart"] * 4 + ["fail"]
    assert [d.delay for d in decisions[:4]] == [0.0, 2.0, 4.0, 5.0]
    assert [d.restart_count for d in decisions] == [1, 2, 3, 4, 4]
    assert all(d.policy == "cold" for d in decisions)
    assert decisions[0].reason == "rank 0 died"
    fail = decisions[-1]
    assert fail.delay == 0.0
    assert "rank 0 died" in fail.reason and "4/4" in fail.reason


def test_decide_zero_budget_fails_at_once():
    d = recovery.decide(0, 0, "cold", "boom")
    assert (d.action, d.restart_count, d.delay) == ("fail", 0, 0.0)


def test_decide_default_backoff():
    def failing(n):
        return recovery.Progress(failing=n)

    assert recovery.decide(1, 3, "cold", "x", progress=failing(1)).delay == 0.0
    assert recovery.decide(1, 3, "cold", "x", progress=failing(2)).delay == 1.0
    assert recovery.decide(2, 100, "cold", "x", progress=failing(3)).delay == 2.0
    assert recovery.decide(40, 100, "cold", "x", progress=failing(40)).delay == 30.0
    assert recovery.decide(40, 100, "cold", "x", progress=failing(1)).delay == 0.0, \
        "restart 41, but the first failure after healthy training: at once"


# One failure of an attempt: (the step it reported, -1 = unknown; seconds its ranks were up).
FAILURES = st.lists(st.tuples(st.integers(-1, 30), st.floats(0, 100)), max_size=30)


@settings(max_examples=200, deadline=None)
@given(FAILURES, st.floats(0.1, 10), st.floats(0.1, 100), st.floats(1, 60))
def test_backoff_waits_only_for_failures_in_a_row_without_healthy_training(
        history, base, cap, healthy_after):
    """The first failure after healthy training (a new best step; with the step unknown,
    ranks up for healthy_after) restarts at once; each further failure in a row without
    health waits base, doubling up to cap; health resets it, however many restarts came
    before."""
    progress, best, in_a_row = recovery.Progress(), -1, 0
    for count, (step, uptime) in enumerate(history):
        healthy = step > best if step >= 0 else uptime >= healthy_after
        best = max(best, step)
        in_a_row = 1 if healthy else in_a_row + 1
        progress = progress.after_failure(step, uptime, healthy_after)
        d = recovery.decide(count, 1000, "rank", "c", base, cap, progress)
        assert progress.failing == in_a_row
        if healthy or in_a_row == 1:  # the first failure of the job, too
            assert d.delay == 0.0
        else:
            assert d.delay == min(cap, base * 2 ** (in_a_row - 2))
        assert 0.0 <= d.delay <= cap


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 50), st.integers(0, 50), st.floats(0, 100), st.floats(0, 100),
       st.integers(0, 50))
def test_decide_properties(count, budget, base, cap, failing):
    progress = recovery.Progress(failing=failing)
    d = recovery.decide(count, budget, "cold", "c", base, cap, progress)
    if count < budget:
        assert d.action == "restart" and d.restart_count == count + 1
        assert d.delay == recovery.backoff_delay(failing, base, cap)
        assert 0.0 <= d.delay <= max(cap, 0.0)
    else:
        assert d.action == "fail" and d.restart_count == count and d.delay == 0.0


# --- failures ------------------------------------------------------------------------------

ERROR_FILE = {"message": {"message": "RuntimeError: boom",
                          "extraInfo": {"py_callstack": "Traceback (most recent call last):\n"
                                                        '  File "train.py", line 3\n'
                                                        "RuntimeError: boom\n",
                                        "timestamp": "1700000000"}}}


def test_failure_from_exit_code_and_torchrun_error_file(tmp_path):
    path = tmp_path / "error.json"
    path.write_text(json.dumps(ERROR_FILE))
    f = failures.from_returncode(3, 1, 4242, 1, str(path))
    assert (f.rank, f.local_rank, f.pid, f.exit_code, f.signal) == (3, 1, 4242, 1, "")
    assert f.error_file == str(path)
    assert f.message == "RuntimeError: boom"
    assert f.traceback.startswith("Traceback (most recent call last):")
    assert f.time == 1700000000.0
    assert f.how == "exited with code 1"
    assert f.cause == "exited with code 1: RuntimeError: boom"
    lines = failures.summary(f).splitlines()
    assert lines == [
        "root cause: rank 3 (local rank 1, pid 4242) exited with code 1",
        "  error: RuntimeError: boom",
        "  traceback:",
        "    Traceback (most recent call last):",
        '      File "train.py", line 3',
        "    RuntimeError: boom",
    ]


def test_a_rank_that_raised_and_parked_left_its_training_function():
    """trainer_shim's in-process restart: the rank raised and lives on, parked; it did not
    exit (no "exited with code None")."""
    f = failures.RankFailure(rank=0, local_rank=0, pid=7, exit_code=None, signal="",
                             error_file="", time=0.0, message="raised ValueError: bad batch")
    assert f.cause == "left its training function: raised ValueError: bad batch"
    assert failures.summary(f).splitlines()[0] == \
        "root cause: rank 0 (local rank 0, pid 7) left its training function"


def test_failure_from_signal_without_error_file(tmp_path):
    missing = str(tmp_path / "none.json")
    before = time.time()
    f = failures.from_returncode(0, 0, 99, -signal.SIGKILL, missing)
    assert before <= f.time <= time.time()
    assert (f.exit_code, f.signal) == (None, "SIGKILL")
    assert f.message == f.traceback == ""
    assert f.how == f.cause == "was killed by SIGKILL"
    text = failures.summary(f)
    assert text.splitlines()[0] == "root cause: rank 0 (local rank 0, pid 99) was killed by SIGKILL"
    assert "no error file" in text and missing in text


def test_failure_from_signal_with_error_file(tmp_path):
    path = tmp_path / "error.json"
    path.write_text(json.dumps(ERROR_FILE))
    f = failures.from_returncode(2, 0, 7, -signal.SIGTERM, str(path))
    assert f.signal == "SIGTERM" and f.exit_code is None
    assert f.cause == "was killed by SIGTERM: RuntimeError: boom"


@pytest.mark.parametrize("torn", ["", '{"message": {"message": "RuntimeError: bo'])
def test_a_torn_error_file_is_no_message(tmp_path, torn):
    """A rank stopped while its ``record`` handler wrote the file leaves it empty or cut
    short: torchrun's agent died of that (json.JSONDecodeError, BENCHMARKS.md "Goodput");
    ours reports the exit without a message."""
    path = tmp_path / "error.json"
    path.write_text(torn)
    f = failures.from_returncode(1, 1, 7, -signal.SIGTERM, str(path))
    assert f.cause == "was killed by SIGTERM" and f.traceback == ""


def test_failure_unknown_signal_number(tmp_path):
    f = failures.from_returncode(0, 0, 1, -200, str(tmp_path / "none"))
    assert f.signal == "signal 200"
    assert f.how == "was killed by signal 200"


def test_failure_plain_string_message(tmp_path):
    path = tmp_path / "error.json"
    path.write_text(json.dumps({"message": "ValueError: plain"}))
    f = failures.from_returncode(0, 0, 1, 2, str(path))
    assert (f.message, f.traceback, f.exit_code) == ("ValueError: plain", "", 2)
    summary = failures.summary(f)
    assert "  error: ValueError: plain" in summary and "traceback" not in summary
    assert "no error file" not in summary


@pytest.mark.parametrize("content", ["", "not json", "[]", '{"other": 1}', '{"message": 5}',
                                     '{"message": {"extraInfo": "x"}}'])
def test_failure_unreadable_error_file_is_ignored(content, tmp_path):
    path = tmp_path / "error.json"
    path.write_text(content)
    f = failures.from_returncode(0, 0, 1, 1, str(path))
    assert f.exit_code == 1 and f.message == "" and f.traceback == ""
    assert "no error file" in failures.summary(f)


# --- rank_env / rank_command ---------------------------------------------------------------

TORCHRUN_VARS = {
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE",
    "WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    # torchrun puts this one in its own environment (torch/distributed/launcher/api.py), so
    # its ranks inherit it
    "TORCHELASTIC_SIGNALS_TO_HANDLE",
}


def attempt(**overrides) -> Attempt:
    """Node 1 of a 2-node job, 4 ranks per node, on its 3rd start."""
    values = dict(run_id="job7", role="trainer", group_rank=1, group_world_size=2, rank_offset=4,
                  world_size=8, local_world_size=4, master_addr="10.0.0.1", master_port=29500,
                  restart_count=2, max_restarts=5, signals_to_handle="SIGTERM,SIGUSR1")
    return Attempt(**{**values, **overrides})


def test_rank_env_exact_torchrun_variables():
    env = rank_env(attempt(), 3, "/logs/err.json", base={})
    # ftlaunch may add its own FTLAUNCH_* variables; everything else is torchrun's, exactly
    own = {k: v for k, v in env.items() if k.startswith("FTLAUNCH_")}
    theirs = {k: v for k, v in env.items() if not k.startswith("FTLAUNCH_")}
    assert set(theirs) == TORCHRUN_VARS | {"OMP_NUM_THREADS"}
    assert all(v == "job7" for k, v in own.items() if k.endswith("RUN_ID"))
    assert theirs == {
        "RANK": "7", "LOCAL_RANK": "3", "GROUP_RANK": "1", "ROLE_RANK": "7",
        "ROLE_NAME": "trainer", "LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "8",
        "GROUP_WORLD_SIZE": "2", "ROLE_WORLD_SIZE": "8", "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500", "TORCHELASTIC_RESTART_COUNT": "2",
        "TORCHELASTIC_MAX_RESTARTS": "5", "TORCHELASTIC_RUN_ID": "job7",
        "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_ERROR_FILE": "/logs/err.json",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "OMP_NUM_THREADS": "1",
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGUSR1",
    }


@pytest.mark.parametrize("local_rank", range(4))
def test_rank_is_offset_plus_local_rank(local_rank):
    for group_rank, offset in ((0, 0), (1, 4)):
        env = rank_env(attempt(group_rank=group_rank, rank_offset=offset), local_rank, "e",
                       base={})
        assert env["RANK"] == env["ROLE_RANK"] == str(offset + local_rank)
        assert env["LOCAL_RANK"] == str(local_rank)
        assert env["GROUP_RANK"] == str(group_rank)


def test_all_values_are_strings():
    env = rank_env(attempt(), 0, "e", base={})
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())


def test_omp_threads_only_when_several_local_ranks():
    assert "OMP_NUM_THREADS" not in rank_env(attempt(local_world_size=1, world_size=2), 0, "e",
                                             base={})
    assert rank_env(attempt(), 0, "e", base={})["OMP_NUM_THREADS"] == "1"
    assert rank_env(attempt(), 0, "e", base={"OMP_NUM_THREADS": "8"})["OMP_NUM_THREADS"] == "8"


def test_base_env_kept_and_torchrun_vars_overwritten():
    base = {"PATH": "/bin", "RANK": "99", "WORLD_SIZE": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}
    env = rank_env(attempt(), 1, "e", base=base)
    assert env["PATH"] == "/bin"
    assert env["RANK"] == "5" and env["WORLD_SIZE"] == "8"
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"
    assert base == {"PATH": "/bin", "RANK": "99", "WORLD_SIZE": "1",
                    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}


def test_default_base_is_process_env_and_is_not_mutated(monkeypatch):
    monkeypatch.setenv("FTLAUNCH_TEST_MARKER", "yes")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    env = rank_env(attempt(), 0, "e")
    assert env["FTLAUNCH_TEST_MARKER"] == "yes"
    assert env["OMP_NUM_THREADS"] == "1" and env["RANK"] == "4"
    assert "RANK" not in os.environ and "OMP_NUM_THREADS" not in os.environ


def test_rank_command_script(monkeypatch):
    monkeypatch.delenv("PYTHON_EXEC", raising=False)
    assert rank_command("train.py", ["--lr", "1"]) == [sys.executable, "-u", "train.py", "--lr",
                                                       "1"]


def test_rank_command_module(monkeypatch):
    monkeypatch.delenv("PYTHON_EXEC", raising=False)
    assert rank_command("pkg.train", ["-x"], module=True) == [sys.executable, "-u", "-m",
                                                              "pkg.train", "-x"]


def test_rank_command_no_python(monkeypatch):
    monkeypatch.setenv("PYTHON_EXEC", "/should/not/be/used")
    assert rank_command("./run.sh", ["a", "b"], no_python=True) == ["./run.sh", "a", "b"]


def test_rank_command_python_exec_override(monkeypatch):
    monkeypatch.setenv("PYTHON_EXEC", "/opt/py/bin/python3")
    assert rank_command("train.py", []) == ["/opt/py/bin/python3", "-u", "train.py"]
    assert rank_command("m", [], module=True) == ["/opt/py/bin/python3", "-u", "-m", "m"]


def test_rank_command_does_not_alias_args():
    args = ["--a"]
    cmd = rank_command("train.py", args)
    cmd.append("--b")
    assert args == ["--a"]


# --- rendezvous rounds, liveness, succession (pure) -------------------------------------

from launcher.membership import (  # noqa: E402
    lost_by_silence,
    round_complete,
    silent_members,
    successor,
    takes_seat,
)


@pytest.mark.parametrize("joined, expected, min_reached_at, now, why", [
    ({"a", "b", "c"}, set(), None, 0.0, "the maximum"),
    ({"a"}, set(), None, 0.0, None),                             # below MIN
    ({"a", "b"}, set(), 10.0, 10.5, None),                       # MIN reached, last call open
    ({"a", "b"}, set(), 10.0, 11.0, "last call"),
    ({"a", "b"}, {"a", "b"}, 10.0, 10.0, "every node the round waited for"),
    ({"a", "b"}, {"a", "b", "c"}, 10.0, 10.2, None),             # waiting for survivor c
    ({"a"}, {"a", "b"}, None, 99.0, None),                       # survivors back, below MIN
])
def test_round_complete_says_why(joined, expected, min_reached_at, now, why):
    reason = round_complete(joined, expected, 2, 3, min_reached_at, now, 1.0)
    assert reason is None if why is None else why in reason


@pytest.mark.parametrize("node, joined, expected, expected_count, max_nodes, seated", [
    ("s", set(), {"a", "b"}, 2, 2, False),        # both seats are the survivors'
    ("s", set(), {"a"}, 1, 2, True),              # the lost node's seat is free
    ("s", set(), {"a"}, 2, 2, False),             # ... an unnamed survivor will fill it
    ("u", set(), {"a", "u"}, 2, 2, True),         # that survivor (its join said so)
    ("s", {"a", "u"}, {"a", "u"}, 2, 3, True),    # a seat none of them fills
    ("a", {"a", "b", "c"}, {"a"}, 1, 3, True),    # a member's duplicate join
    ("s", {"a", "x"}, {"a", "b"}, 2, 4, True),    # a, x and b's seats held: one free
    ("s", {"a", "x"}, {"a", "b"}, 2, 3, False),   # a counted once: none free
])
def test_a_joining_node_takes_only_a_seat_no_survivor_will_fill(node, joined, expected,
                                                                expected_count, max_nodes,
                                                                seated):
    assert takes_seat(node, joined, expected, expected_count, max_nodes) is seated


def test_a_peer_whose_machine_answers_knocks_gets_the_liveness_timeout_twice():
    """Silent past the timeout, its knocks unanswered (cut off, gone, frozen): lost. Its
    machine answering (a lossy link, a stalled agent): lost at twice the timeout."""
    assert not lost_by_silence(silence=1.9, unanswered=1.9, liveness=2.0)
    assert lost_by_silence(silence=2.1, unanswered=1.1, liveness=2.0)
    assert not lost_by_silence(silence=2.1, unanswered=0.3, liveness=2.0)
    assert not lost_by_silence(silence=3.9, unanswered=0.0, liveness=2.0)
    assert lost_by_silence(silence=4.1, unanswered=0.0, liveness=2.0)


def test_silent_members_are_those_past_the_timeout():
    seen = {"b": 7.9, "c": 8.0, "a": 10.0}  # in the order heard
    assert silent_members(seen, now=10.0, timeout=2.0) == ["b"]
    assert silent_members({}, now=10.0, timeout=2.0) == []
    assert silent_members({"host": 1.0, "b": 7.9, "c": 9.0}, 10.0, 2.0, exempt="host") == ["b"]
    assert silent_members({"b": 1.0, "c": 9.0, "d": 2.0}, 10.0, 2.0) == ["b"], \
        "reading stops at the first one heard since: the order is the caller's to keep"


def test_successor_is_lowest_surviving_group_rank():
    order = ["n0", "n1", "n2"]
    assert successor(order, {"n0"}) == "n1"
    assert successor(order, {"n0", "n1"}) == "n2"
    assert successor(order, set(order)) is None


def test_rank_hints_order_newcomers_but_never_move_old_members():
    members = [Member("b", 1, "x", rank_hint=0), Member("a", 1, "x", rank_hint=1),
               Member("c", 1, "x")]
    assert [a.node_id for a in assign_ranks(members)] == ["b", "a", "c"]
    previous = {"a": 0, "b": 1}
    assert [a.node_id for a in assign_ranks(members, previous)] == ["a", "b", "c"]


def test_a_survivor_stuck_in_native_code_is_replaced_without_waiting_for_the_deadline():
    parked = Survivor(pid=11, rank=1, restartable=True, parked=True)
    stuck = Survivor(pid=10, rank=0, restartable=True, parked=False,
                     stuck="all_gather_single (distributed/distributed_c10d.py:4394)")
    verdict = park_or_stop([stuck, parked], "rank", now=0.0, deadline=60.0)
    assert verdict is not None and verdict.keep == (11,) and verdict.stop == (10,)
    assert verdict.late == (0,) and verdict.blocked_in == (stuck.stuck,)
    assert "blocked in all_gather_single" in verdict.reason
    leaving = Survivor(pid=12, rank=2, restartable=True, parked=False)  # may still park
    assert park_or_stop([stuck, parked, leaving], "rank", now=0.0, deadline=60.0) is None
    late = park_or_stop([stuck, parked, leaving], "rank", now=60.0, deadline=60.0)
    assert late is not None and late.late == (0, 2) and late.blocked_in == (stuck.stuck, "")


@pytest.mark.parametrize("policy", ["job", "cold"])
def test_a_whole_job_restart_stops_survivors_once_they_left_or_are_stuck(policy):
    """Every rank goes, yet re-enterable ones are asked to leave first: left, a SIGTERM ends
    them (ft.preempted()'s handler runs); stuck in native code, it would not: killed at
    once. A script without the shim is stopped as ever (SIGTERM's default action)."""
    parked = Survivor(pid=11, rank=1, restartable=True, parked=True)
    leaving = Survivor(pid=12, rank=2, restartable=True, parked=False)
    plain = Survivor(pid=13, rank=3, restartable=False, parked=False)
    assert to_abort([parked, leaving, plain]) == [12]
    assert park_or_stop([parked, leaving, plain], policy, now=0.0, deadline=2.0) is None
    stuck = Survivor(pid=12, rank=2, restartable=True, parked=False, stuck="native code")
    verdict = park_or_stop([parked, stuck, plain], policy, now=0.0, deadline=2.0)
    assert verdict is not None and verdict.keep == () and verdict.stop == (11, 12, 13)
    assert verdict.late == (2,) and verdict.blocked_in == ("native code",)
    left = park_or_stop([parked, plain], policy, now=0.0, deadline=2.0)
    assert left is not None and (left.keep, left.stop, left.late) == ((), (11, 13), ())
    late = park_or_stop([parked, leaving, plain], policy, now=2.0, deadline=2.0)
    assert late is not None and late.late == (2,) and late.blocked_in == ("",)


@given(st.integers(1, 64), st.data())
def test_two_sides_of_a_partition_never_both_have_a_quorum(size, data):
    """A round of ``size`` nodes: some die, the rest are cut in two. Each side sees some of
    its own back (not yet all, maybe), knows some of the dead gone (their connections closed
    while heard from; not all, maybe), and takes no one on the other side for gone. At most
    one side holds the tie. Never both close a round; and the side that ran the round, with
    every node of its own back and at least as many as on the other side, always does."""
    dead = data.draw(st.integers(0, size - 1), label="nodes that died")
    ours = data.draw(st.integers(1, size - dead), label="nodes with the round's coordinator")
    theirs = size - dead - ours
    ours_back = data.draw(st.integers(0, ours), label="back with it")
    theirs_back = data.draw(st.integers(0, theirs), label="back on the other side")
    coordinators_side = has_quorum(size, ours_back, data.draw(st.integers(0, dead)), True)
    other_side = has_quorum(size, theirs_back, data.draw(st.integers(0, dead)), False)
    assert not (coordinators_side and other_side)
    if ours_back == ours >= theirs:
        assert has_quorum(size, ours, dead, True), "one failure at a time stops no job"


@settings(max_examples=500)
@given(st.data())
def test_a_side_still_on_the_electorate_before_never_trains_beside_the_coordinators(data):
    """A round closes on a new electorate (nodes lost or come, spares changed); some of its
    voters learn it, then the network splits in two. The coordinator's side counts the new
    electorate, and the one before until it is settled. On the other side a node that never
    learnt the new one hosts a coordinator that counts by the one before, without the nodes
    that did learn it (they are ahead); one that learnt it counts by the new one. Never do
    both sides close a round."""
    nodes = range(data.draw(st.integers(2, 12), label="nodes"))
    before = frozenset(data.draw(st.sets(st.sampled_from(nodes), min_size=1), label="before"))
    new = frozenset(data.draw(st.sets(st.sampled_from(nodes), min_size=1), label="new"))
    assume(before & new)
    host = data.draw(st.sampled_from(sorted(before & new)), label="coordinator")
    learnt = {node: 1 for node in data.draw(st.sets(st.sampled_from(sorted(new))),
                                            label="learnt the new")} | {host: 1}
    ours = {host} | data.draw(st.sets(st.sampled_from(nodes)), label="coordinator's side")
    theirs = set(nodes) - ours
    coordinators_side = has_quorum(len(new), len(new & ours), 0, True) and (
        settled(Electorate(0, len(before), before), learnt)
        or has_quorum(len(before), len(before & ours), 0, True))
    stale = {node for node in theirs if node in before and node not in learnt}
    if stale:
        assert not (coordinators_side
                    and has_quorum(len(before), len((before & theirs) - learnt.keys()), 0, False))
    assert not (coordinators_side and has_quorum(len(new), len(new & theirs), 0, False))


def test_an_assign_names_each_earlier_electorate_a_successor_counts():
    """An assign goes to every node: an earlier electorate of more than 16 voters (or one
    a successor knew partly) is sent as one row without a name; its successor learns its
    voters from their joins."""
    small = Electorate(1, 3, frozenset("abc"), frozenset("c"))
    partly = Electorate(2, 20, frozenset("abc"))  # a large job's successor knows 16 of 20
    large = Electorate(3, 17, frozenset(f"n{i}" for i in range(17)))
    rows = named([small, partly, large], limit=16)
    assert rows == [(1, 3, "a", False), (1, 3, "b", False), (1, 3, "c", True),
                    (2, 20, "", False), (3, 17, "", False)]
    assert from_named(rows) == [small, Electorate(2, 20, frozenset()),
                                Electorate(3, 17, frozenset())]
    assert from_named(named([large, small], limit=17)) == [small, large], "oldest first"


@pytest.mark.parametrize("seats, settled_below, reported", [
    ([], -1, []),  # never seated
    ([3], 5, [3]),  # the last seat always: a successor tells survivors from spares by it
    ([1, 2, 3, 4], -1, [1, 2, 3, 4]),  # nothing said settled: every one
    ([1, 2, 3, 4], 2, [2, 3, 4]),
    ([1, 2, 3, 4], 4, [4]),
    ([1, 4, 7], 5, [7]),  # (the seats it held: not every epoch had one)
])
def test_a_join_reports_every_seat_since_the_oldest_round_not_settled(seats, settled_below,
                                                                      reported):
    assert seats_to_report(seats, settled_below) == reported


def test_no_round_closed_yet_needs_no_quorum():
    assert has_quorum(0, 0, 0, wins_tie=False)


def test_a_round_whose_nodes_all_died_needs_no_quorum():
    """None of it can count by it anywhere: no tie to win (an earlier round of two
    coordinators lost one after the other)."""
    assert has_quorum(2, 0, 2, wins_tie=False)
    assert not has_quorum(3, 0, 2, wins_tie=True), "one may be alive elsewhere"
