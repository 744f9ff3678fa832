"""Jobs: submit, get, list (own tenant only), follow as server-sent events, and cancel."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Header, HTTPException, Query, Request, Response, status
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse

from app.api.deps import CurrentPrincipal, SessionDep, SettingsDep, rate_limiter
from app.api.errors import CheckedRoute, responses, unprocessable
from app.api.job_stream import resume_point, sse_events
from app.bounds import JOBS_PAGE_MAX
from app.db.models import JobStatus
from app.db.session import get_sessionmaker
from app.schemas import JobCancelled, JobCreate, JobList, JobPublic
from app.services import jobs as job_service
from app.services.answer_events import KEEPALIVE_COMMENT, kept_alive
from app.services.cancel import cancel
from app.services.rate_limits import RateLimited, rate_headers

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], route_class=CheckedRoute, responses=responses(401))

MAX_OFFSET = 2**31 - 1  # SQL takes a 64-bit OFFSET at most; no tenant pages this far


def _unprocessable(exc: job_service.JobValidationError) -> RequestValidationError:
    return unprocessable(str(exc), *(("body", exc.param) if exc.param else ("body",)))


@router.post("", response_model=JobPublic, status_code=status.HTTP_201_CREATED,
             responses={200: {"model": JobPublic, "description": "the job an earlier request with this "
                                                                 "Idempotency-Key created"},
                        **responses(409, 413, 429)})
async def create_job(spec: JobCreate, principal: CurrentPrincipal, settings: SettingsDep, request: Request,
                     response: Response,
                     idempotency_key: Annotated[str | None, Header(max_length=200)] = None) -> JobPublic | Response:
    # async: the common path (no Idempotency-Key) validates on the loop and awaits the
    # group-commit writer, without a worker thread or a DB session per request
    writer = getattr(request.app.state, "job_writer", None)
    try:
        if writer is not None and not idempotency_key:
            if job_service.input_chars(spec) > job_service.BIG_PROMPT_CHARS:
                # tokenizing a long prompt takes milliseconds to seconds: not on the event loop
                job = await run_in_threadpool(job_service.build_job, settings, principal, spec)
            else:
                job = job_service.build_job(settings, principal, spec)
            # the writer judges the tenant's rate limits for its whole batch in one Redis call
            written = await asyncio.wrap_future(writer.submit(job, "submitted via /v1/jobs",
                                                              job_service.rate_charge(principal, job)))
            # serialized here: a returned model would be validated again against response_model
            return Response(JobPublic.of(written.job).model_dump_json(), status.HTTP_201_CREATED,
                            media_type="application/json", headers=rate_headers(written.rate))
        submitted = await run_in_threadpool(_submit_with_session, settings, principal, spec, idempotency_key,
                                            rate_limiter(request))
    except RateLimited as exc:
        raise HTTPException(status.HTTP_429_TOO_MANY_REQUESTS, str(exc), headers=exc.decision.headers()) from exc
    except job_service.IdempotencyConflict as exc:
        raise HTTPException(status.HTTP_409_CONFLICT, str(exc)) from exc
    except job_service.JobValidationError as exc:
        raise _unprocessable(exc) from exc
    if not submitted.created:
        response.status_code = status.HTTP_200_OK
    response.headers.update(submitted.rate_headers())
    return JobPublic.of(submitted.job)


def _submit_with_session(settings, principal, spec, idempotency_key, limiter):
    session = get_sessionmaker(settings.sqlalchemy_url)()
    try:
        return job_service.submit_job(session, principal, spec, settings, idempotency_key=idempotency_key,
                                      limiter=limiter)
    finally:
        session.close()


@router.get("", response_model=JobList)
def list_jobs(session: SessionDep, principal: CurrentPrincipal, settings: SettingsDep,
              status_: Annotated[JobStatus | None, Query(alias="status")] = None,
              kind: Literal["interactive", "batch"] | None = None, tier: str | None = None,
              batch_id: Annotated[str | None, Query(max_length=40)] = None,
              request_id: Annotated[str | None, Query(max_length=256, description=(
                  "the X-Request-Id of the request that submitted the jobs"))] = None,
              created_after: Annotated[datetime | None, Query(description="ISO 8601, exclusive")] = None,
              created_before: Annotated[datetime | None, Query(description="ISO 8601, exclusive")] = None,
              limit: Annotated[int, Query(ge=1, le=JOBS_PAGE_MAX)] = 20, cursor: str | None = None,
              offset: Annotated[int | None, Query(ge=0, le=MAX_OFFSET)] = None) -> JobList:
    if tier is not None and tier not in settings.tiers:  # tiers are configurable, so checked here
        raise unprocessable(f"unknown tier {tier!r}; choose one of {list(settings.tiers)}", "query", "tier")
    for name, at in (("created_after", created_after), ("created_before", created_before)):
        if at is None:
            continue
        if at.tzinfo is None:
            raise unprocessable(f"{name} needs a timezone (e.g. '2030-01-01T12:00:00Z')", "query", name)
        try:
            at.astimezone(UTC)  # how it is compared with the stored times
        except OverflowError:  # year 1 or 9999 with an offset falls off the calendar in UTC
            raise unprocessable(f"{name} is out of range; give a time between years 1 and 9999", "query",
                                name) from None
    try:
        rows, nxt = job_service.list_jobs(session, principal.tenant_id, status=status_, kind=kind, tier=tier,
                                          batch_id=batch_id, request_id=request_id, created_after=created_after,
                                          created_before=created_before, limit=limit, cursor=cursor,
                                          offset=offset)
    except job_service.JobValidationError as exc:
        raise unprocessable(str(exc), "query", exc.param or "cursor") from exc
    return JobList(data=[JobPublic.of(j) for j in rows], next_cursor=nxt)


def _own_job(session, principal, job_id: str):
    job = job_service.get_job(session, principal.tenant_id, job_id)
    if job is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no job {job_id!r}")
    return job


@contextmanager
def acting_on_the_job() -> Iterator[None]:
    """An action on a job read before (a cancel, an admin's resume or promote): where the job's row was deleted
    since, a 404 naming the job, as for a job there is no such one (its re-read raised: a 500)."""
    try:
        yield
    except job_service.JobGone as exc:
        raise HTTPException(status.HTTP_404_NOT_FOUND, str(exc)) from None


@router.get("/{job_id}", response_model=JobPublic, responses=responses(404))
def get_job(job_id: str, session: SessionDep, principal: CurrentPrincipal) -> JobPublic:
    return JobPublic.of(_own_job(session, principal, job_id))


@router.get("/{job_id}/stream", response_class=StreamingResponse,
            responses={200: {"content": {"text/event-stream": {}},
                             "description": "server-sent events: delta, status, then one end (or one "
                                            "error if the stream could not be read on)"},
                        204: {"description": "Last-Event-ID is the end's: the stream has nothing left"},
                        **responses(404)})
def stream_job(job_id: str, session: SessionDep, principal: CurrentPrincipal, settings: SettingsDep,
               last_event_id: Annotated[str | None, Header(description=(
                   "the id of the last event read, to resume after it (what a browser's EventSource sends "
                   "when it reconnects)"))] = None) -> Response:
    """The job's tokens as they are generated, from its first token, then one ``end`` event.

    Events: ``delta`` ``{"text", "token_ids"}`` (and ``"logprobs"`` where the job asked for them),
    ``status`` ``{"status"}`` (relegated/resumed),
    ``end`` ``{"status", "finish_reason", "error", "error_code", "prompt_tokens", "completion_tokens",
    "cached_tokens", "reasoning_tokens"}``. A job
    that already finished replays its stream, or once that is gone (an hour after the end) its whole text and token
    ids as one delta, whose id is the live stream's last, and the end. Each character comes
    once, in order: across a Redis outage the stream resumes where it was, and text the stream
    lost comes with the end. If the stream stays unreadable (``stream_outage_s``) the last event
    is ``error`` ``{"id", "error", "code"}`` instead; the job goes on. Disconnecting does not
    cancel the job (``POST /v1/jobs/{id}/cancel`` does).

    Each ``delta`` has an SSE ``id`` (``<job id>:<position>``); reconnecting with it as ``Last-Event-ID`` resumes
    after that delta (``status`` events at that point come again); another job's id is a 422. The ``end`` has the
    id ``<job id>:end``: a reconnect after it is a 204, which stops an ``EventSource``."""
    job = _own_job(session, principal, job_id)
    resume = None
    if last_event_id is not None:
        try:
            resume = resume_point(job.id, last_event_id)
        except ValueError as exc:
            raise unprocessable(str(exc), "header", "last-event-id") from None
        if resume is None:
            return Response(status_code=status.HTTP_204_NO_CONTENT)
    return StreamingResponse(kept_alive(sse_events(settings, job.id, resume), KEEPALIVE_COMMENT),
                             media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


@router.post("/{job_id}/cancel", response_model=JobCancelled, responses=responses(404))
def cancel_job(job_id: str, session: SessionDep, principal: CurrentPrincipal, settings: SettingsDep) -> JobCancelled:
    job = _own_job(session, principal, job_id)
    with acting_on_the_job():
        cancelled = cancel(session, settings, job, "cancelled by the user")
    return JobCancelled(**dict(JobPublic.of(job)), cancelled=cancelled)
