"""``ftlaunch doctor``: a pre-flight check of this node before a job is put on it.

Each check is a small function returning ``Check`` rows, so a user (or a Kubernetes init
container) sees in one table why a job would fail here: a sick GPU, too small a /dev/shm, a
rendezvous endpoint nobody can reach, or ranks that cannot run one collective together.
The exit code says what a scheduler should do (``exit_code``, a pure function).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass

import click

from launcher import UsageError, exit_codes, gpu_health

SHM = "/dev/shm"
GIB = 1 << 30
CONNECT_TIMEOUT = 2.0
RESOLVE_TIMEOUT = 5.0  # a broken DNS must not hang an init container


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # ok, info, warn, fail; GPU rows also drain or fatal
    detail: str
    hardware: bool = False  # a "fail" here means the hardware is bad: do not requeue


def exit_code(checks: list[Check]) -> int:
    """Bad hardware -> DO_NOT_REQUEUE; any other failure -> JOB_FAILED; else OK (pure)."""
    if any(c.status in ("drain", "fatal") or (c.status == "fail" and c.hardware) for c in checks):
        return exit_codes.DO_NOT_REQUEUE
    if any(c.status == "fail" for c in checks):
        return exit_codes.JOB_FAILED
    return exit_codes.OK


# --- checks ---------------------------------------------------------------------------------


def check_gpus() -> list[Check]:
    """What NVML says about every GPU right now (a reading with no earlier one to compare)."""
    try:
        backend = gpu_health.open_backend()
    except gpu_health.NoGpu as e:
        return [Check("GPUs", "info", f"no NVIDIA GPU: CPU jobs only ({e})")]
    except Exception as e:  # a driver error is a finding, not a crash of the doctor
        return [Check("GPUs", "fail", f"opening NVML failed: {type(e).__name__}: {e}")]
    try:
        rows = [Check("NVIDIA driver", "ok", backend.driver_version()),
                Check("CUDA driver", "ok", f"supports CUDA {backend.cuda_version()}")]
        for sample in backend.samples():
            findings = gpu_health.assess(None, sample)
            detail = "; ".join([f"{sample.name} {sample.uuid}".strip()]
                               + [f"{f.detail} ({f.severity})" for f in findings])
            if sample.pids:
                detail += f"; {len(sample.pids)} process(es) already on it: {list(sample.pids)}"
            rows.append(Check(f"GPU {sample.index}", gpu_health.worst(findings) or "ok", detail))
        return rows
    except Exception as e:
        return [Check("GPUs", "fail", f"reading NVML failed: {type(e).__name__}: {e}")]
    finally:
        backend.close()


def check_torch(nvml_gpus: int) -> tuple[list[Check], int]:
    """torch's version and the CUDA devices it sees (the count sizes the smoke test)."""
    try:
        import torch
    except Exception as e:
        return [Check("torch", "fail", f"cannot import torch: {e}")], 0
    cuda = torch.cuda.is_available()
    count = torch.cuda.device_count() if cuda else 0
    built = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "CPU build"
    if cuda:
        detail = f"{torch.__version__} ({built}); {count} CUDA device(s)"
        return [Check("torch", "ok", detail)], count
    status, hint = "ok", ""
    if nvml_gpus:
        status, hint = "warn", (f": NVML sees {nvml_gpus} GPU(s); a CPU build of torch, or "
                                "CUDA_VISIBLE_DEVICES, or a driver older than torch's CUDA?")
    return [Check("torch", status, f"{torch.__version__} ({built}); no CUDA{hint}")], 0


def check_shm(staging_gib: float, path: str = SHM, replicas: int = 0) -> Check:
    """Checkpoint staging and NCCL live in /dev/shm; docker's default 64 MiB breaks both.
    ``staging_gib`` per node is double-buffered, and so is each of the ``replicas`` copies
    this node keeps of a peer's staging."""
    fix = "enlarge /dev/shm: docker --shm-size, Kubernetes emptyDir medium: Memory"
    try:
        st = os.statvfs(path)
    except OSError as e:
        return Check("/dev/shm", "warn", f"{path} unusable ({e.strerror}): NCCL and checkpoint "
                     f"staging need it; {fix}")
    size, free = st.f_blocks * st.f_frsize / GIB, st.f_bavail * st.f_frsize / GIB
    detail = f"{size:.2f} GiB, {free:.2f} GiB free"
    need = 2 * staging_gib * (1 + replicas)
    if staging_gib > 0 and free < need:
        kept = f" and {replicas} peer cop{'y' if replicas == 1 else 'ies'}" if replicas else ""
        return Check("/dev/shm", "fail", f"{detail}; staging {staging_gib:g} GiB{kept}, "
                     f"double-buffered, needs {need:g} GiB: {fix} (or lower --ckpt-replicas: "
                     "a full /dev/shm only skips replicas)")
    if staging_gib == 0 and size < 1:
        return Check("/dev/shm", "warn", f"{detail}: under 1 GiB breaks NCCL and checkpoint "
                     f"staging; {fix}")
    return Check("/dev/shm", "ok", detail)


def check_port(name: str, addr: str, port: int, in_use_hint: str) -> Check | None:
    """Can a server bind (addr, port)? None when addr is not one of this machine's."""
    with socket.socket(socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the real servers do
        try:
            sock.bind((addr, port))
        except OSError as e:
            if e.errno == errno.EADDRNOTAVAIL:
                return None
            if e.errno == errno.EADDRINUSE:
                return Check(name, "warn", f"{addr}:{port} in use: {in_use_hint}")
            return Check(name, "fail", f"cannot bind {addr}:{port}: {e.strerror}; "
                         "pick another port")
    return Check(name, "ok", f"{addr}:{port} free")


def check_rdzv(host: str, port: int) -> list[Check]:
    """Resolve the endpoint; if it is this machine, can the coordinator bind it; can we dial it."""
    name = f"rdzv {host}:{port}"
    try:
        addr = _resolve(host)
    except OSError as e:
        return [Check(name, "fail", f"cannot resolve {host!r} ({e}): check --rdzv-endpoint "
                      "and DNS (or /etc/hosts)")]
    rows = [check_port("rdzv port", addr, port, "fine if another agent of this job already "
                       "hosts it, else pick another port")
            or Check("rdzv port", "info", f"{host} ({addr}) is another machine: its agent hosts "
                     "the coordinator")]
    try:
        socket.create_connection((addr, port), timeout=CONNECT_TIMEOUT).close()
        rows.append(Check(name, "ok", f"connected to {addr}:{port}"))
    except ConnectionRefusedError:
        rows.append(Check(name, "warn", f"{addr}:{port} refused: nothing listening yet: fine on "
                          "the node that will host it"))
    except TimeoutError:
        rows.append(Check(name, "fail", f"no answer from {addr}:{port} within {CONNECT_TIMEOUT:g} "
                          "s: a firewall, or the wrong address"))
    except OSError as e:
        rows.append(Check(name, "fail", f"cannot connect to {addr}:{port}: {e}"))
    return rows


def _resolve(host: str) -> str:
    """``gethostbyname`` (what the agent binds and dials), bounded by RESOLVE_TIMEOUT."""
    box: list = []

    def resolve() -> None:
        try:
            box.append(socket.gethostbyname(host))
        except Exception as e:  # gaierror, or UnicodeError for a malformed name
            box.append(e)

    thread = threading.Thread(target=resolve, daemon=True)  # getaddrinfo cannot be cancelled
    thread.start()
    thread.join(RESOLVE_TIMEOUT)
    if not box:
        raise OSError(f"no answer from the resolver within {RESOLVE_TIMEOUT:g} s")
    if isinstance(box[0], Exception):
        raise box[0] if isinstance(box[0], OSError) else OSError(str(box[0]))
    return box[0]


# --- smoke test -----------------------------------------------------------------------------

_WORKER = """
import json, os
from datetime import timedelta
import torch, torch.distributed as dist
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
nccl = os.environ["FTLAUNCH_DOCTOR_BACKEND"] == "nccl"
device = torch.device("cuda", rank) if nccl else torch.device("cpu")
if nccl:
    torch.cuda.set_device(device)
dist.init_process_group("nccl" if nccl else "gloo", timeout=timedelta(seconds=float(
    os.environ["FTLAUNCH_DOCTOR_TIMEOUT"])), device_id=device if nccl else None)
x = (torch.arange(256 * 256, dtype=torch.float32) % 7).reshape(256, 256)
assert torch.equal((x.to(device) @ x.to(device)).cpu(), x @ x), "matmul gave a wrong result"
value = torch.full((1024,), float(rank + 1), device=device)
dist.all_reduce(value)
print(json.dumps([value.min().item(), value.max().item()]), flush=True)
dist.destroy_process_group()
"""


def smoke_test(nproc: int, nccl: bool, timeout: float) -> Check:
    """N real ranks rendezvous on loopback, multiply and all-reduce; the sum must be exact."""
    from launcher.store import AgentStore
    from launcher.workers import rank_preexec_fn

    backend = "nccl" if nccl else "gloo"
    name, start = f"smoke ({nproc} x {backend})", time.monotonic()
    store = AgentStore("127.0.0.1")  # held here: the port is ours, no race for a free one
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="ftlaunch-doctor-") as tmp:
        try:
            for rank in range(nproc):
                env = _rank_env(rank, nproc, store.port, backend, timeout)
                with open(f"{tmp}/{rank}.out", "w") as out, open(f"{tmp}/{rank}.err", "w") as err:
                    procs.append(subprocess.Popen(
                        [sys.executable, "-c", _WORKER], env=env, stdin=subprocess.DEVNULL,
                        stdout=out, stderr=err, preexec_fn=rank_preexec_fn()))
            failed = _wait_all(procs, start + timeout)
            running = [rank for rank, p in enumerate(procs) if p.poll() is None]
        finally:
            for p in procs:  # each in its own process group: this takes their children too
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(10)  # only a process stuck in the kernel (a sick GPU) outlives this
            store.close()
        seconds = time.monotonic() - start
        if failed is None:
            return Check(name, "fail", f"timed out after {timeout:g} s (ranks {running} still "
                         f"running){_last_line(tmp, (running or [0])[0])}", nccl)
        if failed >= 0:
            return Check(name, "fail", f"rank {failed} exited with {procs[failed].returncode}"
                         f"{_last_line(tmp, failed)}", nccl)
        expected = float(nproc * (nproc + 1) // 2)
        for rank in range(nproc):
            with open(f"{tmp}/{rank}.out") as f:
                lines = f.read().splitlines() or [""]
            if lines[-1] != json.dumps([expected, expected]):  # [min, max] of the reduced tensor
                return Check(name, "fail", f"rank {rank}: all_reduce gave [min, max] "
                             f"{lines[-1]!r}, expected {expected:g} everywhere", nccl)
    return Check(name, "ok", f"matmul + all_reduce on {nproc} ranks in {seconds:.1f} s")


def _rank_env(rank: int, nproc: int, port: int, backend: str, timeout: float) -> dict[str, str]:
    """torchrun's variables; the store is ours (TORCHELASTIC_USE_AGENT_STORE), as under ftlaunch."""
    env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
           "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0",
           "FTLAUNCH_DOCTOR_BACKEND": backend, "FTLAUNCH_DOCTOR_TIMEOUT": str(timeout)}
    env.setdefault("OMP_NUM_THREADS", "1")  # a 256x256 matmul needs no thread pool
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # all ranks are here, whatever the hostname says
    return env


def _wait_all(procs: list[subprocess.Popen], deadline: float) -> int | None:
    """-1 when all exited 0; the first failed rank; None at the deadline (pidfds: no polling)."""
    pending = {os.pidfd_open(p.pid): rank for rank, p in enumerate(procs)}
    try:
        while pending:
            left = max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select(list(pending), [], [], left)
            if not ready:
                return None
            for fd in ready:
                rank = pending.pop(fd)
                os.close(fd)
                if procs[rank].wait() != 0:
                    return rank
        return -1
    finally:
        for fd in pending:
            os.close(fd)


def _last_line(tmp: str, rank: int) -> str:
    with open(f"{tmp}/{rank}.err", errors="replace") as f:
        lines = [line.strip() for line in f if line.strip()]
    return f": {lines[-1]}" if lines else ""


# --- command --------------------------------------------------------------------------------

COLOURS = {"ok": "green", "info": "cyan", "warn": "yellow", "fail": "red", "drain": "magenta",
           "fatal": "bold red"}


def _endpoint(ctx, param, value: str | None) -> tuple[str, int] | None:
    if not value:
        return None
    from launcher.config import LaunchConfig  # the agent's own parsing, so both agree

    try:
        return LaunchConfig(rdzv_endpoint=value).rdzv_endpoint_parts()
    except UsageError as e:
        raise click.BadParameter(str(e)) from None


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout, no table.")
@click.option("--staging-gib", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Checkpoint staging per node; /dev/shm must have twice this free, for "
                   "itself and for each peer copy (--ckpt-replicas).")
@click.option("--ckpt-replicas", type=click.IntRange(min=0), default=1, show_default=True,
              help="Peer copies of staged checkpoints this node keeps (the job's flag).")
@click.option("--master-port", type=click.IntRange(1, 65535), default=29500, show_default=True,
              help="Port the job's store will bind on this node.")
@click.option("--rdzv-endpoint", callback=_endpoint, metavar="HOST[:PORT]",
              help="The job's rendezvous endpoint: resolved, dialled, and bindable if it is here.")
@click.option("--nproc", type=click.IntRange(min=1),
              help="Ranks in the smoke test  [default: GPUs torch sees, else 2]")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=60.0,
              show_default=True, help="Seconds the smoke test may take.")
@click.option("--no-smoke", is_flag=True, help="Skip the smoke test (starts no processes).")
def doctor(as_json, staging_gib, ckpt_replicas, master_port, rdzv_endpoint, nproc, timeout,
           no_smoke) -> int:
    """Check this node before a job runs here.

    \b
    Exit codes: 0 healthy (warnings allowed), 1 an environment or configuration problem,
    2 usage error, 3 do not requeue here (a GPU to drain, or the smoke test failed on GPUs).
    """
    with _stdout_to_stderr():  # NCCL, torch and children print: stdout stays ours
        checks = check_gpus()
        gpus = sum(c.name.startswith("GPU ") for c in checks)
        torch_rows, cuda_devices = check_torch(gpus)
        checks += torch_rows
        if cuda_devices and nproc and nproc > cuda_devices:
            raise click.UsageError(f"--nproc {nproc} is more than the {cuda_devices} GPU(s) torch "
                                   f"sees (one per rank); use --nproc {cuda_devices} or fewer")
        checks.append(check_shm(staging_gib, replicas=ckpt_replicas))
        port = check_port("master port", "0.0.0.0", master_port, "pick another --master-port")
        checks += [port] if port is not None else []
        if rdzv_endpoint:
            checks += check_rdzv(*rdzv_endpoint)
        if not no_smoke:
            checks.append(smoke_test(nproc or cuda_devices or 2, cuda_devices > 0, timeout))
    code = exit_code(checks)
    if as_json:
        print(json.dumps({"healthy": code == exit_codes.OK, "exit_code": code,
                          "checks": [{k: v for k, v in asdict(c).items() if k != "hardware"}
                                     for c in checks]}))
    else:
        _print_table(checks, code)
    return code


def _print_table(checks: list[Check], code: int) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table("check", "status", "detail", title="ftlaunch doctor")
    for c in checks:
        colour = COLOURS.get(c.status, "white")
        table.add_row(c.name, f"[{colour}]{c.status}[/]", c.detail)
    console = Console()
    console.print(table)
    verdict = {exit_codes.OK: "[green]healthy[/]",
               exit_codes.JOB_FAILED: "[red]not ready: fix the failed checks[/]",
               exit_codes.DO_NOT_REQUEUE: "[bold red]unhealthy hardware: do not run jobs here[/]"}
    console.print(f"{verdict[code]} (exit {code})")


@contextlib.contextmanager
def _stdout_to_stderr():
    """Point fd 1 at stderr meanwhile, so --json output is the only thing on stdout."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def main(argv: list[str]) -> int:
    """``ftlaunch doctor ARGS``: the exit code; usage errors as one line on stderr."""
    try:
        return doctor.main(argv, prog_name="ftlaunch doctor", standalone_mode=False)
    except click.ClickException as e:
        message = e.format_message().rstrip(".").replace("\n", " ")
        print(f"ftlaunch doctor: error: {message}; see ftlaunch doctor --help", file=sys.stderr)
        return exit_codes.USAGE
    except click.exceptions.Abort:  # Ctrl-C: the smoke test's ranks are already gone
        return exit_codes.SIGNAL_BASE + signal.SIGINT
