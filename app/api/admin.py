"""Admin dashboard: a server-rendered page (Jinja2) whose JS polls the JSON endpoints here.

JSON endpoints need an admin API key. Actions: resume a relegated job, promote (change
tier), cancel an open job, cancel a running summarization run, drain/undrain a worker.
Resume/promote reach the job's worker over Redis pub/sub (``workers/control.py``) and are events of the job (from
and to its state: its worker moves it); drain is the ``workers.draining`` flag its heartbeat reads.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
from datetime import datetime, timedelta
from pathlib import Path
from typing import Annotated, Any, Literal

import redis
from fastapi import APIRouter, HTTPException, Query, Request, status
from fastapi.responses import FileResponse, HTMLResponse
from fastapi.templating import Jinja2Templates
from pydantic import BaseModel
from sqlalchemy import Row, func, insert, select, update
from sqlalchemy.orm import load_only

from app.api.deps import AdminPrincipal, SessionDep, SettingsDep
from app.api.errors import CheckedRoute, responses, unprocessable
from app.api.jobs import acting_on_the_job
from app.api.summarize import RUN_ID
from app.batch.queue_limit import queued_by_tenant
from app.db import pagination
from app.db.models import STAGED, Job, JobEvent, JobStatus, SummarizationRun, Tenant, WorkerState
from app.db.session import write_after_read
from app.observability.slo_chart import SLO_BUCKET_S, SLO_CHART
from app.schemas import JobPublic
from app.services import jobs as job_service
from app.services import lora_adapters, routing
from app.services.cancel import cancel as cancel_job
from app.services.dispatch import dispatch, send_back
from app.services.notify import redis_client
from app.services.transitions import ACTIVE, as_utc, utcnow
from app.services.usage import UsageQuery, completions_usage
from app.services.workers import heartbeat_cutoff, live_workers
from app.summarize import driver as summarize_driver
from app.summarize import service as summarize_service
from app.summarize import store as summarize_store
from app.wire import Text, utc_z
from workers.celery_app import message_priority

log = logging.getLogger(__name__)

router = APIRouter(tags=["admin"], route_class=CheckedRoute)
ADMIN = responses(401, 403)

APP_DIR = Path(__file__).resolve().parents[1]
templates = Jinja2Templates(directory=str(APP_DIR / "templates"))
STATIC = APP_DIR / "static"
OPEN = [s.value for s in JobStatus if not s.terminal]
JOBS_SHOWN = 500  # rows of the jobs table's page (the default and the most ``limit`` takes)
# the jobs table's statuses, in the order it lists them: the relegated first (what an operator acts on: a page must
# not hide them behind older running ones), then running, then those waiting for an engine
TABLE_STATUSES = (JobStatus.RELEGATED.value, JobStatus.RUNNING.value, JobStatus.DISPATCHED.value,
                  JobStatus.QUEUED.value)
TableStatus = Literal["relegated", "running", "dispatched", "queued"]
IN_ENGINE = [JobStatus.RELEGATED.value, JobStatus.RUNNING.value]  # the table's statuses when none is asked for
# what the overview's table and overdue_s read of a job
SHOWN_COLUMNS = (Job.id, Job.model, Job.tier, Job.kind, Job.status, Job.worker_id, Job.relegation_count,
                 Job.tenant_id, Job.created_at, Job.first_token_at, Job.deadline_at, Job.ttft_ms, Job.tbt_ms)


# the page runs its own script and style only (what a tenant's text would inject, were it not escaped, does not run)
# and no other site frames it (its buttons clicked through a page laid over it)
DASHBOARD_POLICY = {"Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; "
                                               "img-src 'self' data:; object-src 'none'; base-uri 'none'; "
                                               "form-action 'self'; frame-ancestors 'none'",
                    "X-Frame-Options": "DENY"}


@router.get("/admin", response_class=HTMLResponse, include_in_schema=False)
def dashboard(request: Request, settings: SettingsDep) -> HTMLResponse:
    return templates.TemplateResponse(request, "admin.html", {"model": settings.model_name,
                                                              "tiers": list(settings.tiers)},
                                      headers=DASHBOARD_POLICY)


@router.get("/admin/static/{name}", include_in_schema=False)
def static(name: str) -> FileResponse:
    path = (STATIC / name).resolve() if "\0" not in name else None  # a NUL makes resolve() raise
    if path is None or path.parent != STATIC.resolve() or not path.is_file():
        raise HTTPException(status.HTTP_404_NOT_FOUND, "no such file")
    return FileResponse(path)


@router.get("/favicon.ico", include_in_schema=False)
def favicon() -> FileResponse:
    return FileResponse(STATIC / "favicon.ico", media_type="image/x-icon",
                        headers={"Cache-Control": "public, max-age=86400"})


def overdue_s(job: Job, now: datetime, relegated_at: datetime | None = None) -> float:
    """Seconds the job is late now against the target it is judged by (0 when on time).

    A deadline (batch) job: its TTLT deadline. An interactive job before its first token: its
    TTFT (created + ttft_ms). After the first token a running job is on its TBT pace as far as
    SQL can tell (per-token times live in the worker), but a relegated one produces nothing:
    its next token was due one TBT after it was relegated (or after its first token).
    """
    if job.deadline_at is not None:
        due = as_utc(job.deadline_at)
    elif job.first_token_at is None:
        if not job.ttft_ms:
            return 0.0
        due = as_utc(job.created_at) + timedelta(milliseconds=job.ttft_ms)
    elif job.status == JobStatus.RELEGATED and job.tbt_ms:
        since = as_utc(job.first_token_at)
        if relegated_at is not None:
            since = max(since, as_utc(relegated_at))
        due = since + timedelta(milliseconds=job.tbt_ms)
    else:
        return 0.0
    return max(0.0, (now - due).total_seconds())


def _relegated_at(session, job_ids: list[str]) -> dict[str, datetime]:
    """When each of these jobs was last relegated (its job events)."""
    if not job_ids:
        return {}
    return {job_id: at for job_id, at in session.execute(
        select(JobEvent.job_id, func.max(JobEvent.at))
        # an event that left the job where it was (an operator's move to another tier, or resume) is no relegation
        .where(JobEvent.job_id.in_(job_ids), JobEvent.to_status == JobStatus.RELEGATED.value,
               JobEvent.from_status != JobEvent.to_status)
        .group_by(JobEvent.job_id))}




USAGE_COLUMNS = ("num_model_requests", "input_tokens", "output_tokens", "num_slo_met", "num_slo_missed",
                 "num_relegated")


TENANTS_SHOWN = 100  # rows of the tenants table's page (the default and the most ``limit`` takes)


def _tenant_cursor(name: str) -> str:
    """An opaque ``after`` naming the tenant after which the next page starts (by its name: the table's order, and
    unique), so the next page starts right even once tenants are added before it."""
    return base64.urlsafe_b64encode(name.encode()).decode().rstrip("=")


def _after_tenant(after: str) -> str:
    try:
        return base64.b64decode(after + "=" * (-len(after) % 4), altchars=b"-_", validate=True).decode()
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise unprocessable("after is not a cursor of this table: pass the tenants_next of the page before, or leave "
                            "it out for the first page", "query", "after") from None


@router.get("/admin/api/tenants", responses={**ADMIN, **responses(422)})
def tenants(session: SessionDep, _admin: AdminPrincipal,
            after: Annotated[str | None, Query(max_length=400, description=(
                "the page after this cursor (the tenants_next of the page before)"))] = None,
            limit: Annotated[int, Query(ge=1, le=TENANTS_SHOWN, description="the table's rows")] = TENANTS_SHOWN
            ) -> dict[str, Any]:
    """A page of the tenants by name (``limit``, after the cursor ``after``) with their limits, whether each is
    disabled, the tokens its batches and summarization runs have queued, and its last day's usage (the Usage API's sums
    over the jobs submitted in the 24 hours before now); ``tenants_total``: how many there are, ``tenants_before``: how
    many come before the page now, ``tenants_next``: the next page's cursor (None on the last). The dashboard reads
    it less often than the overview: the day's sums read a day of the page's jobs (by ``ix_jobs_created``)."""
    now = utcnow()
    query = select(Tenant).order_by(Tenant.name).limit(limit + 1)
    mark = _after_tenant(after) if after else None
    if mark is not None:
        query = query.where(Tenant.name > mark)
    page = list(session.scalars(query))
    more, page = len(page) > limit, page[:limit]
    ids = tuple(t.id for t in page)
    end = int(now.timestamp()) + 1  # exclusive: the jobs of this very second count too
    day = completions_usage(session, UsageQuery(end - 86400, end, "1d", 1, group_by=("project_id",),
                                                tenant_ids=ids), str) if ids else None
    usage = {r["project_id"]: r for r in day["data"][0]["results"]} if day else {}
    queued = queued_by_tenant(session, ids)
    rows = [{"id": t.id, "name": t.name, "default_tier": t.default_tier, "disabled": t.disabled,
             "requests_per_minute": t.requests_per_minute, "tokens_per_minute": t.tokens_per_minute,
             "batch_queue_tokens": t.batch_queue_tokens, "batch_queued_tokens": queued.get(t.id, 0),
             "day": {k: usage.get(t.id, {}).get(k, 0) for k in USAGE_COLUMNS}}
            for t in page]
    total = len(rows) if not (after or more) else session.scalar(select(func.count()).select_from(Tenant))
    before = session.scalar(select(func.count()).where(Tenant.name <= mark)) if after else 0
    return {"now": utc_z(now), "tenants": rows, "tenants_total": total, "tenants_before": before,
            "tenants_next": _tenant_cursor(page[-1].name) if more else None}


def _cursor(rank: int, job: Job) -> str:
    """An opaque ``after`` naming the table's row after which the next page starts (its place in the order, so the
    next page starts right even once that job has moved on)."""
    raw = json.dumps([rank, job.created_at.isoformat(), job.id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _after_cursor(after: str) -> tuple[int, datetime, str]:
    try:
        rank, created_at, job_id = json.loads(base64.urlsafe_b64decode(after + "=" * (-len(after) % 4)))
        if rank not in range(len(TABLE_STATUSES)) or not RUN_ID.fullmatch(job_id):  # ids share new_id's shape
            raise ValueError(after)
        return rank, datetime.fromisoformat(created_at), job_id
    except (ValueError, TypeError, binascii.Error, UnicodeDecodeError):
        raise unprocessable("after is not a cursor of this table: pass the jobs_next of the page before, or leave it "
                            "out for the first page", "query", "after") from None


def jobs_page(session, shown: list[str], after: tuple[int, datetime, str] | None, limit: int,
              open_counts: dict[str, int] | None = None) -> tuple[list[Job], int, str | None]:
    """The jobs table's page: the jobs in ``shown`` statuses after the cursor, how many there are in all (so a cut
    table says so; summed from ``open_counts``, the open jobs by status, where given), and the cursor of the next page
    (None on the last). In TABLE_STATUSES' order, each status oldest first: one query a status, each reading its page
    on ``ix_jobs_status_created`` (one sorted by a rank of the status read every job shown), only the columns shown (a
    row's prompt and messages stay in SQL)."""
    start = after[0] if after else 0
    active: list[Job] = []
    for rank, st in enumerate(TABLE_STATUSES):
        if st not in shown or rank < start:
            continue
        if len(active) > limit:
            break
        query = select(Job).options(load_only(*SHOWN_COLUMNS)).where(Job.status == st)
        if after and rank == start:
            query = query.where(pagination.after(Job, after[1], after[2], newest_first=False))
        active += session.scalars(query.order_by(*pagination.in_order(Job, newest_first=False))
                                  .limit(limit + 1 - len(active)))
    more, active = len(active) > limit, active[:limit]
    if not (after or more):
        total = len(active)
    elif open_counts is not None:
        total = sum(open_counts.get(st, 0) for st in shown)
    else:
        total = session.scalar(select(func.count()).where(Job.status.in_(shown)))
    return active, total, _cursor(TABLE_STATUSES.index(active[-1].status), active[-1]) if more else None


def rows_before(session, shown: list[str], after: tuple[int, datetime, str], open_counts: dict[str, int]) -> int:
    """How many rows of the table come before the cursor ``after`` now (the page's first row number, less one): the
    statuses listed before its status (from ``open_counts``), and its status's jobs up to its job (on
    ``ix_jobs_status_created``). Counted as of now, not from the pages an operator turned, which drift as jobs move
    on."""
    rank, created_at, job_id = after
    earlier = sum(open_counts.get(st, 0) for st in TABLE_STATUSES[:rank] if st in shown)
    return earlier + session.scalar(select(func.count()).where(
        Job.status == TABLE_STATUSES[rank], ~pagination.after(Job, created_at, job_id, newest_first=False)))


@router.get("/admin/api/overview", responses={**ADMIN, **responses(422)})
def overview(session: SessionDep, settings: SettingsDep, _admin: AdminPrincipal,
             minutes: Annotated[int, Query(ge=1, le=24 * 60)] = 60,
             status_: Annotated[list[TableStatus] | None, Query(alias="status", description=(
                 "the jobs table's statuses (repeat for several); default: relegated and running"))] = None,
             after: Annotated[str | None, Query(max_length=400, description=(
                 "the jobs table's page after this cursor (the jobs_next of the page before)"))] = None,
             limit: Annotated[int | None, Query(ge=1, le=JOBS_SHOWN, description="the jobs table's rows")] = None
             ) -> dict[str, Any]:
    now = utcnow()
    queues = [{"tier": tier, "status": st, "count": n} for st, tier, n in session.execute(
        select(Job.status, Job.tier, func.count()).where(Job.status.in_(OPEN)).group_by(Job.status, Job.tier))]
    limit = min(limit or JOBS_SHOWN, JOBS_SHOWN)
    shown = [st for st in TABLE_STATUSES if st in (status_ or IN_ENGINE)]
    by_status: dict[str, int] = {}
    for q in queues:
        by_status[q["status"]] = by_status.get(q["status"], 0) + q["count"]
    cursor = _after_cursor(after) if after else None
    active, total, jobs_next = jobs_page(session, shown, cursor, limit, by_status)
    before = rows_before(session, shown, cursor, by_status) if cursor else 0
    relegated_at = _relegated_at(session, [j.id for j in active if j.status == JobStatus.RELEGATED])
    jobs = []
    for j in active:
        # the worker records first_token_at when the first token comes out, so every running job
        # is judged: TTFT before it, TBT while relegated after it, TTLT for deadline jobs
        jobs.append({"id": j.id, "model": j.model, "tier": j.tier, "kind": j.kind, "status": j.status,
                     "worker_id": j.worker_id,
                     "relegation_count": j.relegation_count, "tenant_id": j.tenant_id,
                     "age_s": round((now - as_utc(j.created_at)).total_seconds(), 3),
                     "first_token": j.first_token_at is not None,
                     "overdue_s": round(overdue_s(j, now, relegated_at.get(j.id)), 3)})
    alive_since = heartbeat_cutoff(settings, now)
    loaded = lora_adapters.loaded(settings)  # a worker that loads adapters at runtime serves its model's
    workers = [{"id": w.id, "model": w.model, "device": w.device, "draining": w.draining,
                "stopping": routing.stopping(w.state),  # a warm shutdown's grace: it takes no job
                "served": [*w.served, *(name for name, a in loaded.items() if a.model == w.model and
                                        (w.state or {}).get("runtime_lora"))],
                "heartbeat_age_s": round((now - as_utc(w.heartbeat_at)).total_seconds(), 2), "state": w.state or {},
                "alive": as_utc(w.heartbeat_at) >= alive_since}  # a worker that stopped without a word is "lost"
               for w in session.scalars(select(WorkerState).order_by(WorkerState.id))]
    return {"now": utc_z(now), "queues": queues, "jobs": jobs, "jobs_total": total, "jobs_next": jobs_next,
            "jobs_before": before,
            "jobs_status": shown, "workers": workers, "slo": SLO_CHART.series(session, minutes),
            "slo_window_s": minutes * 60, "slo_bucket_s": SLO_BUCKET_S}


def _job(session, job_id: str) -> Job:
    job = job_service.get_job(session, None, job_id)
    if job is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no job {job_id!r}")
    return job


REQUEST_JOBS_SHOWN = 100  # a request of many prompts or choices has a job each


@router.get("/admin/api/jobs", responses=ADMIN)
def jobs_of_request(session: SessionDep, _admin: AdminPrincipal,
                    request_id: Annotated[str, Query(min_length=1, max_length=256, description=(
                        "the X-Request-Id of the request that submitted the jobs"))]) -> dict[str, Any]:
    """Any tenant's jobs submitted by one request (its ``X-Request-Id``, as a client reports it), oldest first:
    the dashboard's search takes a request id as well as a job id (by ``ix_jobs_request``)."""
    rows = session.execute(select(Job.id, Job.tenant_id, Job.status, Job.tier, Job.created_at)
                           # a fan-out's staged jobs are not its batch's yet
                           .where(Job.request_id == request_id, ~Job.status.startswith(STAGED))
                           .order_by(Job.created_at, Job.id)
                           .limit(REQUEST_JOBS_SHOWN + 1)).all()
    return {"request_id": request_id, "has_more": len(rows) > REQUEST_JOBS_SHOWN,
            "data": [{"id": r.id, "tenant_id": r.tenant_id, "status": r.status, "tier": r.tier,
                      "created_at": utc_z(as_utc(r.created_at))} for r in rows[:REQUEST_JOBS_SHOWN]]}


@router.get("/admin/api/jobs/{job_id}", responses={**ADMIN, **responses(404)})
def job_history(job_id: str, session: SessionDep, _admin: AdminPrincipal) -> dict[str, Any]:
    """Any tenant's job as ``GET /v1/jobs/{id}`` shows it to its tenant, with its tenant and its state transitions
    (who made each and why: a relegation names the tier and the deadline)."""
    job = _job(session, job_id)
    events = session.scalars(select(JobEvent).where(JobEvent.job_id == job.id).order_by(JobEvent.id))
    return {"job": JobPublic.of(job).model_dump(mode="json"), "tenant_id": job.tenant_id,
            "events": [{"at": utc_z(as_utc(e.at)), "from": e.from_status, "to": e.to_status, "worker_id": e.worker_id,
                        "attempt": e.attempt, "detail": e.detail} for e in events]}


def _control(settings, worker_id: str | None, message: dict[str, Any]) -> bool:
    """Tells ``worker_id`` (the worker holding the job) the operator's action on ``message``'s job."""
    if not settings.redis_url or not worker_id:
        return False
    from workers.control import control_channel

    try:
        receivers = redis_client(settings.redis_url).publish(control_channel(worker_id), json.dumps(message))
    except redis.RedisError as exc:  # what SQL holds stands (a promote's tier); "delivered" false says the worker
        # was not told
        log.warning("could not tell worker %s to %s job %s: %s", worker_id, message["action"], message["job_id"],
                    exc)
        return False
    return receivers > 0


def _tell_holder(settings, written: Row | Job, message: dict[str, Any]) -> dict[str, Any]:
    """An action's answer of who heard it: ``worker_id``, the worker holding the job as the action's write (or, where
    it wrote nothing, its read) found it, and ``delivered``, whether it heard the message; null where no worker holds
    the job (queued or dispatched: the worker that leases it reads what SQL holds then), so there was nothing to
    tell."""
    if written.status not in ACTIVE:
        return {"delivered": None, "worker_id": None}
    return {"delivered": _control(settings, written.worker_id, message), "worker_id": written.worker_id}


def _not_staged(job: Job) -> Job:
    """The job, refused (409) where it is staged: a batch's fan-out (or a summarization run's first step) wrote it
    and has not started it, so it has neither started nor ended, and no action of an operator takes it (it
    becomes queued when its batch starts, or is deleted)."""
    if not job.status.startswith(STAGED):
        return job
    owner = (f"its batch {job.batch_id}" if job.batch_id else
             f"its summarization run {job.summarization_run_id}" if job.summarization_run_id else "its batch")
    raise HTTPException(status.HTTP_409_CONFLICT,
                        f"job {job.id} has not started yet: {owner} is still writing its jobs, and this one becomes "
                        f"queued when that starts (or is dropped if it never does); act on it then, or on {owner}")


def _mark_by_admin(session, job_id: str, where: tuple[Any, ...], values: dict[str, Any], detail: str) -> Row | None:
    """Writes ``values`` on the job where ``where`` holds, with an event of it that leaves its state where it was
    (from and to: its state as the write found it; its worker moves it, if at all); the job's status and worker as
    the write found them, None where ``where`` did not hold. The caller commits."""
    written = session.execute(update(Job).where(Job.id == job_id, *where).values(**values)
                              .returning(Job.status, Job.worker_id, Job.attempt)
                              .execution_options(synchronize_session=False)).first()
    if written is not None:
        session.execute(insert(JobEvent).values(job_id=job_id, from_status=written.status, to_status=written.status,
                                                at=utcnow(), attempt=written.attempt, detail=detail))
    return written


@router.post("/admin/api/jobs/{job_id}/resume", responses={**ADMIN, **responses(404, 409)})
def resume(job_id: str, session: SessionDep, settings: SettingsDep, _admin: AdminPrincipal) -> dict[str, Any]:
    """Asks the worker holding a relegated job to resume it; the job's events say the operator did (the job stays
    relegated until its engine takes it back: "engine resumed it"). A job whose worker is lost is given back for a
    live worker to run (``_rerun_elsewhere``)."""
    job = _not_staged(_job(session, job_id))
    relegated = JobStatus.RELEGATED.value
    if job.status == relegated:
        lost_since = _lost_since(session, settings, job.worker_id)
        if lost_since is not None:
            answer = _rerun_elsewhere(session, settings, job, lost_since)
        else:
            answer = _ask_holder_to_resume(session, settings, job_id)
        if answer is not None:
            return answer
        with acting_on_the_job():
            job_service.reread(session, job)
    raise HTTPException(status.HTTP_409_CONFLICT, f"job {job_id} is {job.status}, not relegated")


def _ask_holder_to_resume(session, settings, job_id: str) -> dict[str, Any] | None:
    """Records the operator's resume and tells the job's worker; None where the job left relegated meanwhile."""
    relegated = JobStatus.RELEGATED.value
    with write_after_read(session):  # only a job still relegated, even if its engine resumed it since the read
        written = _mark_by_admin(session, job_id, (Job.status == relegated,), {"status": relegated},
                                 "resumed by an admin")
        session.commit()
    if written is None:
        return None
    return {"id": job_id, "action": "resume", **_tell_holder(settings, written, {"action": "resume", "job_id": job_id})}


def _lost_since(session, settings, worker_id: str | None) -> datetime | None:
    """The last heartbeat of ``worker_id`` where it is lost (stopped beating: killed, or its host gone), as the
    dashboard's workers table reads it; None where it is live, or no heartbeat of it is known to judge it by."""
    beat = session.scalar(select(WorkerState.heartbeat_at).where(WorkerState.id == worker_id)) if worker_id else None
    return beat if beat is not None and as_utc(beat) < heartbeat_cutoff(settings) else None


def _rerun_elsewhere(session, settings, job: Job, lost_since: datetime) -> dict[str, Any] | None:
    """Resumes a relegated job whose worker is lost, which no message reaches: given back as the sweeper gives back a
    job whose lease expired (``give_back_lost``: queued, or failed on its last allowed attempt), at once rather than
    when that lease runs out, and sent to the head of its model's queue for a live worker to run it (a new attempt,
    as after a lease that expired). None where it left relegated or its worker meanwhile (the caller rereads it)."""
    from workers.sweeper import end_streams, give_back_lost

    lost, attempt, model, kind = job.worker_id, job.attempt, job.model, job.kind  # as read: the write expires them
    since = f"its last heartbeat {utc_z(as_utc(lost_since))}"
    with write_after_read(session):  # only a job still relegated on the lost worker
        to, end = give_back_lost(session, job, settings.max_attempts, where=[Job.worker_id == lost],
                                 detail=f"resumed by an admin: its worker {lost} is lost ({since}); given back to run "
                                        "on another",
                                 cause=f"its worker {lost} stopped beating ({since}) and an admin's resume gave it "
                                       "back on its last allowed attempt")
        session.commit()
    if to is None:
        return None
    answer = {"id": job.id, "action": "resume", "delivered": False, "worker_id": lost, "worker_lost": True}
    if to is JobStatus.FAILED:
        end_streams(settings.redis_url, [(job.id, end)])
        return {**answer, "status": to.value,
                "detail": f"worker {lost} is lost and the job had run its last allowed attempt: {end.data['error']}"}
    queue = lora_adapters.queue_models(session, {model})[model]
    sent = bool(settings.redis_url) and dispatch(session, settings.redis_url, job.id, queue, send=send_back,
                                                 detail="sent by an admin's resume", priority=message_priority(kind))
    takers = [w.id for w in live_workers(session, settings) if model in w.served]
    where = (f"a live worker of its model ({', '.join(takers)}) runs it next" if takers else
             "no live worker of its model takes jobs now: the first that starts runs it")
    return {**answer, "status": (JobStatus.DISPATCHED if sent else JobStatus.QUEUED).value,
            "detail": f"worker {lost} is lost ({since}): the job was given back to its model's queue "
                      f"{'at its head' if sent else '(the broker is away: the sweeper sends it)'}, and {where}, "
                      f"as its attempt {attempt + 1}"}


class Promote(BaseModel):
    tier: Text


def _move_tier(session, job_id: str, was: str, tier: str) -> Row | None:
    """Moves the job from tier ``was`` to ``tier`` if it has not ended and is still at ``was`` (another operator's
    promote may have moved it since ``was`` was read), with an event of it; None where it had ended or moved. The
    caller commits."""
    return _mark_by_admin(session, job_id, (Job.status.in_(OPEN), Job.tier == was), {"tier": tier},
                          f"moved from tier {was} to {tier} by an admin")


def _promote_message(settings, job_id: str, attempt: int, tier: str, raised: bool) -> dict[str, Any]:
    """The control message of a promote to ``tier`` (``workers/control.py``): the engine knows free and paid; a job
    moved up (``raised``) that was relegated comes back, one moved down stays where it is. ``attempt``, the one the
    write found, lets a worker that has not added it yet apply the tier when it does."""
    return {"action": "promote", "job_id": job_id, "attempt": attempt, "tier": settings.engine_tier(tier).value,
            "resume": raised}


@router.post("/admin/api/jobs/{job_id}/promote", responses={**ADMIN, **responses(404, 409, 413)})
def promote(job_id: str, body: Promote, session: SessionDep, settings: SettingsDep,
            _admin: AdminPrincipal) -> dict[str, Any]:
    if body.tier not in settings.tiers:
        raise unprocessable(f"tier must be one of {list(settings.tiers)}", "body", "tier")
    job = _not_staged(_job(session, job_id))
    was = job.tier
    if body.tier == was and job.status in OPEN:  # nothing to move nor to record; its worker hears the tier again
        return {"id": job_id, "action": "promote", "tier": body.tier, "moved": False,
                "detail": f"job {job_id} is at tier {was} already: nothing moved (its worker, if one holds it, is "
                          "told that tier again)",
                **_tell_holder(settings, job, _promote_message(settings, job_id, job.attempt, was, raised=False))}
    raised = settings.tier_rank(body.tier) > settings.tier_rank(was)
    with write_after_read(session):  # never a job that ended or moved, even between the read and this write
        moved = _move_tier(session, job_id, was, body.tier)
        session.commit()
    if moved is None:
        with acting_on_the_job():
            job_service.reread(session, job)
        if job.status in OPEN:
            raise HTTPException(status.HTTP_409_CONFLICT,
                                f"job {job_id} is at tier {job.tier} now, not {was}: another operator moved it "
                                f"meanwhile; promote it again from {job.tier} if it is still to go to {body.tier}")
        raise HTTPException(status.HTTP_409_CONFLICT, f"job {job_id} already ended ({job.status})")
    # told to the worker the write found (one that leased the job after the read runs it at the tier its lease read)
    told = _tell_holder(settings, moved, _promote_message(settings, job_id, moved.attempt, body.tier, raised))
    return {"id": job_id, "action": "promote", "tier": body.tier, "moved": True, **told}


@router.post("/admin/api/jobs/{job_id}/cancel", responses={**ADMIN, **responses(404, 409)})
def cancel(job_id: str, session: SessionDep, settings: SettingsDep, _admin: AdminPrincipal) -> dict[str, Any]:
    """Cancels an open job; one that had ended (before the read, or between it and the cancel's write) is a 409
    naming its end, as for a resume or promote of it (a tenant's cancel answers ``cancelled: false``)."""
    job = _not_staged(_job(session, job_id))
    with acting_on_the_job():
        if not cancel_job(session, settings, job, "cancelled by an admin"):
            raise HTTPException(status.HTTP_409_CONFLICT, f"job {job_id} already ended ({job.status}): nothing to "
                                                          "cancel")
    return {"id": job_id, "action": "cancel", "cancelled": True}


class Drain(BaseModel):
    drain: bool = True


@router.post("/admin/api/workers/{worker_id}/drain", responses={**ADMIN, **responses(404, 413)})
def drain(worker_id: str, body: Drain, session: SessionDep, _admin: AdminPrincipal) -> dict[str, Any]:
    with write_after_read(session):
        n = session.execute(update(WorkerState).where(WorkerState.id == worker_id)
                            .values(draining=body.drain)).rowcount
        session.commit()
    if not n:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no worker {worker_id!r}")
    return {"id": worker_id, "draining": body.drain}


RUN_STATUSES = ("validating", "running", "cancelling", "failed", "completed", "cancelled")
RunStatus = Literal["validating", "running", "cancelling", "failed", "completed", "cancelled"]
RUNS_SHOWN = 50  # rows of the summarization runs' table (the default and the most ``limit`` takes)


def _tenant_names(session, tenant_ids: set[str]) -> dict[str, str]:
    return dict(session.execute(select(Tenant.id, Tenant.name).where(Tenant.id.in_(tenant_ids))).all())


def _run_row(run: SummarizationRun, progress: summarize_store.Progress, tenants: dict[str, str]) -> dict[str, Any]:
    """``progress``: the run's (``summarize_store.page_progress``: a live run's jobs_done as of now)."""
    return {**progress.as_dict(), "tenant_id": run.tenant_id,
            "tenant": tenants.get(run.tenant_id), "tier": run.tier, "created_at": utc_z(as_utc(run.created_at)),
            "finished_at": utc_z(as_utc(run.finished_at)) if run.finished_at else None}


@router.get("/admin/api/summarizations", responses={**ADMIN, **responses(422)})
def summarizations(session: SessionDep, _admin: AdminPrincipal,
                   status_: Annotated[list[RunStatus] | None, Query(alias="status", description=(
                       "only the runs in these statuses (repeat for several); default: all"))] = None,
                   limit: Annotated[int, Query(ge=1, le=RUNS_SHOWN)] = RUNS_SHOWN,
                   after: Annotated[str | None, Query(max_length=64, description=(
                       "the last id of the page before"))] = None) -> dict[str, Any]:
    """Every tenant's summarization runs (``/v1/summarize``), newest first, with their progress as their tenant
    polls it and why one failed or was cancelled; ``counts``: how many runs there are in each status."""
    query = select(SummarizationRun)
    if status_:
        query = query.where(SummarizationRun.status.in_(status_))
    mark = None
    if after:
        mark = session.get(SummarizationRun, after) if RUN_ID.fullmatch(after) else None
        if mark is None:
            raise unprocessable(f"no summarization {after!r}: pass the last id of the page before", "query", "after")
    rows = pagination.page_after(session, query, SummarizationRun, mark, limit)
    tenants = _tenant_names(session, {r.tenant_id for r in rows})
    counts = dict(session.execute(select(SummarizationRun.status, func.count())
                                  .group_by(SummarizationRun.status)).all())
    progress = summarize_store.page_progress(session, rows[:limit])
    return {"data": [_run_row(r, progress[r.id], tenants) for r in rows[:limit]], "has_more": len(rows) > limit,
            "counts": {st: counts.get(st, 0) for st in RUN_STATUSES}}


@router.post("/admin/api/summarizations/{run_id}/cancel", responses={**ADMIN, **responses(404, 409)})
def cancel_summarization(run_id: str, session: SessionDep, settings: SettingsDep,
                         _admin: AdminPrincipal) -> dict[str, Any]:
    """Any tenant's running run ends as ``POST /v1/summarize/{id}/cancel`` ends it, its ``reason`` naming the admin:
    the documents not done fail, their jobs are cancelled, the summaries made so far stay."""
    if not RUN_ID.fullmatch(run_id) or session.get(SummarizationRun, run_id) is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no summarization {run_id!r}")
    try:
        cancelled = summarize_service.cancel(settings, run_id, summarize_driver.BY_ADMIN)
    except summarize_driver.RunBusy:
        raise HTTPException(status.HTTP_409_CONFLICT, "the run is being stepped right now; try again") from None
    session.rollback()  # a new read: the cancel wrote in sessions of its own
    run = session.get(SummarizationRun, run_id)
    if not cancelled:
        raise HTTPException(status.HTTP_409_CONFLICT, f"the run is {run.status}: only a running run can be cancelled")
    return {**_run_row(run, summarize_store.progress_of(run, session), _tenant_names(session, {run.tenant_id})),
            "action": "cancel", "cancelled": True}
