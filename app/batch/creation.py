"""A batch's create, the OpenAI Batch API's and Anthropic's Message Batches': the row written and the request charged
in one transaction, once per ``Idempotency-Key`` (``app.services.idempotency``): a create retried under its key
(the official SDKs retry a POST whose connection dropped) answers the first one's batch, uncharged, and no second
batch runs the lines again."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from sqlalchemy.orm import Session

from app.db.models import Batch, File
from app.db.session import write_after_read
from app.services.idempotency import Idempotency, created_once, keyed_row


def keyed_batch(session: Session, tenant_id: str, idempotency: Idempotency | None) -> Batch | None:
    """The tenant's batch made under the request's key (None: no key, or none made under it yet);
    ``IdempotencyConflict`` where a different request made it."""
    return keyed_row(session, Batch, tenant_id, idempotency, "batch") if idempotency is not None else None


def create_once(session: Session, batch: Batch, idempotency: Idempotency | None, charge: Callable[[], object],
                files: Iterable[File] = ()) -> tuple[Batch, bool]:
    """The tenant's batch made under ``idempotency``'s key (created: False), or ``batch`` written with it (True),
    after ``files`` (the rows it names). ``charge`` takes the create from its tenant's rate limits once the row is
    in, in its transaction (raising writes nothing), so neither a retry nor a concurrent create under the key,
    whose insert fails on the key's unique index, is charged."""
    if idempotency is not None:
        batch.idempotency_key, batch.request_digest = idempotency.key, idempotency.digest
    return created_once(lambda: keyed_batch(session, batch.tenant_id, idempotency),
                        lambda: _write(session, batch, charge, files))


def _write(session: Session, batch: Batch, charge: Callable[[], object], files: Iterable[File]) -> Batch:
    try:
        with write_after_read(session):
            session.add_all(files)
            session.flush()  # the files' rows before the batch's, which names them
            session.add(batch)
            session.flush()  # a concurrent create under the key fails here (or waits for it)
            charge()
            session.commit()
    except BaseException:
        session.rollback()
        raise
    return batch
