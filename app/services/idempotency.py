"""A create retried under its ``Idempotency-Key`` answers what the first one made (summarization runs, batches;
``/v1/jobs`` compares its jobs' fields instead of a digest).

The key is kept on the created row with its request body's digest (``idempotency_key``, ``request_digest``), under a
unique index on (tenant_id, idempotency_key): keys are each tenant's own, outlive the process, and of two concurrent
requests under one key the second's insert fails, and it answers the first's row (``created_once``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

T = TypeVar("T")


@dataclass(frozen=True)
class Idempotency:
    """A request's Idempotency-Key and its body's digest: a retry under the key answers what the request made."""

    key: str
    digest: str

    @classmethod
    def of(cls, key: str | None, body: BaseModel) -> Idempotency | None:
        """The request's (None without a key): two requests are the same where their bodies are."""
        return cls(key, hashlib.sha256(body.model_dump_json().encode()).hexdigest()) if key else None


class IdempotencyConflict(ValueError):
    """The Idempotency-Key was already used for a different request (HTTP 409)."""


def keyed_row(session: Session, table: Any, tenant_id: str, idempotency: Idempotency, named: str) -> Any | None:
    """The tenant's row of ``table`` made under ``idempotency.key`` (None: none yet); ``IdempotencyConflict`` where
    it was made by a different request. ``named``: what the row is, for the 409's message."""
    row = session.scalars(select(table).where(table.tenant_id == tenant_id,
                                              table.idempotency_key == idempotency.key)).first()
    if row is not None and row.request_digest != idempotency.digest:
        raise IdempotencyConflict(f"Idempotency-Key {idempotency.key!r} was already used for {named} {row.id} with "
                                  "a different request; use a new key")
    return row


def created_once(find: Callable[[], T | None], create: Callable[[], T]) -> tuple[T, bool]:
    """What ``find`` finds made under the key (created: False), or what ``create`` makes with it (True). Where a
    concurrent request under the key won the insert, ``create`` fails on the unique index (rolled back by it) and
    the winner's is answered."""
    earlier = find()
    if earlier is not None:
        return earlier, False
    try:
        return create(), True
    except IntegrityError:
        earlier = find()
        if earlier is None:
            raise
        return earlier, False
