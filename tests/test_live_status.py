"""The live status line: drawn on a terminal (a real pseudo-terminal here) below whole
output lines; nothing drawn, no control code, when the output is not a terminal."""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
import time

from conftest import ROOT, SCRIPTS

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def test_on_a_terminal_a_status_line_is_drawn_below_whole_rank_lines(tmp_path):
    leader, follower = pty.openpty()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FTLAUNCH_STRICT": "1", "COLUMNS": "200"}
    env = {k: v for k, v in env.items() if not k.startswith(("PET_", "TRAIN_"))}
    proc = subprocess.Popen(
        [sys.executable, "-m", "launcher", "--standalone", "--nproc-per-node", "2",
         "--log-dir", str(tmp_path / "logs"), str(SCRIPTS / "train_gpt.py"), "--steps", "150",
         "--step-time", "0.02", "--shim", "--log-every", "50"],
        stdin=subprocess.DEVNULL, stdout=follower, stderr=follower, env=env, cwd=tmp_path)
    os.close(follower)
    raw = b""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ready, _, _ = select.select([leader], [], [], 1.0)
        if ready:
            try:
                chunk = os.read(leader, 1 << 16)
            except OSError:  # the terminal's other end closed: everything is read
                break
            if not chunk:
                break
            raw += chunk
        elif proc.poll() is not None:
            break
    os.close(leader)
    assert proc.wait(30) == 0, raw.decode(errors="replace")
    text = raw.decode(errors="replace")
    assert "\x1b[" in text, "a terminal gets the live display's control codes"
    plain = ANSI.sub("", text).replace("\r", "\n")
    assert "ftlaunch ▸ running" in plain and "r0 step" in plain, plain
    lines = plain.splitlines()
    for rank in (0, 1):  # each rank's lines whole, on lines of their own
        assert any(re.fullmatch(rf"\[rank{rank}\]: step 100 loss [\d.]+ rank {rank}", line)
                   for line in lines), plain


def test_not_a_terminal_no_control_code(tmp_path, launch):
    run = launch("--standalone", "--nproc-per-node", "2", str(SCRIPTS / "train_gpt.py"),
                 "--steps", "20", "--shim", "--log-every", "10")
    assert run.finish(120) == 0, run.output
    assert "[rank1]: step 20 " in run.output
    assert "\x1b" not in run.output and "ftlaunch ▸" not in run.output


def test_the_status_line_says_what_the_node_waits_for():
    from ftlaunch_contract.messages import RankState
    from launcher.live_status import status_line

    ranks = (RankState(0, 120, 40), RankState(1, -1, -1))
    line = status_line("running", 3.0, None, False, 2, 1, 3, ranks, None)
    assert line == "ftlaunch ▸ running · epoch 2 · restarts 1/3  r0 step 120 ♥0.0s  r1 step -"
    assert "ranks saving; SIGKILL in 42s" in status_line("leaving", 1, 42.2, False, 2, 1, 3,
                                                         (), None)
    assert "pulling checkpoint shards" in status_line("preparing", 1, 5, True, 2, 1, 3, (), None)
    assert "12s, waiting for the round" in status_line("joining", 12.4, None, False, 0, 0, 3,
                                                       (), None)
    assert line.endswith("r1 step -") and status_line(
        "stopping", 0, 2, False, 3, 2, 3, ranks, {"decide": 0.001, "stop": 0.25}).endswith(
        "recovering: decide 0.00s, stop 0.25s")
