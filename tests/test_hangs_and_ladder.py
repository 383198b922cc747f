"""Pure decisions of #4: hang detection, the recovery ladder, the no-progress breaker, and the
node-local messages between ranks and their agent."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftlaunch_contract.messages import LOCAL
from ftlaunch_contract.protocol import ProtocolError, pack_local, unpack_local
from launcher import recovery
from launcher.hang_detection import (
    LEARN_AFTER_BEATS,
    RESUME_WITHIN,
    HangTimeouts,
    RankActivity,
    hang_reason,
    heartbeat_timeout,
)

T = HangTimeouts(heartbeat=10.0, startup=60.0, sections={"checkpoint": 100.0})


# --- hang detection ------------------------------------------------------------------------


def test_startup_timeout_applies_until_the_first_message():
    a = RankActivity(started_at=0.0)
    assert hang_reason(a, T, 59.0) is None
    assert "startup timeout" in hang_reason(a, T, 61.0)
    a.beat(61.0, 0)  # once it speaks, the heartbeat timeout rules
    assert hang_reason(a, T, 70.0) is None
    assert "no heartbeat for 10.5s" in hang_reason(a, T, 71.5)


def test_a_resumed_rank_that_does_not_reenter_its_training_function_is_hung():
    """Whatever the timeouts (none here): re-entering takes milliseconds once resumed."""
    off = HangTimeouts(heartbeat=0.0, startup=0.0)
    stuck = RankActivity(started_at=0.0, awaiting_entry=True)
    assert hang_reason(stuck, off, RESUME_WITHIN - 0.1) is None
    assert "not back in its training function" in hang_reason(stuck, off, RESUME_WITHIN + 0.1)
    back = RankActivity(started_at=0.0, awaiting_entry=True)
    back.awaiting_entry = False  # its shim said it entered
    assert hang_reason(back, off, 10 * RESUME_WITHIN) is None


def test_any_message_is_a_sign_of_life():
    a = RankActivity(0.0)
    a.beat(1.0, 5)
    a.section(9.0, "step", True)  # a section without its own timeout: heartbeat rules apply
    assert hang_reason(a, T, 18.0) is None
    assert hang_reason(a, T, 19.5) is not None


def test_an_open_section_with_a_timeout_replaces_the_heartbeat_timeout():
    a = RankActivity(0.0)
    a.beat(1.0, 1)
    a.section(2.0, "checkpoint", True)
    assert hang_reason(a, T, 90.0) is None  # long past the heartbeat timeout: still fine
    assert "section 'checkpoint'" in hang_reason(a, T, 103.0)
    a.section(50.0, "checkpoint", False)
    assert hang_reason(a, T, 59.0) is None and hang_reason(a, T, 61.0) is not None


def test_zero_timeouts_never_fire():
    a = RankActivity(0.0)
    off = HangTimeouts(heartbeat=0.0, startup=0.0)
    assert hang_reason(a, off, 1e9) is None
    a.beat(1.0, 1)
    assert hang_reason(a, off, 1e9) is None


def test_learned_timeout_needs_enough_beats_and_stays_within_bounds():
    learned = HangTimeouts(heartbeat=30.0, startup=0.0, factor=4.0)
    a = RankActivity(0.0)
    for i in range(LEARN_AFTER_BEATS - 1):
        a.beat(i * 0.5, i)
    assert heartbeat_timeout(a, learned) == 30.0  # not enough evidence yet
    a.beat(LEARN_AFTER_BEATS * 0.5, LEARN_AFTER_BEATS)
    assert heartbeat_timeout(a, learned) == pytest.approx(4.0 * 1.0)  # longest interval 1.0 s
    fast = RankActivity(0.0)
    for i in range(LEARN_AFTER_BEATS + 5):
        fast.beat(i * 0.01, i)
    assert heartbeat_timeout(fast, learned) == 1.0  # the floor
    slow = RankActivity(0.0)
    for i in range(LEARN_AFTER_BEATS + 5):
        slow.beat(i * 20.0, i)
    assert heartbeat_timeout(slow, learned) == 30.0  # never above the configured one


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(0.001, 50.0), min_size=1, max_size=60), st.floats(0.0, 200.0))
def test_a_rank_that_beats_within_the_timeout_is_never_hung(gaps, extra):
    a, now = RankActivity(0.0), 0.0
    for i, gap in enumerate(gaps):
        now += gap
        a.beat(now, i)
    limit = heartbeat_timeout(a, T)
    assert (hang_reason(a, T, now + extra) is None) == (extra <= limit)
    assert a.step == len(gaps) - 1


# --- the ladder and the breaker -----------------------------------------------------------


def test_escalation_climbs_one_rung_per_stalled_recovery_and_stays_on_top():
    assert [recovery.escalate("rank", n) for n in range(5)] == ["rank", "job", "cold", "cold",
                                                                 "cold"]
    assert [recovery.escalate("job", n) for n in range(3)] == ["job", "cold", "cold"]
    assert recovery.escalate("cold", 7) == "cold"


def test_progress_counts_recoveries_without_a_new_best_step():
    p = recovery.Progress()
    p = p.after_failure(12)
    assert (p.best_step, p.stalled) == (12, 0)
    p = p.after_failure(12).after_failure(9)
    assert (p.best_step, p.stalled) == (12, 2)
    unknown = p.after_failure(-1)  # no shim, lost node: neither way for the ladder
    assert (unknown.best_step, unknown.stalled) == (12, 2)
    assert p.after_failure(13) == recovery.Progress(13, 0, failing=1)


def test_decide_escalates_and_stops_with_do_not_requeue_when_stalled():
    stalled = recovery.Progress(best_step=10, stalled=1)
    d = recovery.decide(1, 5, "rank", "boom", progress=stalled, max_stalled=3)
    assert (d.action, d.policy) == ("restart", "job")
    d = recovery.decide(3, 5, "rank", "boom", progress=recovery.Progress(10, 3), max_stalled=3)
    assert d.action == "stalled" and "no progress" in d.reason and "beyond 10" in d.reason
    d = recovery.decide(3, 5, "rank", "boom", progress=recovery.Progress(10, 3), max_stalled=0)
    assert (d.action, d.policy) == ("restart", "cold")  # 0 = the breaker is off


# --- node-local messages -------------------------------------------------------------------


def test_local_messages_round_trip():
    for kind, fields in [("hello", {"pid": 7, "stacks": True}), ("restartable", {"pid": 7}),
                         ("beat", {"pid": 7, "step": 3}),
                         ("section", {"pid": 7, "name": "step", "open": False}),
                         ("parked", {"pid": 7, "error": "", "step": 5, "sent": 1.5}), ("abort", {}),
                         ("resume", {"env": {"RANK": "1"}}), ("committed", {"step": 4}),
                         ("durable", {"pid": 7, "rank": 1, "step": 4, "seconds": 1.25}),
                         ("staged", {"pid": 7, "rank": 1, "step": 4, "seconds": 0.5})]:
        msg = unpack_local(pack_local(LOCAL[kind](**fields)))
        assert (msg.TYPE, msg.payload()) == (kind, fields)


@pytest.mark.parametrize("body", [
    b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"type": "beat", "pid": 1}),
    msgpack.packb({"type": "beat", "pid": 1, "step": "3"}),
    msgpack.packb({"type": "beat", "pid": True, "step": 3}),
    msgpack.packb({"type": "hello", "pid": 1, "stacks": 1}),
    msgpack.packb({"type": "resume", "env": {"A": 1}}),
    msgpack.packb({"type": "exec", "code": "import os"}),
    b"\x00" * (2 << 20),
])
def test_malformed_local_messages_are_rejected(body):
    with pytest.raises(ProtocolError):
        unpack_local(body)


def test_a_restored_interval_sets_the_learned_timeout_from_the_first_beat():
    learned = HangTimeouts(heartbeat=60.0, startup=0.0, factor=3.0)
    a = RankActivity(0.0)
    a.restore(2.0)  # saved by trainer_shim.state_dict() with the last checkpoint
    a.beat(1.0, 0)
    assert heartbeat_timeout(a, learned) == 6.0
    assert hang_reason(a, learned, 6.5) is None and hang_reason(a, learned, 7.5) is not None


def test_shim_state_dict_round_trips_without_an_agent():
    import trainer_shim as ft

    assert not ft.is_managed()
    ft.load_state_dict({"longest_heartbeat_interval": 1.5, "step_interval": 0.2})
    assert ft.state_dict() == {"longest_heartbeat_interval": 1.5, "step_interval": 0.2}
    ft.heartbeat(3)  # no agent: nothing happens, nothing fails
    with ft.section("step"):
        pass
    assert ft.restartable(lambda ctx, x: (ctx.attempt, x))(7) == (0, 7)


def test_the_hang_verdict_blames_the_frozen_rank_else_all_that_fell_silent_together():
    from launcher.hang_detection import RankActivity, hung_ranks

    timeouts = HangTimeouts(heartbeat=1.0, startup=0.0)
    ranks = {}
    for pid, last in ((1, 0.0), (2, 0.1), (3, 5.0)):  # 3 is fine: it beat recently
        ranks[pid] = RankActivity(0.0)
        ranks[pid].beat(last, 1)
        ranks[pid].last_tick = 5.0  # every shim thread still runs
    assert [pid for pid, _ in hung_ranks(ranks, timeouts, 1.05)] == [1, 2]  # asleep: both go
    ranks[1].last_tick = 0.0  # 1 is frozen: its peer only waits on it
    assert [pid for pid, _ in hung_ranks(ranks, timeouts, 5.1)] == [1]
    assert "frozen" in hung_ranks(ranks, timeouts, 5.1)[0][1]
    ranks[1].last_tick = 5.0
    without_2 = {pid: a for pid, a in ranks.items() if pid != 2}  # the hub leaves out parked ranks
    assert [pid for pid, _ in hung_ranks(without_2, timeouts, 1.05)] == [1]
    # The waiting peer crosses the timeout first: it is not blamed, the verdict waits
    # until the frozen rank crosses it too.
    ranks[1].beat(4.5, 1)
    ranks[1].last_tick = 2.0
    assert hung_ranks(ranks, timeouts, 5.11) == []
    assert [pid for pid, _ in hung_ranks(ranks, timeouts, 5.6)] == [1]


def test_ranks_that_still_tick_wait_for_a_culprit_frozen_on_another_node_to_be_found_there():
    """Chaos (SIGSTOP of one rank, 2 nodes): the other node's ranks, blocked on it, crossed
    the timeout first and were replaced; the stopped rank could not park and was waited
    for until --stop-timeout. Its own node finds it frozen once its ticks are 2 s old."""
    from launcher.hang_detection import RankActivity, hung_ranks

    def waiting(now: float, limit: float, other_nodes: bool) -> list[int]:
        ranks = {pid: RankActivity(0.0) for pid in (1, 2)}
        for activity in ranks.values():
            activity.beat(0.0, 1)
            activity.last_tick = now  # both still tick: blocked in a collective
        timeouts = HangTimeouts(heartbeat=limit, startup=0.0)
        return [pid for pid, _ in hung_ranks(ranks, timeouts, now, other_nodes)]

    assert waiting(1.05, 1.0, other_nodes=False) == [1, 2]  # alone: nobody else to wait for
    assert waiting(1.05, 1.0, other_nodes=True) == []
    assert waiting(2.95, 1.0, other_nodes=True) == []  # the culprit is frozen at 2 s + a tick
    assert waiting(3.05, 1.0, other_nodes=True) == [1, 2]
    assert waiting(4.3, 4.0, other_nodes=True) == []  # its own node blames it at ~4 s
    assert waiting(4.55, 4.0, other_nodes=True) == [1, 2]


def test_a_checkpoint_step_commits_once_every_rank_holds_it():
    from launcher.commits import CommitLog

    log = CommitLog(world_size=3)
    assert log.report(0, 10) is None and log.report(1, 10) is None
    assert log.report(2, 20) is None, "rank 2 never had 10 durable"
    assert log.report(2, 10) == 10
    assert log.report(0, 20) is None and log.report(1, 20) == 20
    assert log.report(0, 10) is None, "older than the committed step: nothing new"
    assert log.report(3, 30) is None and log.report(-1, 30) is None, "not a rank of this world"
    assert log.committed == 20


def test_parked_ranks_read_together_are_taken_in_the_order_they_left():
    """A rank that raised parks before it releases its process group; the peer whose
    collective then fails parks after it. Read in one batch, the first to leave comes
    first (it is the failure), whatever the order the messages arrived in."""
    from launcher.rank_hub import first_to_leave

    assert first_to_leave([(2.0, 2), (1.0, 1)]) == [1, 2]  # arrival order: 2, then 1
    assert first_to_leave([(1.0, 7), (1.5, 3), (0.5, 9)]) == [9, 7, 3]


def test_parked_ranks_are_reported_with_their_error_and_step(tmp_path):
    """Over the hub's socket: both parked ranks reported, the highest step either reached
    counts as progress, each rank's error kept."""
    import time

    import zmq

    from ftlaunch_contract.messages import Parked
    from launcher.rank_hub import RankHub

    context = zmq.Context()
    hub = RankHub(context, tmp_path)
    try:
        hub.track(1, 0.0)
        hub.track(2, 0.0)
        shims = []
        for pid, sent, step in ((2, 2.0, 5), (1, 1.0, 6)):
            shim = context.socket(zmq.DEALER)
            shim.connect(hub.endpoint)
            shim.send(pack_local(Parked(pid=pid, error=f"rank {pid}", step=step, sent=sent)))
            shims.append(shim)
        poller = zmq.Poller()
        poller.register(hub.socket, zmq.POLLIN)
        news, deadline = [], time.monotonic() + 10
        while len(news) < 2 and time.monotonic() < deadline:
            poller.poll(100)
            news += hub.receive(time.monotonic()).parked
        assert sorted(news) == [1, 2]
        assert hub.best_step == 6 and hub.parked(1) and hub.error(2) == "rank 2"
    finally:
        hub.close()
        context.destroy(linger=0)


def test_a_rank_frozen_right_after_its_resume_is_still_found_frozen(tmp_path):
    """Chaos (3 nodes, seeds 1316 and 1322): a rank SIGSTOPped within half a second of
    resuming in place had sent no tick since (seed 1316: not even a heartbeat). Its record
    had restarted with the resume, so it never looked frozen (nor, silent since, hung); a
    peer blocked on it on another node was blamed instead, and the stopped rank, unable to
    park, was waited for until --stop-timeout."""
    import time

    import zmq

    from ftlaunch_contract.messages import Beat, Hello, Tick
    from launcher.rank_hub import RankHub

    context = zmq.Context()
    hub = RankHub(context, tmp_path)
    shim = context.socket(zmq.DEALER)
    timeouts = HangTimeouts(heartbeat=4.0, startup=600.0)

    def tell(now: float, *msgs: object) -> None:
        """Send, ending with a heartbeat: read once it is (one socket keeps their order)."""
        for msg in msgs:
            shim.send(pack_local(msg))
        beats, deadline = hub.links[1].activity.beats, time.monotonic() + 10
        while hub.links[1].activity.beats == beats and time.monotonic() < deadline:
            hub.socket.poll(100)
            hub.receive(now)

    def blamed(now: float) -> list[tuple[int, bool]]:
        return [(pid, "frozen" in why) for pid, why in hub.hung(now, timeouts, True)]

    try:
        hub.track(1, 0.0)
        shim.connect(hub.endpoint)
        tell(0.6, Hello(pid=1, stacks=True), Tick(pid=1, sent=0.5), Beat(pid=1, step=3))
        hub.track(1, 0.7, resumed=True)  # then SIGSTOPped: never a word again
        assert "frozen" in hub.stuck(1, 3.0)
        assert blamed(4.6) == [] and blamed(5.0) == [(1, True)]
        tell(1.0, Beat(pid=1, step=4))  # back in training for a step, then SIGSTOPped
        assert blamed(5.0) == [] and blamed(5.3) == [(1, True)]
    finally:
        shim.close(linger=0)
        hub.close()
        context.destroy(linger=0)
