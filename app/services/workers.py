"""The workers as the API sees them: which are live (their heartbeat in SQL), and operator actions that reach
every live worker of the model over its control channel (``workers.control``)."""

from __future__ import annotations

import json
import logging
import time
import uuid
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from app import output_constraints
from app.db.models import WorkerState
from app.services import routing
from app.services.model_info import context_length
from app.services.notify import redis_client
from app.services.transitions import utcnow
from app.settings import Settings
from workers.control import control_channel

log = logging.getLogger(__name__)

RESET_TIMEOUT_S = 30.0  # how long a prefix-cache reset waits for every worker's answer


def heartbeat_cutoff(settings: Settings, now: datetime | None = None) -> datetime:
    """The oldest heartbeat of a worker still live (three periods and a second ago); older: lost."""
    return (now or utcnow()) - timedelta(seconds=routing.live_seconds(settings))


def live_workers(session: Session, settings: Settings, *, leaving: bool = False) -> list[WorkerState]:
    """Workers whose heartbeat came within three periods that take jobs; those draining or stopping (a warm
    shutdown's grace: ``routing.stopping``) too, where ``leaving``."""
    query = select(WorkerState).where(WorkerState.heartbeat_at >= heartbeat_cutoff(settings))
    if leaving:
        return list(session.scalars(query.order_by(WorkerState.id)))
    query = query.where(WorkerState.draining.is_(False))
    return [w for w in session.scalars(query.order_by(WorkerState.id)) if not routing.stopping(w.state)]


def served_context(session: Session, settings: Settings) -> int | None:
    """The least context (prompt + output tokens) a live worker of the model serves, from its heartbeat; None where
    none says."""
    return min((n for w in live_workers(session, settings) if settings.model_name in w.served
                and (n := routing.advertised_context(w.state)) is not None), default=None)


def grammar_backends(settings: Settings) -> tuple[str, ...]:
    """The structured-output backends a constraint of a job of the model must compile with: each one its live
    workers' engines compile with, as their heartbeats say (``output_constraints.backends_of``: xgrammar where none
    says). The workers as the process's router last read them (at most once per ``routing.REFRESH_S``)."""
    try:
        published = routing.settings_router(settings).grammar_backends(settings.model_name)
    except SQLAlchemyError as exc:  # nothing known of the workers: xgrammar, as none being up leaves it
        log.warning("could not read the workers' structured-output backends (%s); checking with xgrammar", exc)
        published = []
    return output_constraints.backends_of(published)


def grammar_refusal(settings: Settings) -> str | None:
    """Why a job of the model with a structured output is refused at submit: a live worker of it says its engine's
    backend cannot run (``output_constraints.unusable_refusal``); None where none says so. The workers as the
    process's router last read them (at most once per ``routing.REFRESH_S``)."""
    router = routing.settings_router(settings)
    try:
        unusable = router.grammar_unavailable(settings.model_name)
        live = len(router.grammar_backends(settings.model_name))
    except SQLAlchemyError as exc:  # nothing known of the workers: the worker refuses one it cannot run
        log.warning("could not read whether the workers can run structured outputs (%s)", exc)
        return None
    return output_constraints.unusable_refusal(unusable, live)


def held_context_length(settings: Settings) -> int:
    """The context the API holds a job to: its own engine settings' (``context_length``), or less where a live
    worker of the model serves less (its engine set shorter than this API knows), so a job it accepts is one every
    worker can run. The workers as the process's router last read them (at most once per ``routing.REFRESH_S``)."""
    try:
        served = routing.settings_router(settings).served_context(settings.model_name)
    except SQLAlchemyError as exc:
        # nothing known of the workers: the settings' context (writing the job reports the database)
        log.warning("could not read the workers' context (%s); holding jobs to the settings'", exc)
        served = None
    own = context_length(settings)
    return own if served is None else min(own, served)


def reset_prefix_caches(session: Session, settings: Settings, *, reset_running_requests: bool = False,
                        timeout_s: float = RESET_TIMEOUT_S) -> dict[str, dict[str, Any]]:
    """Asks every live worker of the model (draining or stopping ones too: their caches serve their last jobs) to
    forget its cached prefix blocks, as vLLM's ``POST /reset_prefix_cache``; each worker's answer, by worker id
    (``reset`` false with no ``error``: running requests held blocks; a worker that did not answer in ``timeout_s``
    says so)."""
    workers = [w.id for w in live_workers(session, settings, leaving=True) if settings.model_name in w.served]
    client = redis_client(settings.redis_url)
    reply_to = f"coserve:control:reply:{uuid.uuid4().hex}"
    message = json.dumps({"action": "reset_prefix_cache", "reply_to": reply_to,
                          "reset_running_requests": reset_running_requests})
    asked = [w for w in workers if client.publish(control_channel(w), message)]  # those listening
    answers: dict[str, dict[str, Any]] = {w: {"reset": False, "error": "not listening on its control channel"}
                                          for w in workers if w not in asked}
    deadline, waiting = time.monotonic() + timeout_s, set(asked)
    while waiting and (left := deadline - time.monotonic()) > 0:
        popped = client.blpop([reply_to], timeout=max(1, int(left)))
        if popped is not None:
            reply = json.loads(popped[1])
            worker = reply.pop("worker")
            answers[worker] = reply
            waiting.discard(worker)
    client.delete(reply_to)
    for w in asked:
        answers.setdefault(w, {"reset": False, "error": f"no answer within {timeout_s:.0f} s"})
    return answers
