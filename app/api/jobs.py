"""Jobs: submit, get, list (own tenant only), follow as server-sent events, and cancel."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Header, HTTPException, Query, Request, Response, status
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse

from app.api.deps import CurrentPrincipal, SessionDep, SettingsDep, rate_limiter
from app.api.errors import CheckedRoute, responses, unprocessable
from app.db.models import JobStatus
from app.db.session import get_sessionmaker
from app.schemas import JobCreate, JobList, JobPublic
from app.services import jobs as job_service
from app.services.job_follow import job_events, rest_from_sql
from app.services.cancel import cancel
from app.services.rate_limits import RateLimited, rate_headers
from app.settings import Settings

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
              created_after: Annotated[datetime | None, Query(description="ISO 8601, exclusive")] = None,
              created_before: Annotated[datetime | None, Query(description="ISO 8601, exclusive")] = None,
              limit: Annotated[int, Query(ge=1, le=500)] = 20, cursor: str | None = None,
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
                                          batch_id=batch_id, created_after=created_after,
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


@router.get("/{job_id}", response_model=JobPublic, responses=responses(404))
def get_job(job_id: str, session: SessionDep, principal: CurrentPrincipal) -> JobPublic:
    return JobPublic.of(_own_job(session, principal, job_id))


@router.get("/{job_id}/stream", response_class=StreamingResponse,
            responses={200: {"content": {"text/event-stream": {}},
                             "description": "server-sent events: delta, status, then one end (or one "
                                            "error if the stream could not be read on)"}, **responses(404)})
def stream_job(job_id: str, session: SessionDep, principal: CurrentPrincipal, settings: SettingsDep
               ) -> StreamingResponse:
    """The job's tokens as they are generated, from its first token, then one ``end`` event.

    Events: ``delta`` ``{"text", "token_ids"}`` (and ``"logprobs"`` where the job asked for them),
    ``status`` ``{"status"}`` (relegated/resumed),
    ``end`` ``{"status", "finish_reason", "error", "error_code", "prompt_tokens", "completion_tokens",
    "cached_tokens", "reasoning_tokens"}``. A job
    that already finished answers its whole text as one delta and the end. Each character comes
    once, in order: across a Redis outage the stream resumes where it was, and text the stream
    lost comes with the end. If the stream stays unreadable (``stream_outage_s``) the last event
    is ``error`` ``{"id", "error", "code"}`` instead; the job goes on. Disconnecting does not
    cancel the job (``POST /v1/jobs/{id}/cancel`` does)."""
    job = _own_job(session, principal, job_id)
    return StreamingResponse(_sse_events(settings, job.id), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


async def _sse_events(settings: Settings, job_id: str) -> AsyncIterator[bytes]:
    delivered = 0  # characters sent, to fill in what the stream missed when SQL reports the end
    logprobs_sent = 0  # token logprobs sent, likewise
    try:
        async with aclosing(job_events(settings, job_id)) as events:
            async for ev in events:
                if ev.type == "delta":
                    if ev.text or ev.token_ids:
                        delivered += len(ev.text)
                        delta: dict[str, Any] = {"text": ev.text, "token_ids": ev.token_ids}
                        if "logprobs" in ev.data:
                            delta["logprobs"] = ev.data["logprobs"]
                            logprobs_sent += len(delta["logprobs"])
                        yield _sse("delta", delta)
                elif ev.type == "status":
                    yield _sse("status", {"status": ev.status})
                elif ev.type == "error":  # the stream could not be read on; the job goes on
                    yield _sse("error", {"id": job_id, "error": ev.data.get("error"), "code": ev.data.get("code")})
                    return
                elif ev.type == "end":
                    if ev.data.get("from_sql"):  # what SQL kept (a cancelled job keeps its text too)
                        rest, rest_logprobs = rest_from_sql(ev, delivered, logprobs_sent)
                        if rest or rest_logprobs:
                            yield _sse("delta", {"text": rest, "token_ids": []} | (
                                {"logprobs": rest_logprobs} if rest_logprobs is not None else {}))
                    yield _sse("end", {"id": job_id, "status": ev.status, "finish_reason": ev.finish_reason,
                                       "error": ev.data.get("error"), "error_code": ev.data.get("code"),
                                       "prompt_tokens": ev.data.get("prompt_tokens"),
                                       "completion_tokens": ev.data.get("completion_tokens"),
                                       "cached_tokens": ev.data.get("cached_tokens"),
                                       "reasoning_tokens": ev.data.get("reasoning_tokens")})
                    return
    except Exception:  # a bug or a database error: an error event rather than a body cut short
        log.exception("the stream of job %s failed", job_id)
        yield _sse("error", {"id": job_id, "error": f"the stream failed; the job goes on (GET /v1/jobs/{job_id})",
                             "code": "stream_interrupted"})


@router.post("/{job_id}/cancel", response_model=JobPublic, responses=responses(404))
def cancel_job(job_id: str, session: SessionDep, principal: CurrentPrincipal, settings: SettingsDep) -> JobPublic:
    job = _own_job(session, principal, job_id)
    cancel(session, settings, job, "cancelled by the user")
    return JobPublic.of(job)
