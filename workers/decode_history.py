"""A starting worker's decode-length history, read from the jobs its model already finished.

The scheduler predicts each application's output length (mean + 2 std of its finished
jobs) for batch deadlines and for KV admission; without a history it must reserve
max_tokens. Seeding it from SQL lets a restarted or added worker admit at full
concurrency from its first job.
"""

from __future__ import annotations

import logging

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.db.models import Job, JobStatus
from gpu_runtime.scheduler.decode_length import DecodeLengthHistory

log = logging.getLogger(__name__)


def finished_lengths(session: Session, model: str, limit: int = 4096) -> list[tuple[str | None, int]]:
    """(app_id, output tokens) of the model's latest ``limit`` succeeded jobs, oldest first."""
    rows = session.execute(
        select(Job.app_id, Job.completion_tokens)
        .where(Job.model == model, Job.status == JobStatus.SUCCEEDED, Job.completion_tokens.is_not(None))
        .order_by(Job.finished_at.desc()).limit(limit)).all()
    return [(app, int(n)) for app, n in reversed(rows)]


def seed(history: DecodeLengthHistory, lengths: list[tuple[str | None, int]]) -> None:
    for app, n in lengths:
        history.record(app, n)
    if lengths:
        log.info("decode-length history seeded with %d finished jobs (%d applications)", len(lengths),
                 len({app for app, _ in lengths}))
