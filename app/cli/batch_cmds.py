"""CLI commands: batch_cmds (to be filled by its owner)."""

import typer


def register(cli: typer.Typer) -> None:
    pass
