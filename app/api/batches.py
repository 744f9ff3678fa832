"""OpenAI Batch API: create (validation + fan-out in the background), get, list, cancel.

Reading a batch also runs the fan-in (``maybe_finalize``), so a batch whose last job just
ended is finalized by whoever looks first: the worker's sweeper, a poll, or a cancel. The list counts its page's
open batches in one query and finalizes only those whose jobs all ended (``fan_in_page``).
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from fastapi import APIRouter, BackgroundTasks, Header, Query, Request
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import select

from app.anthropic_schemas import ENDPOINT as MESSAGES
from app.api.deps import CurrentPrincipal, SessionDep, SettingsDep, rate_limiter
from app.api.errors import openai_responses
from app.api.openai_compat import charge_request, idempotency_conflicts
from app.bounds import BATCHES_PAGE_MAX
from app.batch import storage
from app.batch.creation import create_once, keyed_batch
from app.batch.fanout import cancel_and_count, expires_at_for, start_batch
from app.batch.finalize import Counts, fan_in_page, maybe_finalize
from app.batch.lines import ENDPOINTS
from app.batch.objects import batch_object, batch_usage
from app.db import pagination
from app.db.models import Batch, new_id
from app.openai_schemas import OpenAIError, OpenAIRoute, charged, parse_window
from app.services.idempotency import Idempotency
from app.services.jobs import JobValidationError, resolve_tier
from app.services.rate_limits import rate_headers
from app.services.transitions import utcnow
from app.wire import Metadata

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/batches", tags=["batches"], route_class=OpenAIRoute, responses=openai_responses(401))


class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="ignore")
    input_file_id: str
    endpoint: Literal["/v1/chat/completions", "/v1/completions", "/v1/responses"]
    completion_window: str = Field("24h", max_length=Batch.completion_window.type.length,
                                   description="'24h', or any window such as '30m', '2h', '7d'")
    metadata: Metadata | None = Field(None, description="up to 16 pairs: keys up to 64 characters, values up to 512")
    output_expires_after: storage.ExpiresAfter | None = Field(
        None, description="when the batch's output and error files expire, counted from when each is made "
                          "(unset: they are kept until deleted)")
    tier: str | None = Field(None, description="coserve extension: the batch's tier (up to the key's)")


def _own(session, principal, batch_id: str) -> Batch:
    row = session.get(Batch, batch_id, populate_existing=True)
    # a message batch (Anthropic's, /v1/messages/batches) is no Batch object of this API
    if row is None or row.tenant_id != principal.tenant_id or row.endpoint == MESSAGES:
        raise OpenAIError(404, f"No such Batch object: {batch_id}", param="batch_id", code="batch_not_found")
    return row


@router.post("", responses=openai_responses(400, 404, 409, 413, 429))
def create_batch(body: BatchCreate, session: SessionDep, principal: CurrentPrincipal, settings: SettingsDep,
                 background: BackgroundTasks, request: Request,
                 idempotency_key: Annotated[str | None, Header(max_length=200)] = None) -> dict[str, Any]:
    """A batch of the input file's requests, run by their completion window. The create is one request of the
    tenant's requests per minute and no tokens (as OpenAI's is; the batch queue limit counts its tokens at the
    fan-out), taken once its checks let it through: a refused create is not charged. A create retried with the same
    Idempotency-Key (and body) answers the batch the first one made, uncharged; one with a different body is a 409."""
    assert body.endpoint in ENDPOINTS
    idempotency = Idempotency.of(idempotency_key, body)
    with idempotency_conflicts():
        earlier = keyed_batch(session, principal.tenant_id, idempotency)
    if earlier is not None:
        return batch_object(earlier, batch_usage(session, [earlier.id]).get(earlier.id))
    try:
        parse_window(body.completion_window)
    except ValueError as exc:
        raise OpenAIError(400, str(exc), param="completion_window") from exc
    try:
        tier = resolve_tier(settings, principal, body.tier)
    except JobValidationError as exc:
        raise OpenAIError(400, str(exc), param="tier") from exc
    src = storage.tenant_file(session, principal.tenant_id, body.input_file_id)
    if src is None:
        raise OpenAIError(404, f"No such File object: {body.input_file_id}", param="input_file_id")
    if src.purpose != "batch":
        raise OpenAIError(400, "the input file's purpose must be 'batch'", param="input_file_id")
    now = utcnow()
    batch = Batch(id=new_id("batch"), tenant_id=principal.tenant_id, api_key_id=principal.key_id,
                  endpoint=body.endpoint, input_file_id=src.id, completion_window=body.completion_window,
                  status="validating", tier=tier,
                  metadata_=body.metadata, created_at=now, expires_at=expires_at_for(now, body.completion_window),
                  output_expires_after_s=body.output_expires_after.seconds if body.output_expires_after else None)
    with idempotency_conflicts():
        made, created = create_once(session, batch, idempotency, lambda: charged(
            request, rate_headers(charge_request(rate_limiter(request), principal))))
    if not created:  # a concurrent create under the key won
        return batch_object(made, batch_usage(session, [made.id]).get(made.id))
    background.add_task(start_batch, settings, batch.id)
    return batch_object(batch)


def _shown(batch: Batch, counts: Counts | None) -> tuple[int, int] | None:
    """An open batch's (completed, failed) requests as counted now: its invalid lines fail too (``total`` counts
    every line, each valid one has jobs)."""
    if counts is None or batch.total is None:
        return None
    return counts.completed, batch.total - counts.pending - counts.completed


@router.get("", responses=openai_responses(400))
def list_batches(session: SessionDep, principal: CurrentPrincipal, settings: SettingsDep,
                 limit: Annotated[int, Query(ge=1, le=BATCHES_PAGE_MAX)] = 20, after: str | None = None
                 ) -> dict[str, Any]:
    try:
        rows = pagination.rows_after(session, select(Batch).where(Batch.tenant_id == principal.tenant_id,
                                                                     Batch.endpoint != MESSAGES), Batch,
                                     principal.tenant_id, after, limit)
    except pagination.UnknownCursor as exc:
        raise OpenAIError(400, exc.says("after", "batches"), param="after") from None
    page = rows[:limit]
    counts = fan_in_page(session, page, settings.data_dir, settings.redis_url)
    usage = batch_usage(session, (b.id for b in page))
    data = [batch_object(b, usage.get(b.id), _shown(b, counts.get(b.id))) for b in page]
    return {"object": "list", "data": data, "has_more": len(rows) > limit,
            "first_id": page[0].id if page else None, "last_id": page[-1].id if page else None}


@router.get("/{batch_id}", responses=openai_responses(404))
async def get_batch(batch_id: str, session: SessionDep, principal: CurrentPrincipal,
                    settings: SettingsDep) -> dict[str, Any]:
    def read() -> dict[str, Any]:
        batch = _own(session, principal, batch_id)
        if batch.status in ("in_progress", "cancelling"):
            maybe_finalize(session, batch_id, settings.data_dir, settings.redis_url)
            session.refresh(batch)
        return batch_object(batch, batch_usage(session, [batch_id]).get(batch_id))

    return await run_in_threadpool(read)


@router.post("/{batch_id}/cancel", responses=openai_responses(404, 409))
def cancel(batch_id: str, session: SessionDep, principal: CurrentPrincipal, settings: SettingsDep,
           background: BackgroundTasks) -> dict[str, Any]:
    batch = _own(session, principal, batch_id)
    # an ended batch, or one that ended on its own before the cancel's update (its window too): 409 (README)
    if batch.status not in ("validating", "in_progress", "cancelling") or not cancel_and_count(
            session, settings, batch, background.add_task):
        why = ": its completion window ended before the cancel" if batch.status == "expired" else ""
        raise OpenAIError(409, f"Cannot cancel a batch with status {batch.status!r}{why}", param="batch_id")
    return batch_object(batch, batch_usage(session, [batch_id]).get(batch_id))
