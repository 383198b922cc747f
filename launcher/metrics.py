"""Prometheus metrics of one node (``--metrics-port``; the optional extra ``ftlaunch[metrics]``).

Fed by the node's own events (the same record as ``events.jsonl``, so the two never
disagree) and, for what changes between events, a snapshot the agent hands over: its ranks'
heartbeat ages. Served by prometheus-client's HTTP server in its own thread; the goodput
gauges are computed from the events at each scrape.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from launcher import failures, goodput

CAUSE_KINDS = (  # low-cardinality labels for restarts, from the recovery's cause; in order
    ("coordinator_lost", re.compile(r"coordinator node \S+ lost")),
    ("node_lost", re.compile(r"\bnode \S+ lost\b")),
    ("hang", re.compile(r"\bhung\b|no heartbeat|frozen")),
    ("node_left", re.compile(r"\bleft\b")),
    ("node_unhealthy", re.compile(r"excluded|unhealthy")),
    ("scale_up", re.compile(r"joined: scaling up")),
    ("dropped", re.compile(r"dropped from the job")),
    ("rank_exit", re.compile(r"\brank \d+\b")),
)


def cause_kind(cause: str) -> str:
    """The kind of a recovery's cause, for a label: a rank that exited or raised, a hang, a
    lost node, ... (`other` when none fits)."""
    for kind, pattern in CAUSE_KINDS:
        if pattern.search(cause):
            return kind
    return "other"


class Metrics:
    def __init__(self, port: int, addr: str = "0.0.0.0"):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
        from prometheus_client.exposition import start_http_server

        self.registry = r = CollectorRegistry()
        self._events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self.restarts = Counter("ftlaunch_restarts", "Recoveries ordered, by cause and policy.",
                                ["cause", "policy"], registry=r)
        self.rank_failures = Counter("ftlaunch_rank_failures", "Ranks of this node that failed "
                                     "(exited, were killed, raised or hung), not counting a "
                                     "rank that raised only because a peer died under it.",
                                     registry=r)
        self.recovery = Histogram("ftlaunch_recovery_seconds", "Failure to ranks back.",
                                  buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300),
                                  registry=r)
        self.detection = Histogram("ftlaunch_detection_seconds", "The last step report "
                                   "before a failure until the failure is known (a hang's "
                                   "length; for a crash, about one report interval).",
                                   buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 300, 1800),
                                   registry=r)
        self._failing = False  # the current attempt's failure is counted already
        seconds = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
        self.stall = Histogram("ftlaunch_checkpoint_stall_seconds", "How long a rank's save "
                               "blocked training (until staged in shared memory).",
                               buckets=seconds, registry=r)
        self.durable = Histogram("ftlaunch_checkpoint_durable_seconds", "A rank's save until "
                                 "its shard is durable in storage.", buckets=seconds,
                                 registry=r)
        self.heartbeat_age = Gauge("ftlaunch_heartbeat_age_seconds", "Seconds since each "
                                   "rank's last trainer_shim heartbeat.", ["rank"], registry=r)
        self.step = Gauge("ftlaunch_step", "Highest step a rank of this node reported.",
                          registry=r)
        self.steps_per_second = Gauge("ftlaunch_steps_per_second", "Steps per second between "
                                      "the last two step reports.", registry=r)
        self.committed = Gauge("ftlaunch_checkpoint_committed_step", "Newest checkpoint step "
                               "every rank made durable.", registry=r)
        self.nodes = Gauge("ftlaunch_nodes", "Nodes in the job's current round.", registry=r)
        r.register(_GoodputCollector(self))
        self._last_progress: tuple[float, int] | None = None
        self.server, self._thread = start_http_server(port, addr=addr, registry=r)

    def on_event(self, record: Mapping[str, Any]) -> None:
        """One event as it is logged (the EventLog's sink)."""
        with self._lock:
            self._events.append(dict(record))
        kind = record["event"]
        if kind in ("rank_failed", "rank_hung", "recovering") and not self._failing:
            self._failing = True
            if self._last_progress is not None:
                self.detection.observe(max(0.0, record["ts"] - self._last_progress[0]))
        elif kind in ("recovered", "started"):
            self._failing = False
        if kind == "recovering":
            self.restarts.labels(cause_kind(record.get("cause", "")),
                                 record.get("policy", "")).inc()
        elif kind == "rank_failed" and not failures.is_peer_error(record.get("cause", "")):
            self.rank_failures.inc()  # the peer's own failure is counted where it happened
        elif kind == "recovered":
            self.recovery.observe(record.get("seconds", 0.0))
        elif kind == "progress":
            at, step = record.get("at", record["ts"]), record["step"]
            if self._last_progress is not None and at > self._last_progress[0] \
                    and step > self._last_progress[1]:
                self.steps_per_second.set((step - self._last_progress[1])
                                          / (at - self._last_progress[0]))
            self._last_progress = (at, step)
            self.step.set(step)
        elif kind == "checkpoint_shard" and record.get("seconds", -1) >= 0:
            (self.stall if record.get("stage") == "staged" else self.durable).observe(
                record["seconds"])
        elif kind == "checkpoint_committed":
            self.committed.set(record["step"])

    def set_nodes(self, count: int) -> None:
        self.nodes.set(count)

    def set_heartbeat_ages(self, ages: Mapping[int, float]) -> None:
        """Rank -> seconds since its last heartbeat (ranks not listed are gone)."""
        self.heartbeat_age.clear()
        for rank, age in ages.items():
            self.heartbeat_age.labels(str(rank)).set(age)

    def account(self) -> goodput.Account:
        with self._lock:
            events = list(self._events)
        return goodput.account(events)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _GoodputCollector:
    """Goodput so far and time lost by cause, from the node's events at each scrape."""

    def __init__(self, metrics: Metrics):
        self._metrics = metrics

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        acc = self._metrics.account()
        ratio = GaugeMetricFamily("ftlaunch_goodput_ratio", "Productive time over wall time "
                                  "so far (NaN without trainer_shim step reports).")
        ratio.add_metric([], float("nan") if acc.goodput is None else acc.goodput)
        yield ratio
        lost = GaugeMetricFamily("ftlaunch_lost_seconds", "Wall time not spent training, "
                                 "by cause.", labels=["cause"])
        for cause, seconds in acc.lost.items():
            lost.add_metric([cause], seconds)
        yield lost
