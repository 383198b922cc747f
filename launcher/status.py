"""``ftlaunch status``: what a running job is doing, asked of its coordinator.

The query is a control-plane message like any other, signed with the job's secret: no
other port, nothing unauthenticated. On the same node the agents' runtime records say where
the coordinator is and hold the key (files only their user can read); from anywhere else,
``--endpoint HOST:PORT`` and the job's secret (``FTLAUNCH_SECRET`` or ``--secret-file``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import click
import psutil
import zmq

from ftlaunch_contract.messages import JobStatus, StatusQuery
from ftlaunch_contract.protocol import Codec, ProtocolError
from launcher import UsageError, events, exit_codes, goodput


def runtime_dir() -> Path:
    return Path(os.environ.get("FTLAUNCH_RUNTIME_DIR") or f"/tmp/ftlaunch-{os.getuid()}")


class RuntimeRecord:
    """This agent's entry in the runtime directory: its run, where its coordinator is now,
    and the key to ask it. Rewritten when the coordinator moves, removed at exit."""

    def __init__(self, run_id: str, node_id: str, secret: bytes, events: Path):
        self._fields = {"run_id": run_id, "node_id": node_id, "pid": os.getpid(),
                        "secret": secret.hex(), "coordinator": "", "events": str(events)}
        self.path = runtime_dir() / f"{run_id}.{os.getpid()}.json"

    def publish(self, coordinator: str) -> None:
        if coordinator == self._fields["coordinator"]:
            return
        self._fields["coordinator"] = coordinator
        local_jobs()  # records of agents that were SIGKILLed go now, not only when asked
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(self._fields, f)
            os.replace(tmp, self.path)
        except OSError:
            pass  # status on this node is a convenience; the job runs without it

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def local_jobs() -> list[dict[str, Any]]:
    """The records of this node's running agents (stale ones, of dead agents, removed)."""
    found = []
    for path in sorted(runtime_dir().glob("*.json")):
        try:
            record = json.loads(path.read_text())
            alive = psutil.pid_exists(record["pid"])
        except (OSError, ValueError, KeyError):
            continue
        if alive and record.get("coordinator"):
            found.append(record)
        elif not alive:
            path.unlink(missing_ok=True)
    return found


def query(endpoint: str, key: bytes, timeout: float) -> JobStatus | None:
    """The coordinator's answer, or None when none came within ``timeout``."""
    codec = Codec(key)
    context: zmq.Context = zmq.Context.instance()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send_multipart(codec.encode(StatusQuery(), 0))
        while sock.poll(int(timeout * 1000)):
            try:
                reply = codec.decode(sock.recv_multipart())
            except ProtocolError:
                continue  # not signed with our key: not an answer to us
            if isinstance(reply.body, JobStatus):
                return reply.body
        return None
    finally:
        sock.close()


def as_dict(status: JobStatus) -> dict[str, Any]:
    out = status.payload()
    out["nodes"] = [n._asdict() for n in status.nodes]
    out["ranks"] = [r._asdict() for r in status.ranks]
    return out


def table(status: JobStatus) -> str:
    s = status
    lines = [f"run {s.run_id}: {'finished: ' + s.final if s.final else s.round_phase}, "
             f"coordinator {s.coordinator_node}, epoch {s.job_epoch}, restarts "
             f"{s.restart_count}/{s.max_restarts}, nodes {len(s.nodes)} "
             f"(min {s.min_nodes}, max {s.max_nodes}), committed step "
             f"{s.committed_step if s.committed_step >= 0 else 'none'}"]
    if s.last_cause:
        lines.append(f"last recovery: {s.last_cause}")
    for node in s.nodes:
        seen = f"{node.seen_ms_ago / 1000:.1f}s ago" if node.seen_ms_ago >= 0 else "never"
        rank = node.group_rank if node.group_rank >= 0 else "-"
        lines.append(f"  node {node.node_id}  group rank {rank}  {node.phase}  (heard {seen})")
        for r in s.ranks:
            if r.node_id == node.node_id:
                step = r.step if r.step >= 0 else "-"
                beat = f"{r.beat_age_ms / 1000:.2f}s ago" if r.beat_age_ms >= 0 else "none yet"
                lines.append(f"    rank {r.rank}  step {step}  heartbeat {beat}")
    return "\n".join(lines)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--endpoint", help="HOST:PORT of the job's coordinator (its --rdzv-endpoint), "
              "for a job not on this node; the secret from FTLAUNCH_SECRET or --secret-file.")
@click.option("--secret-file", type=click.Path(dir_okay=False), help="File holding the job "
              "secret (with --endpoint).")
@click.option("--rdzv-id", default="none", help="The job's --rdzv-id (with --endpoint, when the "
              "job has no secret: its key is derived from the id).")
@click.option("--run-id", help="Which of this node's jobs, when it runs several.")
@click.option("--json", "as_json", is_flag=True, help="Print the status as one JSON object.")
@click.option("--timeout", default=3.0, show_default=True, help="Seconds to wait for an answer.")
def status(endpoint: str | None, secret_file: str | None, rdzv_id: str, run_id: str | None,
           as_json: bool, timeout: float) -> None:
    """What every node and rank of a running job is doing."""
    if endpoint:
        from launcher.control_plane import job_secret

        host, _, port = endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise click.UsageError(f"--endpoint {endpoint}: give HOST:PORT")
        where, key = f"tcp://{host}:{port}", job_secret(secret_file, rdzv_id, False)
        log = None  # another node's job: its event logs are not here
    else:
        jobs = [j for j in local_jobs() if run_id in (None, j["run_id"])]
        if not jobs:
            raise click.ClickException(
                f"no running ftlaunch job{f' {run_id}' if run_id else ''} on this node (none "
                f"in {runtime_dir()}); for another node's, give --endpoint HOST:PORT")
        if len({j["run_id"] for j in jobs}) > 1:
            runs = ", ".join(sorted({j["run_id"] for j in jobs}))
            raise click.UsageError(f"this node runs several jobs ({runs}): pick one with --run-id")
        where, key = jobs[0]["coordinator"], bytes.fromhex(jobs[0]["secret"])
        log = Path(jobs[0].get("events", ""))
    answer = query(where, key, timeout)
    if answer is None:
        raise click.ClickException(f"no ftlaunch coordinator answered at {where} within "
                                   f"{timeout:g}s: is the job running, and is the secret its?")
    # This node's goodput so far, from its agent's event log.
    account = goodput.account(events.load(log)) if log and log.is_file() else None
    if as_json:
        print(json.dumps({**as_dict(answer), "goodput_here": account.as_dict() if account
                          else None}, indent=2))
    else:
        print(table(answer) + (f"\nthis node so far: {goodput.table(account)}" if account
                               else ""))


def main(argv: list[str]) -> int:
    try:
        status.main(argv, prog_name="ftlaunch status", standalone_mode=False)
    except click.ClickException as e:  # usage errors exit 2, no job to ask 1
        print(f"ftlaunch status: error: {e.format_message()}", file=sys.stderr)
        return e.exit_code
    except UsageError as e:  # an unreadable --secret-file
        print(f"ftlaunch status: error: {e}", file=sys.stderr)
        return exit_codes.USAGE
    return exit_codes.OK
