"""Jobs: submit, get, list (own tenant only) and cancel."""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated, Literal

from fastapi import APIRouter, Header, HTTPException, Query, Request, Response, status

from fastapi.concurrency import run_in_threadpool

from app.api.deps import CurrentPrincipal, SessionDep, SettingsDep
from app.db.session import get_sessionmaker
from app.schemas import JobCreate, JobList, JobPublic
from app.services import jobs as job_service
from app.services.notify import announce_cancel

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])


@router.post("", response_model=JobPublic, status_code=status.HTTP_201_CREATED)
async def create_job(spec: JobCreate, principal: CurrentPrincipal, settings: SettingsDep, request: Request,
                     response: Response,
                     idempotency_key: Annotated[str | None, Header(max_length=200)] = None) -> JobPublic:
    # async: the common path (no Idempotency-Key) validates on the loop and awaits the
    # group-commit writer, without a worker thread or a DB session per request
    writer = getattr(request.app.state, "job_writer", None)
    try:
        if writer is not None and not idempotency_key:
            job = job_service.build_job(settings, principal, spec)
            return JobPublic.of(await asyncio.wrap_future(writer.submit(job, "submitted via /v1/jobs")))
        submitted = await run_in_threadpool(_submit_with_session, settings, principal, spec, idempotency_key)
    except job_service.IdempotencyConflict as exc:
        raise HTTPException(status.HTTP_409_CONFLICT, str(exc)) from exc
    except job_service.JobValidationError as exc:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, str(exc)) from exc
    if not submitted.created:
        response.status_code = status.HTTP_200_OK
    return JobPublic.of(submitted.job)


def _submit_with_session(settings, principal, spec, idempotency_key):
    session = get_sessionmaker(settings.sqlalchemy_url)()
    try:
        return job_service.submit_job(session, principal, spec, settings, idempotency_key=idempotency_key)
    finally:
        session.close()


@router.get("", response_model=JobList)
def list_jobs(session: SessionDep, principal: CurrentPrincipal,
              status_: Annotated[str | None, Query(alias="status")] = None,
              kind: Literal["interactive", "batch"] | None = None, tier: str | None = None,
              limit: Annotated[int, Query(ge=1, le=500)] = 20, cursor: str | None = None,
              offset: Annotated[int | None, Query(ge=0)] = None) -> JobList:
    try:
        rows, nxt = job_service.list_jobs(session, principal.tenant_id, status=status_, kind=kind, tier=tier,
                                          limit=limit, cursor=cursor, offset=offset)
    except job_service.JobValidationError as exc:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, str(exc)) from exc
    return JobList(data=[JobPublic.of(j) for j in rows], next_cursor=nxt)


def _own_job(session, principal, job_id: str):
    job = job_service.get_job(session, principal.tenant_id, job_id)
    if job is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no job {job_id!r}")
    return job


@router.get("/{job_id}", response_model=JobPublic)
def get_job(job_id: str, session: SessionDep, principal: CurrentPrincipal) -> JobPublic:
    return JobPublic.of(_own_job(session, principal, job_id))


@router.post("/{job_id}/cancel", response_model=JobPublic)
def cancel_job(job_id: str, session: SessionDep, principal: CurrentPrincipal, settings: SettingsDep) -> JobPublic:
    job = _own_job(session, principal, job_id)
    if job_service.cancel_job(session, job):
        announce_cancel(settings.redis_url, job)
    return JobPublic.of(job)
