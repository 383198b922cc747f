"""Recovery after kill -9 of one rank: torchrun (with its restart workaround) vs ftlaunch policies.

Each rep starts scripts/train_gpt.py under every launcher in turn (order alternates per rep),
reads the launcher's merged output line by line with time.monotonic() stamps, SIGKILLs rank 1
at its first step line >= --kill-step (--kill-step 1: in the first seconds of the job), ends
the run --steps-after rank-0 steps after the recovery (SIGTERM to the launcher, SIGKILL 10 s
later) and times the phases of the recovery:

    launch -> first step     start-up: import torch, rendezvous, first DDP step
    launch -> template ready ftlaunch's rank template has imported torch
    kill -> detected         the launcher's first line about the failure
    kill -> respawned        torchrun: fork of the first new rank (its /proc start time, 10 ms
                             ticks); ftlaunch: its "recovered" event (every rank forked from
                             the rank template, started fresh or resumed in place)
    kill -> ranks up         first "start rank" line after the kill (init_process_group + ckpt)
    kill -> first step       first "step" line after the restart: the recovery time

Launchers: torchrun (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with default settings it does not
recover with gloo on torch 2.13, restarted workers read stale addresses from the reused
rendezvous store, see BENCHMARKS.md), torchrun-default (reproduces that failure),
ftlaunch-cold / ftlaunch-job (--restart-policy cold / job, unmodified script),
ftlaunch-plain (default policy, unmodified script), ftlaunch-spawn (the same with
--start-method spawn: fresh interpreters) and ftlaunch-rank (default policy, script run with
--shim; "ftlaunch" is an alias). Each rank's PSS (/proc/PID/smaps_rollup) is read at the
first step: a forked rank shares the template's pages.

--hang-timeouts 1,2,5: per timeout T one ftlaunch-rank run where rank 1 hangs (TRAIN_FAULT_KIND
=hang at --kill-step): seconds from "injecting fault hang" to
ftlaunch's "hung:" line, against T. --overhead-steps N: ftlaunch with 2 ranks, N steps,
--step-time 0, without and with --shim (heartbeats): rank 0's "time per step" of each.

    python scripts/bench_recovery.py --reps 1                 # smoke check
    python scripts/bench_recovery.py --reps 5 --out-json recovery.json
    python scripts/bench_recovery.py --reps 0 --hang-timeouts 1,2,5 --overhead-steps 2000
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
SCRIPT = str(REPO / "scripts" / "train_gpt.py")
START = re.compile(r"start rank (\d+) world \d+ pid (\d+) resume_from (\d+)")
STEP = re.compile(r"step (\d+) loss \S+ rank (\d+)")
DETECT = re.compile(r"rank \d+ was killed|closing signal|failed \(exitcode|rank \d+ hung:")
TEMPLATE_READY = re.compile(r"rank template ready")
INJECTED = re.compile(r"injecting fault hang rank")
HUNG = re.compile(r"ftlaunch: rank (\d+) hung: ([^;]*)")
TIME_PER_STEP = re.compile(r"time per step ([\d.]+) ms")
LAUNCHERS = {"torchrun": ("torchrun", {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}),
             "torchrun-default": ("torchrun", {}),
             "ftlaunch-cold": ("cold", {}), "ftlaunch-job": ("job", {}),
             "ftlaunch-plain": ("plain", {}), "ftlaunch-spawn": ("spawn", {}),
             "ftlaunch-rank": ("rank", {})}
ALIASES = {"ftlaunch": "ftlaunch-rank"}
FTLAUNCH_PHASES = ["decide", "stop", "backoff", "rendezvous", "spawn"]
PHASES = [("launch_to_first_step", "launch -> first step"),
          ("launch_to_template_ready", "launch -> template ready"),
          ("kill_to_detected", "kill -> detected"),
          ("kill_to_respawned", "kill -> ranks respawned"),
          ("kill_to_ranks_up", "kill -> ranks up"),
          ("kill_to_first_step", "kill -> first step (recovery)"),
          ("wall", "whole run"),
          ("pss_mib", "PSS per rank (MiB)")]


def launcher_command(name, nproc, run_dir, options=()):
    """(argv up to the script's own arguments, extra env)."""
    how, env = LAUNCHERS[name]
    restarts = ["--nproc-per-node", str(nproc), "--max-restarts", "3"]
    if how == "torchrun":
        return [str(BIN / "torchrun"), "--standalone", *restarts, SCRIPT], env
    policy = {"plain": "rank", "spawn": "rank"}.get(how, how)
    fresh = ["--start-method", "spawn"] if how in ("cold", "spawn") else []
    argv = [str(BIN / "ftlaunch"), "--standalone", *restarts, "--restart-policy", policy,
            "--log-dir", str(run_dir), *fresh, *options, SCRIPT]
    return argv + ["--shim"] * (how == "rank"), env


def pss_mib(pid):
    """Proportional set size of ``pid`` (its private pages plus its share of shared ones)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    return None


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
    """SIGKILL the launcher's session and every process whose environment holds ``marker``."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid_dir in Path("/proc").iterdir():  # torchrun puts each rank in its own session
        if not pid_dir.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if marker.encode() + b"\0" in (pid_dir / "environ").read_bytes():
                os.kill(int(pid_dir.name), signal.SIGKILL)
    proc.wait()


class Job:
    """One launcher run: its merged output, stamped and copied to run_dir/output.log."""

    def __init__(self, cmd, env, run_dir, timeout):
        self.marker = f"BENCH_RECOVERY_RUN={run_dir}"  # inherited by every process of the run
        env = {**os.environ, **env, "PYTHONUNBUFFERED": "1", "BENCH_RECOVERY_RUN": str(run_dir)}
        self.queue, self.timed_out = queue.Queue(), False
        self.log = open(run_dir / "output.log", "w")  # noqa: SIM115 - closed in stop()
        self.t0 = time.monotonic()
        self.deadline = self.t0 + timeout
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        threading.Thread(target=read_lines, args=(self.proc.stdout, self.queue),
                         daemon=True).start()

    def lines(self):
        """(stamp, line) until the output ends or the run times out."""
        while True:
            try:
                now, line = self.queue.get(timeout=max(0.0, self.deadline - time.monotonic()))
            except queue.Empty:
                self.timed_out = True
                return
            if line is None:
                return
            self.log.write(f"{now - self.t0:9.3f} {line}\n")
            yield now, line

    def stop(self):
        """SIGTERM the launcher's group, SIGKILL what is left 10 s later; returns seconds the
        launcher took to exit on SIGTERM (None: it had already exited, or had to be killed)."""
        term_to_exit, t = None, time.monotonic()
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
                term_to_exit = time.monotonic() - t
        kill_leftovers(self.proc, self.marker)
        self.deadline = time.monotonic() + 2
        for _ in self.lines():  # the rest of the output, for the log
            pass
        self.log.close()
        return term_to_exit


def read_events(run_dir):
    """ftlaunch's own view: the first "recovering" and "recovered" events (minus bulky keys)."""
    found = {}
    for event_file in run_dir.glob("*/events.jsonl"):
        for event in map(json.loads, event_file.read_text().splitlines()):
            if event["event"] in ("recovering", "recovered"):
                found.setdefault(f"event_{event['event']}",
                                 {k: v for k, v in event.items() if k not in ("event", "cause")})
    return found


def run_once(name, args, run_dir, hang_timeout=None):
    """One job with one fault (kill -9, or a hang if ``hang_timeout``); times and facts."""
    ckpt_dir = run_dir / "ckpt"
    options = ["--hang-timeout", str(hang_timeout)] if hang_timeout is not None else []
    argv, env = launcher_command(name, args.nproc, run_dir, options)
    cmd = [*argv, "--steps", str(args.steps), "--ckpt-dir", str(ckpt_dir), "--ckpt-every", "10",
           "--step-time", str(args.step_time)]
    if hang_timeout is not None:
        env = {**env, "TRAIN_FAULT_KIND": "hang", "TRAIN_FAULT_RANK": "1",
               "TRAIN_FAULT_STEP": str(args.kill_step)}
    r = {"launcher": name, "completed": False, "returncode": None, "pss_mib": None,
         "loadavg_1m_before": os.getloadavg()[0]}
    job = Job(cmd, env, run_dir, args.timeout)
    t = dict.fromkeys(["first_step", "template_ready", "kill", "detected", "ranks_up",
                       "step_after"])
    victim, old_pids, respawned, steps_after = None, set(), [], 0
    for now, line in job.lines():
        start, step = START.search(line), STEP.search(line)
        if start and t["kill"] is None:
            old_pids.add(int(start[2]))
            victim = int(start[2]) if start[1] == "1" else victim
        elif start and t["step_after"] is None:
            if int(start[2]) not in old_pids:
                respawned.append(started_at(int(start[2])))  # read while the rank is alive
            if t["ranks_up"] is None:
                t["ranks_up"], r["resume_from"] = now, int(start[3])
        if t["template_ready"] is None and TEMPLATE_READY.search(line):
            t["template_ready"] = now
        if step and t["first_step"] is None:
            t["first_step"] = now
            sizes = [m for pid in old_pids if (m := pss_mib(pid)) is not None]
            r["pss_mib"] = statistics.median(sizes) if sizes else None
        if hang_timeout is not None and t["kill"] is None and INJECTED.search(line):
            t["kill"], wall_at_kill = now, time.time() - (time.monotonic() - now)
            kill_boottime = time.clock_gettime(time.CLOCK_BOOTTIME) - (time.monotonic() - now)
        elif (hang_timeout is None and step and t["kill"] is None and victim is not None
              and step[2] == "1" and int(step[1]) >= args.kill_step):
            t["kill"], wall_at_kill = time.monotonic(), time.time()
            kill_boottime = time.clock_gettime(time.CLOCK_BOOTTIME)
            os.kill(victim, signal.SIGKILL)
            r["kill_step"] = int(step[1])
        elif step and t["ranks_up"] is not None:
            t["step_after"] = t["step_after"] or now
            steps_after += step[2] == "0"
            if steps_after >= args.steps_after:
                r["completed"] = True  # recovered and trained on: end the run here
                break
        if t["kill"] is not None and t["detected"] is None and DETECT.search(line):
            t["detected"] = now
        if (hung := HUNG.search(line)) and "hung_rank" not in r:
            r["hung_rank"], r["hung_reason"] = int(hung[1]), hung[2]
    r["timed_out"] = job.timed_out
    r["sigterm_to_exit"] = job.stop()
    r["returncode"] = job.proc.returncode
    r["wall"] = time.monotonic() - job.t0
    for key, phase in (("first_step", "launch_to_first_step"),
                       ("template_ready", "launch_to_template_ready")):
        r[phase] = t[key] and t[key] - job.t0
    for key, phase in (("detected", "kill_to_detected"), ("ranks_up", "kill_to_ranks_up"),
                       ("step_after", "kill_to_first_step")):
        r[phase] = t[key] - t["kill"] if t[key] is not None and t["kill"] is not None else None
    r["killed"] = t["kill"] is not None
    r.update(read_events(run_dir))
    respawned = [b for b in respawned if b is not None]
    r["kill_to_respawned"] = None
    if "event_recovered" in r and r["killed"]:
        r["kill_to_respawned"] = r["event_recovered"]["ts"] - wall_at_kill
    elif respawned and r["killed"]:
        r["kill_to_respawned"] = min(respawned) - kill_boottime
    r["log"] = str(run_dir / "output.log")
    return r


def run_overhead(args, work):
    """Rank 0's time per step (ms) without and with --shim: ftlaunch, 2 ranks, no faults.

    The script's own figure includes the first step's lazy imports (seconds); "steady" is the
    bench's, from the stamps of rank 0's step lines after the first 10."""
    result = {"steps": args.overhead_steps}
    for variant in ("plain", "shim"):
        run_dir = work / f"overhead-{variant}"
        run_dir.mkdir(parents=True)
        cmd = [str(BIN / "ftlaunch"), "--standalone", "--nproc-per-node", "2",
               "--log-dir", str(run_dir), SCRIPT, "--steps", str(args.overhead_steps),
               "--step-time", "0", *["--shim"] * (variant == "shim")]
        result[f"{variant}_loadavg_1m_before"] = os.getloadavg()[0]
        job = Job(cmd, {}, run_dir, args.timeout)
        ms, stamps = [], []
        for now, line in job.lines():
            if m := TIME_PER_STEP.search(line):
                ms.append(float(m[1]))
            if (step := STEP.search(line)) and step[2] == "0":
                stamps.append(now)
        job.stop()
        result[variant] = ms[0] if ms else None
        result[f"{variant}_steady"] = (1000 * (stamps[-1] - stamps[10]) / (len(stamps) - 11)
                                       if len(stamps) > 20 else None)
        result[f"{variant}_returncode"] = job.proc.returncode
        print(f"overhead {variant:<5} rc={job.proc.returncode} load before "
              f"{result[f'{variant}_loadavg_1m_before']:.2f}  time per step: script "
              f"{num(result[variant])} ms, steady {num(result[f'{variant}_steady'])} ms",
              flush=True)
    for kind in ("", "_steady"):
        plain, shim = result[f"plain{kind}"], result[f"shim{kind}"]
        if plain and shim:
            result[f"overhead_pct{kind}"] = 100 * (shim / plain - 1)
    return result


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


def num(value):
    return "-" if value is None else f"{value:.2f}"


def median_or_none(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def report(runs, launchers):
    """The phase table, ftlaunch's own phases, and torchrun / each ftlaunch variant."""
    print(f"\n{'phase (seconds)':<31} {'launcher':<17} {'n':>2} {'median':>7} {'min':>7} "
          f"{'max':>7}")
    for key, label in PHASES:
        for name in launchers:
            values = [r[key] for r in runs if r["launcher"] == name and r[key] is not None]
            print(f"{label:<31} {name:<17} {len(values):>2} {fmt(values)}")
    for name in launchers:
        mine = [r for r in runs if r["launcher"] == name]
        print(f"{name}: completed {sum(r['completed'] for r in mine)}/{len(mine)} runs")
    variants = [n for n in launchers if n.startswith("ftlaunch")]
    if variants:
        print("\nftlaunch 'recovered' event, median s  "
              + " ".join(f"{p:>10}" for p in [*FTLAUNCH_PHASES, "total"]) + "  ranks")
    for name in variants:
        events = [r["event_recovered"] for r in runs
                  if r["launcher"] == name and "event_recovered" in r]
        cells = [median_or_none([e["phases"].get(p) for e in events]) for p in FTLAUNCH_PHASES]
        cells.append(median_or_none([e["seconds"] for e in events]))
        sources = sorted({"/".join(str(len(e[k])) for k in ("resumed", "forked", "fresh"))
                          for e in events})
        print(f"{name:<37} " + " ".join("         -" if c is None else f"{c:10.3f}"
                                        for c in cells)
              + f"  resumed/forked/fresh {','.join(sources) or '-'}")
    medians = {name: median_or_none([r["kill_to_first_step"] for r in runs
                                     if r["launcher"] == name]) for name in launchers}
    ratios = {}
    for name in variants:
        if medians.get("torchrun") and medians[name]:
            ratios[name] = medians["torchrun"] / medians[name]
            print(f"median recovery time torchrun / {name} = {ratios[name]:.2f}x")
    return ratios


def report_hangs(hangs):
    print(f"\n{'hang timeout T (s)':>18} {'latency':>8} {'latency-T':>9} {'rank':>4} "
          f"{'fault->step':>11}  reason")
    for h in hangs:
        latency, recovery = h["kill_to_detected"], h["kill_to_first_step"]
        print(f"{h['hang_timeout']:>18g} "
              + (f"{latency:8.2f} {latency - h['hang_timeout']:9.2f}" if latency is not None
                 else f"{'-':>8} {'-':>9}")
              + f" {h.get('hung_rank', '-'):>4} "
              + f"{num(recovery):>11}"
              + f"  {h.get('hung_reason', 'not detected')}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--steps", type=int, default=100000,
                   help="the script's --steps; runs are ended --steps-after the recovery")
    p.add_argument("--steps-after", type=int, default=10,
                   help="rank-0 steps after the recovery before the run is ended")
    p.add_argument("--kill-step", type=int, default=25,
                   help="rank 1 is killed (or hangs) at its first step >= this one")
    p.add_argument("--step-time", type=float, default=0.02)
    p.add_argument("--timeout", type=float, default=300, help="per run, seconds")
    p.add_argument("--launchers", default="torchrun,ftlaunch-plain,ftlaunch-rank",
                   help=f"comma list of {', '.join(LAUNCHERS)} (ftlaunch = ftlaunch-rank)")
    p.add_argument("--hang-timeouts", default="",
                   help="comma list of --hang-timeout values: one ftlaunch-rank hang run each")
    p.add_argument("--overhead-steps", type=int, default=0,
                   help="> 0: time per step without and with --shim over this many steps")
    p.add_argument("--work-dir", default=None, help="checkpoints and logs (default: a temp dir)")
    p.add_argument("--out-json", default=None, help="write every run's raw numbers here")
    args = p.parse_args()
    if not 0 < args.kill_step < args.steps:
        p.error("--kill-step must be between 0 and --steps")
    launchers = [ALIASES.get(n, n) for n in args.launchers.split(",") if n]
    if unknown := [n for n in launchers if n not in LAUNCHERS]:
        p.error(f"unknown launcher(s) {unknown}; choose from {', '.join(LAUNCHERS)}")
    hang_timeouts = [float(v) for v in args.hang_timeouts.split(",") if v]
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench_recovery_")).resolve()
    import torch  # only for the record

    info = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "torch": torch.__version__, "cpus": os.cpu_count(), "cpu": cpu_model(),
            "commit": git_commit(), "argv": sys.argv[1:]}
    print(f"{info['date']}  commit {info['commit']}  torch {info['torch']}  {info['cpus']} x "
          f"{info['cpu']}\nlogs in {work}")
    runs, hangs, ratios, overhead = [], [], {}, None
    for rep in range(args.reps):
        for name in launchers if rep % 2 == 0 else launchers[::-1]:
            run_dir = work / f"rep{rep}-{name}"
            run_dir.mkdir(parents=True)
            r = run_once(name, args, run_dir)
            r["rep"] = rep
            runs.append(r)
            shown = "  ".join(f"{k}={r[k]:.2f}" for k, _ in PHASES if r[k] is not None)
            print(f"rep {rep} {name:<17} completed={r['completed']} killed at step "
                  f"{r.get('kill_step', '-')} term->exit={num(r['sigterm_to_exit'])}  {shown}",
                  flush=True)
    if runs:
        ratios = report(runs, launchers)
    for timeout in hang_timeouts:
        run_dir = work / f"hang-{timeout:g}"
        run_dir.mkdir(parents=True)
        h = {"hang_timeout": timeout, **run_once("ftlaunch-rank", args, run_dir, timeout)}
        hangs.append(h)
        print(f"hang {timeout:g}s completed={h['completed']} term->exit="
              f"{num(h['sigterm_to_exit'])}  latency={num(h['kill_to_detected'])}", flush=True)
    if hangs:
        report_hangs(hangs)
    if args.overhead_steps > 0:
        print()
        overhead = run_overhead(args, work)
        for kind, label in (("", "script's"), ("_steady", "steady")):
            if f"overhead_pct{kind}" in overhead:
                print(f"shim overhead ({label} time per step): "
                      f"{overhead[f'overhead_pct{kind}']:+.2f}% ({overhead[f'plain{kind}']:.2f}"
                      f" -> {overhead[f'shim{kind}']:.2f} ms/step)")
    if args.out_json:
        with open(args.out_json, "w") as f:
            json.dump({**info, "config": vars(args), "ratios_torchrun_over": ratios,
                       "runs": runs, "hangs": hangs, "overhead": overhead}, f, indent=1)


if __name__ == "__main__":
    main()
