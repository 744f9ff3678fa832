"""The SQL statements the code under test sends, for tests that count its queries (an N+1 shows as one a row)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine


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


def query_plan(connection: Connection, sql: str, parameters: Any = None, priced_out: tuple[str, ...] = ("seqscan",)
               ) -> str:
    """The plan ``connection``'s database takes for ``sql`` (not run), one text: SQLite's EXPLAIN QUERY PLAN, or
    PostgreSQL's EXPLAIN with the plan nodes ``priced_out`` off in this transaction (``enable_<node>``: on a test's
    few rows the planner scans the table whole), so either names the indexes the query can use."""
    if connection.dialect.name == "sqlite":
        return " ".join(str(row) for row in connection.exec_driver_sql("EXPLAIN QUERY PLAN " + sql, parameters))
    for node in priced_out:
        connection.exec_driver_sql(f"SET LOCAL enable_{node} = off")
    return "\n".join(row[0] for row in connection.exec_driver_sql("EXPLAIN " + sql, parameters))


def sorts_rows(plan: str) -> bool:
    """Whether ``plan`` (``query_plan``'s) sorts all its rows for its ORDER BY, not reading them in an index's order
    (SQLite's sort of the ties only, "TEMP B-TREE FOR RIGHT PART OF ORDER BY", and PostgreSQL's Incremental Sort
    read them in that order)."""
    return "TEMP B-TREE FOR ORDER BY" in plan or re.search(r"^\s*(->\s*)?Sort  \(", plan, re.M) is not None
