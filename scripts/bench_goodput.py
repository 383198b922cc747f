"""Goodput under a fault a minute: ftlaunch, torchrun, NVRx's ft_launcher and DLRover's
dlrover-run, same script; TorchFT with the same training in its API.

Each run trains the unmodified scripts/train_gpt.py (DDP, gloo; checkpoint every
--ckpt-every steps) for a fixed wall time (--minutes) and SIGKILLs a random rank (seeded
RNG) every --every seconds; one run per launcher in turn, the order alternating run by run.
Variants: ``plain`` (the unmodified script, its own checkpoint: rank 0 saves, fsync,
barrier) and ``shim`` (the same script with --shim --async-ckpt: trainer_shim's restartable
training and AsyncCheckpointer; only under ftlaunch, the shim is a no-op elsewhere).

Goodput is computed the same way for every launcher, from the launcher's merged output
read line by line (time.monotonic stamps) - rank 0's ``step N`` lines:

    wall           the fixed wall time, from the launcher's start
    productive     the time between consecutive step lines of one attempt, and from an
                   attempt's ``start`` line (printed as its loop begins) to its first step
                   line, for the steps whose results survived: for each step number only
                   its LAST training counts (less the checkpoint stalls below)
    start-up       launch -> rank 0's first start line
    re-computed    trainings of a step number that a later attempt trained again (it
                   resumed from an older checkpoint), and the step in flight at a kill
    restart        detection + restart: kill -> rank 0's start line of the next attempt
                   (a step line a survivor prints before it learns of the kill is ignored)
    ckpt stalls    the steps with a save in them took this much longer, summed, than as
                   many steps without (the mean of those): what checkpointing blocked. A
                   mean, not per step clipped at the median, which counted every slow
                   step's noise as a stall (with saves every step: not told apart)
    tail           the step in flight when the wall time ended

    goodput = productive / wall; "excl. start-up" = productive / (wall - start-up)

TorchFT (``torchft``) cannot run the unmodified script: it runs
scripts/train_gpt_torchft.py (the same model, batches, optimizer and --step-time through
TorchFT's Manager, one replica group a rank) under a torchrun a group and a lighthouse, as
its README does, with the settings of its DDP example. Its survivors train on while a
killed group restarts and heals from them, so its goodput counts the samples committed, in
fault-free step time (``account_replicas``). ``torchft-tuned``: the same with TorchFT 0.2.0's
DDP error path patched (a survivor mid-all-reduce died with its peer) and 1 s timeouts (the
lighthouse's heartbeat, gloo's): TorchFT at its best here.

The kill schedule is fixed (every --every s from launch); a kill that falls while the job
is still recovering is held until every rank is up and rank 0 stepped again. For ftlaunch
its own account (``ftlaunch report LOGDIR --json``, launcher/goodput.py: from trainer_shim
heartbeats, so only the shim variant has one) is printed beside it as a cross-check.

--recovery-rate: torchrun as a new user runs it (defaults: --max-restarts 3, no store
workaround) and with the workaround, on several scripts (scripts/train_gpt.py and
scripts/ddp_minimal.py, the DDP tutorial's shape) and several kill points (RANK:STEP):
recovered k of n. A run counts as recovered when rank 0 trains --rate-steps-after steps in
a new attempt; a launcher that exits or hangs (--rate-timeout s after the kill) did not.

    python scripts/bench_goodput.py --every 60,30 --minutes 4 --out-json goodput.json \\
        --plot docs/goodput.png
    python scripts/bench_goodput.py --recovery-rate --out-json rate.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import queue
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ports import free_port

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SCRIPTS = {"train_gpt": REPO / "scripts" / "train_gpt.py",
           "ddp_minimal": REPO / "scripts" / "ddp_minimal.py",
           "train_gpt_torchft": REPO / "scripts" / "train_gpt_torchft.py"}
START = re.compile(r"start rank (\d+) world \d+ pid (\d+) resume_from (\d+)")
STEP = re.compile(r"step (\d+) loss \S+ rank (\d+)(?: participants (\d+))?")
CAUSES = ("start-up", "re-computed", "restart", "ckpt stalls", "fewer replicas", "tail")
OTHERS = {"nvrx": "/tmp/nvrx-venv/bin/ft_launcher",
          "dlrover": "/tmp/dlrover-venv/bin/dlrover-run",
          "torchft": "/tmp/torchft-venv/bin/torchft_lighthouse"}
"""The launchers in venvs of their own (scripts/install_competitors.sh puts them there)."""
WORKAROUND = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def launcher_argv(name, nproc, run_dir, max_restarts, others):
    """(argv up to the script, extra env, skip reason or None) of one launcher; ``others``:
    name -> the executable of NVRx's and DLRover's."""
    n = ["--standalone", "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts)]
    if name == "ftlaunch":
        return [str(BIN / "python"), "-m", "launcher", *n, "--restart-backoff", "0",
                "--log-dir", str(run_dir / "logs")], {}, None
    if name == "ftlaunch-default":  # what a new user types
        return [str(BIN / "python"), "-m", "launcher", *n, "--log-dir",
                str(run_dir / "logs")], {}, None
    if name == "torchrun":  # with the store workaround, else it cannot recover
        return [str(BIN / "torchrun"), *n], dict(WORKAROUND), None
    if name == "torchrun-default":
        return [str(BIN / "torchrun"), *n], {}, None
    if name.startswith("torchft"):
        if not Path(others["torchft"]).exists():
            return None, None, (f"{others['torchft']} not found (torchft is not installed: "
                                "scripts/install_competitors.sh, or --torchft)")
        return torchft_job(others["torchft"], nproc, max_restarts, tuned=name == "torchft-tuned")
    if name in OTHERS:
        if not Path(others[name]).exists():
            return None, None, (f"{others[name]} not found ({name} is not installed: "
                                f"scripts/install_competitors.sh, or --{name})")
        if name == "dlrover":  # (its defaults; see dlrover_master)
            return dlrover_master(others[name]) + [others[name], *n], {
                "DLROVER_MASTER_ADDR": f"127.0.0.1:{free_port()}"}, None
        return [others[name], *n, "--ignore-missing-fault-tol-cfg"], {}, None  # else defaults
    raise ValueError(name)


def dlrover_master(dlrover_run):
    """The argv prefix that starts DLRover's local master beside dlrover-run, as its
    --standalone would: 0.6.1 cannot under torch 2.13 (torch's SubprocessHandler gained an
    argument: TypeError). dlrover-run finds it at $DLROVER_MASTER_ADDR (it waits up to 60 s)."""
    master = (f'"{Path(dlrover_run).parent / "python"}" -u -m dlrover.python.master.main '
              '--port "${DLROVER_MASTER_ADDR##*:}" --node_num 1 --job_name goodput '
              "--platform local")
    return ["bash", "-c", f'{master} & exec "$0" "$@"']


def torchft_job(lighthouse, nproc, max_restarts, tuned=False):
    """TorchFT as its README runs it: a lighthouse, and each replica group (here one rank,
    train_gpt_torchft.py) under a torchrun of its own that restarts it when it dies.
    ``tuned``: a replica silent for 1 s is dead to the lighthouse (its default: 5 s), a
    failed all-reduce is given up after 1 s and its DDP error path is patched."""
    port = free_port()
    script = "--patch-ddp-hook --pg-timeout 1" if tuned else ""  # after the script's args
    groups = " ".join(f'REPLICA_GROUP_ID={g} "$0" "$@" {script} &' for g in range(nproc))
    job = (f'"{lighthouse}" --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000 '
           f'{"--heartbeat_timeout_ms 1000 " if tuned else ""}--bind "[::]:{port}" & '
           f'{groups} wait')
    torchrun = ["--standalone", "--nproc-per-node", "1", "--max-restarts", str(max_restarts)]
    return ["bash", "-c", job, str(Path(lighthouse).parent / "torchrun"), *torchrun], {
        "NUM_REPLICA_GROUPS": str(nproc), "TORCHFT_LIGHTHOUSE": f"http://localhost:{port}"}, None


def script_args(script, variant, run_dir, ckpt_every, step_time, persist_every=1,
                overlap=False):
    ckpt = run_dir / "ckpt"
    if script == "train_gpt_torchft":
        return [str(SCRIPTS[script]), "--steps", "10000000", "--step-time", str(step_time)]
    if script == "ddp_minimal":
        return [str(SCRIPTS[script]), "--epochs", "100000", "--snapshot", str(run_dir / "snap.pt"),
                "--step-time", str(step_time)]
    argv = [str(SCRIPTS[script]), "--steps", "10000000", "--ckpt-dir", str(ckpt),
            "--ckpt-every", str(ckpt_every), "--step-time", str(step_time)]
    if variant == "shim":
        argv += ["--shim", "--async-ckpt", "--persist-every", str(persist_every)]
        argv += ["--overlap-ckpt"] if overlap else []
    return argv


def read_lines(stream, out):
    for raw in iter(stream.readline, b""):
        out.put((time.monotonic(), raw.decode(errors="replace").rstrip("\n")))
    out.put((time.monotonic(), None))


class Job:
    """One launcher run: its merged output, stamped, copied to run_dir/output.log."""

    def __init__(self, cmd, env, run_dir):
        self.marker = f"BENCH_GOODPUT_RUN={run_dir}"  # inherited by every process of the run
        env = {**os.environ, **env, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO),
               "BENCH_GOODPUT_RUN": str(run_dir)}
        self.queue = queue.Queue()
        self.log = open(run_dir / "output.log", "w")  # noqa: SIM115 - closed in stop()
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        threading.Thread(target=read_lines, args=(self.proc.stdout, self.queue),
                         daemon=True).start()
        self.ended = False

    def next_line(self, until):
        """(stamp, line), or (now, None) at ``until`` or when the output ended."""
        if self.ended:
            time.sleep(max(0.0, until - time.monotonic()))
            return time.monotonic(), None
        try:
            now, line = self.queue.get(timeout=max(0.0, until - time.monotonic()))
        except queue.Empty:
            return time.monotonic(), None
        if line is None:
            self.ended = True
            return now, None
        self.log.write(f"{now - self.t0:9.3f} {line}\n")
        return now, line

    def stop(self, grace=15.0):
        """SIGTERM the launcher's group, SIGKILL what is left after ``grace`` s."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        for pid_dir in Path("/proc").iterdir():  # torchrun puts each rank in its own session
            if pid_dir.name.isdigit():
                with contextlib.suppress(OSError):
                    if self.marker.encode() + b"\0" in (pid_dir / "environ").read_bytes():
                        os.kill(int(pid_dir.name), signal.SIGKILL)
        self.proc.wait()
        end = time.monotonic() + 2
        while not self.ended and time.monotonic() < end:
            self.next_line(end)
        self.log.close()


# ---------------------------------------------------------------- goodput from the stamps


def on_the_final_path(steps):
    """For each training (its step number, in time order), whether the final state descends
    from it: one that a later training of the same or a lower step number follows was lost
    (a restart from an older state trained it again, or has yet to)."""
    kept, low = [], float("inf")
    for step in reversed(steps):
        kept.append(step < low)
        low = min(low, step)
    return kept[::-1]


def account(t0, wall, events, ckpt_every):
    """The goodput account of one run from its stamped events.

    ``events``: (t, kind, rank, value) with kind "step" (value = step number), "start"
    (value = pid) or "kill"; only rank 0's step and start lines are used."""
    end = t0 + wall
    lost = dict.fromkeys(CAUSES, 0.0)
    trainings = []  # (step, seconds, t_end, an attempt's first step) in order
    recoveries = []  # kill -> rank 0's start line of the next attempt
    state, prev_t, down_since, waiting_start = "startup", None, None, False
    begun = None  # rank 0's start line of the attempt to come (its loop begins)
    for t, kind, rank, value in sorted(e for e in events if e[0] <= end):
        if kind == "kill":
            if state == "up":
                lost["re-computed"] += t - prev_t  # the step in flight
                state, down_since, waiting_start = "down", t, True
            continue
        if rank != 0:
            continue
        if kind == "start":
            if state == "startup" or (state == "down" and t >= down_since):
                waiting_start, begun = False, t
        elif kind == "step":
            if state == "startup":
                begun = t if begun is None else begun
                lost["start-up"] = begun - t0
                trainings.append((value, t - begun, t, True))
                state, prev_t = "up", t
            elif state == "up":
                trainings.append((value, t - prev_t, t, False))
                prev_t = t
            elif not waiting_start:  # down, and rank 0 has started again
                lost["restart"] += begun - down_since
                recoveries.append(begun - down_since)
                trainings.append((value, t - begun, t, True))
                state, prev_t = "up", t
    if state == "startup":
        lost["start-up"] = wall
    elif state == "up":
        lost["tail"] = end - prev_t
    else:
        lost["restart"] += end - down_since
        recoveries.append(None)  # never came back within the wall time
    kept = on_the_final_path([step for step, *_ in trainings])
    lost["re-computed"] += sum(s for (_, s, _, _), k in zip(trainings, kept, strict=True)
                               if not k)
    # checkpoint stalls: the save at step k*ckpt_every lies in the interval of the step after
    # (an attempt's first step is timed from its start line: no save, no --step-time in it)
    def saved(step, first):
        return ckpt_every > 1 and (step - 1) % ckpt_every == 0 and not first
    counted = [(step, s, t, first) for (step, s, t, first), k
               in zip(trainings, kept, strict=True) if k]
    durations = [s for step, s, _, first in counted if not saved(step, first) and not first]
    typical = statistics.median(durations) if durations else 0.0
    baseline = statistics.mean(durations) if durations else 0.0
    with_saves = [s for step, s, _, first in counted if saved(step, first)]
    stalled = sum(with_saves) - baseline * len(with_saves) > 0  # else the saves cost nothing
    timeline, productive = [(t0, 0.0)], 0.0
    for step, seconds, t, first in counted:
        stall = seconds - baseline if stalled and saved(step, first) else 0.0
        lost["ckpt stalls"] += stall
        productive += seconds - stall
        timeline.append((t, productive))
    timeline.append((end, productive))
    startup = lost["start-up"]
    return {"wall_s": wall, "productive_s": productive, "goodput": productive / wall,
            "goodput_excl_startup": productive / (wall - startup) if wall > startup else None,
            "lost_s": lost, "unaccounted_s": wall - productive - sum(lost.values()),
            "recoveries_s": recoveries, "steps_final": trainings[-1][0] if trainings else 0,
            "step_median_s": typical,
            "timeline": [(round(t - t0, 3), round(p, 3)) for t, p in timeline]}


def account_replicas(t0, wall, events, groups):
    """The goodput account of a TorchFT run, whose survivors train on while a killed replica
    group restarts: no attempt to follow, so ``account``'s rank-0 reading does not apply.
    A step's training is its lines, from whichever groups took part in it; as in
    ``account``, only those the final state descends from count (``on_the_final_path``: a
    restart from an older step trains again what was lost). Each counts its share of the global batch
    (participants / groups) times the run's fault-free step time (the median interval
    between consecutive steps every group took part in): goodput = the samples kept, in
    fault-free step time, over the wall time. Lost: start-up (launch -> the first step's
    begin), re-computed (trainings lost), fewer replicas (the share of the kept steps a
    missing group did not train), tail (after the last step) and restart (the rest: a
    survivor stalled until its collective failed, the quorums, a restarted group's healing).

    ``events``: (t, kind, rank, value), a step's value (step number, participants)."""
    end = t0 + wall
    trainings, kills = [], []  # (step, t of its first line, participants)
    for t, kind, _, value in sorted(e for e in events if e[0] <= end):
        if kind == "kill":
            kills.append(t)
        elif kind == "step" and not (trainings and trainings[-1][0] == value[0]):
            trainings.append((value[0], t, value[1]))  # (the other groups' lines: the same)
    full = [b[1] - a[1] for a, b in zip(trainings, trainings[1:], strict=False)
            if b[0] == a[0] + 1 and a[2] == b[2] == groups]
    step_s = statistics.median(full) if full else 0.0
    kept = on_the_final_path([step for step, _, _ in trainings])
    lost = dict.fromkeys(CAUSES, 0.0)
    lost["start-up"] = trainings[0][1] - step_s - t0 if trainings else wall
    lost["tail"] = end - trainings[-1][1] if trainings else 0.0
    timeline, productive = [(t0, 0.0)], 0.0
    for (_, t, participants), k in zip(trainings, kept, strict=True):
        if not k:
            lost["re-computed"] += step_s * participants / groups
            continue
        productive += step_s * participants / groups
        lost["fewer replicas"] += step_s * (1 - participants / groups)
        timeline.append((t, productive))
    timeline.append((end, productive))
    lost["restart"] = wall - productive - sum(lost.values())
    # per kill: -> the next step any group trained, and -> every group in a step again
    recoveries = [next((t - k for _, t, _ in trainings if t > k), None) for k in kills]
    whole = [next((t - k for _, t, p in trainings if t > k and p == groups), None)
             for k in kills]
    startup = lost["start-up"]
    return {"wall_s": wall, "productive_s": productive, "goodput": productive / wall,
            "goodput_excl_startup": productive / (wall - startup) if wall > startup else None,
            "lost_s": lost, "unaccounted_s": 0.0, "recoveries_s": recoveries,
            "whole_again_s": [None if w is None else round(w, 3) for w in whole],
            "steps_final": trainings[-1][0] if trainings else 0, "step_median_s": step_s,
            "timeline": [(round(t - t0, 3), round(p, 3)) for t, p in timeline]}


def ftlaunch_report(log_dir):
    """ftlaunch's own account of the run (launcher/goodput.py), or None."""
    out = subprocess.run([str(BIN / "python"), "-m", "launcher", "report", str(log_dir),
                          "--json"], cwd=REPO, capture_output=True, text=True, check=False,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        data = json.loads(out.stdout)
    except ValueError:
        return {"error": (out.stdout + out.stderr)[-500:]}
    return data


# ---------------------------------------------------------------- one fixed-wall run


def goodput_run(launcher, variant, every, args, run_dir, rng):
    argv, env, skip = launcher_argv(launcher, args.nproc, run_dir, 1000, others(args))
    if skip:
        return {"launcher": launcher, "variant": variant, "every_s": every, "skipped": skip}
    ckpt_every = args.shim_ckpt_every if variant == "shim" else args.ckpt_every
    replicas = launcher.startswith("torchft")  # survivors train on: every group counts
    script = "train_gpt_torchft" if replicas else "train_gpt"
    cmd = argv + script_args(script, variant, run_dir, ckpt_every, args.step_time,
                             args.shim_persist_every, not args.shim_no_overlap)
    wall = args.minutes * 60
    load_before = os.getloadavg()
    job = Job(cmd, env, run_dir)
    t0, events, kills = job.t0, [], []
    end, next_kill = t0 + wall, t0 + every
    # up: every rank started since the kill and rank 0 stepped (TorchFT: every group stepped)
    pids, started, stepped, up = {}, set(), set(), False
    while True:
        now, line = job.next_line(min(end, next_kill) if up else end)
        if now >= end:
            break
        if line is not None:
            if m := START.search(line):
                rank, pid = int(m[1]), int(m[2])
                pids[rank] = pid
                started.add(rank)
                events.append((now, "start", rank, pid))
            elif m := STEP.search(line):
                rank = int(m[2])
                events.append((now, "step", rank, (int(m[1]), int(m[3] or args.nproc))
                               if replicas else int(m[1])))
                stepped.add(rank)
                if replicas:
                    up = len(stepped) == args.nproc
                elif rank == 0 and len(started) == args.nproc:
                    up = True
        if up and time.monotonic() >= next_kill:
            victim = rng.randrange(args.nproc)
            t = time.monotonic()
            try:
                os.kill(pids[victim], signal.SIGKILL)
            except ProcessLookupError:  # replaced a moment ago: try again with the next line
                continue
            events.append((t, "kill", victim, pids[victim]))
            kills.append({"t": round(t - t0, 3), "rank": victim, "pid": pids[victim],
                          "late_s": round(t - next_kill, 3)})
            up, started, stepped = False, set(), set()
            next_kill += every
    returncode = job.proc.poll()
    job.stop()
    r = {"launcher": launcher, "variant": variant, "every_s": every, "minutes": args.minutes,
         "kills": kills, "faults": len(kills), "exited_early_rc": returncode,
         "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
         "log": str(run_dir / "output.log"),
         "ckpt_every": ckpt_every,
         **(account_replicas(t0, wall, events, args.nproc) if replicas
            else account(t0, wall, events, ckpt_every))}
    if launcher.startswith("ftlaunch"):
        r["ftlaunch_report"] = ftlaunch_report(run_dir / "logs")
    return r


def fmt_s(v):
    return "-" if v is None else f"{v:.2f}"


def ft_own(r):
    """The first run's account in ftlaunch's report ({run dir: account}), or None."""
    rep = r.get("ftlaunch_report")
    if not isinstance(rep, dict) or "error" in rep:
        return None
    accounts = [a for a in rep.values() if isinstance(a, dict)]
    return accounts[0] if accounts else None


def print_run(r):
    if "skipped" in r:
        print(f"{r['launcher']:<9} {r['variant']:<5} every {r['every_s']:g}s: skipped: "
              f"{r['skipped']}", flush=True)
        return
    rec = [x for x in r["recoveries_s"] if x is not None]
    print(f"{r['launcher']:<9} {r['variant']:<5} every {r['every_s']:>3g}s: goodput "
          f"{r['goodput']:.4f} (excl. start-up {fmt_s(r['goodput_excl_startup'])}), "
          f"{r['faults']} faults, recovery median "
          f"{fmt_s(statistics.median(rec) if rec else None)}s, lost "
          + ", ".join(f"{k} {v:.2f}" for k, v in r["lost_s"].items())
          + f", step {r['step_median_s']:.3f}s"
          + (f", kill -> every group in a step again {r['whole_again_s']}"
             if "whole_again_s" in r else "")
          + f", load {r['loadavg_before'][0]:.2f}->{r['loadavg_after'][0]:.2f}", flush=True)
    own = ft_own(r)
    if r["launcher"].startswith("ftlaunch"):
        if own is None:
            print(f"    ftlaunch's own account: {r.get('ftlaunch_report')}", flush=True)
        else:
            g = own.get("goodput")
            lost = ", ".join(f"{k} {v:.2f}" for k, v in own["lost_s"].items() if v)
            print(f"    ftlaunch's own account: goodput {'unknown' if g is None else g} over "
                  f"{own['wall_s']:.1f}s (to its last event), lost {lost}, "
                  f"{own['restarts']} restarts, recovery phases {own['recovery_phases_s']}"
                  + (f"; {'; '.join(own['notes'])}" if own.get("notes") else ""), flush=True)


def table(runs):
    head = ("| launcher | variant | fault every | goodput | excl. start-up | faults | "
            + " | ".join(f"{c} s" for c in CAUSES) + " | median recovery s | ftlaunch's own |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in runs:
        if "skipped" in r:
            lines.append(f"| {r['launcher']} | {r['variant']} | {r['every_s']:g} s | skipped: "
                         f"{r['skipped']} |")
            continue
        rec = [x for x in r["recoveries_s"] if x is not None]
        own = ft_own(r)
        own_s = "-" if own is None or own.get("goodput") is None else f"{own['goodput']:.4f}"
        lines.append(f"| {r['launcher']} | {r['variant']} | {r['every_s']:g} s | "
                     f"**{r['goodput']:.4f}** | {r['goodput_excl_startup'] or 0:.4f} | "
                     f"{r['faults']} | "
                     + " | ".join(f"{r['lost_s'][c]:.2f}" for c in CAUSES)
                     + f" | {fmt_s(statistics.median(rec) if rec else None)} | {own_s} |")
    return "\n".join(lines)


def plot(runs, path):
    """Per fault interval: cumulative productive time (top) and time lost (bottom) vs wall."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    intervals = sorted({r["every_s"] for r in runs if "timeline" in r}, reverse=True)
    names = sorted({(r["launcher"], r["variant"]) for r in runs if "timeline" in r})
    colors = {n: f"C{i}" for i, n in enumerate(names)}  # the same in every panel
    fig, axes = plt.subplots(2, len(intervals), figsize=(6.5 * len(intervals), 8.2),
                             squeeze=False, sharex="col", height_ratios=[3, 2])
    for col, every in enumerate(intervals):
        top, bottom = axes[0][col], axes[1][col]
        mine = [r for r in runs if r.get("every_s") == every and "timeline" in r]
        for r in sorted(mine, key=lambda r: names.index((r["launcher"], r["variant"]))):
            xs, ys = zip(*r["timeline"], strict=True)
            color = colors[r["launcher"], r["variant"]]
            label = f"{r['launcher']} {r['variant']}: goodput {r['goodput']:.3f}"
            top.step(xs, ys, where="post", label=label, color=color)
            bottom.step(xs, [x - y for x, y in zip(xs, ys, strict=True)], where="post",
                        label=label, color=color)
        for k in mine[0]["kills"] if mine else []:
            for ax in (top, bottom):
                ax.axvline(k["t"], color="grey", alpha=0.35, lw=0.8)
        wall = max(r["wall_s"] for r in mine)
        top.plot([0, wall], [0, wall], color="grey", ls=":", lw=1, label="goodput 1")
        top.set_title(f"kill -9 of a random rank every {every:g} s (grey lines)")
        top.set_ylabel("cumulative productive step time (s)")
        bottom.set_ylabel("wall - productive: time lost (s)")
        bottom.set_xlabel("wall time since launch (s)")
        top.legend(loc="upper left", fontsize=8)
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
    torchft = any(n.startswith("torchft") for n, _ in names)
    fig.suptitle("Goodput timeline: scripts/train_gpt.py, DDP/gloo, 2 ranks on 2 vCPU"
                 + ("\n(TorchFT: the same training in train_gpt_torchft.py)" if torchft else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot: {path}")


# ---------------------------------------------------------------- torchrun's recovery rate


def rate_run(launcher, script, kill_rank, kill_step, args, run_dir):
    """One kill -9 of ``kill_rank`` at its first step line >= ``kill_step``: the outcome."""
    argv, env, skip = launcher_argv(launcher, args.nproc, run_dir, args.rate_max_restarts,
                                    others(args))
    r = {"launcher": launcher, "script": script, "kill_rank": kill_rank,
         "kill_step": kill_step}
    if skip:
        return {**r, "outcome": "skipped", "why": skip}
    cmd = argv + script_args(script, "plain", run_dir, 10, args.step_time)
    job = Job(cmd, env, run_dir)
    deadline = job.t0 + args.rate_timeout
    pids, kill_t, restarted, after, outcome, restarts = {}, None, False, 0, None, 0
    while outcome is None:
        now, line = job.next_line(deadline)
        if line is None:
            if job.ended:
                job.proc.wait()
                outcome = f"exited rc {job.proc.returncode}"
            elif now >= deadline:
                outcome = "hung" if kill_t is not None else "no kill (timeout)"
            continue
        if m := START.search(line):
            pids[int(m[1])] = int(m[2])
            if kill_t is not None and int(m[1]) == 0:
                restarted = True
                restarts += 1
        elif (m := STEP.search(line)) and kill_t is None and int(m[2]) == kill_rank \
                and int(m[1]) >= kill_step and kill_rank in pids:
            kill_t = now
            os.kill(pids[kill_rank], signal.SIGKILL)
            deadline = now + args.rate_timeout
        elif m and restarted and int(m[2]) == 0:
            after += 1
            if after == 1:
                r["kill_to_step_s"] = round(now - kill_t, 2)
            if after >= args.rate_steps_after:
                outcome = "recovered"
    job.stop(grace=5)
    r.update(outcome=outcome, rank0_starts_after_kill=restarts, log=str(run_dir / "output.log"))
    return r


def recovery_rate(args, work):
    launchers = [x for x in args.rate_launchers.split(",") if x]
    points = [tuple(map(int, p.split(":"))) for p in args.kill_points.split(",") if p]
    scripts = [s for s in args.rate_scripts.split(",") if s]
    results, i = [], 0
    for script in scripts:
        for kill_rank, kill_step in points:
            order = launchers if i % 2 == 0 else launchers[::-1]
            i += 1
            for launcher in order:
                run_dir = work / f"rate-{script}-{launcher}-r{kill_rank}s{kill_step}"
                run_dir.mkdir(parents=True)
                r = rate_run(launcher, script, kill_rank, kill_step, args, run_dir)
                results.append(r)
                print(f"rate {launcher:<18} {script:<12} kill rank {kill_rank} at step "
                      f"{kill_step:>3}: {r['outcome']}"
                      + (f" (kill -> step {r['kill_to_step_s']}s)" if "kill_to_step_s" in r
                         else "") + f"  [{r.get('log', '')}]", flush=True)
    print("\n| launcher | script | recovered | outcomes |\n|---|---|---|---|")
    for launcher in launchers:
        for script in scripts:
            mine = [r for r in results if r["launcher"] == launcher and r["script"] == script
                    and r["outcome"] != "skipped"]
            if not mine:
                continue
            k = sum(r["outcome"] == "recovered" for r in mine)
            outs = ", ".join(f"r{r['kill_rank']}@{r['kill_step']}: {r['outcome']}" for r in mine)
            print(f"| {launcher} | {script} | **{k} of {len(mine)}** | {outs} |")
    return results


# ---------------------------------------------------------------- main


def others(args):
    return {name: getattr(args, name) for name in OTHERS}


def compile_ours():
    """Byte-compile ftlaunch's packages, as ``pip install`` does: torchrun's and NVRx's
    modules are compiled in site-packages, and with PYTHONDONTWRITEBYTECODE (set on these
    machines) ours would be compiled from source by every process, every restart."""
    import compileall

    for package in ("launcher", "trainer_shim", "ftlaunch_contract"):
        compileall.compile_dir(REPO / package, quiet=1)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--launchers", default="ftlaunch,torchrun,nvrx,dlrover,torchft",
                   help="comma list of ftlaunch, torchrun (with its store workaround), nvrx, "
                   "dlrover, torchft (scripts/train_gpt_torchft.py: its API, not the same "
                   "script), torchft-tuned (the same, its DDP bug patched and 1 s timeouts)")
    p.add_argument("--variants", default="plain,shim",
                   help="plain (unmodified script), shim (--shim --async-ckpt; ftlaunch only)")
    p.add_argument("--every", default="60,30", help="comma list: seconds between kills")
    p.add_argument("--minutes", type=float, default=4.0, help="fixed wall time per run")
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--ckpt-every", type=int, default=10, help="plain: the script's --ckpt-every")
    p.add_argument("--shim-ckpt-every", type=int, default=5,
                   help="shim: AsyncCheckpointer saves (staged in shared memory) every K steps")
    p.add_argument("--shim-persist-every", type=int, default=50,
                   help="shim: of the saved steps, persist multiples of this to --ckpt-dir")
    p.add_argument("--shim-no-overlap", action="store_true",
                   help="shim: copy each save in the training thread (default: overlap=True, "
                   "the copy beside the next step)")
    p.add_argument("--step-time", type=float, default=0.1,
                   help="the script's extra sleep per step (a stand-in for device time)")
    p.add_argument("--seed", type=int, default=0)
    for name, path in OTHERS.items():
        p.add_argument(f"--{name}", default=path, help=f"{name}'s launcher (its own venv)")
    p.add_argument("--recovery-rate", action="store_true",
                   help="measure torchrun's recovery rate instead of goodput")
    p.add_argument("--rate-launchers",
                   default="torchrun-default,torchrun,ftlaunch-default,nvrx,dlrover")
    p.add_argument("--rate-scripts", default="train_gpt,ddp_minimal")
    p.add_argument("--kill-points", default="1:3,1:30,0:15",
                   help="comma list of RANK:STEP")
    p.add_argument("--rate-max-restarts", type=int, default=3)
    p.add_argument("--rate-timeout", type=float, default=150,
                   help="seconds after the kill (and before it) before a run counts as hung")
    p.add_argument("--rate-steps-after", type=int, default=5)
    p.add_argument("--work-dir", default=None)
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument("--out-json", default=None)
    p.add_argument("--plot", default=None, help="PNG of the goodput timeline")
    p.add_argument("--from-json", default=None,
                   help="no runs: the table (and --plot) of an earlier --out-json")
    args = p.parse_args()
    if args.from_json:
        runs = json.loads(Path(args.from_json).read_text())["runs"]
        print(table(runs))
        if args.plot:
            plot(runs, args.plot)
        return
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench_goodput_")).resolve()
    compile_ours()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                            capture_output=True, text=True, check=False).stdout.strip()
    info = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "commit": commit, "cpus": os.cpu_count(), "argv": sys.argv[1:],
            "loadavg_start": os.getloadavg()}
    print(f"{info['date']}  commit {commit}  {info['cpus']} CPUs  load "
          f"{info['loadavg_start'][0]:.2f}\nlogs in {work}", flush=True)
    if args.recovery_rate:
        out = {**info, "config": vars(args), "recovery_rate": recovery_rate(args, work)}
    else:
        configs = [(lc, "own loop" if lc.startswith("torchft") else v)
                   for v in args.variants.split(",")
                   for lc in args.launchers.split(",") if v == "plain" or lc.startswith("ftlaunch")]
        runs, i = [], 0
        for rep in range(args.reps):
            for every in (float(x) for x in args.every.split(",")):
                for launcher, variant in configs if i % 2 == 0 else configs[::-1]:
                    run_dir = work / f"rep{rep}-{launcher}-{variant.replace(' ', '-')}-{every:g}"
                    run_dir.mkdir(parents=True)
                    rng = random.Random(f"{args.seed}-{rep}-{every:g}")  # same victims
                    r = goodput_run(launcher, variant, every, args, run_dir, rng)
                    r["rep"] = rep
                    runs.append(r)
                    print_run(r)
                i += 1
        print("\n" + table(runs))
        if args.plot:
            plot(runs, args.plot)
        out = {**info, "config": vars(args), "runs": runs}
    out["loadavg_end"] = os.getloadavg()
    if args.out_json:
        Path(args.out_json).write_text(json.dumps(out, indent=1))
    if not args.keep and not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
