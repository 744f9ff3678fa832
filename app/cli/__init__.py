"""The ``coserve`` command line (Typer). Each module registers one group of commands."""

from __future__ import annotations

import typer

from app.cli import batch_cmds, runtime_cmds, service_cmds

cli = typer.Typer(help="coserve: co-serve interactive LLM requests and deadline batch jobs.",
                  no_args_is_help=True, add_completion=False)
service_cmds.register(cli)  # up, worker, submit, status, jobs
batch_cmds.register(cli)  # batch, summarize
runtime_cmds.register(cli)  # simulate, profile


def main() -> None:
    cli()
