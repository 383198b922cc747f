"""Reads GPU health off the training path and wakes the agent's loop when something is found.

A daemon thread polls the backend every ``interval`` seconds (NVML calls can block for
milliseconds; the agent's loop must not), assesses each GPU against its previous reading,
and queues findings behind a pipe the agent polls. The latest readings stay available for
the agent's one blocking question: is a dead rank's GPU memory released yet?
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading

from launcher.gpu_health import Backend, Finding, NoGpu, Sample, assess, open_backend

log = logging.getLogger("ftlaunch.health")


class HealthMonitor:
    def __init__(self, backend: Backend, interval: float):
        self._backend = backend
        self._interval = interval
        self._findings: queue.Queue[Finding] = queue.Queue()
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.samples: list[Sample] = []
        self.versions = (backend.driver_version(), backend.cuda_version())
        self._poll()  # a GPU already bad at start is found before any rank runs on it
        self._thread = threading.Thread(target=self._run, name="ftlaunch-health", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, interval: float) -> tuple[HealthMonitor | None, str]:
        """A running monitor, or None and why not (no GPU is a normal case)."""
        if interval <= 0:
            return None, "GPU health monitoring off (--health-interval 0)"
        try:
            backend = open_backend()
        except NoGpu as e:
            return None, f"{e}: GPU health monitoring off"
        except Exception as e:  # e.g. a GPU lost before we started: say so, train anyway
            return None, f"GPU health monitoring could not start: {type(e).__name__}: {e}"
        monitor = cls(backend, interval)
        return monitor, (f"watching {len(monitor.samples)} GPU(s) every {interval:g}s "
                         f"(driver {monitor.versions[0]}, CUDA {monitor.versions[1]})")

    @property
    def fd(self) -> int:
        return self._read_fd

    def findings(self) -> list[Finding]:
        """What was found since the last call (the agent calls it when ``fd`` is readable)."""
        with contextlib.suppress(BlockingIOError):
            os.read(self._read_fd, 4096)
        found = []
        while True:
            try:
                found.append(self._findings.get_nowait())
            except queue.Empty:
                return found

    def processes(self) -> set[int]:
        """Pids holding GPU memory at the last reading."""
        with self._lock:
            return {pid for s in self.samples for pid in s.pids}

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._poll()

    def read_now(self) -> None:
        """Read at once (the agent asks while it waits for GPU memory to be released)."""
        self._poll()

    def _poll(self) -> None:
        with self._lock:
            try:
                current = self._backend.samples()
            except Exception as e:  # a monitoring hiccup must never take the job down
                log.warning("reading GPU health failed: %s", e)
                return
            before = {s.index: s for s in self.samples}
            self.samples = current
        found = [f for s in current for f in assess(before.get(s.index), s)]
        for finding in found:
            self._findings.put(finding)
        if found:
            os.write(self._write_fd, b"!")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._backend.close()
        os.close(self._read_fd)
        os.close(self._write_fd)
