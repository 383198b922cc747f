"""Recovery after kill -9 of one rank: torchrun (with its restart workaround) vs ftlaunch cold.

Each rep starts scripts/train_gpt.py under every launcher in turn (order alternates per rep),
reads the launcher's merged output line by line with time.monotonic() stamps, SIGKILLs rank 1
when it prints step --kill-step and times the phases of the recovery:

    launch -> first step   start-up: import torch, rendezvous, first DDP step
    kill -> detected       the launcher's first line about the failure
    kill -> respawned      fork of the first new rank (its /proc start time, 10 ms ticks)
    kill -> ranks up       first new "start rank" line (re-import + init_process_group + ckpt)
    kill -> first step     first "step" line after the restart: the recovery time

torchrun with default settings does not recover with gloo on torch 2.13 (restarted workers read
stale addresses from the reused rendezvous store; see BENCHMARKS.md), so "torchrun" sets
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1; "torchrun-default" reproduces the failure.

    python scripts/bench_recovery.py --reps 1                 # smoke check
    python scripts/bench_recovery.py --reps 5 --out-json recovery.json
"""

import argparse
import contextlib
import datetime
import json
import os
import queue
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
START = re.compile(r"start rank (\d+) world \d+ pid (\d+) resume_from (\d+)")
STEP = re.compile(r"step (\d+) loss \S+ rank (\d+)")
DETECT = re.compile(r"rank \d+ was killed|closing signal|failed \(exitcode")
PHASES = [("launch_to_first_step", "launch -> first step"),
          ("kill_to_detected", "kill -> detected"),
          ("kill_to_respawned", "kill -> ranks respawned"),
          ("kill_to_ranks_up", "kill -> ranks up"),
          ("kill_to_first_step", "kill -> first step (recovery)"),
          ("wall", "whole run")]


def launcher_command(name, nproc, run_dir):
    """(argv prefix before the script, extra env) of each launcher."""
    restarts = ["--nproc-per-node", str(nproc), "--max-restarts", "3"]
    if name == "ftlaunch":
        return [str(BIN / "ftlaunch"), "--standalone", *restarts, "--log-dir", str(run_dir)], {}
    torchrun = [str(BIN / "torchrun"), "--standalone", *restarts]
    if name == "torchrun":
        return torchrun, {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    if name == "torchrun-default":
        return torchrun, {}
    raise ValueError(f"unknown launcher {name!r}")


def started_at(pid):
    """When ``pid`` was started, in CLOCK_BOOTTIME seconds (10 ms resolution), or None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[19]) / os.sysconf("SC_CLK_TCK")


def read_lines(stream, out):
    for raw in iter(stream.readline, b""):
        out.put((time.monotonic(), raw.decode(errors="replace").rstrip("\n")))
    out.put((time.monotonic(), None))


def kill_leftovers(proc, marker):
    """SIGKILL the launcher's session and every process whose argv holds this run's marker."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid_dir in Path("/proc").iterdir():  # torchrun puts each rank in its own session
        if not pid_dir.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if marker.encode() in (pid_dir / "cmdline").read_bytes():
                os.kill(int(pid_dir.name), signal.SIGKILL)
    proc.wait()


def run_once(name, args, run_dir):
    """One job under one launcher with one kill; returns the measured times (s) and facts."""
    ckpt_dir = run_dir / "ckpt"
    prefix, extra_env = launcher_command(name, args.nproc, run_dir)
    cmd = [*prefix, str(REPO / "scripts" / "train_gpt.py"), "--steps", str(args.steps),
           "--ckpt-dir", str(ckpt_dir), "--ckpt-every", "10", "--step-time", str(args.step_time)]
    env = {**os.environ, **extra_env, "PYTHONUNBUFFERED": "1"}
    lines = queue.Queue()
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    threading.Thread(target=read_lines, args=(proc.stdout, lines), daemon=True).start()
    r = {"launcher": name, "completed": False, "timed_out": False, "returncode": None,
         "loadavg_1m_before": os.getloadavg()[0]}
    t = dict.fromkeys(["first_step", "kill", "detected", "ranks_up", "step_after"])
    victim, respawned = None, []
    with open(run_dir / "output.log", "w") as log:
        while True:
            try:
                now, line = lines.get(timeout=max(0.0, t0 + args.timeout - time.monotonic()))
            except queue.Empty:
                r["timed_out"] = True
                break
            if line is None:
                break
            log.write(f"{now - t0:9.3f} {line}\n")
            start, step = START.search(line), STEP.search(line)
            if start and victim is None and start[1] == "1":
                victim = int(start[2])
            elif start and t["kill"] is not None and t["step_after"] is None:
                respawned.append(started_at(int(start[2])))  # read while the rank is alive
                if t["ranks_up"] is None:
                    t["ranks_up"], r["resume_from"] = now, int(start[3])
            if step and t["first_step"] is None:
                t["first_step"] = now
            if (step and t["kill"] is None and victim is not None and step[2] == "1"
                    and int(step[1]) == args.kill_step):
                t["kill"], kill_boottime = time.monotonic(), time.clock_gettime(time.CLOCK_BOOTTIME)
                os.kill(victim, signal.SIGKILL)
            elif step and t["ranks_up"] is not None and t["step_after"] is None:
                t["step_after"] = now
            if t["kill"] is not None and t["detected"] is None and DETECT.search(line):
                t["detected"] = now
    kill_leftovers(proc, str(ckpt_dir))  # nothing is left after a clean exit; after a hang, all
    r["returncode"] = proc.returncode
    r["completed"] = not r["timed_out"] and proc.returncode == 0
    r["wall"] = time.monotonic() - t0
    r["launch_to_first_step"] = t["first_step"] and t["first_step"] - t0
    for key, phase in (("detected", "kill_to_detected"), ("ranks_up", "kill_to_ranks_up"),
                       ("step_after", "kill_to_first_step")):
        r[phase] = t[key] - t["kill"] if t[key] is not None and t["kill"] is not None else None
    r["killed"] = t["kill"] is not None
    respawned = [b for b in respawned if b is not None]
    r["kill_to_respawned"] = min(respawned) - kill_boottime if respawned else None
    for event_file in run_dir.glob("*/events.jsonl"):  # ftlaunch's own view of the recovery
        for event in map(json.loads, event_file.read_text().splitlines()):
            if event["event"] in ("recovering", "recovered"):
                r[f"event_{event['event']}"] = {k: v for k, v in event.items()
                                                if k not in ("event", "cause")}
    r["log"] = str(run_dir / "output.log")
    return r


def cpu_model():
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown CPU"


def git_commit():
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                         text=True, check=False)
    return out.stdout.strip() or "unknown"


def fmt(values):
    if not values:
        return f"{'-':>7} {'-':>7} {'-':>7}"
    return f"{statistics.median(values):7.2f} {min(values):7.2f} {max(values):7.2f}"


def report(runs, launchers):
    print(f"\n{'phase (seconds)':<31} {'launcher':<17} {'n':>2} {'median':>7} {'min':>7} {'max':>7}")
    for key, label in PHASES:
        for name in launchers:
            values = [r[key] for r in runs if r["launcher"] == name and r[key] is not None]
            print(f"{label:<31} {name:<17} {len(values):>2} {fmt(values)}")
    for name in launchers:
        mine = [r for r in runs if r["launcher"] == name]
        print(f"{name}: completed {sum(r['completed'] for r in mine)}/{len(mine)} runs")
    medians = {}
    for name in launchers:
        values = [r["kill_to_first_step"] for r in runs
                  if r["launcher"] == name and r["kill_to_first_step"] is not None]
        medians[name] = statistics.median(values) if values else None
    if medians.get("ftlaunch") and medians.get("torchrun"):
        ratio = medians["torchrun"] / medians["ftlaunch"]
        print(f"median recovery time torchrun / ftlaunch = {ratio:.2f}x")
        return ratio
    return None


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--kill-step", type=int, default=25, help="rank 1 is killed after this step")
    p.add_argument("--step-time", type=float, default=0.02)
    p.add_argument("--timeout", type=float, default=300, help="per run, seconds")
    p.add_argument("--launchers", default="torchrun,ftlaunch",
                   help="comma list of torchrun, ftlaunch, torchrun-default")
    p.add_argument("--work-dir", default=None, help="checkpoints and logs (default: a temp dir)")
    p.add_argument("--out-json", default=None, help="write every run's raw numbers here")
    args = p.parse_args()
    if not 0 < args.kill_step < args.steps:
        p.error("--kill-step must be between 0 and --steps")
    launchers = args.launchers.split(",")
    for name in launchers:
        launcher_command(name, args.nproc, Path())  # fail early on a bad name
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench_recovery_")).resolve()
    import torch  # only for the record

    info = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "torch": torch.__version__, "cpus": os.cpu_count(), "cpu": cpu_model(),
            "commit": git_commit(), "argv": sys.argv[1:]}
    print(f"{info['date']}  commit {info['commit']}  torch {info['torch']}  {info['cpus']} x "
          f"{info['cpu']}\nlogs in {work}")
    runs = []
    for rep in range(args.reps):
        for name in launchers if rep % 2 == 0 else launchers[::-1]:
            run_dir = work / f"rep{rep}-{name}"
            run_dir.mkdir(parents=True)
            r = run_once(name, args, run_dir)
            r["rep"] = rep
            runs.append(r)
            shown = "  ".join(f"{k}={r[k]:.2f}" for k, _ in PHASES if r[k] is not None)
            print(f"rep {rep} {name:<17} rc={r['returncode']} completed={r['completed']}  {shown}",
                  flush=True)
    ratio = report(runs, launchers)
    if args.out_json:
        with open(args.out_json, "w") as f:
            json.dump({**info, "config": vars(args), "ratio_torchrun_over_ftlaunch": ratio,
                       "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
