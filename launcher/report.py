"""``ftlaunch report LOGDIR [--plot PNG]``: the goodput account of a run, from its event logs.

Every ``events.jsonl`` under LOGDIR (one per node and run id) is accounted on its own
(``launcher.goodput``); ``--json`` prints the accounts as one JSON object by log path.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from launcher import UsageError, events, exit_codes, goodput


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("log_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the accounts as JSON.")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path),
              help="Also draw the run's timeline into this PNG (needs ftlaunch[plot]).")
@click.option("--events", "as_events", is_flag=True,
              help="Instead, list every node's events in one time order (a post-mortem).")
@click.option("--routine", is_flag=True,
              help="With --events: also the per-step and per-save events.")
def report(log_dir: Path, as_json: bool, plot: Path | None, as_events: bool,
           routine: bool) -> None:
    """Goodput and lost time by cause of the run(s) logged under LOG_DIR (ftlaunch's
    --log-dir, or one run's directory in it, or several nodes' log dirs under one)."""
    logs = sorted(log_dir.rglob("events.jsonl")) if log_dir.is_dir() else []
    if not logs:
        raise click.ClickException(f"no events.jsonl under {log_dir}: give the --log-dir of "
                                   "a run")  # exit 1: nothing to report, not a usage error
    if as_events:
        from launcher.timeline import merged

        print("\n".join(merged({str(path.parent.relative_to(log_dir)): events.load(path)
                                for path in logs}, routine)))
        return
    loaded = {str(path.parent): events.load(path) for path in logs}
    accounts = {where: goodput.account(log) for where, log in loaded.items()}
    if plot is not None:
        from launcher.timeline import plot as draw

        try:
            draw(loaded, plot)
        except UsageError as e:
            raise click.ClickException(str(e)) from None
    if as_json:
        print(json.dumps({k: a.as_dict() for k, a in accounts.items()}, indent=2))
        return
    for where, acc in accounts.items():
        print(f"{where}\n{goodput.table(acc)}")


def main(argv: list[str]) -> int:
    try:
        report.main(argv, prog_name="ftlaunch report", standalone_mode=False)
    except click.ClickException as e:  # usage errors exit 2, a missing log 1
        print(f"ftlaunch report: error: {e.format_message()}", file=sys.stderr)
        return e.exit_code
    return exit_codes.OK
