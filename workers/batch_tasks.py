"""Batch finalization outside the API: a Celery task and a sweep over open batches.

``finalize_open_batches`` suits a periodic caller (the worker's sweeper thread); the task
``coserve.batch.finalize`` finalizes one batch by id. Both call
``app.batch.finalize.maybe_finalize``, which is idempotent.
"""

from __future__ import annotations

import logging
from pathlib import Path

from celery import shared_task
from sqlalchemy import select

from app.batch.finalize import OPEN, maybe_finalize
from app.db.models import Batch
from app.db.session import session_scope

log = logging.getLogger(__name__)

FINALIZE_BATCH = "coserve.batch.finalize"


def finalize_open_batches(url: str, data_dir: Path, redis_url: str | None) -> list[str]:
    """Finalizes every open batch whose jobs are all terminal (or whose window ended)."""
    done = []
    with session_scope(url) as s:
        for batch_id in list(s.scalars(select(Batch.id).where(Batch.status.in_(OPEN)))):
            try:
                if maybe_finalize(s, batch_id, data_dir, redis_url):
                    done.append(batch_id)
            except Exception:
                log.exception("could not finalize batch %s", batch_id)
    return done


@shared_task(name=FINALIZE_BATCH, ignore_result=True)
def finalize_batch(batch_id: str) -> bool:
    from app.settings import get_settings

    settings = get_settings()
    with session_scope(settings.sqlalchemy_url) as s:
        return maybe_finalize(s, batch_id, settings.data_dir, settings.redis_url)
