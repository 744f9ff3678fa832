"""What the list commands print: tables whose IDs, statuses and dates are never cut, JSON for
scripts (``--json``), and error responses as their messages.

Rich fits a table to the console, 80 columns when stdout is not a terminal, by cutting cells
to "job_4d2605…". An ID that cannot be copied is useless, so ID and status columns keep their
longest value on one line, dates wrap between the day and the time, and other columns wrap.
List tables have no borders (``docker ps``-like: more room, lines that copy cleanly). Off a
terminal (a pipe, a file) a table is printed at its natural width, since nothing there needs
it to fit 80 columns; on a terminal too narrow for its IDs it is printed wider (the terminal
wraps the lines) rather than cropped.
"""

from __future__ import annotations

import io
import json
import os
import signal
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any
from urllib.parse import unquote

import httpx
import typer
import rich.console
from rich import box
from rich.console import JustifyMethod, RenderableType
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Column, Table

DATE_WIDTH = len("2025-01-31")  # a date column may wrap to its time below, never narrower
INTERRUPTED = 130  # the exit status of a command Ctrl-C stopped (128 + SIGINT), as a shell reports it
# the exit status of a command whose stdout reader went away (`coserve jobs --json | head -1`): 128 + SIGPIPE, what a
# shell reports of a Unix tool that signal stopped (`seq 100000 | head -1`)
PIPE_CLOSED = 128 + signal.SIGPIPE


def stdout_closed() -> typer.Exit:
    """The reader of stdout went away: the command stops quietly (no traceback, no "Exception ignored" when Python
    flushes stdout at exit: it flushes into /dev/null) with ``PIPE_CLOSED``; the caller raises the returned exit."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, io.UnsupportedOperation):
        pass  # stdout is no file descriptor (a test runner's buffer): nothing is flushed into a pipe at exit
    return typer.Exit(PIPE_CLOSED)


class Console(rich.console.Console):
    """Rich's console, stopping as every command does when its reader goes away (rich's own exits 1), and leaving
    its lines whole off a terminal: rich wraps them at 80 columns in a pipe or a file, which broke a line a script
    greps or a log keeps ("created from PATH (498" with "bytes)" below). A terminal still wraps at its width. Tables
    are laid out as before (``print_table``: off a terminal, at their natural width)."""

    @property  # read at each print: a console made at import writes to whatever stdout is then (a test's, a pipe)
    def soft_wrap(self) -> bool:
        return self._soft_wrap or not self.is_terminal

    @soft_wrap.setter
    def soft_wrap(self, value: bool) -> None:  # rich's __init__ sets its soft_wrap argument
        self._soft_wrap = value

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise stdout_closed()


# what went wrong goes to stderr, on one line however narrow (a script reads stdout, a person reads both); its
# fresh file lookup follows a redirected sys.stderr (pytest's, CliRunner's)
stderr = Console(stderr=True, soft_wrap=True)


def bar_on(console: Console) -> Console:
    """Where a progress bar meant for ``console`` is drawn: there on a terminal, else on stderr. Off a terminal rich
    prints a bar's last frame once it stops, which in stdout's file or pipe is a line of bar characters among the
    output (`batch create --wait > out.txt`); on stderr it is what a person watching still sees."""
    return console if console.is_terminal else stderr


def stopped_waiting(what: str, show: str, stop: str) -> typer.Exit:
    """Ctrl-C while a command waits on the server: only the wait stops. Says so, and how to look again or stop the
    work, on stderr; the caller raises the returned exit (status ``INTERRUPTED``)."""
    stderr.print(f"\nstopped waiting; {escape(what)} goes on on the server: `{escape(show)}` shows it, "
                 f"`{escape(stop)}` stops it")
    return typer.Exit(INTERRUPTED)


@contextmanager
def asking(may_happen: str, look: str) -> Iterator[None]:
    """Ctrl-C while a command waits for the answer to a request that makes or stops work (an upload, a start, a
    cancel): the server may do it anyway. Says so (``may_happen``) and how to look (``look``) on stderr, and exits
    ``INTERRUPTED``: a bare 130 left the operator not knowing whether the work was made or stopped."""
    try:
        yield
    except KeyboardInterrupt:
        stderr.print(f"\nstopped waiting for the server's answer; {escape(may_happen)} anyway: {escape(look)}")
        raise typer.Exit(INTERRUPTED) from None


def list_table(*columns: Column) -> Table:
    """A borderless table for a list command's rows."""
    return Table(*columns, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True)


def kept(header: str, values: Iterable[str], justify: JustifyMethod = "left") -> Column:
    """A column whose values are never wrapped or cut (IDs, statuses): at least as wide as the longest."""
    return Column(header, no_wrap=True, min_width=max([len(header), *(len(v) for v in values)]), justify=justify)


def date(header: str) -> Column:
    """A "YYYY-MM-DD HH:MM:SS" column: when narrow, the time goes to a second line."""
    return Column(header, min_width=DATE_WIDTH, overflow="fold")


def other(header: str, justify: JustifyMethod = "left") -> Column:
    """Any other column: wraps (a word too long for it folds) rather than being cut."""
    return Column(header, overflow="fold", justify=justify)


def when(value: str | int | float | None) -> str:
    """An ISO timestamp or epoch seconds (UTC) as "YYYY-MM-DD HH:MM:SS"; "-" for none."""
    if value is None:
        return "-"
    if isinstance(value, int | float):
        return datetime.fromtimestamp(value, UTC).strftime("%Y-%m-%d %H:%M:%S")
    return value[:19].replace("T", " ")


def print_table(console: Console, table: Table) -> None:
    """``table`` whole: at the console's width if it fits, squeezed on a terminal (kept columns
    whole, the others wrapped), else wider than the console (off a terminal nothing needs 80
    columns; a terminal wraps the lines, which still beats a cropped table)."""
    natural = console.measure(table, options=console.options.update_width(10_000)).maximum
    if natural <= console.width or (console.is_terminal and _squeeze(console, table, natural)):
        console.print(table)
        return
    # console.print clamps width= to the console's own, so a wider console renders it
    Console(file=console.file, width=natural, color_system="auto" if console.color_system else None,
            force_terminal=console.is_terminal).print(table)


SQUEEZED_MIN = 3  # the narrowest a wrapping column gets when squeezed


def _squeeze(console: Console, table: Table, natural: int) -> bool:
    """Fixes column widths that fit the console: kept (no-wrap) columns at their natural width,
    the others from their minimum up to their values' width (headers wrap at spaces), the ones
    that need least first, so most columns stay whole and the widest text wraps; what is left
    unwraps headers. Rich's own fitting can shrink a kept column below its minimum and then
    crop the table, losing its last columns. False (nothing changed) when minimums do not fit."""
    def width(cell: RenderableType) -> int:
        return Measurement.get(console, console.options, cell).maximum

    cols = table.columns
    values = [max((width(c) for c in col.cells), default=0) for col in cols]
    full = [max(v, width(col.header)) for v, col in zip(values, cols, strict=True)]
    room = console.width - (natural - sum(full))  # minus borders and padding
    flexible = [i for i, col in enumerate(cols) if not col.no_wrap]
    room -= sum(w for i, w in enumerate(full) if i not in flexible)
    words = {i: max(len(w) for w in str(cols[i].header).split() or [""]) for i in flexible}
    target = {i: max(values[i], words[i]) for i in flexible}
    low = {i: min(target[i], cols[i].min_width or SQUEEZED_MIN) for i in flexible}
    if room < sum(low.values()):
        return False
    spare, got = room - sum(low.values()), dict(low)
    for goal in (target, dict(enumerate(full))):
        for i in sorted(flexible, key=lambda i: goal[i] - got[i]):
            grant = min(spare, max(0, goal[i] - got[i]))
            got[i], spare = got[i] + grant, spare - grant
    for i in flexible:
        cols[i].width = got[i]
    return True


def print_json(data: Any) -> None:
    """Plain JSON on stdout, for every ``--json``: one document, no markup, no wrapping and no colour on a terminal
    either (rich's ``print_json`` colours it there, which ``jq`` cannot read)."""
    print(json.dumps(data, indent=2, default=str))


def error_line(resp: httpx.Response, looked_up: tuple[str, str] | None = None) -> str:
    """An error response as stderr shows it: its status and message. ``looked_up``: what the request asked for by id
    (what it is, the id as the URL holds it: ``in_path``'s). No id holds a "/", and the server reads one there as the
    path's (``in_path``'s %2F decoded), so such an id meets no route and was answered a bare "404 Not Found" (or
    "Invalid URL"): its 404 says there is no such one, by the id the operator gave."""
    if resp.status_code == 404 and looked_up is not None and "/" in (given := unquote(looked_up[1])):
        return f"[red]404[/red] {escape(f'no {looked_up[0]} {given!r}')}"
    return f"[red]{resp.status_code}[/red] {error_message(resp)}"


def error_message(resp: httpx.Response) -> str:
    """The human part of an error response, escaped for rich: FastAPI's ``detail`` (for a 422, each
    pydantic error as "field: message" instead of the raw list of dicts), OpenAI's
    ``error.message``, or the body's text."""
    try:
        body = resp.json()
    except ValueError:
        return escape(resp.text.strip() or resp.reason_phrase)
    msg: Any = body
    if isinstance(body, dict):
        if isinstance(body.get("error"), dict) and body["error"].get("message"):
            msg = body["error"]["message"]
        elif "detail" in body:
            msg = body["detail"]
    if isinstance(msg, list):
        msg = "; ".join(_validation_error(e) for e in msg)
    return escape(msg if isinstance(msg, str) else json.dumps(msg))


def _validation_error(err: Any) -> str:
    """One pydantic error: "max_tokens: Input should be ..." (the location without its
    "body"/"query" part; model-level checks have none)."""
    if not isinstance(err, dict):
        return str(err)
    loc = [str(p) for p in err.get("loc", [])]
    if loc and loc[0] in ("body", "query", "path", "header"):
        loc = loc[1:]
    msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
    return f"{'.'.join(loc)}: {msg}" if loc else msg
