"""Celery tasks. They carry only job ids; the job row in SQL says what to run."""

from __future__ import annotations

import logging

from celery import shared_task
from sqlalchemy.exc import OperationalError

from workers.celery_app import INTERACTIVE_PRIORITY, RUN_JOB

log = logging.getLogger(__name__)


@shared_task(name=RUN_JOB, bind=True, acks_late=True, autoretry_for=(OperationalError,),
             retry_backoff=True, retry_backoff_max=30, max_retries=10)
def run_job(self, job_id: str, set_aside_rounds: int = 0) -> None:
    """Lease the job and hand it to this process's engine (acked once leased). ``set_aside_rounds`` is not read: a
    message an older worker sent again while it held the job's id set aside carries it (a rerun no longer waits for
    an earlier attempt's aborted request to leave the engine: each attempt has its own request id there)."""
    runtime = getattr(self.app, "coserve_worker", None)
    if runtime is None:
        raise RuntimeError("run_job needs the GPU worker process (`coserve worker`), not a plain celery worker")
    # the message's priority (its job's kind: workers.celery_app.message_priority), kept where it is handed back
    info = self.request.delivery_info or {}
    runtime.accept(job_id, info.get("priority") or INTERACTIVE_PRIORITY, info.get("routing_key"))
