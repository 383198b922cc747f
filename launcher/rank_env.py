"""The environment and command line of each rank: torchrun's variables, same names and meaning."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from ftlaunch_contract import environment


@dataclass(frozen=True, kw_only=True)
class Attempt:
    """One start of this node's ranks: what the rendezvous round decided."""

    run_id: str
    role: str
    group_rank: int
    group_world_size: int
    rank_offset: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int
    restart_count: int
    max_restarts: int
    signals_to_handle: str = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


def rank_env(attempt: Attempt, local_rank: int, error_file: str,
             base: dict[str, str] | None = None) -> dict[str, str]:
    """The full environment for ``local_rank``: the agent's own plus torchrun's variables."""
    env = dict(os.environ if base is None else base)
    rank = attempt.rank_offset + local_rank
    env.update({
        "LOCAL_RANK": str(local_rank),
        "RANK": str(rank),
        "GROUP_RANK": str(attempt.group_rank),
        "ROLE_RANK": str(rank),
        "ROLE_NAME": attempt.role,
        "LOCAL_WORLD_SIZE": str(attempt.local_world_size),
        "WORLD_SIZE": str(attempt.world_size),
        "GROUP_WORLD_SIZE": str(attempt.group_world_size),
        "ROLE_WORLD_SIZE": str(attempt.world_size),
        "MASTER_ADDR": attempt.master_addr,
        "MASTER_PORT": str(attempt.master_port),
        "TORCHELASTIC_RESTART_COUNT": str(attempt.restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(attempt.max_restarts),
        "TORCHELASTIC_RUN_ID": attempt.run_id,
        # The agent holds torch's store, so ranks connect as clients and never host it.
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_ERROR_FILE": error_file,
        "TORCHELASTIC_SIGNALS_TO_HANDLE": attempt.signals_to_handle,
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        environment.RUN_ID: attempt.run_id,  # tells trainer_shim it is managed
    })
    env.update(pre_import_env(attempt.local_world_size, env))
    return env


def pre_import_env(local_world_size: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """The agent's environment plus what a rank's imports already read (the rank template's)."""
    env = dict(os.environ if base is None else base)
    if local_world_size > 1:
        env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: ranks must not oversubscribe cores
    return env


def rank_command(script: str, script_args: list[str], *, module: bool = False,
                 no_python: bool = False) -> list[str]:
    """argv of a rank, as torchrun builds it (``python -u script`` unless told otherwise)."""
    if no_python:
        return [script, *script_args]
    python = os.environ.get("PYTHON_EXEC", sys.executable)
    if module:
        return [python, "-u", "-m", script, *script_args]
    return [python, "-u", script, *script_args]
