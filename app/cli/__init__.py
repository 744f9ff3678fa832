"""The ``coserve`` command line (Typer). Each module registers one group of commands."""

from __future__ import annotations

import click
import typer
from typer.core import TyperGroup

from app.cli import batch_cmds, files_cmds, runtime_cmds, service_cmds, usage_cmds
from app.cli.output import stdout_closed

HELP = """coserve: co-serve interactive LLM requests (TTFT/TBT targets) and deadline batch jobs on the same GPUs.

Start everything locally with `coserve up`; then `coserve submit`, `coserve batch create` or
`coserve summarize` talk to it (credentials from `coserve up`, or --url/--key,
COSERVE_URL/COSERVE_API_KEY). Settings come from COSERVE_* environment variables or .env.
"""

class CommandLine(TyperGroup):
    """Every command stops alike when the reader of its stdout goes away (`--json | head -1`, a table to `head`):
    click exits 1 for a plain print's broken pipe, rich for its own; here both exit as a Unix tool does."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except BrokenPipeError:
            raise stdout_closed() from None


# Markdown: a docstring's paragraph wraps as one (rich mode kept its line breaks, leaving short lines)
cli = typer.Typer(cls=CommandLine, help=HELP, epilog="Run `coserve COMMAND --help` for a command's options.",
                  no_args_is_help=True, add_completion=False, rich_markup_mode="markdown")
service_cmds.register(cli)  # up, worker, submit, status, jobs
batch_cmds.register(cli)  # batch, summarize
files_cmds.register(cli)  # files
runtime_cmds.register(cli)  # simulate, profile
usage_cmds.register(cli)  # usage


def main() -> None:
    cli()
