"""The agent's rank processes (launcher.workers) in this process: real processes, real pipes."""

from __future__ import annotations

import sys
import time

from launcher.config import StreamMode
from launcher.orphan_guard import OrphanGuard
from launcher.rank_env import Attempt
from launcher.workers import OutputPlan, Program, WorkerGroup

WAIT_FOR_FILE = """
import os, sys, time
while not os.path.exists(sys.argv[1]):
    time.sleep(0.01)
print("still heard", flush=True)
"""


def _service_until(group: WorkerGroup, done, timeout: float = 30.0) -> list:
    exits, end = [], time.monotonic() + timeout  # a hang guard
    while not done():
        assert time.monotonic() < end, "the ranks did not get there"
        exits += group.wait(0.2)
    return exits


def test_releasing_a_replaced_rank_leaves_the_pipes_that_took_its_numbers_alone(tmp_path, capsys):
    """A rank's pipe closed at its end frees its number; the pipe of a rank started next
    takes it. Released later (as a stop releases every reaped rank), the old rank matched
    its pumps by number: it read the new rank's output as its own, then closed the new
    rank's pipe, which died of it on its next line (and the agent closed that number a
    second time, by then anyone's)."""
    both = (StreamMode(file=False, console=True),) * 2
    plan = OutputPlan(tmp_path, {0: both, 1: both}, console={0, 1})
    attempt = Attempt(run_id="t", role="trainer", group_rank=0, group_world_size=1,
                      rank_offset=0, world_size=2, local_world_size=2,
                      master_addr="127.0.0.1", master_port=1, restart_count=0, max_restarts=1)
    guard = OrphanGuard()
    try:
        group = WorkerGroup(Program(sys.executable, ["-c", "print('old rank')"], no_python=True),
                            plan, guard, lambda rank_dir: {})
        old = group.spawn(attempt, 0, None)
        _service_until(group, lambda: old.returncode is not None
                       and all(p.fd < 0 for p in old.pumps))
        group._program = Program(sys.executable, ["-c", WAIT_FOR_FILE, str(tmp_path / "go")],
                                 no_python=True)
        new = group.spawn(attempt, 1, None)
        new_fds = [p.fd for p in new.pumps]
        group.release_reaped()
        assert all(fd in group.fds() for fd in new_fds), "the new rank's pipes were released"
        (tmp_path / "go").touch()
        exits = _service_until(group, lambda: new.returncode is not None
                               and all(p.fd < 0 for p in new.pumps))
        assert [e.returncode for e in exits] == [0], exits
        assert "still heard" in capsys.readouterr().out
        group.release_reaped()
        assert group.fds() == []
    finally:
        guard.close()
