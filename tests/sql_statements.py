"""The SQL statements the code under test sends, for tests that count its queries (an N+1 shows as one a row)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Engine


@contextmanager
def statements(engine: Any = Engine, with_parameters: bool = False) -> Iterator[list[Any]]:
    """Every statement ``engine`` (each engine, by default) sends meanwhile, in order: its SQL text, or
    ``(text, parameters)`` with ``with_parameters``."""
    seen: list[Any] = []

    def on_execute(_conn, _cursor, statement, parameters, *_args) -> None:
        seen.append((statement, parameters) if with_parameters else statement)

    event.listen(engine, "before_cursor_execute", on_execute)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", on_execute)
