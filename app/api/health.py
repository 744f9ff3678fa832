"""Liveness (``/healthz``), readiness (``/readyz``: DB, Redis, a live worker serving the model; warnings, e.g. a
worker that cannot run structured outputs), and vLLM's server's probes under its names (``/health``: ready or not,
as the status code says; ``/version``), for load balancers set up for it."""

from __future__ import annotations

import logging
from importlib.metadata import version as package_version

from fastapi import APIRouter, HTTPException
from fastapi.responses import JSONResponse, Response
from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from app.api.deps import SessionDep, SettingsDep
from app.db.migrate import schema_problem
from app.db.models import Job, JobStatus, WorkerState
from app.db.session import DATABASE_ERRORS, database_unavailable, unavailable_reason
from app.services.model_info import context_length
from app.services.notify import redis_client
from app.services.routing import grammar_unavailable_of
from app.services.workers import live_workers, served_context
from app.settings import Settings
from workers.engine_thread import KEPT_ABORT_LEASES

log = logging.getLogger(__name__)

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"description": "a check failed (the body says which)"}})
def readyz(session: SessionDep, settings: SettingsDep) -> JSONResponse:
    ready, checks = _readiness(session, settings)
    return JSONResponse({"status": "ready" if ready else "not ready", "checks": checks},
                        status_code=200 if ready else 503)


def _readiness(session: Session, settings: Settings) -> tuple[bool, dict[str, str]]:
    """Whether the service can serve, and each check's outcome (DB, Redis, a live worker)."""
    checks: dict[str, str] = {}
    try:
        session.execute(text("SELECT 1"))
        problem = schema_problem(session.connection())
        checks["database"] = "ok" if problem is None else f"error: {problem}"
    except Exception as exc:
        checks["database"] = f"error: {exc.__class__.__name__}"
    try:
        if not settings.redis_url:
            raise RuntimeError("REDIS_URL is not set")
        redis_client(settings.redis_url).ping()
        checks["redis"] = "ok"
    except Exception as exc:
        checks["redis"] = f"error: {exc}"
    if checks["database"] == "ok":
        checks.update(_worker_checks(session, settings))
    else:
        checks["workers"] = "unknown"
    # a warning (an adapter no live worker serves) is reported without taking the model's service down
    return all(not v.startswith("error") and v != "unknown" for v in checks.values()), checks


def _worker_checks(session: Session, settings: Settings) -> dict[str, str]:
    """A live worker serves the API's model, and one serves each of its adapters; a job for a model no worker
    consumes would wait in its queue for good."""
    live = live_workers(session, settings)  # a draining or stopping one takes no job: not ready on it alone
    if not live:
        leaving = len(live_workers(session, settings, leaving=True))
        return {"workers": "error: no live worker" + (f" taking jobs ({leaving} draining or stopping)" if leaving
                                                      else "")}
    served = {m for w in live for m in w.served}
    if settings.model_name not in served:
        return {"workers": f"error: {len(live)} live, none serving {settings.model_name!r} "
                           f"(they serve {', '.join(repr(m) for m in sorted(served))}: set COSERVE_MODEL_NAME alike)"}
    checks = {"workers": f"{len(live)} live"}
    if unserved := [name for name in settings.lora_modules if name not in served]:
        checks["adapters"] = (f"warning: no live worker serves {', '.join(repr(m) for m in unserved)}; their jobs "
                              "wait in the queue (give the workers the same COSERVE_LORA_MODULES)")
    if settings.runtime_lora and not any((w.state or {}).get("runtime_lora") for w in live
                                         if settings.model_name in w.served):
        checks["runtime_lora"] = ("warning: no live worker of the model loads adapters at runtime; jobs of the "
                                  "adapters loaded so fail (set COSERVE_RUNTIME_LORA=1 on the workers too)")
    if unserved := {(w.id, name): why for w in live if settings.model_name in w.served
                    for name, why in ((w.state or {}).get("lora_unserved") or {}).items()}:
        checks["lora_unserved"] = ("warning: " + "; ".join(f"worker {w!r} cannot serve the runtime adapter {name!r} "
                                                           f"({why})" for (w, name), why in sorted(unserved.items()))
                                   + "; their jobs go to the model's other workers, and fail where none serves them "
                                   "(unload them, or start those workers with engines that serve them)")
    if warning := _context_warning(session, settings):
        checks["context_length"] = warning
    if set_aside := {w.id: n for w in live if (n := (w.state or {}).get("set_aside_jobs"))}:
        checks["set_aside"] = ("warning: " + ", ".join(f"{w} set aside {n}" for w, n in sorted(set_aside.items()))
                               + " job attempts whose abort the engine has not confirmed (a rerun of their job runs "
                               "beside them; a worker stops, for a fresh engine, once its engine still holds one "
                               f"{KEPT_ABORT_LEASES} leases ({KEPT_ABORT_LEASES * settings.lease_seconds:g} s) after "
                               "its abort; the worker's log names them)")
    if warning := _grammar_warning(live, settings.model_name):
        checks["structured_outputs"] = warning
    if settings.lora_resolver_dir is not None and not settings.lora_resolver_dir.expanduser().is_dir():
        checks["lora_resolver_dir"] = (f"warning: COSERVE_LORA_RESOLVER_DIR {str(settings.lora_resolver_dir)!r} is "
                                       "not a directory this API can read; requests that name its adapters fail")
    return checks


def _grammar_warning(live: list[WorkerState], model: str) -> str | None:
    """A warning naming each live worker of ``model`` whose engine cannot run a structured output, and why, as its
    heartbeat says (``routing.grammar_unavailable_of``): while one is live, the API refuses every structured output
    of the model (``output_constraints.unusable_refusal``); None where none says so."""
    if not (unusable := grammar_unavailable_of(live, model)):
        return None
    named = "; ".join(f"worker {w!r} cannot run a structured output ({why})" for w, why in sorted(unusable.items()))
    return (f"warning: {named}; while it is live, every request of the model with a structured output is refused "
            "(stop it, or restart it with a backend that runs)")


def _context_warning(session: Session, settings: Settings) -> str | None:
    """A warning where a live worker of the model serves less context than this API's engine settings say (its vLLM
    engine set shorter than the API knows): jobs are held to the worker's (``held_context_length``)."""
    served = served_context(session, settings)
    try:
        own = context_length(settings)
    except Exception:  # noqa: BLE001 - no model config here: the submit path reports that itself
        return None
    if served is None or served >= own:
        return None
    fix = (f"set COSERVE_VLLM_MAX_MODEL_LEN={served} on the API to match" if settings.backend != "torch" else
           "the own engine fits its context to its KV cache: give the worker more COSERVE_KV_BLOCKS, or more device "
           "memory, to serve the model's")
    return (f"warning: a live worker serves a context of {served} tokens, this API's engine settings say {own}; "
            f"jobs are held to {served} ({fix})")


_PROBE = {200: {"description": "ready (empty body)", "content": None},
          503: {"description": "not ready (empty body): /readyz says why", "content": None}}


@router.get("/health", response_class=Response, responses=_PROBE)
def health(session: SessionDep, settings: SettingsDep) -> Response:
    """vLLM's probe: 200 with an empty body where the service can serve (``/readyz``'s checks pass), else 503."""
    return Response(status_code=200 if _readiness(session, settings)[0] else 503)


@router.get("/ping", response_class=Response, responses=_PROBE)  # one route a method: each its own operation id
@router.post("/ping", response_class=Response, responses=_PROBE)
def ping(session: SessionDep, settings: SettingsDep) -> Response:
    """SageMaker's probe, as vLLM serves it: ``/health``'s answer."""
    return health(session, settings)


UNFINISHED = tuple(s.value for s in JobStatus if not s.terminal)


@router.get("/load", responses={503: {"description": "the database cannot serve now (the detail says why)"}})
def load(session: SessionDep) -> dict[str, int]:
    """vLLM's load figure for a router in front of several deployments: the jobs this deployment has accepted and
    not finished (queued, running or relegated, every model's and tenant's)."""
    try:
        unfinished = session.scalar(select(func.count()).select_from(Job).where(Job.status.in_(UNFINISHED)))
    except DATABASE_ERRORS as exc:  # the router in front tries another deployment, as it would on a 503
        if not database_unavailable(exc):
            raise  # a statement's own failure (a table missing): a defect, the 500 it is
        reason = unavailable_reason(exc)
        log.warning("/load: the database is unavailable (%s)", reason)
        raise HTTPException(503, f"the database is unavailable ({reason}); /readyz says what else is down") from exc
    return {"server_load": unfinished or 0}


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": package_version("coserve")}
