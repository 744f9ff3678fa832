"""The Batch API's queue limit: how many prompt tokens a tenant may have waiting in its deadline work at once.

OpenAI caps the input tokens enqueued across a project's batches for a model; a batch that would go past the cap
fails validation with ``token_limit_exceeded`` and the batches already queued run on. coserve keeps the cap per
tenant (``tenants.batch_queue_tokens``, null: none) and counts, for the model, the prompt tokens of the tenant's
batch and summarization jobs that have not ended, plus the new work's own: a summarization run is deadline work
as a batch is, and its first level is checked as a batch is at its start (``app/summarize/driver``; its later
levels, built from its own summaries, count but are never refused: a run let in runs to its end). Rate limits
(app/services/rate_limits.py) do not count their tokens (a batch's create and a summarization start are one
request of them each, and no tokens): this is their guard against one tenant filling the queue.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session

from app.db.models import Job, Tenant
from app.services.transitions import NOT_TERMINAL

ERROR_CODE = "token_limit_exceeded"
# the unended jobs of a batch or of a summarization run
QUEUED = (or_(Job.batch_id.is_not(None), Job.summarization_run_id.is_not(None)),
          Job.status.in_([s.value for s in NOT_TERMINAL]))


@dataclass(frozen=True)
class Work:
    """What asks for room, as a refusal names it, and what its tenant can do instead of waiting."""

    tokens_of: str  # "this batch's"
    smaller: str  # "split this one"


BATCH = Work("this batch's", "split this one")
SUMMARIZATION = Work("this summarization run's first level's", "send its documents in smaller runs")


def enqueued_tokens(session: Session, tenant_id: str, model: str) -> int:
    """Prompt tokens of the tenant's batch and summarization jobs for ``model`` that have not ended."""
    return int(session.scalar(select(func.coalesce(func.sum(Job.prompt_tokens), 0)).where(
        Job.tenant_id == tenant_id, Job.model == model, *QUEUED)))


def queued_by_tenant(session: Session, tenant_ids: Iterable[str] | None = None) -> dict[str, int]:
    """Every tenant's (of ``tenant_ids``: a page of the admin dashboard's table; None: all) prompt tokens queued in
    batches and summarization runs, all models together (the admin dashboard's column)."""
    query = select(Job.tenant_id, func.sum(Job.prompt_tokens)).where(*QUEUED)
    if tenant_ids is not None:
        query = query.where(Job.tenant_id.in_(list(tenant_ids)))
    return {tenant_id: int(n or 0) for tenant_id, n in session.execute(query.group_by(Job.tenant_id))}


def refusal(session: Session, tenant_id: str, model: str, tokens: int, work: Work = BATCH) -> dict | None:
    """The error (a batch's file error's shape) where ``tokens`` more of ``work`` would pass the tenant's cap, else
    None. Call it in the transaction that makes the jobs runnable: the tenant's row is locked (PostgreSQL) or the
    database is (SQLite), so two batches or runs started at once cannot both fit in the room that only one has."""
    cap = session.scalar(select(Tenant.batch_queue_tokens).where(Tenant.id == tenant_id).with_for_update())
    if cap is None:
        return None
    queued = enqueued_tokens(session, tenant_id, model)
    if queued + tokens <= cap:
        return None
    return {"code": ERROR_CODE, "line": None,
            "message": f"{work.tokens_of} {tokens} prompt tokens and the {queued} already queued in your batches "
                       f"and summarization runs for {model} exceed your limit of {cap} enqueued tokens; wait for "
                       f"some of them to finish or {work.smaller}"}
