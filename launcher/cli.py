"""The ``ftlaunch`` command: torchrun's command line, built from ``LaunchConfig``'s fields."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import socket
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import click

from launcher import UsageError, __version__, cluster_env, exit_codes
from launcher.config import (
    FIELDS,
    GENERAL,
    RECOVERY,
    TORCHRUN,
    LaunchConfig,
    env_var,
    load_config_file,
)
from launcher.init_process import become_init_if_pid1

HELP = """Run TRAINING_SCRIPT on this node's ranks and recover them when they fail.

Takes torchrun's flags with torchrun's meaning (dashed or underscored spellings, or PET_*
environment variables); every --rdzv-backend is served by ftlaunch's own rendezvous.
Precedence: command line > environment > --config file > default.

\b
Exit codes: 0 success, 1 failed after restarts, 2 usage error,
3 do not requeue (unhealthy hardware / no progress), 128+N stopped by signal N.
"""


class _Command(click.Command):
    """Lists options under torchrun's group and ftlaunch's, in field order."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        for group in (TORCHRUN, RECOVERY, GENERAL):
            rows = [r for p in self.get_params(ctx) if getattr(p, "group", GENERAL) == group
                    and (r := p.get_help_record(ctx)) is not None]
            if rows:
                with formatter.section(group[0].upper() + group[1:]):
                    formatter.write_dl(rows)


class _Option(click.Option):
    def __init__(self, *args, group: str = GENERAL, **kwargs):
        super().__init__(*args, **kwargs)
        self.group = group


def _option_for(f: dataclasses.Field) -> click.Option:
    names = [f"--{f.name.replace('_', '-')}"]
    if "_" in f.name:
        names.append(f"--{f.name}")
    if f.metadata["short"]:
        names.insert(0, f.metadata["short"])
    kind = type(f.default) if f.default is not None else str
    kwargs = {"help": f.metadata["help"], "envvar": env_var(f.name), "show_envvar": True,
              "group": f.metadata["group"]}
    if kind is bool:
        kwargs.update(is_flag=True, default=False)
    else:
        choices = f.metadata["choices"]
        kwargs.update(type=click.Choice(choices) if choices else kind, default=f.default,
                      show_default=f.default is not None)
    return _Option([*names, f.name], **kwargs)


def _build_command() -> click.Command:
    params: list[click.Parameter] = [_option_for(f) for f in dataclasses.fields(LaunchConfig)]
    params.append(click.Argument(["training_script"], metavar="TRAINING_SCRIPT"))
    params.append(click.Argument(["training_script_args"], nargs=-1, type=click.UNPROCESSED))
    return _Command(
        "ftlaunch", params=params, help=HELP,
        context_settings={"allow_interspersed_args": False, "help_option_names": ["-h", "--help"],
                          "max_content_width": 100},
    )


class Resolved(NamedTuple):
    """A launch as resolved from every source, and where each setting came from."""

    config: LaunchConfig
    script: str
    script_args: list[str]
    sources: dict[str, str]  # field -> "flag", "env PET_NNODES", "slurm SLURM_NNODES", ...
    cluster: cluster_env.Cluster


def resolve(argv: list[str], environ: Mapping[str, str] | None = None) -> Resolved:
    """Command line > environment > --config file > SLURM/Kubernetes > default; raises
    UsageError."""
    environ = os.environ if environ is None else environ
    command = _build_command()
    try:
        ctx = command.make_context("ftlaunch", list(argv))
    except click.UsageError as e:
        raise UsageError(e.format_message().replace("\n", " ")) from None
    values = ctx.params
    given = {name: ctx.get_parameter_source(name) for name in FIELDS}
    file_values = load_config_file(values["config"]) if values.get("config") else {}
    standalone = values["standalone"] or file_values.get("standalone", False)
    cluster = cluster_env.Cluster("") if standalone else _detect(environ)
    merged: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name in FIELDS:
        found = cluster.settings.get(name)
        if given[name] == click.core.ParameterSource.COMMANDLINE:
            merged[name], sources[name] = values[name], "flag"
        elif given[name] == click.core.ParameterSource.ENVIRONMENT:
            merged[name], sources[name] = values[name], f"env {env_var(name)}"
        elif found is not None and found.env_level:
            merged[name], sources[name] = found.value, f"env {found.source}"
        elif name in file_values:
            merged[name], sources[name] = file_values[name], f"file {values['config']}"
        elif found is not None:
            merged[name], sources[name] = found.value, f"{cluster.scheduler} {found.source}"
        else:
            merged[name], sources[name] = FIELDS[name].default, "default"
    try:
        config = LaunchConfig(**{k: _typed(k, v) for k, v in merged.items()})
    except ValueError as e:
        raise UsageError(str(e)) from None
    config.validate()
    script = values["training_script"]
    if not config.dry_run:
        _check_script(config, script)
    return Resolved(config, script, list(values["training_script_args"]), sources, cluster)


def parse_args(argv: list[str]) -> tuple[LaunchConfig, str, list[str]]:
    """Command line (+ env + config file + cluster) -> (config, script, script args)."""
    resolved = resolve(argv)
    return resolved.config, resolved.script, resolved.script_args


def _detect(environ: Mapping[str, str]) -> cluster_env.Cluster:
    hostname = socket.gethostname()
    fqdn = socket.getfqdn() if environ.get("JOB_COMPLETION_INDEX") is not None and \
        not environ.get("JOBSET_NAME") else hostname  # a DNS lookup: only where needed
    return cluster_env.detect(environ, hostname, fqdn)


def _typed(name: str, value: Any) -> Any:
    """A cluster's value in its field's type (node_rank is an int, nnodes text)."""
    default: Any = FIELDS[name].default
    if value is None or default is None or isinstance(value, type(default)):
        return value
    return type(default)(value)


def dry_run_report(r: Resolved) -> dict:
    """What ``--dry-run`` prints: the launch in torchrun's terms, and every setting's source."""
    c = r.config
    endpoint = c.coordinator_endpoint()
    lo, hi = c.node_range()
    static = c.rdzv_backend == "static" and not c.rdzv_endpoint and endpoint is not None
    return {
        "scheduler": r.cluster.scheduler or None,
        "scheduler_restart_count": r.cluster.restart_count,
        "torchrun": {
            "nnodes": c.nnodes, "nproc_per_node": c.nproc_per_node,
            "node_rank": c.node_rank if static else None,
            "rdzv_backend": c.rdzv_backend,
            "rdzv_endpoint": f"{endpoint[0]}:{endpoint[1]}" if endpoint else None,
            "rdzv_id": c.rdzv_id, "max_restarts": c.max_restarts,
            "master_addr": c.master_addr, "master_port": c.master_port,
            "standalone": c.standalone, "start_method": c.start_method},
        "nodes": {"min": lo, "max": hi, "single_node": c.single_node()},
        "script": r.script, "script_args": r.script_args,
        "settings": {name: {"value": getattr(c, name), "source": r.sources[name]}
                     for name in FIELDS},
    }


def _check_script(config: LaunchConfig, script: str) -> None:
    if config.module:
        return  # resolved by the rank's interpreter; a bad module fails the rank with a traceback
    if config.no_python:
        if shutil.which(script) is None:
            raise UsageError(f"executable {script!r} not found or not executable; give a path or a "
                             "command on PATH")
        return
    if not Path(script).is_file():
        raise UsageError(f"training script {script!r} not found; check the path (or use -m for a "
                         "module, --no-python for an executable)")


def main(argv: list[str] | None = None) -> None:
    """Console entry point: parse, run one agent, exit with a scheduler-friendly code."""
    argv = sys.argv[1:] if argv is None else argv
    become_init_if_pid1()  # a container's entrypoint: PID 1 reaps orphans, the child goes on
    if argv and argv[0] == "doctor":  # pre-flight check of this node, before torchrun's flags
        from launcher.doctor import main as doctor_main

        sys.exit(doctor_main(argv[1:]))
    if argv and argv[0] == "status":  # a running job's picture, from its coordinator
        from launcher.status import main as status_main

        sys.exit(status_main(argv[1:]))
    if argv and argv[0] == "report":  # a finished run's goodput, from its event logs
        from launcher.report import main as report_main

        sys.exit(report_main(argv[1:]))
    logging.basicConfig(level=os.environ.get("FTLAUNCH_LOG_LEVEL", "WARNING").upper(),
                        format="ftlaunch: %(name)s: %(message)s")
    if argv in (["--version"], ["-V"]):
        print(f"ftlaunch {__version__}")
        sys.exit(exit_codes.OK)
    try:
        resolved = resolve(argv)
        if resolved.config.dry_run:
            print(json.dumps(dry_run_report(resolved), indent=2))
            sys.exit(exit_codes.OK)
        from launcher.agent import Agent

        agent = Agent(resolved.config, resolved.script, resolved.script_args)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except UsageError as e:
        print(f"ftlaunch: error: {e}", file=sys.stderr)
        sys.exit(exit_codes.USAGE)
    try:
        code = agent.run()
    except UsageError as e:
        print(f"ftlaunch: error: {e}", file=sys.stderr)
        code = exit_codes.USAGE
    sys.exit(code)


