"""Batch upkeep outside the API, run by every worker's sweeper thread.

``finalize_open_batches`` finishes batches whose jobs are all terminal (or whose window
ended) through ``app.batch.finalize.maybe_finalize``, which is idempotent.
``restart_stalled_validation`` re-runs the validation and fan-out of batches left in
``validating`` (the API process that ran it died): the fan-out's guarded
``validating -> in_progress`` update lets only one run create the jobs.
``count_abandoned_cancels`` counts the lines of batches cancelled while validating whose fan-out died and whose
cancel's count never ran (its API died first).
``drop_left_working_dirs`` deletes the working folders that no fan-in or fan-out run deleted as the batch ended.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from pathlib import Path

from sqlalchemy import func, select

from app.batch.fanout import count_if_abandoned, start_batch
from app.batch.finalize import ENDED, drop_working_dir, maybe_finalize, stalled_or_open, working_dirs
from app.db.models import Batch
from app.db.session import session_scope
from app.services.transitions import utcnow
from app.settings import Settings
from app.summarize.store import in_chunks

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


# how long after its batch ended a working folder is left over: a fan-out run still reading a cancelled batch's lines
# (it deletes the folder at its end) has long ended by then
LEFT_OVER_AFTER = timedelta(hours=1)


def count_abandoned_cancels(settings: Settings, within: timedelta = LEFT_OVER_AFTER) -> list[str]:
    """Counts the lines of the batches cancelled while validating ``within`` ago (``LEFT_OVER_AFTER``: later their
    working folders go) whose working folder is left with no fan-out run holding its lock, or whose lines no run read
    (``fanout.count_if_abandoned``): a fan-out killed before it counted them (or a create whose API died before its
    fan-out ran), then a cancel whose API died before its background count ran. Such a batch showed ``total`` 0 for
    good, its dead run's staged jobs and part files kept. Returns their ids. Call it before
    ``drop_left_working_dirs``."""
    since = utcnow() - within
    with session_scope(settings.sqlalchemy_url) as s:
        cancelled = list(s.scalars(select(Batch.id).where(
            Batch.status == "cancelled", Batch.cancelling_at.is_not(None), Batch.in_progress_at.is_(None),
            Batch.deleted_at.is_(None), Batch.cancelled_at > since)))
    return [batch_id for batch_id in cancelled if count_if_abandoned(settings, batch_id)]


def drop_left_working_dirs(url: str, data_dir: Path, after: timedelta = LEFT_OVER_AFTER) -> list[str]:
    """Deletes the working folders (``finalize.working_dir``) of batches that ended ``after`` ago or more, or whose
    row is gone: a batch cancelled before it started whose fan-out run was killed (no run's end deleted it), one
    that ended before its fan-in deleted them. Returns their batch ids."""
    root = working_dirs(data_dir)
    if not root.is_dir():
        return []
    ended_at = func.coalesce(Batch.completed_at, Batch.failed_at, Batch.expired_at, Batch.cancelled_at)
    left = []
    with session_scope(url) as s:
        for ids in in_chunks(sorted(p.name for p in root.iterdir() if p.is_dir())):
            kept = set(s.scalars(select(Batch.id).where(Batch.id.in_(ids), Batch.status.not_in(ENDED) | (
                ended_at > utcnow() - after))))
            left += [batch_id for batch_id in ids if batch_id not in kept]
    for batch_id in left:
        drop_working_dir(data_dir, batch_id)
    if left:
        log.info("deleted the working folders of %d ended batches", len(left))
    return left
