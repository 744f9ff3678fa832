"""Keyset pagination of the listed tables: rows in (created_at, id) order, and the rows after a cursor row.

A cursor names a row by its creation time and id, so a page starts after it even once that row is gone from the
list (deleted, expired, another status), and rows created meanwhile neither shift nor repeat a page. A cursor that
names no row of the tenant's is the client's mistake (``UnknownCursor``: a 400 naming it), not an empty page.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, Select, and_, or_
from sqlalchemy.orm import Session


class UnknownCursor(LookupError):
    """A cursor naming no row of the tenant's: an id it never had, or another tenant's alike."""

    def says(self, param: str, listed: str) -> str:
        """The 400's message for the query parameter ``param`` of a list of ``listed``."""
        return f"{param} {self.args[0]!r} is none of your {listed}; page on from an id a listing gave you"


def in_order(table: Any, newest_first: bool = True) -> tuple[Any, Any]:
    """``order_by`` of ``table``'s rows: by creation, ties by id."""
    return (table.created_at.desc(), table.id.desc()) if newest_first else (table.created_at.asc(), table.id.asc())


def after(table: Any, created_at: datetime, row_id: str, newest_first: bool = True) -> ColumnElement[bool]:
    """The rows of ``table`` that come after the row (``created_at``, ``row_id``) in ``in_order``."""
    if newest_first:
        return or_(table.created_at < created_at, and_(table.created_at == created_at, table.id < row_id))
    return or_(table.created_at > created_at, and_(table.created_at == created_at, table.id > row_id))


def cursor_row(session: Session, table: Any, row_id: str, tenant_id: str) -> Any | None:
    """The tenant's row that an ``after`` cursor names; None for an unknown id and for another tenant's alike, so a
    listing tells no tenant whether someone else's id exists (or when it was made)."""
    row = session.get(table, row_id)
    return row if row is not None and row.tenant_id == tenant_id else None


def rows_after(session: Session, query: Select, table: Any, tenant_id: str, cursor: str | None, limit: int,
               newest_first: bool = True) -> list[Any]:
    """``query``'s rows of ``table`` in order after the tenant's row ``cursor`` names (none where it names no row of
    the tenant's: ``UnknownCursor``), up to ``limit + 1``: a page and one more, which tells the caller whether more
    follow."""
    mark = cursor_row(session, table, cursor, tenant_id) if cursor else None
    if cursor and mark is None:
        raise UnknownCursor(cursor)
    return page_after(session, query, table, mark, limit, newest_first)


def page_after(session: Session, query: Select, table: Any, mark: Any | None, limit: int,
               newest_first: bool = True) -> list[Any]:
    """``query``'s rows of ``table`` in order after the row ``mark`` (from the first where None), up to
    ``limit + 1``."""
    if mark is not None:
        query = query.where(after(table, mark.created_at, mark.id, newest_first))
    return list(session.scalars(query.order_by(*in_order(table, newest_first)).limit(limit + 1)))
