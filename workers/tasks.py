"""Celery tasks. They carry only job ids; the job row in SQL says what to run."""

from __future__ import annotations

import logging

from celery import shared_task
from celery.exceptions import Retry
from celery.utils.time import get_exponential_backoff_interval
from sqlalchemy.exc import OperationalError

from workers.celery_app import INTERACTIVE_PRIORITY, RUN_JOB

log = logging.getLogger(__name__)

SET_ASIDE_BACKOFF_MAX_S = 16  # the longest countdown of a set-aside job's retry, well within the sweeper's resend wait
SET_ASIDE_ROUNDS = 10  # a set-aside job's message sent again this often, still coming back: its engine is given up on


@shared_task(name=RUN_JOB, bind=True, acks_late=True, autoretry_for=(OperationalError,),
             retry_backoff=True, retry_backoff_max=30, max_retries=10)
def run_job(self, job_id: str, set_aside_rounds: int = 0) -> None:
    """Lease the job and hand it to this process's engine (acked once leased). ``set_aside_rounds``: how often the
    message was sent again because a worker held the job's id set aside (none in a message sent by dispatch)."""
    runtime = getattr(self.app, "coserve_worker", None)
    if runtime is None:
        raise RuntimeError("run_job needs the GPU worker process (`coserve worker`), not a plain celery worker")
    # the message's priority (its job's kind: workers.celery_app.message_priority), kept where it is handed back
    info = self.request.delivery_info or {}
    priority = info.get("priority") or INTERACTIVE_PRIORITY
    back_to = runtime.accept(job_id, priority, info.get("routing_key"))
    if back_to is None:
        return
    # its id is held here until the engine lets its aborted request go: sent again after a backoff, on the queue the
    # model's workers share (any of them may run it then), not taken back here at once over and over
    if set_aside_rounds >= SET_ASIDE_ROUNDS:  # no other worker took it meanwhile, and the engine kept the id:
        runtime.give_up_engine(job_id, back_to, priority, set_aside_rounds)  # a fresh engine lets it go
        return
    raise _set_aside_retry(self, set_aside_rounds, back_to)


def _set_aside_retry(task, rounds: int, back_to: str) -> Retry:
    """Celery's retry of the message in hand, counted in its ``set_aside_rounds`` apart from ``retries``: those are
    the database errors' (``autoretry_for``), whose budget and backoff a round would otherwise use up, and whose
    errors would bring the give-up on a healthy engine sooner. Sent as ``Task.retry`` sends it (same task id, after
    the countdown); under ``apply`` (eager) it is only raised, for ``apply`` to run."""
    countdown = get_exponential_backoff_interval(factor=1, retries=rounds, maximum=SET_ASIDE_BACKOFF_MAX_S)
    resend = task.signature_from_request(kwargs={"set_aside_rounds": rounds + 1}, countdown=countdown, queue=back_to)
    if not task.request.is_eager:
        resend.apply_async()
    return Retry(when=countdown, is_eager=task.request.is_eager, sig=resend)
