"""Celery tasks. They carry only job ids; the job row in SQL says what to run."""

from __future__ import annotations

import logging

from celery import shared_task
from celery.utils.time import get_exponential_backoff_interval
from sqlalchemy.exc import OperationalError

from workers.celery_app import INTERACTIVE_PRIORITY, RUN_JOB

log = logging.getLogger(__name__)

SET_ASIDE_BACKOFF_MAX_S = 16  # the longest countdown of a set-aside job's retry, well within the sweeper's resend wait


@shared_task(name=RUN_JOB, bind=True, acks_late=True, autoretry_for=(OperationalError,),
             retry_backoff=True, retry_backoff_max=30, max_retries=10)
def run_job(self, job_id: str) -> None:
    """Lease the job and hand it to this process's engine (acked once leased)."""
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
    if self.request.retries >= self.max_retries:  # no other worker took it meanwhile, and the engine kept the id:
        runtime.give_up_engine(job_id, back_to, priority, self.request.retries)  # a fresh engine lets it go
        return
    countdown = get_exponential_backoff_interval(factor=1, retries=self.request.retries,
                                                 maximum=SET_ASIDE_BACKOFF_MAX_S)
    raise self.retry(countdown=countdown, queue=back_to)
