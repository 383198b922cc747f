"""What a node knows of its job before anything happens, derived once from the config: its
identity, where the coordinator is, what its ranks run, where their logs go."""

from __future__ import annotations

import os
import socket
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import zmq

from launcher.config import LaunchConfig
from launcher.control_plane import ControlPlane, job_secret, outgoing_addr
from launcher.coordinator import JobState
from launcher.hang_detection import HangTimeouts
from launcher.workers import OutputPlan, Program


@dataclass(frozen=True)
class NodePlan:
    config: LaunchConfig
    local_world_size: int
    min_nodes: int
    max_nodes: int
    run_id: str
    node_id: str
    endpoint: tuple[str, int] | None  # the coordinator's; None: ours, on a free local port
    addr: str  # where the other nodes reach this one
    rank_hint: int  # --node-rank in torchrun's static form, else -1
    last_call_timeout: float
    join_timeout: float
    secret: bytes
    log_dir: Path
    program: Program
    output: OutputPlan
    hang_timeouts: HangTimeouts

    @classmethod
    def from_config(cls, config: LaunchConfig, script: str, script_args: list[str]) -> NodePlan:
        local_world_size = config.local_world_size()
        min_nodes, max_nodes = config.node_range()
        single_node = max_nodes == 1 and not config.rdzv_endpoint
        run_id = str(uuid.uuid4()) if config.standalone or (
            single_node and config.rdzv_id == "none") else config.rdzv_id
        endpoint = config.coordinator_endpoint()
        addr = config.local_addr or (
            config.master_addr if endpoint is None else outgoing_addr(endpoint[0]))
        static_form = config.rdzv_backend == "static" and not config.rdzv_endpoint
        last_call_timeout, join_timeout = config.rdzv_timeouts()
        log_root = Path(config.log_dir) if config.log_dir else Path(tempfile.mkdtemp(prefix="ftlaunch_"))
        return cls(
            config, local_world_size, min_nodes, max_nodes, run_id,
            node_id=f"{socket.gethostname()}:{os.getpid()}", endpoint=endpoint, addr=addr,
            rank_hint=config.node_rank if static_form and endpoint else -1,
            last_call_timeout=last_call_timeout, join_timeout=join_timeout,
            secret=job_secret(config.secret_file, run_id, endpoint is None),
            log_dir=log_root / run_id,
            program=Program(script, script_args, config.module, config.no_python),
            output=OutputPlan(log_root / run_id, config.stream_modes(local_world_size),
                              config.console_ranks(local_world_size)),
            hang_timeouts=HangTimeouts(config.hang_timeout, config.startup_timeout,
                                       config.section_timeout_map(),
                                       config.hang_timeout_factor))

    @property
    def job_key(self) -> str:
        """What the agents of this job, and only they, share on any host: its run id and
        where its nodes meet (a re-created pod or a requeued node has both; another job
        with the same --rdzv-id meets elsewhere, and a standalone run's id is fresh)."""
        return self.run_id if self.endpoint is None else \
            f"{self.run_id}@{self.endpoint[0]}:{self.endpoint[1]}"

    def job_state(self) -> JobState:
        """A fresh coordinator state (every node derives the same)."""
        c = self.config
        return JobState(min_nodes=self.min_nodes, max_nodes=self.max_nodes,
                        max_restarts=c.max_restarts, policy=c.restart_policy,
                        backoff=c.restart_backoff, backoff_max=c.restart_backoff_max,
                        exit_barrier_timeout=c.exit_barrier_timeout,
                        node_timeout=c.node_timeout, last_call=self.last_call_timeout,
                        join_timeout=self.join_timeout, host_node=self.node_id,
                        max_stalled=c.max_stalled_recoveries, healthy_after=c.healthy_interval,
                        replicas=c.ckpt_replicas, run_id=self.run_id)

    def control_plane(self, context: zmq.Context, runtime_dir: str) -> ControlPlane:
        return ControlPlane(context, self.secret, self.node_id, self.addr, self.endpoint,
                            self.job_state, self.config.node_timeout,
                            self.config.heartbeat_interval, self.config.intakes, runtime_dir)

    def store_port(self) -> int:
        """Torch's store port for an attempt: the user's --master-port, or any."""
        return self.config.master_port if self.endpoint is None else 0
