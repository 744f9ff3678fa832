"""Summarization API: start a map-reduce run over documents with a deadline, poll it, fetch results."""

from __future__ import annotations

import logging
import re
from datetime import timedelta
from functools import partial
from typing import Annotated, Any

from fastapi import APIRouter, Header, HTTPException, Query, Request, status
from fastapi.exceptions import RequestValidationError
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, field_validator
from sqlalchemy import select

from app.api.deps import CurrentPrincipal, SessionDep, SettingsDep, rate_limiter
from app.api.errors import CheckedRoute, responses, unprocessable
from app.bounds import RUNS_PAGE_MAX
from app.db import pagination
from app.db.models import SummarizationRun
from app.openai_schemas import list_page, parse_window
from app.schemas import MAX_WINDOW_S
from app.services.idempotency import Idempotency, IdempotencyConflict
from app.services.jobs import JobValidationError, resolve_model, resolve_tier
from app.services.rate_limits import RateLimited, rate_headers, take_request
from app.services.transitions import utcnow
from app.summarize import driver, service, store
from app.summarize.documents import Document
from app.wire import NumbersNotBooleans, SecondsOrWindow, Text, shown

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/summarize", tags=["summarize"], route_class=CheckedRoute, responses=responses(401))


class DocumentIn(BaseModel):
    id: Text = Field(min_length=1, max_length=200)
    text: Text = Field(min_length=1)

    @field_validator("text")
    @classmethod
    def _has_text(cls, text: str) -> str:
        if not text.strip():  # the model would summarize nothing into a made-up summary
            raise ValueError("the document has no text (only whitespace); leave it out")
        return text


class SummarizeCreate(NumbersNotBooleans):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # a NaN deadline is no deadline
    documents: list[DocumentIn] = Field(min_length=1, max_length=10_000)
    deadline: SecondsOrWindow = Field("2h", description="window ('30m', '2h', '7d') or seconds from now")
    max_summary_tokens: int = Field(128, ge=8, le=4096)
    chunk_tokens: int = Field(1024, ge=64, le=32_768, description="largest chunk of document text per job")
    overlap_tokens: int = Field(64, ge=0, le=1024)
    tier: Text | None = None
    model: Text | None = Field(None, description="the server's model (default) or one of its LoRA adapters")


REPEATS_SHOWN = 20  # repeated ids a 422 names one by one (10,000 documents may repeat thousands)


def repeated_ids(ids: list[str]) -> list[dict[str, Any]]:
    """A 422's errors for the ids given more than once: one at each repeat, naming the document it repeats (the
    first ``REPEATS_SHOWN``, the last of them counting the rest); none where all are unique."""
    first: dict[str, int] = {}
    repeats = [(i, first[doc_id]) for i, doc_id in enumerate(ids) if first.setdefault(doc_id, i) != i]
    errors = [{"type": "value_error", "loc": ("body", "documents", i, "id"),
               "msg": f"document id {shown(ids[i])} is also documents[{j}]'s: document ids must be unique"}
              for i, j in repeats[:REPEATS_SHOWN]]
    if len(repeats) > REPEATS_SHOWN:
        errors[-1]["msg"] += f" ({len(repeats) - REPEATS_SHOWN} more repeats not listed)"
    return errors


@router.post("", status_code=status.HTTP_201_CREATED,
             responses={200: {"description": "the run an earlier request with this Idempotency-Key started"},
                        **responses(409, 413, 429)})
async def start(body: SummarizeCreate, principal: CurrentPrincipal, settings: SettingsDep, request: Request,
                response: Response, idempotency_key: Annotated[str | None, Header(max_length=200)] = None) -> dict:
    """Starts a run: answers at once with the run ``validating`` (its documents are split off the request, by its
    first step, which ends it ``failed`` naming why where the split shows it cannot run); a retry with the same
    Idempotency-Key (and body) answers the run the first request started, one with a different body is a 409. A start
    is one request of the tenant's requests per minute (a 429 over it), as a batch's creation is; its jobs' tokens
    count against the batch queue limit instead, at its first step."""
    if repeats := repeated_ids([d.id for d in body.documents]):
        raise RequestValidationError(repeats)
    try:
        window = float(body.deadline) if isinstance(body.deadline, float | int) else parse_window(body.deadline)
    except ValueError as exc:
        raise unprocessable(str(exc), "body", "deadline") from exc
    try:
        tier = resolve_tier(settings, principal, body.tier)
    except JobValidationError as exc:
        raise unprocessable(str(exc), "body", "tier") from exc
    try:
        model = resolve_model(settings, body.model)
    except JobValidationError as exc:
        raise unprocessable(str(exc), "body", "model") from exc
    if window <= 0:
        raise unprocessable("deadline must be in the future", "body", "deadline")
    if window > MAX_WINDOW_S:  # also keeps now + window inside the calendar (1e12 s is 31,700 years)
        raise unprocessable(f"deadline {window:g}s is longer than {MAX_WINDOW_S / 86400:.0f} days; give a shorter one",
                            "body", "deadline")
    docs = [Document(d.id, d.text) for d in body.documents]
    idempotency = Idempotency.of(idempotency_key, body)  # two bodies of one window are the same, not its end
    start_run = partial(service.create_run, settings, principal, docs, utcnow() + timedelta(seconds=window),
                        max_summary_tokens=body.max_summary_tokens, chunk_tokens=body.chunk_tokens,
                        overlap_tokens=body.overlap_tokens, tier=tier, model=model, idempotency=idempotency,
                        charge=lambda: response.headers.update(rate_headers(  # once its row is in (a retry: uncharged)
                            take_request(rate_limiter(request), principal.tenant_id, principal.limits))))
    try:
        if idempotency is None:
            progress, created = await run_in_threadpool(start_run), True
        else:
            progress, created = await run_in_threadpool(service.start_idempotent_run, settings, principal,
                                                        idempotency, start_run)
    except RateLimited as exc:
        raise HTTPException(status.HTTP_429_TOO_MANY_REQUESTS, str(exc), headers=exc.decision.headers()) from exc
    except IdempotencyConflict as exc:
        raise HTTPException(status.HTTP_409_CONFLICT, str(exc)) from exc
    except JobValidationError as exc:
        raise unprocessable(str(exc), *(("body", exc.param) if exc.param else ("body",))) from exc
    except ValueError as exc:
        raise unprocessable(str(exc)) from exc
    if created:
        request.app.state.run_drivers.drive(settings, progress.id)
    else:
        response.status_code = status.HTTP_200_OK
    return progress.as_dict()


@router.get("", responses=responses(422))
def list_runs(session: SessionDep, principal: CurrentPrincipal,
              limit: Annotated[int, Query(ge=1, le=RUNS_PAGE_MAX)] = 20, after: str | None = None
              ) -> dict[str, Any]:
    """The tenant's runs, newest first; ``after``: the last id of the page before."""
    try:
        rows = pagination.rows_after(session, select(SummarizationRun).where(
            SummarizationRun.tenant_id == principal.tenant_id), SummarizationRun, principal.tenant_id, after, limit)
    except pagination.UnknownCursor as exc:
        raise unprocessable(exc.says("after", "summarization runs"), "query", "after") from None
    progress = store.page_progress(session, rows[:limit])
    return list_page(rows, None, limit, lambda run: progress[run.id].as_dict())


RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")  # new_id's shape; anything else (a NUL, a path) names no run


def _own(settings, principal, run_id: str, with_results: bool = False) -> store.RunView:
    run = service.view(settings, run_id, with_results) if RUN_ID.fullmatch(run_id) else None
    if run is None or run.tenant_id != principal.tenant_id:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no summarization {run_id!r}")
    return run


@router.get("/{run_id}", responses=responses(404))
def get_run(run_id: str, principal: CurrentPrincipal, settings: SettingsDep) -> dict:
    return _own(settings, principal, run_id).progress.as_dict()


@router.post("/{run_id}/cancel", responses=responses(404, 409))
def cancel_run(run_id: str, principal: CurrentPrincipal, settings: SettingsDep) -> dict:
    """Ends a running run: the documents not done yet fail with ``cancelled`` and their jobs are cancelled; the
    summaries made so far stay in its results. A run that had ended is a 409."""
    _own(settings, principal, run_id)
    try:
        cancelled = service.cancel(settings, run_id)
    except driver.RunBusy:
        raise HTTPException(status.HTTP_409_CONFLICT, "the run is being stepped right now; try again") from None
    progress = _own(settings, principal, run_id).progress
    if not cancelled:
        raise HTTPException(status.HTTP_409_CONFLICT, f"the run already ended ({progress.status})")
    return progress.as_dict()


@router.get("/{run_id}/results", response_class=Response,
            responses={200: {"content": {"application/jsonl": {}}, "description": "one summary per line"},
                       **responses(404, 409)})
def results(run_id: str, principal: CurrentPrincipal, settings: SettingsDep) -> Response:
    run = _own(settings, principal, run_id, with_results=True)
    if run.progress.status in store.OPEN or run.results is None:
        raise HTTPException(status.HTTP_409_CONFLICT, "the run is still going; poll until its status is completed")
    return Response(run.results, media_type="application/jsonl")
