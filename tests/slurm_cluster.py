"""A real SLURM (Debian's ``slurm-wlm``) on this one machine, for tests: one slurmctld and one
slurmd per fake node, everything under a work directory. Installs nothing
(``scripts/test.sh`` does, as root); ``missing()`` says why a cluster cannot run here.

Facts it relies on (verified on Slurm 22.05): ``AuthType=auth/none`` + ``CredType=cred/none``
need no munge; several slurmd on one host work when each has its own ``-N NAME`` and port;
``slurmctld -i`` ignores old state. The fake nodes share this host, so their names are
made to resolve (ftlaunch dials the first host of the step's node list by name, as on a real
cluster): a marked block in /etc/hosts maps them to 127.0.0.1 while the cluster runs.

Every daemon, step daemon and job process carries ``SLURM_CONF`` (this cluster's file) in
its environment: that finds them all at teardown, whatever state the jobs were left in.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil
from ports import free_port

DAEMONS = ("slurmctld", "slurmd", "sbatch", "scontrol", "srun", "scancel", "sinfo")
HOSTS_FILE = Path("/etc/hosts")


def missing() -> str | None:
    """Why a SLURM cluster cannot be started here, or None."""
    absent = [name for name in DAEMONS if shutil.which(name) is None]
    if absent:
        return (f"SLURM not installed ({', '.join(absent)} missing): apt-get install "
                "slurm-wlm (scripts/test.sh does, as root)")
    if os.geteuid() != 0:
        return "the SLURM tests run the daemons as root (SlurmUser=root, jobs as root)"
    if not os.access(HOSTS_FILE, os.W_OK):
        return f"{HOSTS_FILE} is not writable: the fake nodes' names cannot be made to resolve"
    return None


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class SlurmError(RuntimeError):
    pass


class SlurmCluster:
    """``start()`` ... ``stop()`` (or ``with``). ``env`` is what a client command needs."""

    def __init__(self, workdir: Path, nodes: int = 2, cpus: int = 2, prefix: str = "ftl-n",
                 cred_expire: int = 120):
        self.workdir = Path(workdir)
        self.names = [f"{prefix}{i}" for i in range(1, nodes + 1)]
        self.cpus = cpus
        self.cred_expire = cred_expire  # also how long a requeued job waits (BeginTime)
        self.conf = self.workdir / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        for name in list(self.env):  # a cluster of our own: nothing from an enclosing job
            if name.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")) and name != "SLURM_CONF":
                del self.env[name]
        self._hosts_marker = f"# ftlaunch tests: SLURM fake nodes ({self.workdir})"
        self.first_job_id = 0

    # --- lifecycle ---------------------------------------------------------------------

    def __enter__(self) -> SlurmCluster:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, timeout: float = 60) -> None:
        why = missing()
        if why:
            raise SlurmError(why)
        try:
            self._write_config()
            self._add_hosts()
            self._run(["slurmctld", "-i", "-f", str(self.conf)])
            for name in self.names:
                self._run(["slurmd", "-f", str(self.conf), "-N", name])
            self.wait_nodes_idle(timeout)
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout: float = 20) -> list[str]:
        """Cancel every job, stop the daemons (their pid files), then kill whatever still
        carries this cluster's SLURM_CONF (step daemons, tasks). Returns what had to be
        SIGKILLed after the daemons were asked to stop (empty on a clean run)."""
        if self.conf.exists():
            subprocess.run(["scancel", "--full", "--quiet", "--signal=KILL", "--user=root"],
                           env=self.env, capture_output=True, timeout=15, check=False)
            subprocess.run(["scancel", "--quiet", "--user=root"], env=self.env,
                           capture_output=True, timeout=15, check=False)
        for pid_file in sorted(self.workdir.glob("*.pid")):
            with contextlib.suppress(OSError, ValueError, IndexError):
                os.kill(int(pid_file.read_text().split()[0]), signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while (left := self.processes()) and time.monotonic() < deadline:
            psutil.wait_procs(left, timeout=min(0.5, max(0.01, deadline - time.monotonic())))
        killed = []
        for p in self.processes():
            try:
                killed.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(self.processes(), timeout=5)
        self._remove_hosts()
        return killed

    def processes(self) -> list[psutil.Process]:
        """Live processes of this cluster: daemons, step daemons, batch scripts, tasks."""
        found = []
        for p in psutil.process_iter():
            try:
                if p.pid != os.getpid() and p.environ().get("SLURM_CONF") == str(self.conf) \
                        and p.status() != psutil.STATUS_ZOMBIE:
                    found.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return found

    # --- configuration -----------------------------------------------------------------

    def _write_config(self) -> None:
        w = self.workdir
        for d in ("state", "spool", "log", "tmp"):
            (w / d).mkdir(parents=True, exist_ok=True)
        for name in self.names:
            (w / "spool" / name).mkdir(exist_ok=True)
        host = socket.gethostname().split(".")[0]
        # ftlaunch's coordinator port is 29400 + job id % 1000: start where the next few ports
        # are free, so parallel runs of the suite (each its own cluster) do not collide.
        for _ in range(50):
            first = random.randrange(100, 900)
            if all(_port_free(29400 + (first + i) % 1000) for i in range(12)):
                break
        self.first_job_id = first
        lines = [
            "ClusterName=ftltest",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/none",
            f"AuthInfo=cred_expire={self.cred_expire}",
            "CredType=cred/none",
            "MpiDefault=none",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SwitchType=switch/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/builtin",
            "SchedulerParameters=sched_interval=1",  # a requeued job starts once eligible
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none",
            "JobRequeue=1",
            "ReturnToService=2",
            f"FirstJobId={first}",
            "KillWait=10",  # SIGTERM .. SIGKILL when a step or job is cancelled
            "InactiveLimit=0",
            "MinJobAge=600",  # finished jobs stay visible to `scontrol show job`
            "MailProg=/bin/true",
            f"StateSaveLocation={w}/state",
            f"SlurmdSpoolDir={w}/spool/%n",
            f"SlurmctldPidFile={w}/slurmctld.pid",
            f"SlurmdPidFile={w}/slurmd-%n.pid",
            f"SlurmctldLogFile={w}/log/slurmctld.log",
            f"SlurmdLogFile={w}/log/slurmd-%n.log",
            f"TmpFS={w}/tmp",
        ]
        for name in self.names:
            lines.append(f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 "
                         f"Port={free_port()} CPUs={self.cpus} RealMemory=1000 State=UNKNOWN")
        lines.append(f"PartitionName=ftl Nodes={','.join(self.names)} Default=YES "
                     "MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")

    def _add_hosts(self) -> None:
        """The fake nodes' names -> 127.0.0.1, as a cluster's DNS would resolve them. The
        file is edited in place (it may be a bind mount), in a block removed at stop()."""
        block = [self._hosts_marker, *(f"127.0.0.1 {name}" for name in self.names),
                 self._hosts_marker + " end"]
        with HOSTS_FILE.open("r+") as f:
            text = f.read()
            if self._hosts_marker in text:
                return
            if text and not text.endswith("\n"):
                f.write("\n")
            f.write("\n".join(block) + "\n")

    def _remove_hosts(self) -> None:
        try:
            with HOSTS_FILE.open("r+") as f:
                lines = f.read().splitlines(keepends=True)
                kept, inside = [], False
                for line in lines:
                    if line.rstrip("\n") == self._hosts_marker:
                        inside = True
                    elif inside and line.rstrip("\n") == self._hosts_marker + " end":
                        inside = False
                    elif not inside:
                        kept.append(line)
                if len(kept) != len(lines):
                    f.seek(0)
                    f.write("".join(kept))
                    f.truncate()
        except OSError:
            pass

    # --- commands ------------------------------------------------------------------------

    def _run(self, cmd: list[str], timeout: float = 30, **kw) -> subprocess.CompletedProcess:
        done = subprocess.run(cmd, env=kw.pop("env", self.env), capture_output=True, text=True,
                              timeout=timeout, **kw)
        if done.returncode != 0:
            raise SlurmError(f"{' '.join(cmd)} exited {done.returncode}: "
                             f"{done.stdout}{done.stderr}\n{self.logs()}")
        return done

    def scontrol(self, *args: str) -> str:
        return self._run(["scontrol", *args]).stdout

    def scancel(self, *args: str) -> None:
        self._run(["scancel", *args])

    def logs(self, tail: int = 30) -> str:
        out = []
        for log in sorted((self.workdir / "log").glob("*.log")):
            lines = log.read_text(errors="replace").splitlines()[-tail:]
            out.append(f"--- {log.name}\n" + "\n".join(lines))
        return "\n".join(out)

    def node_states(self) -> dict[str, str]:
        states = {}
        for line in self.scontrol("show", "node", "-o").splitlines():
            fields = _fields(line)
            if "NodeName" in fields:
                states[fields["NodeName"]] = fields.get("State", "")
        return states

    def wait_nodes_idle(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            try:
                states = self.node_states()
            except SlurmError:
                states = {}  # slurmctld still starting
            if len(states) == len(self.names) and \
                    all(s.split("+")[0] == "IDLE" for s in states.values()):
                return
            time.sleep(0.2)  # the daemons register on their own: nothing to wait on but polls
        raise SlurmError(f"nodes not idle within {timeout}s: {states}\n{self.logs()}")

    def sbatch(self, script: Path, *args: str, env: dict[str, str] | None = None) -> int:
        """Submit ``script``; returns the job id. ``env``: the job's environment (sbatch
        exports the submitter's, as --export=ALL)."""
        run_env = {**(env or self.env), "SLURM_CONF": str(self.conf)}
        out = self._run(["sbatch", "--parsable", *args, str(script)], env=run_env).stdout
        return int(out.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job -o``'s fields (JobState, Reason, Restarts, ExitCode...)."""
        return _fields(self.scontrol("show", "job", "-o", str(job_id)).strip())

    def wait_job(self, job_id: int, predicate, timeout: float, what: str) -> dict[str, str]:
        """Poll the job's record until ``predicate(fields)``; raises with the record and the
        daemons' logs on timeout."""
        deadline = time.monotonic() + timeout
        fields: dict[str, str] = {}
        while time.monotonic() < deadline:
            fields = self.job(job_id)
            if predicate(fields):
                return fields
            time.sleep(0.1)  # a scheduler's state: polled, as squeue does
        raise SlurmError(f"job {job_id}: not {what} within {timeout}s: {fields}\n{self.logs()}")

    def wait_done(self, job_id: int, timeout: float) -> dict[str, str]:
        return self.wait_job(job_id, lambda f: f.get("JobState") in FINAL_STATES, timeout,
                             "finished")


FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                "BOOT_FAIL", "DEADLINE", "PREEMPTED"}


def _fields(line: str) -> dict[str, str]:
    """``Key=Value Key=Value`` as one ``scontrol -o`` line prints them (values without
    spaces, except the last fields of a job; good enough for the ones read here)."""
    fields: dict[str, str] = {}
    for token in line.split():
        key, sep, value = token.partition("=")
        if sep and key not in fields:
            fields[key] = value
    return fields
