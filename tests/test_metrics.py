"""Prometheus metrics (``--metrics-port``), scraped over loopback from a real job with one
injected fault, and the labels restarts are counted under."""

from __future__ import annotations

import re
import socket
import urllib.request

import pytest
from conftest import SCRIPTS
from ports import free_port

from launcher.metrics import Metrics, cause_kind


def _scrape(port: int) -> dict[str, float]:
    """name{labels} -> value, from the text exposition format."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(r"^(ftlaunch_\S+) (\S+)$", text, re.M)}


def test_a_scrape_during_a_job_shows_the_restart_the_recovery_and_each_ranks_heartbeat(
        tmp_path, launch):
    port = free_port()
    run = launch("--standalone", "--nproc-per-node", "2", "--metrics-port", str(port),
                 str(SCRIPTS / "train_gpt.py"), "--steps", "400", "--step-time", "0.02",
                 "--shim", "--log-every", "10", "--async-ckpt", "--ckpt-every", "10",
                 "--ckpt-dir", str(tmp_path / "ckpt"),
                 env={"TRAIN_FAULT_RANK": "1", "TRAIN_FAULT_STEP": "5",
                      "TRAIN_FAULT_KIND": "kill"})
    run.wait_for(r"ranks back")  # the recovery is over
    run.wait_for(r"\[rank1\]: step 40 ")  # and both ranks report steps again
    m = _scrape(port)
    assert m['ftlaunch_restarts_total{cause="rank_exit",policy="rank"}'] == 1, m
    assert m["ftlaunch_recovery_seconds_count"] == 1 and m["ftlaunch_recovery_seconds_sum"] > 0
    assert m["ftlaunch_rank_failures_total"] == 1
    assert m["ftlaunch_detection_seconds_count"] == 1  # the kill, once (not each event of it)
    ages = {k: v for k, v in m.items() if k.startswith("ftlaunch_heartbeat_age_seconds{")}
    assert set(ages) == {'ftlaunch_heartbeat_age_seconds{rank="0"}',
                         'ftlaunch_heartbeat_age_seconds{rank="1"}'}, m
    assert all(0 <= age < 30 for age in ages.values()), ages
    # Step reports are sampled once a second: past the fault (step 5), not at the last line.
    assert m["ftlaunch_step"] > 10 and m["ftlaunch_nodes"] == 1
    assert 0 < m["ftlaunch_goodput_ratio"] <= 1, m
    assert m['ftlaunch_lost_seconds{cause="recovery"}'] > 0, m
    assert m["ftlaunch_checkpoint_stall_seconds_count"] >= 2, m  # both ranks saved step 10
    assert m["ftlaunch_checkpoint_durable_seconds_count"] >= 2, m
    assert m["ftlaunch_checkpoint_committed_step"] >= 10, m
    run.proc.terminate()
    run.finish(60)


def test_a_port_in_use_is_a_clear_usage_error(tmp_path, launch):
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = launch("--standalone", "--nproc-per-node", "1", "--metrics-port", str(port),
                     str(SCRIPTS / "train_gpt.py"), "--steps", "1")
        assert run.finish(60) == 2, run.output
    assert f"ftlaunch: error: --metrics-port {port}: Address already in use; pick a free " \
        "port" in run.output


def test_a_peer_that_raised_because_a_rank_died_is_not_a_second_rank_failure():
    """A SIGKILLed rank resets its peer's collective; the peer's "Connection reset by peer"
    can reach the agent first, and both are logged. One rank failed."""
    metrics = Metrics(port=0, addr="127.0.0.1")
    try:
        for ts, cause in ((1.0, "raised RuntimeError: [gloo] Connection reset by peer"),
                          (1.1, "was killed by SIGKILL")):
            metrics.on_event({"event": "rank_failed", "ts": ts, "cause": cause})
        metrics.on_event({"event": "recovering", "ts": 1.2, "cause": "rank 1 was killed",
                          "policy": "rank"})
        assert metrics.rank_failures._value.get() == 1
    finally:
        metrics.close()


@pytest.mark.parametrize("cause, kind", [
    ("rank 1 (node vm:12) was killed by SIGKILL", "rank_exit"),
    ("rank 0 (node vm:12) hung: no heartbeat for 9.0s", "hang"),
    ("node n2:44 lost (no heartbeat for 5s)", "node_lost"),
    ("nodes ['p0:4'] left: the others go on", "node_left"),
    ("node n3:9 joined: scaling up to 3 nodes", "scale_up"),
    ("node n1 was dropped from the job; re-joining", "dropped"),
    ("coordinator node n0:1 lost", "coordinator_lost"),
    ("something new", "other"),
])
def test_restart_causes_get_few_labels(cause, kind):
    assert cause_kind(cause) == kind
