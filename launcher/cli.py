"""The ``ftlaunch`` command: torchrun's command line, built from ``LaunchConfig``'s fields."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import sys
from pathlib import Path

import click

from launcher import UsageError, __version__, exit_codes
from launcher.config import (
    FIELDS,
    GENERAL,
    RECOVERY,
    TORCHRUN,
    LaunchConfig,
    env_var,
    load_config_file,
)

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


def parse_args(argv: list[str]) -> tuple[LaunchConfig, str, list[str]]:
    """Command line (+ env + config file) -> (config, script, script args); raises UsageError."""
    command = _build_command()
    try:
        ctx = command.make_context("ftlaunch", list(argv))
    except click.UsageError as e:
        raise UsageError(e.format_message().replace("\n", " ")) from None
    values = ctx.params
    from_user = {name for name in FIELDS
                 if ctx.get_parameter_source(name) in (click.core.ParameterSource.COMMANDLINE,
                                                       click.core.ParameterSource.ENVIRONMENT)}
    file_values = load_config_file(values["config"]) if values.get("config") else {}
    merged = {name: values[name] if name in from_user else file_values.get(name, FIELDS[name].default)
              for name in FIELDS}
    config = LaunchConfig(**merged)
    config.validate()
    script = values["training_script"]
    _check_script(config, script)
    return config, script, list(values["training_script_args"])


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
    if argv and argv[0] == "doctor":  # pre-flight check of this node, before torchrun's flags
        from launcher.doctor import main as doctor_main

        sys.exit(doctor_main(argv[1:]))
    logging.basicConfig(level=os.environ.get("FTLAUNCH_LOG_LEVEL", "WARNING").upper(),
                        format="ftlaunch: %(name)s: %(message)s")
    if argv in (["--version"], ["-V"]):
        print(f"ftlaunch {__version__}")
        sys.exit(exit_codes.OK)
    try:
        config, script, script_args = parse_args(argv)
        from launcher.agent import Agent

        agent = Agent(config, script, script_args)
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


