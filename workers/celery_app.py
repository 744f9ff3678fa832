"""The Celery application: Redis broker, one queue per model, late acks.

Tasks carry only job ids; SQL is the source of truth. The API sends tasks by name
(``send_task``) so it never imports worker code.
"""

from __future__ import annotations

import logging
import os
from functools import lru_cache

from celery import Celery

from app.observability.logs import log_level

log = logging.getLogger(__name__)

RUN_JOB = "coserve.run_job"
# A job's message priority by its kind (kombu's Redis transport keeps a list per priority of a queue and reads the
# lowest number first): interactive jobs on the queue's own list, deadline (batch) jobs on its last, so a worker
# takes a waiting interactive job before any of a batch backlog
INTERACTIVE_PRIORITY, BATCH_PRIORITY = 0, 9


def message_priority(kind: str) -> int:
    return BATCH_PRIORITY if kind == "batch" else INTERACTIVE_PRIORITY


def queue_lists(queue: str) -> tuple[str, str]:
    """The Redis lists kombu keeps for ``queue``'s messages: the interactive jobs', then the batch jobs'."""
    from kombu.transport.redis import Channel

    return queue, f"{queue}{Channel.sep}{BATCH_PRIORITY}"


def cold_shutdown() -> bool:
    """Whether this process's Celery worker began a cold shutdown (SIGQUIT, or a second Ctrl+C): it cancels the task
    running on the solo pool by raising in it (``kill_job``'s NotImplementedError), and it flags this before the
    exception reaches the task."""
    from celery.worker import state

    return state.should_terminate not in (None, False)


def queue_name(model_name: str) -> str:
    return f"coserve.{model_name}"


@lru_cache(maxsize=8)
def get_celery(redis_url: str) -> Celery:
    app = Celery("coserve", broker=redis_url, include=["workers.tasks"])
    app.conf.update(
        task_acks_late=True,  # a message is acked only after the job is leased in SQL
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,  # the GPU worker pulls as its engine has room
        task_ignore_result=True,  # results live in SQL
        task_serializer="json", accept_content=["json"],
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,  # workers ride out broker restarts
        broker_pool_limit=32,
        worker_hijack_root_logger=False,
        worker_send_task_events=False,
        task_default_queue="coserve.default",
        broker_transport_options={
            "socket_connect_timeout": 1.0, "socket_timeout": 5.0,
            "visibility_timeout": 3600,  # the SQL sweeper, not redelivery, recovers lost jobs
        },
    )
    return app


def consumer(app: Celery, queues: list[str], hostname: str):
    """The solo-pool Celery worker a GPU worker consumes its queues with. Celery sets the root logger's level to the
    worker's, so it is ``COSERVE_LOG_LEVEL``'s (INFO by default), the level ``configure_logging`` gave the worker's
    own lines; Celery's own (a line for every task received and done) stay at warnings unless that variable is set."""
    worker = app.Worker(pool="solo", concurrency=1, queues=queues, hostname=hostname, loglevel=log_level(),
                        without_heartbeat=True, without_mingle=True, without_gossip=True, quiet=True)
    if "COSERVE_LOG_LEVEL" not in os.environ:
        logging.getLogger("celery").setLevel(logging.WARNING)
    return worker
