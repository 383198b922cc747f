"""The goodput account (launcher/goodput.py) on synthetic event logs: every cause, events
out of order, reports after a failure, a job that never trained; and the pieces always add
up to the wall time."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from launcher.goodput import CAUSES, account, table


def _log(*items):
    """(ts, event, fields) tuples -> events."""
    return [{"v": 1, "ts": float(ts), "event": kind, **fields} for ts, kind, fields in items]


def _p(ts, step):
    return (ts, "progress", {"step": step})


def test_a_fault_free_run_is_start_up_productive_and_shutdown():
    acc = account(_log((0, "gpu_health_monitor", {"active": False}), (2, "started", {}),
                       _p(3, 1), _p(4, 10), _p(13, 100), (14, "job_finished", {"exit_code": 0})))
    assert acc.known and acc.restarts == 0 and acc.steps == 100
    assert acc.lost["start-up"] == 3 and acc.lost["shutdown"] == 1
    assert acc.productive == pytest.approx(10) and acc.goodput == pytest.approx(10 / 14)
    assert acc.lost["re-computed"] == acc.lost["recovery"] == acc.lost["detection"] == 0


def test_a_crash_costs_detection_recovery_and_the_steps_trained_again():
    acc = account(_log((0, "started", {}), _p(1, 1), _p(11, 101), _p(12, 111),
                       (12.5, "rank_failed", {"rank": 1}), (12.6, "recovering", {}),
                       _p(12.7, 112),  # a survivor's late report: not the next attempt's
                       (14, "recovered", {"phases": {"stop": 0.5, "spawn": 0.9}}),
                       _p(14.5, 101), _p(15.5, 111), _p(24.5, 201),
                       (25, "job_finished", {})))
    assert acc.restarts == 1 and acc.steps == 201
    assert acc.lost["detection"] == pytest.approx(0.5)  # last report 12, failure 12.5
    assert acc.lost["recovery"] == pytest.approx(2.0)  # 12.5 until the first step at 14.5
    # Resumed from step 100: steps 101..111 of the first attempt are trained again.
    assert acc.lost["re-computed"] == pytest.approx(1.0 + 10 * 0.01)
    assert acc.recovery_phases == {"stop": 0.5, "spawn": 0.9}
    assert acc.productive + sum(acc.lost.values()) == pytest.approx(acc.wall)


def test_a_hang_is_lost_until_it_is_detected():
    acc = account(_log((0, "started", {}), _p(1, 1), _p(5, 41),
                       (35, "rank_hung", {"rank": 0, "reason": "no heartbeat", "stacks": "x"}),
                       (36, "rank_failed", {}), (37, "recovered", {}), _p(38, 41),
                       _p(48, 141), (49, "job_finished", {})))
    assert acc.lost["detection"] == pytest.approx(30)
    assert acc.lost["recovery"] == pytest.approx(3)
    # Resumed from 40: step 41 (one of the 40 steps 2..41 of 1 s..5 s) is trained again.
    assert acc.lost["re-computed"] == pytest.approx(0.1)
    assert acc.productive == pytest.approx(3.9 + 10)


def test_without_step_reports_goodput_is_unknown_and_says_why():
    acc = account(_log((0, "gpu_health_monitor", {}), (3, "started", {}),
                       (10, "rank_failed", {}), (11, "recovered", {"seconds": 0.8}),
                       (20, "job_finished", {})))
    assert not acc.known and acc.goodput is None
    assert acc.lost["start-up"] == 3 and acc.lost["recovery"] == pytest.approx(0.8)
    assert "trainer_shim.heartbeat" in acc.notes[0]
    assert "unknown" in table(acc)


def test_a_job_that_never_trained():
    acc = account(_log((0, "started", {}), (5, "job_failed", {"exit_code": 1})))
    assert acc.goodput is None and acc.wall == 5
    assert account([]).goodput is None


def test_events_in_any_order_give_the_same_account():
    log = _log((0, "started", {}), _p(1, 1), _p(2, 11), (2.5, "rank_failed", {}),
               (3, "recovered", {}), _p(3.5, 11), _p(4.5, 21), (5, "job_finished", {}))
    assert account(reversed(log)).as_dict() == account(log).as_dict()


_kinds = st.sampled_from(["progress", "rank_failed", "recovering", "recovered", "started",
                          "rank_hung", "checkpoint_committed"])


@given(st.lists(st.tuples(st.floats(0, 1000, allow_nan=False), _kinds, st.integers(0, 500)),
                max_size=40))
def test_the_pieces_add_up_to_the_wall_time(items):
    log = [{"ts": ts, "event": kind, **({"step": step} if kind == "progress" else {})}
           for ts, kind, step in items]
    acc = account(log)
    assert set(acc.lost) == set(CAUSES)
    assert all(v >= -1e-9 for v in acc.lost.values()) and acc.productive >= -1e-9
    if acc.known and acc.wall > 0:
        assert acc.productive + sum(acc.lost.values()) == pytest.approx(acc.wall, abs=1e-6)
        assert 0 <= acc.goodput <= 1 + 1e-9


def test_checkpoint_stalls_come_out_of_productive_time():
    saves = [(5.0, "checkpoint_shard", {"rank": r, "step": 10, "stage": "staged",
                                        "seconds": s}) for r, s in ((0, 0.2), (1, 0.3))]
    saves.append((6.0, "checkpoint_shard", {"rank": 0, "step": 10, "stage": "durable",
                                            "seconds": 1.5}))
    acc = account(_log((0, "started", {}), _p(1, 1), *saves, _p(11, 101),
                       (12, "job_finished", {})))
    assert acc.lost["checkpoint stalls"] == pytest.approx(0.3)  # the slower rank's, once
    assert acc.productive == pytest.approx(10 - 0.3)
    assert acc.productive + sum(acc.lost.values()) == pytest.approx(acc.wall)
