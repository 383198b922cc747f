"""GPU health: what NVML says about each GPU, and what that means for the job.

``Sample`` is one reading of one GPU; ``assess`` (pure) turns the previous and the current
reading into findings, each with a severity:

- ``warn``: logged as an event (thermal/power slowdown, NVLink error counters growing,
  an XID that is usually the application's own fault);
- ``drain``: the node should take no new work (a row remap pending a reset, the driver
  asking for a GPU reset): the job goes on, and when the job ends or recovers this node
  leaves it, with exit code 3 so the scheduler does not put work here again;
- ``fatal``: act now (the GPU fell off the bus, uncorrectable ECC errors, a failed row
  remap, the driver asking for a node reboot): stop this node's ranks, exclude the node,
  the job recovers on the others.

Backends (``open_backend``): the real one reads NVML through ``nvidia-ml-py``; the fake one
(``FTLAUNCH_FAKE_NVML=scenario.json``, for tests on machines without a GPU) replays a
scenario behind the same interface. No GPU is a normal case: ``NoGpu``.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Protocol

FAKE_ENV = "FTLAUNCH_FAKE_NVML"

FATAL_XIDS = {48: "double-bit ECC error", 79: "GPU fell off the bus",
              95: "uncontained ECC error", 119: "GSP RPC timeout", 120: "GSP error"}
DRAIN_XIDS = {63: "row remap pending (ECC)", 64: "row remap failure", 74: "NVLink error",
              92: "high single-bit ECC rate", 94: "contained ECC error"}
"""Critical XIDs by what they demand (NVIDIA's XID catalogue); any other is a warning."""

RECOVERY_ACTIONS = {1: ("drain", "the driver asks for a GPU reset"),
                    2: ("fatal", "the driver asks for a node reboot"),
                    3: ("drain", "the driver asks to drain peer-to-peer traffic"),
                    4: ("drain", "the driver asks to drain and reset the GPU")}
"""NVML_FI_DEV_GET_GPU_RECOVERY_ACTION values (0: none)."""



class Severity(StrEnum):
    """What a finding demands, mildest first (see above)."""

    WARN = "warn"
    DRAIN = "drain"
    FATAL = "fatal"


SEVERITIES = tuple(Severity)


class NoGpu(Exception):
    """No NVIDIA GPU (or driver) here: health monitoring stays off; CPU jobs are fine."""


@dataclass(frozen=True)
class Sample:
    """One reading of one GPU. Counters are cumulative; ``xids`` are those since the last."""

    index: int
    uuid: str = ""
    name: str = ""
    lost: bool = False
    ecc_uncorrected: int = 0  # volatile (since the last driver load)
    remap_pending: bool = False  # or, on older GPUs, retired pages pending
    remap_failed: bool = False
    recovery_action: int = 0
    nvlink_errors: int = 0  # summed over links and counters
    xids: tuple[int, ...] = ()
    slowdown: tuple[str, ...] = ()  # active thermal/power slowdown reasons
    memory_used: int = 0
    pids: tuple[int, ...] = ()  # compute processes on it


@dataclass(frozen=True)
class Finding:
    severity: Severity
    gpu: int
    kind: str
    detail: str

    def __str__(self) -> str:
        return f"GPU {self.gpu}: {self.detail} ({self.kind}, {self.severity})"


def assess(before: Sample | None, now: Sample) -> list[Finding]:
    """What changed for the worse between two readings of one GPU (pure)."""
    found: list[Finding] = []

    def add(severity: str, kind: str, detail: str) -> None:
        found.append(Finding(Severity(severity), now.index, kind, detail))

    was = before or Sample(now.index)
    if now.lost and not was.lost:
        add("fatal", "gpu_lost", "GPU is lost (fallen off the bus or not responding)")
    for xid in now.xids:
        if xid in FATAL_XIDS:
            add("fatal", "xid", f"XID {xid}: {FATAL_XIDS[xid]}")
        elif xid in DRAIN_XIDS:
            add("drain", "xid", f"XID {xid}: {DRAIN_XIDS[xid]}")
        else:
            add("warn", "xid", f"XID {xid}")
    if now.ecc_uncorrected > was.ecc_uncorrected:
        add("fatal", "ecc", f"{now.ecc_uncorrected - was.ecc_uncorrected} new uncorrectable "
            "ECC error(s)")
    if now.remap_failed and not was.remap_failed:
        add("fatal", "remapped_rows", "row remapping failed: the memory cannot be repaired")
    elif now.remap_pending and not was.remap_pending:
        add("drain", "remapped_rows", "row remap pending: needs a GPU reset")
    if now.recovery_action and now.recovery_action != was.recovery_action:
        severity, detail = RECOVERY_ACTIONS.get(now.recovery_action,
                                                ("drain", f"recovery action {now.recovery_action}"))
        add(severity, "recovery_action", detail)
    if now.nvlink_errors > was.nvlink_errors:
        add("warn", "nvlink", f"NVLink error counters grew by {now.nvlink_errors - was.nvlink_errors}")
    for reason in sorted(set(now.slowdown) - set(was.slowdown)):
        add("warn", "slowdown", f"{reason} slowdown")
    return found


def worst(findings: list[Finding]) -> Severity | None:
    return max((f.severity for f in findings), key=SEVERITIES.index, default=None)


class Backend(Protocol):
    def driver_version(self) -> str: ...
    def cuda_version(self) -> str: ...
    def samples(self) -> list[Sample]: ...
    def close(self) -> None: ...


def open_backend() -> Backend:
    """The fake backend when ``FTLAUNCH_FAKE_NVML`` names a scenario, else NVML; raises
    NoGpu when there is no NVIDIA GPU or driver."""
    scenario = os.environ.get(FAKE_ENV)
    if scenario:
        return FakeNvml(scenario)
    return Nvml()


class Nvml:
    """NVML through nvidia-ml-py: counters polled, critical XID events drained each poll."""

    def __init__(self):
        try:
            import pynvml
        except ImportError:
            raise NoGpu("nvidia-ml-py is not installed") from None
        self._nvml = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            raise NoGpu(f"no NVIDIA GPU ({e})") from None
        try:
            count = pynvml.nvmlDeviceGetCount()
            if count == 0:
                raise NoGpu("NVML sees no GPU")
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        except BaseException:
            pynvml.nvmlShutdown()
            raise
        self._events = self._register_xid_events()

    def _register_xid_events(self):
        n = self._nvml
        try:
            events = n.nvmlEventSetCreate()
            for h in self._handles:
                n.nvmlDeviceRegisterEvents(h, n.nvmlEventTypeXidCriticalError, events)
            return events
        except n.NVMLError:
            return None  # not supported (e.g. in some containers): counters still polled

    def driver_version(self) -> str:
        return _text(self._nvml.nvmlSystemGetDriverVersion())

    def cuda_version(self) -> str:
        v = self._nvml.nvmlSystemGetCudaDriverVersion()
        return f"{v // 1000}.{v % 1000 // 10}"

    def samples(self) -> list[Sample]:
        xids = self._drain_xids()
        return [self._read(i, h, tuple(xids.get(i, ()))) for i, h in enumerate(self._handles)]

    def _drain_xids(self) -> dict[int, list[int]]:
        n, found = self._nvml, dict[int, list[int]]()
        while self._events is not None:
            try:
                data = n.nvmlEventSetWait_v2(self._events, 0)
            except n.NVMLError:  # timeout: nothing (more) pending
                break
            index = n.nvmlDeviceGetIndex(data.device)
            found.setdefault(index, []).append(int(data.eventData))
        return found

    def _read(self, index: int, h, xids: tuple[int, ...]) -> Sample:
        n = self._nvml

        def get(fn, *args, default=None):
            try:
                return fn(h, *args)
            except n.NVMLError_GpuIsLost:
                raise
            except n.NVMLError:
                return default  # not supported on this GPU or driver

        try:
            name = _text(n.nvmlDeviceGetName(h))
        except n.NVMLError_GpuIsLost:
            return Sample(index, lost=True, xids=xids)
        try:
            ecc = get(n.nvmlDeviceGetTotalEccErrors, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                      n.NVML_VOLATILE_ECC, default=0)
            remap = get(n.nvmlDeviceGetRemappedRows)  # (corr, uncorr, pending, failed)
            if remap is not None:
                pending, failed = bool(remap[2]), bool(remap[3])
            else:  # older GPUs retire pages instead
                pending = bool(get(n.nvmlDeviceGetRetiredPagesPendingStatus, default=0))
                failed = False
            action = self._field(h, getattr(n, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None))
            reasons = get(n.nvmlDeviceGetCurrentClocksThrottleReasons, default=0)
            memory = get(n.nvmlDeviceGetMemoryInfo)
            procs = get(n.nvmlDeviceGetComputeRunningProcesses, default=[])
            return Sample(index, _text(get(n.nvmlDeviceGetUUID, default="")), name, False,
                          int(ecc), pending, failed, int(action or 0), self._nvlink_errors(h),
                          xids, _slowdowns(n, reasons), memory.used if memory else 0,
                          tuple(p.pid for p in procs))
        except n.NVMLError_GpuIsLost:
            return Sample(index, name=name, lost=True, xids=xids)

    def _field(self, h, field_id: int | None) -> int | None:
        n = self._nvml
        if field_id is None:
            return None  # an nvidia-ml-py too old to name this field
        try:
            value = n.nvmlDeviceGetFieldValues(h, [field_id])[0]
        except n.NVMLError:
            return None
        return None if value.nvmlReturn != n.NVML_SUCCESS else int(value.value.uiVal)

    def _nvlink_errors(self, h) -> int:
        n, total = self._nvml, 0
        for link in range(getattr(n, "NVML_NVLINK_MAX_LINKS", 18)):
            for counter in (n.NVML_NVLINK_ERROR_DL_REPLAY, n.NVML_NVLINK_ERROR_DL_RECOVERY,
                            n.NVML_NVLINK_ERROR_DL_CRC_FLIT, n.NVML_NVLINK_ERROR_DL_CRC_DATA):
                try:
                    total += int(n.nvmlDeviceGetNvLinkErrorCounter(h, link, counter))
                except n.NVMLError:
                    break  # no such link (or no NVLink): the next link
        return total

    def close(self) -> None:
        if self._events is not None:
            self._nvml.nvmlEventSetFree(self._events)
        self._nvml.nvmlShutdown()


def _slowdowns(n, reasons: int) -> tuple[str, ...]:
    named = {"thermal (software)": getattr(n, "nvmlClocksThrottleReasonSwThermalSlowdown", 0),
             "thermal (hardware)": getattr(n, "nvmlClocksThrottleReasonHwThermalSlowdown", 0),
             "power brake (hardware)": getattr(n, "nvmlClocksThrottleReasonHwPowerBrakeSlowdown", 0),
             "power cap": getattr(n, "nvmlClocksThrottleReasonSwPowerCap", 0)}
    return tuple(name for name, bit in named.items() if bit and reasons & bit)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass
class FakeNvml:
    """Replays a scenario (tests only): ``{"gpus": N, "driver": "...", "cuda": "...",
    "events": [{"after": seconds, "gpu": i, "set": {Sample field: value}}]}``; an event
    applies once ``after`` seconds passed since the backend opened, or, with ``"when":
    PATH`` instead, once that file exists (a test injects a finding at a chosen moment).
    ``"gpus": 0`` acts as a machine without a GPU. ``xids`` in an event are reported once.
    ``"pids_file": PATH``: the pids listed there (one a line, read at every reading) hold
    memory on GPU 0, as a dead rank's do until its CUDA context is torn down."""

    path: str
    opened: float = field(default_factory=time.monotonic)

    def __post_init__(self):
        try:
            with open(self.path) as f:
                self._scenario = json.load(f)
        except (OSError, ValueError) as e:  # not NoGpu: a typo must not pass for "no GPU"
            raise RuntimeError(f"fake NVML scenario {self.path} unreadable: {e}") from None
        count = int(self._scenario.get("gpus", 1))
        if count == 0:
            raise NoGpu("no NVIDIA GPU (fake NVML: NVML Shared Library Not Found)")
        self._state = [Sample(i, f"GPU-fake-{i}", "Fake H200") for i in range(count)]
        self._pending = list(self._scenario.get("events", []))

    def driver_version(self) -> str:
        return self._scenario.get("driver", "565.57.01")

    def cuda_version(self) -> str:
        return self._scenario.get("cuda", "12.7")

    def samples(self) -> list[Sample]:
        elapsed = time.monotonic() - self.opened
        due = [e for e in self._pending if (os.path.exists(e["when"]) if "when" in e
                                            else e.get("after", 0) <= elapsed)]
        state = [replace(s, xids=()) for s in self._state]
        for event in due:
            self._pending.remove(event)
            changes = dict(event["set"])
            for key in ("xids", "slowdown", "pids"):
                if key in changes:
                    changes[key] = tuple(changes[key])
            gpu = event.get("gpu", 0)
            state[gpu] = replace(state[gpu], **changes)
        self._state = [replace(s, xids=()) for s in state]
        if "pids_file" in self._scenario:
            with contextlib.suppress(OSError), open(self._scenario["pids_file"]) as f:
                state[0] = replace(state[0], pids=tuple(int(x) for x in f.read().split()))
        return state

    def close(self) -> None:
        pass
