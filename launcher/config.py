"""The one launch configuration: every CLI flag, env var, YAML key and default comes from here.

Precedence is CLI > environment (``PET_*`` for torchrun's flags, ``FTLAUNCH_*`` for ours) >
config file > what SLURM or Kubernetes tell the process (``cluster_env``) > default. ``cli.py`` builds the click options from these fields, and
``load_config_file`` accepts exactly these names as YAML keys.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from launcher import UsageError
from launcher.rank_template import DEFAULT_PRELOAD
from launcher.recovery import RESTART_POLICIES

TORCHRUN = "torchrun-compatible options"
RECOVERY = "fault tolerance"
GENERAL = "ftlaunch"

"""The recovery ladder, cheapest first; a recovery that makes no progress escalates one rung."""
STACK_DUMPS = ("auto", "py-spy", "faulthandler", "off")
RDZV_BACKENDS = ("static", "c10d", "etcd", "etcd-v2", "ftlaunch")
START_METHODS = ("spawn", "fork", "forkserver")


class StreamMode(NamedTuple):
    """Where one rank stream goes."""

    file: bool
    console: bool


def _opt(default: Any, help: str, *, group: str = TORCHRUN, short: str | None = None,
         choices: tuple[str, ...] | None = None) -> Any:
    meta = {"help": help, "group": group, "short": short, "choices": choices}
    return field(default=default, metadata=meta)


@dataclass
class LaunchConfig:
    """Everything a launch needs besides the script and its arguments."""

    # --- torchrun's flags, same names, same meaning ---------------------------------------
    nnodes: str = _opt("1:1", "Number of nodes, or MIN:MAX for an elastic job.")
    nproc_per_node: str = _opt("1", "Ranks per node: an integer, 'cpu', 'gpu' or 'auto'.")
    standalone: bool = _opt(False, "Single-node job: run the coordinator in this agent on a free port.")
    rdzv_backend: str = _opt("static", "Rendezvous backend; every value is served by ftlaunch's own "
                             "ZeroMQ rendezvous.", choices=RDZV_BACKENDS)
    rdzv_endpoint: str = _opt("", "Coordinator endpoint HOST[:PORT].")
    rdzv_id: str = _opt("none", "Job id shared by all nodes of one job.")
    rdzv_conf: str = _opt("", "Extra rendezvous settings KEY=VALUE,... (e.g. timeout=900).")
    node_rank: int = _opt(0, "Rank of this node (static rendezvous).")
    master_addr: str = _opt("127.0.0.1", "Address of the node hosting torch's key-value store.")
    master_port: int = _opt(0, "Port of torch's key-value store; 0 picks a free port per attempt.")
    local_addr: str | None = _opt(None, "Address other nodes use to reach this one.")
    max_restarts: int = _opt(3, "Restarts before the job fails (torchrun's default is 0, which "
                             "never recovers).")
    monitor_interval: float = _opt(0.1, "Accepted for compatibility: ftlaunch reacts to rank exits "
                                   "at once instead of polling.")
    start_method: str = _opt("forkserver", "How ranks start: 'forkserver' (or 'fork') forks "
                             "each from the node's rank template, which imported --preload "
                             "once; 'spawn' starts each as a fresh interpreter (for scripts "
                             "that must not inherit preloaded modules).", choices=START_METHODS)
    role: str = _opt("default", "Role name given to the ranks (ROLE_NAME).")
    module: bool = _opt(False, "Run the script as a module: python -m SCRIPT.", short="-m")
    no_python: bool = _opt(False, "Run SCRIPT as an executable instead of a Python file.")
    run_path: bool = _opt(False, "Run SCRIPT by path with runpy, as torchrun does.")
    log_dir: str | None = _opt(None, "Directory for per-rank logs and error files.")
    redirects: str = _opt("0", "Send rank output to files only: 0 none, 1 stdout, 2 stderr, "
                          "3 both; or per local rank, e.g. 0:1,1:2.", short="-r")
    tee: str = _opt("0", "Send rank output to files and the console (same format as "
                    "--redirects).", short="-t")
    local_ranks_filter: str = _opt("", "Show console output only for these local ranks, e.g. 0,2.")
    signals_to_handle: str = _opt("SIGTERM,SIGINT,SIGHUP,SIGQUIT", "Signals forwarded to ranks.")

    # --- ftlaunch's own ------------------------------------------------------------------
    restart_policy: str = _opt("rank", "First rung of the recovery ladder: 'rank' replaces only "
                               "failed ranks (survivors using trainer_shim re-enter in place), "
                               "'job' replaces every rank with forks of the rank template, "
                               "'cold' starts fresh interpreters.", group=RECOVERY, choices=RESTART_POLICIES)
    max_stalled_recoveries: int = _opt(3, "Recoveries in a row without a new step (reported by "
                                       "trainer_shim.heartbeat) before the job stops with exit "
                                       "code 3, do not requeue; 0 = never.", group=RECOVERY)
    no_warm_pool: bool = _opt(False, "Start every rank as a fresh interpreter, never forked "
                              "from the rank template (as --start-method spawn).",
                              group=RECOVERY)
    preload: str = _opt(DEFAULT_PRELOAD, "Modules the rank template imports once, before it "
                        "forks the ranks.", group=RECOVERY)
    ckpt_replicas: int = _opt(1, "Peer nodes that keep a copy of each node's staged "
                              "checkpoint shards in their shared memory: a lost node's ranks "
                              "then restore from a peer's memory, not storage; 0 = none "
                              "(fewer when the job has fewer other nodes).", group=RECOVERY)
    replica_bandwidth: float = _opt(0.0, "MB/s a node spends at most on copying peers' "
                                    "checkpoint shards (0 = no cap); restores are not capped.",
                                    group=RECOVERY)
    hang_timeout: float = _opt(300.0, "Seconds without a trainer_shim heartbeat before a rank "
                               "is declared hung; 0 = never.", group=RECOVERY)
    hang_timeout_factor: float = _opt(0.0, "When > 0, learn the hang timeout: this factor times "
                                      "the longest heartbeat interval seen (after 20 beats, at "
                                      "least 1 s, at most --hang-timeout).", group=RECOVERY)
    startup_timeout: float = _opt(600.0, "Seconds from a rank's start to its first heartbeat, "
                                  "for ranks using trainer_shim; 0 = never.", group=RECOVERY)
    section_timeouts: str = _opt("", "Per-section timeouts NAME=SECONDS,... for "
                                 "trainer_shim.section(NAME); while one is open it replaces "
                                 "--hang-timeout.", group=RECOVERY)
    stack_dump: str = _opt("auto", "How a hung rank's stacks are captured before it is killed "
                           "(auto: py-spy if installed, else faulthandler).", group=RECOVERY,
                           choices=STACK_DUMPS)
    health_interval: float = _opt(5.0, "Seconds between GPU health readings through NVML (ECC, "
                                  "row remapping, XIDs, recovery action, NVLink, slowdowns); "
                                  "0 = off. No GPU: off by itself.", group=RECOVERY)
    gpu_release_timeout: float = _opt(10.0, "Seconds to wait for dead ranks' GPU memory to be "
                                      "released before their replacements start.",
                                      group=RECOVERY)
    restart_backoff: float = _opt(1.0, "Seconds to wait before restarting after the 2nd "
                                  "failure in a row, doubling with each further one; failures "
                                  "in a row are those with no healthy training in between (no "
                                  "new best step; without trainer_shim, ranks up less than "
                                  "--healthy-interval). The 1st is restarted at once.",
                                  group=RECOVERY)
    restart_backoff_max: float = _opt(30.0, "Longest wait between restarts, seconds.",
                                      group=RECOVERY)
    healthy_interval: float = _opt(20.0, "Seconds ranks must stay up for a failure to count as "
                                   "the first after healthy training (restarted at once, the "
                                   "backoff reset) when trainer_shim reports no steps.",
                                   group=RECOVERY)
    grace_period: float = _opt(60.0, "Seconds ranks get to exit after a forwarded signal before "
                               "SIGKILL.", group=RECOVERY)
    stop_timeout: float = _opt(2.0, "Seconds survivors get to exit when a recovery stops them.",
                               group=RECOVERY)
    exit_barrier_timeout: float = _opt(300.0, "Seconds a finished node waits for the others.",
                                       group=RECOVERY)
    node_timeout: float = _opt(5.0, "Seconds of silence after which a node, or the "
                               "coordinator, is declared lost.", group=RECOVERY)
    heartbeat_interval: float = _opt(0.5, "Seconds between control-plane heartbeats.",
                                     group=RECOVERY)
    intakes: int = _opt(0, "Processes that serve this node's coordinator ports beside its "
                        "agent (the rendezvous endpoint should it host the job, its standby "
                        "port should it take over): they verify what thousands of agents "
                        "send and sign the answers (see docs/scale.md); 0 = the agent alone, "
                        "as a job of fewer than ~4,096 nodes needs.", group=RECOVERY)
    secret_file: str | None = _opt(None, "File holding the job's control-plane secret (or set "
                                   "FTLAUNCH_SECRET); single-node jobs generate one.",
                                   group=GENERAL)
    config: str | None = _opt(None, "YAML file with any of these options (CLI and env win).",
                              group=GENERAL)
    metrics_port: int = _opt(0, "Serve this node's Prometheus metrics on this port (0: off; "
                             "needs the extra ftlaunch[metrics]).", group=GENERAL)
    dry_run: bool = _opt(False, "Print the resolved launch as one JSON object (every setting "
                         "and where it came from: flag, env, file, SLURM, Kubernetes, "
                         "default) and exit 0, starting nothing.", group=GENERAL)

    # --- derived views, each a pure parse of one field ------------------------------------

    def node_range(self) -> tuple[int, int]:
        """``--nnodes`` as (min, max)."""
        text = self.nnodes.strip()
        lo, sep, hi = text.partition(":")
        try:
            result = (int(lo), int(hi) if sep else int(lo))
        except ValueError:
            raise UsageError(f"--nnodes {self.nnodes!r} is not N or MIN:MAX; use e.g. 2 or 1:4") from None
        if result[0] < 1 or result[1] < result[0]:
            raise UsageError(f"--nnodes {self.nnodes!r} needs 1 <= MIN <= MAX; use e.g. 2 or 1:4")
        return result

    def local_world_size(self, gpu_count: int | None = None) -> int:
        """``--nproc-per-node`` as a number; ``gpu_count`` is asked for only when needed."""
        value = self.nproc_per_node.strip()
        if value == "cpu":
            return os.cpu_count() or 1
        if value in ("gpu", "auto"):
            gpus = gpu_count if gpu_count is not None else _count_gpus()
            if gpus > 0:
                return gpus
            if value == "gpu":
                raise UsageError("--nproc-per-node gpu: no GPU found; use a number or 'cpu'")
            return os.cpu_count() or 1
        try:
            n = int(value)
        except ValueError:
            n = 0
        if n < 1:
            raise UsageError(f"--nproc-per-node {self.nproc_per_node!r} is not a positive "
                             "integer, 'cpu', 'gpu' or 'auto'")
        return n

    def stream_modes(self, local_world_size: int) -> dict[int, tuple[StreamMode, StreamMode]]:
        """Per local rank: where (stdout, stderr) go. Redirect = file only; tee = file + console."""
        redirect = _parse_std(self.redirects, "--redirects", local_world_size)
        tee = _parse_std(self.tee, "--tee", local_world_size)

        def mode(r: int, bit: int) -> StreamMode:
            return StreamMode(file=bool((redirect[r] | tee[r]) & bit),
                              console=bool(tee[r] & bit) or not redirect[r] & bit)
        return {r: (mode(r, 1), mode(r, 2)) for r in range(local_world_size)}

    def console_ranks(self, local_world_size: int) -> set[int]:
        """Local ranks whose output reaches the console (``--local-ranks-filter``)."""
        if not self.local_ranks_filter.strip():
            return set(range(local_world_size))
        try:
            ranks = {int(x) for x in self.local_ranks_filter.split(",") if x.strip()}
        except ValueError:
            raise UsageError(f"--local-ranks-filter {self.local_ranks_filter!r} is not a "
                             "comma-separated list of local ranks; use e.g. 0,2") from None
        bad = sorted(r for r in ranks if not 0 <= r < local_world_size)
        if bad:
            raise UsageError(f"--local-ranks-filter names local rank {bad[0]} but there are "
                             f"{local_world_size}; use ranks 0..{local_world_size - 1}")
        return ranks

    def signals(self) -> list[signal.Signals]:
        """``--signals-to-handle`` as signal objects."""
        result: list[signal.Signals] = []
        for name in (s.strip() for s in self.signals_to_handle.split(",") if s.strip()):
            try:
                sig = signal.Signals[name if name.startswith("SIG") else "SIG" + name]
            except KeyError:
                raise UsageError(f"--signals-to-handle: unknown signal {name!r}; use names "
                                 "like SIGTERM,SIGUSR1") from None
            if sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD):
                raise UsageError(f"--signals-to-handle: {sig.name} cannot be handled; remove it")
            result.append(sig)
        return result

    def section_timeout_map(self) -> dict[str, float]:
        """``--section-timeouts`` as {name: seconds}."""
        result = {}
        for item in (s.strip() for s in self.section_timeouts.split(",") if s.strip()):
            name, sep, value = item.partition("=")
            try:
                seconds = float(value) if sep and name.strip() else -1.0
            except ValueError:
                seconds = -1.0
            if seconds <= 0:
                raise UsageError(f"--section-timeouts item {item!r} is not NAME=SECONDS with "
                                 "SECONDS > 0; use e.g. step=60,checkpoint=900")
            result[name.strip()] = seconds
        return result

    def forks_ranks(self) -> bool:
        """Whether ranks are forked from the rank template (else fresh interpreters)."""
        return not (self.no_warm_pool or self.no_python or self.start_method == "spawn")

    def preload_modules(self) -> list[str]:
        return [m.strip() for m in self.preload.split(",") if m.strip()]

    def rdzv_settings(self) -> dict[str, str]:
        """``--rdzv-conf`` as a dict."""
        settings = {}
        for item in (s.strip() for s in self.rdzv_conf.split(",") if s.strip()):
            key, sep, value = item.partition("=")
            if not sep or not key.strip():
                raise UsageError(f"--rdzv-conf item {item!r} is not KEY=VALUE; use e.g. "
                                 "timeout=900,join_timeout=60")
            settings[key.strip()] = value.strip()
        return settings

    def rdzv_timeouts(self) -> tuple[float, float]:
        """(last_call_timeout, join_timeout) seconds from ``--rdzv-conf``, with defaults."""
        settings = self.rdzv_settings()
        result = []
        for key, default in (("last_call_timeout", 1.0), ("join_timeout", 600.0)):
            value = settings.get(key, default)
            try:
                seconds = float(value)
            except ValueError:
                seconds = -1.0
            if seconds < 0:
                raise UsageError(f"--rdzv-conf {key}={value!r} is not a number of seconds")
            result.append(seconds)
        return result[0], result[1]

    def single_node(self) -> bool:
        """No other node to wait for: the coordinator is this agent's, on a free port."""
        return self.standalone or (self.node_range()[1] == 1 and not self.rdzv_endpoint)

    def coordinator_endpoint(self) -> tuple[str, int] | None:
        """Where the nodes meet: ``--rdzv-endpoint``, else torchrun's static form's
        ``--master-addr``/``--master-port`` (29400 when 0); None for a single node."""
        if self.single_node():
            return None
        return self.rdzv_endpoint_parts() or (self.master_addr, self.master_port or 29400)

    def rdzv_endpoint_parts(self, default_port: int = 29400) -> tuple[str, int] | None:
        """``--rdzv-endpoint HOST[:PORT]`` as (host, port), or None when not given."""
        text = self.rdzv_endpoint.strip()
        if not text:
            return None
        host, sep, port = text.rpartition(":") if text.count(":") == 1 or text.startswith("[") \
            else ("", "", "")
        host = (host or text).strip("[]")
        try:
            number = int(port) if sep else default_port
        except ValueError:
            number = -1
        if not host or not 0 <= number <= 65535:
            raise UsageError(f"--rdzv-endpoint {self.rdzv_endpoint!r} is not HOST[:PORT]; use "
                             "e.g. node0:29400")
        return host, number

    def validate(self) -> None:
        """Fail early, with one line, on anything a later step would trip over."""
        self.node_range()
        n = self.local_world_size(gpu_count=1)  # GPUs are counted later, only if asked for
        self.stream_modes(n)
        self.console_ranks(n)
        self.signals()
        self.rdzv_settings()
        self.rdzv_endpoint_parts()
        if self.module and self.no_python:
            raise UsageError("--module and --no-python cannot be used together; drop one")
        self.section_timeout_map()
        for name in ("max_restarts", "node_rank", "master_port", "max_stalled_recoveries",
                     "ckpt_replicas", "replica_bandwidth", "intakes"):
            if getattr(self, name) < 0:
                raise UsageError(f"--{name.replace('_', '-')} must be >= 0")
        if self.intakes > 255:
            raise UsageError(f"--intakes {self.intakes}: at most 255; use about one a core "
                             "the coordinator's node can spare")
        if self.master_port > 65535:
            raise UsageError(f"--master-port {self.master_port} is not a TCP port; use 1..65535 or 0")
        if self.heartbeat_interval <= 0 or self.node_timeout <= self.heartbeat_interval:
            raise UsageError("--node-timeout must exceed --heartbeat-interval, which must be > 0")
        self.rdzv_timeouts()
        for name in ("restart_backoff", "restart_backoff_max", "healthy_interval", "grace_period",
                     "stop_timeout",
                     "exit_barrier_timeout", "monitor_interval", "hang_timeout",
                     "hang_timeout_factor", "startup_timeout", "health_interval",
                     "gpu_release_timeout"):
            if getattr(self, name) < 0:
                raise UsageError(f"--{name.replace('_', '-')} must be >= 0 seconds")
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise UsageError(f"--{f.name.replace('_', '-')} {getattr(self, f.name)!r} is not "
                                 f"one of {', '.join(choices)}")


def env_var(name: str) -> str:
    """Environment variable for a field: torchrun's ``PET_*`` for its flags, ``FTLAUNCH_*`` else."""
    f = FIELDS[name]
    prefix = "PET_" if f.metadata["group"] == TORCHRUN else "FTLAUNCH_"
    return prefix + name.upper()


FIELDS = {f.name: f for f in dataclasses.fields(LaunchConfig)}


def load_config_file(path: str) -> dict[str, Any]:
    """Read a YAML config file into checked field values; unknown keys and wrong types fail."""
    import yaml

    try:
        text = Path(path).read_text()
    except OSError as e:
        raise UsageError(f"config file {path}: {e.strerror}; pass an existing YAML file to "
                         "--config") from None
    try:
        data = yaml.load(text, Loader=_yaml_loader())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise UsageError(f"config file {path}: invalid YAML{where}; fix the syntax") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(f"config file {path}: top level must be a mapping of option: value")
    values = {}
    for raw_key, value in data.items():
        key = str(raw_key).replace("-", "_")
        if key == "config":
            raise UsageError(f"config file {path}: 'config' cannot name another file; pass "
                             "--config on the command line or in FTLAUNCH_CONFIG")
        if key not in FIELDS:
            close = difflib.get_close_matches(key, [k for k in FIELDS if k != "config"], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else "; see 'ftlaunch --help'"
            raise UsageError(f"config file {path}: unknown key {raw_key!r}{hint}")
        values[key] = _coerce(key, value, f"config file {path}: {raw_key}")
    return values


def _coerce(name: str, value: Any, where: str) -> Any:
    """Check a file value against the field's type (str fields accept numbers, as YAML reads 4)."""
    default = FIELDS[name].default
    kind = type(default) if default is not None else str
    if value is None and default is None:
        return None
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    else:
        ok = isinstance(value, (str, int)) and not isinstance(value, bool)
        value = str(value) if ok else value
    if not ok:
        raise UsageError(f"{where} must be a {kind.__name__}, got {value!r}")
    return value


def _yaml_loader() -> type:
    """YAML's safe loader without YAML 1.1's base-60 numbers, so ``nnodes: 1:4`` stays text."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    number_tags = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")
    Loader.yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in resolvers if tag not in number_tags]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    Loader.add_implicit_resolver(number_tags[0], re.compile(r"^[-+]?[0-9]+$"), list("-+0123456789"))
    Loader.add_implicit_resolver(number_tags[1], re.compile(
        r"^[-+]?([0-9]+\.[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?$"), list("-+0123456789."))
    return Loader


def _parse_std(spec: str, flag: str, local_world_size: int) -> dict[int, int]:
    """torchrun's Std format: one digit for all ranks, or LOCAL_RANK:DIGIT,..."""
    spec = spec.strip()
    error = UsageError(f"{flag} {spec!r} is not 0-3 or LOCAL_RANK:0-3,...; use e.g. 3 or 0:1,1:2")
    if ":" not in spec:
        if spec not in ("0", "1", "2", "3"):
            raise error
        return dict.fromkeys(range(local_world_size), int(spec))
    modes = dict.fromkeys(range(local_world_size), 0)
    for item in spec.split(","):
        rank, _, digit = item.partition(":")
        if not rank.strip().isdigit() or digit.strip() not in ("0", "1", "2", "3"):
            raise error
        modes[int(rank)] = int(digit)
    return modes


def _count_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:
        return 0
