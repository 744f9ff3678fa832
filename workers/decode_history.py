"""A worker's decode-length history, read from the jobs its model finished.

The scheduler predicts each application's output length (mean + 2 std of its finished
jobs) for batch deadlines and for KV admission; without a history it must reserve
max_tokens. Seeding it from SQL lets a restarted or added worker admit at full
concurrency from its first job, and reading what the other workers of the model finished
since (``PeerLengths``, every heartbeat) keeps the workers' histories from drifting apart.

Lengths are learnt per tenant and ``app_id`` (``history_key``); a job without one is learnt
with its tenant's jobs of the same kind, so chat answers and long batch outputs do not share
a prediction. A job run with a LoRA adapter is learnt apart from the model's (a tuned model
answers at its own length).
"""

from __future__ import annotations

import logging
from datetime import datetime

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from app.db.models import Job, JobStatus
from gpu_runtime.scheduler.decode_length import DecodeLengthHistory

log = logging.getLogger(__name__)


def history_key(app_id: str | None, tenant_id: str, kind: str, adapter: str | None = None) -> str:
    """What a job's output length is learnt under: its tenant's app_id, else its tenant's jobs of its kind
    (scoped by tenant, so no tenant's outputs move another's predictions and KV reservations), and its LoRA
    ``adapter``'s apart from the model's."""
    scope = f"{tenant_id}/lora:{adapter}" if adapter else tenant_id
    return f"{scope}/app:{app_id}" if app_id else f"{scope}/kind:{kind}"


def _served(models: str | tuple[str, ...]) -> tuple[str, ...]:
    """The model's name, or it and its LoRA adapters' (a worker serves them all), the model's first."""
    return (models,) if isinstance(models, str) else tuple(models)


def _adapter(model: str, served: tuple[str, ...]) -> str | None:
    """``model`` if it is one of the served LoRA adapters, not the model itself."""
    return None if model == served[0] else model


def _succeeded(served: tuple[str, ...]):
    return (Job.model.in_(served), Job.status == JobStatus.SUCCEEDED, Job.completion_tokens.is_not(None))


def finished_lengths(session: Session, models: str | tuple[str, ...], limit: int = 4096) -> list[tuple[str, int]]:
    """(history key, output tokens) of the models' latest ``limit`` succeeded jobs, oldest first."""
    models = _served(models)
    rows = session.execute(
        select(Job.app_id, Job.tenant_id, Job.kind, Job.completion_tokens, Job.model).where(*_succeeded(models))
        .order_by(Job.finished_at.desc()).limit(limit)).all()
    return [(history_key(app, tenant, kind, _adapter(model, models)), int(n))
            for app, tenant, kind, n, model in reversed(rows)]


class PeerLengths:
    """What the model's other workers finished since the last read (this worker records its own)."""

    def __init__(self, models: str | tuple[str, ...], worker_id: str, since: datetime, limit: int = 4096) -> None:
        self.models, self.worker_id, self.since, self.limit = _served(models), worker_id, since, limit

    def read(self, session: Session) -> list[tuple[str, int]]:
        rows = session.execute(
            select(Job.app_id, Job.tenant_id, Job.kind, Job.completion_tokens, Job.finished_at, Job.model)
            .where(*_succeeded(self.models), Job.finished_at > self.since,
                   or_(Job.worker_id.is_(None), Job.worker_id != self.worker_id))
            .order_by(Job.finished_at).limit(self.limit)).all()
        if rows:
            self.since = rows[-1].finished_at
        return [(history_key(app, tenant, kind, _adapter(model, self.models)), int(n))
                for app, tenant, kind, n, _, model in rows]


def seed(history: DecodeLengthHistory, lengths: list[tuple[str, int]]) -> None:
    for app, n in lengths:
        history.record(app, n)
    if lengths:
        log.info("decode-length history seeded with %d finished jobs (%d applications)", len(lengths),
                 len({app for app, _ in lengths}))
