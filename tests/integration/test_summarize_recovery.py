"""Kill -9 the API mid-summarization: the workers' sweeper carries the run to its end, and
another API answers its progress and results as before (issue 19 item 5)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import sys
from collections.abc import Iterator

import httpx
import pytest
from sqlalchemy import func, select

from app.db.models import Job, SummarizationDocument, SummarizationRun
from app.db.session import session_scope
from app.summarize.documents import specbench_summarization
from tests.conftest import ROOT, Keys, free_port, wait_for, worker_env

pytestmark = pytest.mark.integration


class ApiProcess:
    """``uvicorn app.main:app_factory`` in its own process group, as ``coserve up`` runs it."""

    def __init__(self, settings, log_path) -> None:
        self.settings, self.log_path = settings, log_path
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        env = worker_env(self.settings, "api")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--factory", "app.main:app_factory", "--host", "127.0.0.1",
             "--port", str(self.port), "--log-level", "warning", "--no-access-log"],
            cwd=ROOT, env=env, stdout=open(self.log_path, "ab"), stderr=subprocess.STDOUT, start_new_session=True)

        def ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"the API exited: {self.log_path.read_text()[-3000:]}")
            try:
                return httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False
        wait_for(ready, 60, "the API to serve")

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)  # no shutdown, no finally blocks: its driver thread dies
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture
def api(settings, tmp_path) -> Iterator[ApiProcess]:
    proc = ApiProcess(settings, tmp_path / "api.log")
    yield proc
    proc.stop()


@pytest.mark.writes_text
def test_api_killed_mid_run_the_run_still_completes(api, client, keys, settings, start_worker):
    url = settings.sqlalchemy_url
    # each engine step slowed down: the map level takes seconds, so the kill lands mid-run
    start_worker("w1", COSERVE_ENGINE_FACTORY="tests.e2e.slow_engine:build", COSERVE_STEP_DELAY_S="0.15")
    api.start()
    long_doc = specbench_summarization(limit=1)[0]
    body = {"documents": [{"id": "long", "text": long_doc.text},
                          {"id": "short", "text": "The cat sat on the mat. It was warm."}],
            "deadline": "30m", "max_summary_tokens": 12, "chunk_tokens": 160, "overlap_tokens": 16}
    r = httpx.post(f"{api.url}/v1/summarize", headers=Keys.header(keys.paid), json=body, timeout=60)
    assert r.status_code == 201, r.text
    run_id = r.json()["id"]
    assert (r.json()["status"], r.json()["jobs_submitted"]) == ("validating", 0)  # answered before the split

    def first_level():
        with session_scope(url) as s:
            run = s.get(SummarizationRun, run_id, populate_existing=True)
            return run.status != "validating" and run
    split = wait_for(first_level, 60, "the run's first step (the API's driver thread)")
    assert split.status == "running" and split.jobs_submitted >= 4  # 3+ map jobs and "short"

    def some_jobs_done():
        with session_scope(url) as s:
            return s.scalar(select(func.count()).select_from(Job).where(
                Job.endpoint == "/v1/summarize", Job.status == "succeeded")) >= 1
    wait_for(some_jobs_done, 120, "the first summarization jobs to finish", interval=0.05)
    api.kill()
    with session_scope(url) as s:
        at_kill = s.get(SummarizationRun, run_id)
    assert at_kill.status == "running", "the run ended before the kill: slow the engine down"

    def ended():
        with session_scope(url) as s:
            run = s.get(SummarizationRun, run_id, populate_existing=True)
            return run.status != "running" and run
    run = wait_for(ended, 180, "the workers' sweeper to finish the run", interval=0.25)
    assert (run.status, run.documents_done, run.documents_failed) == ("completed", 2, 0)
    assert run.version > at_kill.version  # steps were taken after the kill, by the worker
    with session_scope(url) as s:
        jobs = s.scalars(select(Job).where(Job.endpoint == "/v1/summarize")).all()
        per_doc = {d.doc_id: d for d in s.scalars(select(SummarizationDocument))}
    assert {j.status for j in jobs} == {"succeeded"}
    # the key that started the run is every job's, the worker's steps' too (usage by key)
    assert {j.api_key_id for j in jobs} == {run.api_key_id} and run.api_key_id.startswith("key")
    # every job submitted once: the run's count, the documents' counts and the table agree
    assert len(jobs) == run.jobs_submitted == run.jobs_done == sum(d.jobs for d in per_doc.values())
    assert per_doc["long"].level >= 1 and per_doc["long"].jobs > per_doc["long"].chunks >= 3

    # another API (here in-process) answers from SQL as the killed one did
    h = Keys.header(keys.paid)
    progress = client.get(f"/v1/summarize/{run_id}", headers=h).json()
    assert progress == {"id": run_id, "object": "summarization", "model": run.model, "status": "completed",
                        "reason": None, "deadline_at": progress["deadline_at"], "documents": 2, "documents_done": 2,
                        "documents_failed": 0, "jobs_submitted": len(jobs), "jobs_done": len(jobs)}
    assert progress["deadline_at"].endswith("Z")
    r = client.get(f"/v1/summarize/{run_id}/results", headers=h)
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/jsonl")
    rows = [json.loads(line) for line in r.text.splitlines()]
    assert [list(row) for row in rows] == [["id", "summary", "error", "chunks", "levels", "jobs", "retries",
                                            "retry_errors"]] * 2
    assert [row["id"] for row in rows] == ["long", "short"]
    assert all(row["summary"].strip() and row["error"] is None for row in rows), rows
    assert rows[0]["levels"] >= 2 and rows[1] == {**rows[1], "chunks": 1, "levels": 1, "jobs": 1}
    assert client.get(f"/v1/summarize/{run_id}", headers=Keys.header(keys.other)).status_code == 404


def test_a_stopped_app_drives_its_runs_no_further(settings, keys):
    """The app's lifespan ends (a server's shutdown, a test's client): the threads that drove its runs stop after
    the step they are in, so a stopped app writes and sends nothing more; its run stays open for the sweeper."""
    from fastapi.testclient import TestClient

    from app.main import create_app
    from app.summarize.store import OPEN

    with TestClient(create_app(settings)) as client:
        r = client.post("/v1/summarize", headers=Keys.header(keys.paid), json={"documents": [{"id": "a", "text": "x"}]})
        assert r.status_code == 201, r.text
        name = f"summarize-{r.json()['id']}"
        assert [t for t in threading.enumerate() if t.name == name]
    assert not [t for t in threading.enumerate() if t.name == name]
    with session_scope(settings.sqlalchemy_url) as s:
        assert s.get(SummarizationRun, r.json()["id"]).status in OPEN
