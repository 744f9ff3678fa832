"""Server-side summarization runs: jobs submitted in-process, state in ``data_dir/summaries``.

A run is driven by a thread of the API process (``start_run``); its progress and results
are written to ``<id>.json`` / ``<id>.jsonl`` after every change, so a poll from any API
process can read them. A run whose API process stopped is not resumed (its jobs still
finish; the report says so).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from datetime import datetime
from pathlib import Path

from sqlalchemy import select

from app.auth import Principal
from app.db.models import Job, new_id
from app.db.session import session_scope
from app.schemas import JobCreate
from app.services import jobs as job_service
from app.services.model_info import get_tokenizer, max_model_len
from app.settings import Settings
from app.summarize.documents import Document
from app.summarize.pipeline import SummarizeRun
from app.summarize.split import TokenSplitter

log = logging.getLogger(__name__)

PROMPT_OVERHEAD_TOKENS = 64  # instruction + chat template around a chunk
POLL_S = 0.5


class SqlBackend:
    """Submits jobs with ``submit_job`` and reads their state from SQL."""

    def __init__(self, settings: Settings, principal: Principal, tier: str | None) -> None:
        self.settings, self.principal, self.tier = settings, principal, tier

    def submit(self, messages, max_tokens: int, deadline_at: datetime, app_id: str) -> str:
        spec = JobCreate(kind="batch", messages=messages, max_tokens=max_tokens, deadline_at=deadline_at,
                         temperature=0.0, app_id=app_id, tier=self.tier)
        with session_scope(self.settings.sqlalchemy_url) as s:
            return job_service.submit_job(s, self.principal, spec, self.settings, endpoint="/v1/summarize",
                                          overdue_ok=True).job.id

    def poll(self, job_ids):
        with session_scope(self.settings.sqlalchemy_url) as s:
            rows = s.execute(select(Job.id, Job.status, Job.output_text, Job.error).where(Job.id.in_(job_ids)))
            return {r.id: (r.status, r.output_text, r.error) for r in rows}


def runs_dir(data_dir: Path) -> Path:
    path = Path(data_dir) / "summaries"
    path.mkdir(parents=True, exist_ok=True)
    return path


def chunk_budget(settings: Settings, chunk_tokens: int, max_summary_tokens: int) -> int:
    room = max_model_len(settings.model) - max_summary_tokens - PROMPT_OVERHEAD_TOKENS
    if room < 32:
        raise ValueError(f"max_summary_tokens={max_summary_tokens} leaves no room for text in the model's context")
    return min(chunk_tokens, room)


def save(data_dir: Path, tenant_id: str, run: SummarizeRun) -> None:
    d = runs_dir(data_dir)
    state = {"tenant_id": tenant_id, **run.progress()}
    tmp = d / f"{run.id}.json.tmp"
    tmp.write_text(json.dumps(state))
    tmp.replace(d / f"{run.id}.json")
    if run.status != "running":
        (d / f"{run.id}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in run.results()))


def load(data_dir: Path, run_id: str) -> dict | None:
    path = runs_dir(data_dir) / f"{run_id}.json"
    if "/" in run_id or not path.exists():
        return None
    return json.loads(path.read_text())


def start_run(settings: Settings, principal: Principal, documents: list[Document], deadline_at: datetime, *,
              max_summary_tokens: int, chunk_tokens: int, overlap_tokens: int, tier: str | None) -> SummarizeRun:
    budget = chunk_budget(settings, chunk_tokens, max_summary_tokens)
    splitter = TokenSplitter(get_tokenizer(settings.model), budget, min(overlap_tokens, budget // 4))
    run = SummarizeRun.create(new_id("sum"), documents, deadline_at, max_summary_tokens)
    backend = SqlBackend(settings, principal, tier)
    run.step(backend, splitter)  # submit the first level now: errors surface in the request
    save(settings.data_dir, principal.tenant_id, run)

    def drive() -> None:
        try:
            while run.status == "running":
                time.sleep(POLL_S)
                before = (run.jobs_submitted, run.jobs_done)
                run.step(backend, splitter)
                if (run.jobs_submitted, run.jobs_done) != before or run.status != "running":
                    save(settings.data_dir, principal.tenant_id, run)
        except Exception as exc:
            log.exception("summarization run %s failed", run.id)
            run.status = "failed"
            for d in run.docs:
                if not d.done:
                    d.error = f"pipeline error: {exc}"
            save(settings.data_dir, principal.tenant_id, run)

    threading.Thread(target=drive, name=f"summarize-{run.id}", daemon=True).start()
    return run
