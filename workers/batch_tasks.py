"""Batch upkeep outside the API, run by every worker's sweeper thread.

``finalize_open_batches`` finishes batches whose jobs are all terminal (or whose window
ended) through ``app.batch.finalize.maybe_finalize``, which is idempotent.
``restart_stalled_validation`` re-runs the validation and fan-out of batches left in
``validating`` (the API process that ran it died): the fan-out's guarded
``validating -> in_progress`` update lets only one run create the jobs.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from pathlib import Path

from sqlalchemy import select

from app.batch.fanout import start_batch
from app.batch.finalize import maybe_finalize, stalled_or_open
from app.db.models import Batch
from app.db.session import session_scope
from app.services.transitions import utcnow
from app.settings import Settings

log = logging.getLogger(__name__)


def finalize_open_batches(url: str, data_dir: Path, redis_url: str | None) -> list[str]:
    """Finalizes every open batch whose jobs are all terminal (or whose window ended), and takes over the finalizing
    of a batch whose writer died."""
    done = []
    with session_scope(url) as s:
        for batch_id in list(s.scalars(select(Batch.id).where(stalled_or_open()))):
            try:
                if maybe_finalize(s, batch_id, data_dir, redis_url):
                    done.append(batch_id)
            except Exception:
                log.exception("could not finalize batch %s", batch_id)
    return done


def restart_stalled_validation(settings: Settings, stale_after_s: float = 300.0) -> list[str]:
    """Validates and fans out batches still ``validating`` ``stale_after_s`` after creation."""
    cutoff = utcnow() - timedelta(seconds=stale_after_s)
    with session_scope(settings.sqlalchemy_url) as s:
        stalled = list(s.scalars(select(Batch.id).where(Batch.status == "validating", Batch.created_at < cutoff)))
    for batch_id in stalled:
        log.warning("batch %s has been validating since before %s; validating it here", batch_id, cutoff)
        start_batch(settings, batch_id)
    return stalled
