"""``run_job``'s two retry budgets (workers/tasks.py): Celery's ``retries`` for database errors (autoretry), the
message's ``set_aside_rounds`` for a job whose id the worker holds set aside. Driven by Celery's ``apply``, which runs
each retry's message in turn, against a runtime that only answers ``accept`` (the task's logic given a worker)."""

from __future__ import annotations

import pytest
from sqlalchemy.exc import OperationalError

from workers.celery_app import RUN_JOB, get_celery
from workers.tasks import SET_ASIDE_ROUNDS

JOB_ID = f"job_{'1' * 24}"
LOCKED = OperationalError("UPDATE jobs", {}, Exception("database is locked"))


class _Runtime:
    """``accept`` answers from ``answers`` in turn (an exception is raised), then the model's queue for good (the id
    stays set aside); ``give_up_engine`` is recorded."""

    def __init__(self, answers: list) -> None:
        self.answers = iter(answers)
        self.accepted = 0
        self.gave_up: tuple | None = None

    def accept(self, job_id: str, priority: int, routing_key: str | None) -> str | None:
        self.accepted += 1
        answer = next(self.answers, "coserve.tiny")
        if isinstance(answer, Exception):
            raise answer
        return answer

    def give_up_engine(self, job_id: str, back_to: str, priority: int, rounds: int) -> None:
        self.gave_up = (job_id, back_to, rounds)


@pytest.fixture
def run_job():
    app = get_celery("redis://127.0.0.1:1/0")  # apply sends nothing
    app.loader.import_default_modules()
    return app.tasks[RUN_JOB]


def _with(monkeypatch, run_job, runtime: _Runtime):
    monkeypatch.setattr(run_job.app, "coserve_worker", runtime, raising=False)


def test_database_errors_before_do_not_shorten_the_set_aside_rounds(monkeypatch, run_job):
    """A message that Celery retried for locked databases, then found its id set aside, comes back for all its own
    rounds before the engine is given up on (it was given up on once ``retries`` reached ``max_retries``)."""
    locked = run_job.max_retries - 2
    runtime = _Runtime([LOCKED] * locked)
    _with(monkeypatch, run_job, runtime)
    run_job.apply(args=[JOB_ID])
    assert runtime.gave_up == (JOB_ID, "coserve.tiny", SET_ASIDE_ROUNDS)
    assert runtime.accepted == locked + SET_ASIDE_ROUNDS + 1


def test_a_message_sent_before_the_rounds_were_counted_counts_them_from_nought(monkeypatch, run_job):
    """A message with no ``set_aside_rounds`` (dispatch's, or one in Redis from before) counts its rounds from 0,
    whatever its ``retries``."""
    runtime = _Runtime([])
    _with(monkeypatch, run_job, runtime)
    run_job.apply(args=[JOB_ID], retries=run_job.max_retries)
    assert runtime.gave_up == (JOB_ID, "coserve.tiny", SET_ASIDE_ROUNDS)
    assert runtime.accepted == SET_ASIDE_ROUNDS + 1


def test_a_job_let_go_after_some_rounds_runs(monkeypatch, run_job):
    """Once the engine let the id go (``accept`` leases: None), the retried message ends there; no give-up."""
    runtime = _Runtime(["coserve.tiny"] * 3 + [None])
    _with(monkeypatch, run_job, runtime)
    assert run_job.apply(args=[JOB_ID]).successful()
    assert (runtime.gave_up, runtime.accepted) == (None, 4)
