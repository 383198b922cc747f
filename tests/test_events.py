"""The event log's schema: what the code emits, ``launcher.events.EVENTS`` and docs/events.md
say the same, and a real run's lines follow it."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys

import pytest
from conftest import ROOT, SCRIPTS

from launcher import events

DOC = ROOT / "docs" / "events.md"


def _emitted() -> dict[str, set[str]]:
    """Every ``.emit("kind", text, field=...)`` in the launcher: kind -> its field names."""
    found: dict[str, set[str]] = {}
    for path in (ROOT / "launcher").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "emit"):
                continue
            kind = node.args[0]
            assert isinstance(kind, ast.Constant), \
                f"{path.name}:{node.lineno}: an event's kind must be a literal"
            fields = {k.arg for k in node.keywords if k.arg not in (None, "console")}
            found.setdefault(kind.value, set()).update(fields)
    return found


def _documented() -> dict[str, set[str]]:
    """The tables of docs/events.md: event -> the fields its row names (backticked, outside
    the parentheses that describe their values)."""
    rows = re.findall(r"^\| `([a-z_]+)` \| ([^|]*) \|", DOC.read_text(), re.M)
    return {kind: set(re.findall(r"`([a-z_]+)`", re.sub(r"\([^)]*\)", "", fields)))
            for kind, fields in rows if kind not in ("v", "ts", "event")}


def test_every_emitted_event_and_field_is_in_the_schema():
    schema = events.EVENTS
    for kind, fields in _emitted().items():
        assert kind in schema, f"event {kind!r} emitted but not in launcher/events.py EVENTS"
        assert fields <= schema[kind], f"{kind}: fields {fields - schema[kind]} not in EVENTS"
    unused = set(schema) - set(_emitted())
    assert not unused, f"in EVENTS but never emitted: {unused}"


def test_the_document_describes_exactly_the_schema():
    documented, schema = _documented(), events.EVENTS
    assert set(documented) == set(schema), \
        f"undocumented: {set(schema) - set(documented)}; gone: {set(documented) - set(schema)}"
    for kind, fields in schema.items():
        assert documented[kind] == fields, f"{kind}: docs say {documented[kind]}, code {fields}"


def test_an_event_outside_the_schema_is_refused_in_strict_mode(tmp_path, monkeypatch):
    monkeypatch.setenv("FTLAUNCH_STRICT", "1")
    log = events.EventLog(tmp_path / "events.jsonl")
    with pytest.raises(ValueError, match="not in the schema"):
        log.emit("no_such_event", "x", console=False)
    with pytest.raises(ValueError, match="surprise"):
        log.emit("progress", "x", console=False, step=1, surprise=2)
    log.emit("progress", "x", console=False, step=3)
    log.close()
    (line,) = (tmp_path / "events.jsonl").read_text().splitlines()
    assert json.loads(line) == {"v": events.SCHEMA_VERSION, "ts": json.loads(line)["ts"],
                                "event": "progress", "step": 3}


def test_a_real_runs_events_follow_the_schema_and_account_for_its_time(tmp_path, launch):
    """A run with a killed rank: every line versioned and within the schema, and the step
    timeline the goodput account reads is there (progress up to the fault and after); the
    account the agent wrote (goodput.json) and ``ftlaunch report`` add up to the wall."""
    run = launch("--standalone", "--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"),
                 str(SCRIPTS / "train_gpt.py"), "--steps", "30", "--step-time", "0.02",
                 "--shim", "--async-ckpt", "--ckpt-every", "10",
                 "--ckpt-dir", str(tmp_path / "ckpt"),
                 env={"TRAIN_FAULT_RANK": "1", "TRAIN_FAULT_STEP": "15",
                      "TRAIN_FAULT_KIND": "kill"})
    assert run.finish(120) == 0, run.output
    (path,) = (tmp_path / "logs").glob("*/events.jsonl")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    for e in lines:
        assert e["v"] == events.SCHEMA_VERSION and isinstance(e["ts"], float), e
        assert set(e) - {"v", "ts", "event"} <= events.EVENTS[e["event"]], e
    kinds = [e["event"] for e in lines]
    assert kinds.index("started") < kinds.index("rank_failed") < kinds.index("recovered") \
        < kinds.index("job_finished"), kinds
    failed_at = kinds.index("rank_failed")
    before = [e["step"] for e in lines[:failed_at] if e["event"] == "progress"]
    after = [e["step"] for e in lines[failed_at:] if e["event"] == "progress"]
    # The fault came after step 14; heartbeats are throttled, so the agent knew a step or so
    # less, but more than the checkpoint at 10 it resumes from.
    assert before and before[-1] > 10, before
    assert after and after[-1] > 20, after  # well past the resume point (the last beat of
    # step 30 may be throttled away too)
    account = json.loads((path.parent / "goodput.json").read_text())
    assert account["restarts"] == 1 and account["known"] and account["steps"] >= 25, account
    total = account["productive_s"] + sum(account["lost_s"].values())
    assert abs(total - account["wall_s"]) <= 0.01 * account["wall_s"], account
    assert 0 < account["goodput"] < 1 and account["lost_s"]["recovery"] > 0, account
    assert "goodput: " in run.output  # the table at the end, on stderr
    report = subprocess.run([sys.executable, "-m", "launcher", "report", "--json",
                             str(tmp_path / "logs")], capture_output=True, text=True,
                            timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert report.returncode == 0, report.stderr
    assert json.loads(report.stdout) == {str(path.parent): account}
    png = tmp_path / "timeline.png"
    drawn = subprocess.run([sys.executable, "-m", "launcher", "report", "--plot", str(png),
                            str(tmp_path / "logs")], capture_output=True, text=True,
                           timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert drawn.returncode == 0, drawn.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert "goodput: " in drawn.stdout
    listed = subprocess.run([sys.executable, "-m", "launcher", "report", "--events",
                             str(tmp_path / "logs")], capture_output=True, text=True,
                            timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert listed.returncode == 0, listed.stderr
    order = [line.split()[2] for line in listed.stdout.splitlines()]
    assert order.index("rank_failed") < order.index("recovered") < order.index("job_finished")
    assert "progress" not in order, listed.stdout


def test_the_merged_timeline_puts_every_nodes_events_in_one_order():
    from launcher.timeline import merged

    logs = {"node1": [{"v": 1, "ts": 10.0, "event": "started", "world_size": 4},
                      {"v": 1, "ts": 12.5, "event": "progress", "step": 3},
                      {"v": 1, "ts": 13.25, "event": "recovered", "seconds": 0.123456,
                       "phases": {"stop": 0.1}}],
            "n2": [{"v": 1, "ts": 11.0, "event": "rank_failed", "rank": 2, "cause": "SIGKILL"}]}
    assert merged(logs) == [
        "    0.000  node1  started  world_size=4",
        "    1.000  n2     rank_failed  rank=2 cause=SIGKILL",
        '    3.250  node1  recovered  seconds=0.1235 phases={"stop": 0.1}']
    assert len(merged(logs, routine=True)) == 4, "per-step events only when asked for"


def test_report_without_a_log_is_a_clear_error(tmp_path):
    done = subprocess.run([sys.executable, "-m", "launcher", "report", str(tmp_path)],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip() == f"ftlaunch report: error: no events.jsonl under {tmp_path}: " \
        "give the --log-dir of a run"
