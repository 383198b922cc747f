"""The shim's abort: an exception raised in the training thread by its listener, and its
withdrawal, leave the interpreter as they found it."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT
from ports import free_port

AFTER_AN_ABORT = """\
import cProfile, threading
from trainer_shim.agent_link import raise_in, withdraw_abort
from trainer_shim.restart import RestartRequested

def call():
    return 1

try:
    raise_in(threading.get_ident(), RestartRequested)
    call()
except RestartRequested:
    print("delivered", flush=True)
withdraw_abort()  # as the shim leaves the training function: nothing is pending now
withdraw_abort()
profiler = cProfile.Profile()
profiler.enable()
call()
profiler.disable()
print("profiled call returned", flush=True)
"""


def test_withdrawing_an_abort_leaves_no_pending_flag_behind():
    """PyThreadState_SetAsyncExc(NULL), the obvious withdrawal, leaves CPython 3.11's flag
    for a pending exception set with nothing to deliver: the next call under a profiler
    spins for ever (this script then hangs at ``call()``)."""
    done = subprocess.run([sys.executable, "-c", AFTER_AN_ABORT], cwd=ROOT, timeout=60,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["delivered", "profiled call returned"], done.stdout


STUCK_OR_NOT = """\
import hashlib, os, sys, threading, time
import zmq
from ftlaunch_contract import environment
from ftlaunch_contract.messages import Abort
from ftlaunch_contract.protocol import pack_local, unpack_local

hub = zmq.Context().socket(zmq.ROUTER)
hub.bind(os.environ[environment.HUB])
from trainer_shim.agent_link import AgentLink
from trainer_shim.restart import RestartRequested

link = AgentLink(os.environ[environment.HUB])
link.pace = 0.05  # as after heartbeats 50 ms apart: looked at every 0.1 s
identity, _ = hub.recv_multipart()  # its hello
gate = threading.Lock()
gate.acquire()
left = threading.Event()

def blocked_in_native_code():  # idle: a lock nobody releases (as a gloo wait)
    gate.acquire()

def busy_in_native_code():  # a long native step, the GIL released: it uses its CPU
    hashlib.pbkdf2_hmac("sha256", b"x", b"y", int(sys.argv[2]))

def train(fn):
    link.enter_training()
    try:
        fn()
    except RestartRequested:
        pass
    link.leave_training()
    left.set()

thread = threading.Thread(target=train, args=(globals()[sys.argv[1]],))
thread.start()
time.sleep(0.2)
hub.send_multipart([identity, pack_local(Abort())])
deadline = time.monotonic() + 10
while time.monotonic() < deadline and not left.is_set():
    if hub.poll(50):
        msg = unpack_local(hub.recv_multipart()[1])
        if msg.TYPE == "entered":
            print("entered", flush=True)
        if msg.TYPE == "stuck":
            print("stuck in", msg.where, flush=True)
            gate.release()
print("left" if left.wait(30) else "still inside", flush=True)
"""


def _stuck_or_not(tmp_path, fn: str, rounds: int = 0) -> list[str]:
    done = subprocess.run([sys.executable, "-c", STUCK_OR_NOT, fn, str(rounds)], cwd=ROOT,
                          timeout=120, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT),
                               "FTLAUNCH_HUB": f"ipc://{tmp_path}/hub"})
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_a_training_thread_idle_in_native_code_after_an_abort_is_reported_stuck(tmp_path):
    """Blocked where the abort cannot reach it, burning no CPU: the shim says where."""
    lines = _stuck_or_not(tmp_path, "blocked_in_native_code")
    assert lines[0] == "entered", "the agent hears when the training function is entered"
    assert lines[1].startswith("stuck in blocked_in_native_code (<string>:"), lines
    assert lines[-1] == "left", lines


def test_a_training_thread_busy_in_native_code_is_left_to_finish(tmp_path):
    """A long native step uses its CPU: no report; the abort lands when the step returns."""
    lines = _stuck_or_not(tmp_path, "busy_in_native_code", rounds=3_000_000)  # ~1 s
    assert lines == ["entered", "left"], lines


ABORT_IN_A_SLEEP = """\
import os, threading, time
import zmq
from ftlaunch_contract import environment
from ftlaunch_contract.messages import Abort
from ftlaunch_contract.protocol import pack_local

hub = zmq.Context().socket(zmq.ROUTER)
hub.bind(os.environ[environment.HUB])
from trainer_shim.agent_link import AgentLink
from trainer_shim.restart import RestartRequested

link = AgentLink(os.environ[environment.HUB])
identity, _ = hub.recv_multipart()  # its hello
link.enter_training()  # the main thread trains, as a script's loop does
threading.Timer(0.2, hub.send_multipart, ([identity, pack_local(Abort())],)).start()
start = time.monotonic()
try:
    time.sleep(60)  # the rest of a step: device time, a data loader's queue
    print("slept it out", flush=True)
except RestartRequested:
    print(f"left after {time.monotonic() - start:.0f}s", flush=True)
link.leave_training()
"""


def test_an_abort_cuts_a_wait_in_the_main_thread_short(tmp_path):
    """An exception raised in a thread lands only between two Python instructions: a
    survivor sleeping out its step would park a step late. The shim also signals the main
    thread, and the abort is raised out of the sleep."""
    done = subprocess.run([sys.executable, "-c", ABORT_IN_A_SLEEP], cwd=ROOT, timeout=120,
                          capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT),
                               "FTLAUNCH_HUB": f"ipc://{tmp_path}/hub"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["left after 0s"], done.stdout


RELEASE_WITH_WORK_PENDING = """\
import os, sys, threading, time
import torch, torch.distributed as dist, torch.multiprocessing as mp
import trainer_shim

def init(port, rank):
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)

def worker(rank, ports, released):
    init(ports[0], rank)
    if rank == 1:  # a collective its peer never joins: pending when the rank parks
        dist.all_reduce(torch.ones(4), async_op=True)
        release = threading.Thread(target=trainer_shim._release_process_group, daemon=True)
        release.start()
        release.join(20)
        print("released" if not release.is_alive() else "still releasing", flush=True)
        released.set()
    else:
        released.wait(60)  # then its own (nothing pending): the old connections close
        trainer_shim._release_process_group()
    assert not dist.is_initialized()
    init(ports[1], rank)  # the next attempt's group, in the same process
    x = torch.ones(1)
    dist.all_reduce(x)
    print(f"rank {rank} all-reduced {x.item():g} in the next group", flush=True)
    os._exit(0)  # not what is tested: a bare script's exit with gloo groups alive may abort

if __name__ == "__main__":
    ports = [int(port) for port in sys.argv[1:3]]
    context = mp.get_context("spawn")
    mp.spawn(worker, args=(ports, context.Event()), nprocs=2)
"""


def test_a_parked_rank_lets_go_of_a_group_whose_pending_work_will_never_finish(tmp_path):
    """A survivor parks with a collective still pending that its peers will not join:
    destroy_process_group would wait for it for ever, and so would gloo's destructor after an
    abort (it joins the group's threads). The rank goes on at once, and re-enters: the next
    attempt's group works in the same process."""
    script = tmp_path / "release.py"
    script.write_text(RELEASE_WITH_WORK_PENDING)
    done = subprocess.run([sys.executable, str(script), str(free_port()), str(free_port())],
                          cwd=tmp_path, timeout=120, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout + done.stderr
    lines = sorted(done.stdout.splitlines())
    assert lines == ["rank 0 all-reduced 2 in the next group",
                     "rank 1 all-reduced 2 in the next group", "released"], done.stdout


INIT_CUT_SHORT = """\
import datetime, os, sys
import torch, torch.distributed as dist, torch.multiprocessing as mp
import trainer_shim

def worker(rank, port):
    if rank == 1:  # its last init_process_group named the group, then the abort landed
        dist.distributed_c10d._process_group_name([], use_hashed_name=False)
        trainer_shim._release_process_group()
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=20))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=20))
    x = torch.ones(1)
    dist.all_reduce(x)
    print(f"rank {rank} in group {dist.distributed_c10d._get_default_group().group_name!r} "
          f"all-reduced {x.item():g}", flush=True)
    os._exit(0)

if __name__ == "__main__":
    mp.spawn(worker, args=(int(sys.argv[1]),), nprocs=2)
"""


def test_a_rank_whose_init_was_cut_short_meets_fresh_peers_in_the_next_group(tmp_path):
    """Chaos seed 6906: a restart ordered while a resumed rank was in init_process_group
    landed after torch had named (and counted) the new group but before it existed; the
    rank's next group was then "1", its store keys under that name, while the fresh ranks'
    were under "0": all six waited for each other's keys for ever. Released, the count
    starts again: the next group meets its fresh peers."""
    script = tmp_path / "cut_short.py"
    script.write_text(INIT_CUT_SHORT)
    done = subprocess.run([sys.executable, str(script), str(free_port())],
                          cwd=tmp_path, timeout=120, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(done.stdout.splitlines()) == ["rank 0 in group '0' all-reduced 2",
                                                "rank 1 in group '0' all-reduced 2"], done.stdout


RESTORED_PACE = """\
import os, sys
import zmq
from ftlaunch_contract import environment

hub = zmq.Context().socket(zmq.ROUTER)
hub.bind(os.environ[environment.HUB])
import trainer_shim
from trainer_shim.agent_link import STUCK_AFTER_UNPACED

link = trainer_shim._link
assert link is not None, "a rank under an agent talks to it"
print(link._window() == STUCK_AFTER_UNPACED, flush=True)
trainer_shim.load_state_dict({"longest_heartbeat_interval": 2.0, "step_interval": 0.15})
print(link._window(), flush=True)
trainer_shim.load_state_dict({"step_interval": 0.4})  # an older save: the first restore holds
print(link._window(), trainer_shim.state_dict()["step_interval"], flush=True)
"""


SLOW_STEP = """\
import os, types
import zmq
from ftlaunch_contract import environment

hub = zmq.Context().socket(zmq.ROUTER)
hub.bind(os.environ[environment.HUB])
import trainer_shim

clock = [100.0]
trainer_shim.time = types.SimpleNamespace(monotonic=lambda: clock[0])  # steps of our choosing
for step, seconds in enumerate([0.0625] * 8 + [1.5]):  # a slow step last (a save, a retransmit)
    trainer_shim.heartbeat(step)
    clock[0] += seconds
trainer_shim.heartbeat(9)
print(trainer_shim._link._window(), trainer_shim.state_dict(), flush=True)
"""


def _as_a_managed_rank(script: str, tmp_path) -> subprocess.CompletedProcess:
    """Run ``script`` as a rank its agent's hub manages (the script binds the hub)."""
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, timeout=60,
                          capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT),
                               "FTLAUNCH_HUB": f"ipc://{tmp_path}/hub",
                               "FTLAUNCH_RUN_ID": "pace-test"})
    assert done.returncode == 0, done.stderr
    return done


def test_one_slow_step_does_not_stretch_the_window_in_which_a_rank_is_found_stuck(tmp_path):
    """The window is two steps, a step as the last heartbeats tell it: the last interval
    alone made one 1.5 s step a 3 s window, past the 2 s --stop-timeout, and a survivor
    idle in a collective after a partition was killed late instead of at once (chaos seed
    4501). The median of the last eight is the pace; the longest is still learnt."""
    done = _as_a_managed_rank(SLOW_STEP, tmp_path)
    assert done.stdout.strip() == "0.125 {'longest_heartbeat_interval': 1.5, 'step_interval': 0.0625}", \
        done.stdout


def test_a_rank_restored_from_a_checkpoint_takes_its_stuck_window_from_the_saved_pace(tmp_path):
    """A rank forked as a replacement has stepped too few times to know its pace, and told to
    leave in its first step would wait the unpaced second before saying it is stuck in a
    collective (chaos seed 1450: a recovery of 1.04 s). The pace saved with the shim's state
    gives it two steps' window from the start."""
    done = _as_a_managed_rank(RESTORED_PACE, tmp_path)
    assert done.stdout.splitlines() == ["True", "0.3", "0.3 0.15"], done.stdout
