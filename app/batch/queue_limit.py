"""The Batch API's queue limit: how many prompt tokens a tenant may have waiting in its batches at once.

OpenAI caps the input tokens enqueued across a project's batches for a model; a batch that would go past the cap
fails validation with ``token_limit_exceeded`` and the batches already queued run on. coserve keeps the cap per
tenant (``tenants.batch_queue_tokens``, null: none) and counts, for the batch's model, the prompt tokens of the
tenant's batch jobs that have not ended, plus the new batch's own. Rate limits (app/services/rate_limits.py) do not
apply to batches: this is their guard against one tenant filling the queue.
"""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.db.models import Job, Tenant
from app.services.transitions import NOT_TERMINAL

ERROR_CODE = "token_limit_exceeded"
QUEUED = (Job.batch_id.is_not(None), Job.status.in_([s.value for s in NOT_TERMINAL]))  # a batch's unended jobs


def enqueued_tokens(session: Session, tenant_id: str, model: str) -> int:
    """Prompt tokens of the tenant's batch jobs for ``model`` that have not ended."""
    return int(session.scalar(select(func.coalesce(func.sum(Job.prompt_tokens), 0)).where(
        Job.tenant_id == tenant_id, Job.model == model, *QUEUED)))


def queued_by_tenant(session: Session) -> dict[str, int]:
    """Every tenant's prompt tokens queued in batches, all models together (the admin dashboard's column)."""
    return {tenant_id: int(n or 0) for tenant_id, n in session.execute(
        select(Job.tenant_id, func.sum(Job.prompt_tokens)).where(*QUEUED).group_by(Job.tenant_id))}


def refusal(session: Session, tenant_id: str, model: str, tokens: int) -> dict | None:
    """The batch's file error where ``tokens`` more would pass the tenant's cap, else None. Call it in the
    transaction that adds the jobs: the tenant's row is locked (PostgreSQL) or the database is (SQLite), so two
    batches validated at once cannot both fit in the room that only one has."""
    cap = session.scalar(select(Tenant.batch_queue_tokens).where(Tenant.id == tenant_id).with_for_update())
    if cap is None:
        return None
    queued = enqueued_tokens(session, tenant_id, model)
    if queued + tokens <= cap:
        return None
    return {"code": ERROR_CODE, "line": None,
            "message": f"this batch's {tokens} prompt tokens and the {queued} already queued in your batches for "
                       f"{model} exceed your limit of {cap} enqueued tokens; wait for some batches to finish or "
                       "split this one"}
