"""Off a terminal (a pipe, a file) rich wrapped every console's lines at 80 columns: a line a script greps, or a
log keeps, broke mid-sentence. Every console the commands print with leaves such a line whole there; a terminal
still wraps at its width."""

from __future__ import annotations

import io

from rich.table import Table

from app.cli import batch_cmds, service_cmds, usage_cmds
from app.cli.output import Console, print_table, stderr

LINE = "batch batch_7e5c1d0a4b3f42e6a9d8c0b1 created from " + "/a/long/folder" * 8 + "/in.jsonl (498 bytes)"


def test_each_commands_console_leaves_a_long_line_whole_on_stdout_or_stderr_off_a_terminal(capsys):
    for console in (batch_cmds.console, service_cmds.console, usage_cmds.console, Console()):
        console.print(LINE)
        assert capsys.readouterr().out == LINE + "\n"
    stderr.print(LINE)
    assert capsys.readouterr().err == LINE + "\n"


def test_a_console_on_a_file_leaves_lines_whole_and_a_terminal_still_wraps_them():
    written = io.StringIO()
    Console(file=written, width=40).print(LINE)
    assert written.getvalue() == LINE + "\n"
    shown = io.StringIO()
    Console(file=shown, width=40, force_terminal=True, color_system=None).print(LINE)
    assert all(len(line) <= 40 for line in shown.getvalue().splitlines()), shown.getvalue()


def test_a_table_off_a_terminal_keeps_its_natural_width_and_its_cells_whole():
    table = Table("id", "file")
    table.add_row("batch_7e5c1d0a4b3f42e6a9d8c0b1", "/a/long/folder" * 8)
    written = io.StringIO()
    print_table(Console(file=written, width=40), table)
    assert "/a/long/folder" * 8 in written.getvalue(), written.getvalue()
