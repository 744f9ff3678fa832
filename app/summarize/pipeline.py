"""Map-reduce summarization over deadline (batch-class) jobs.

Each document is split to fit the model's context (``split.TokenSplitter``). One chunk:
one final job. Several: a map job per chunk, then the joined chunk summaries are treated
as the next level's text (split again if still too long) until one final job remains.
All jobs carry the run's deadline as their TTLT deadline, so the scheduler fits them
around interactive traffic (a later level begun when that deadline had all but passed gets a
fresh batch window instead: ``driver.later_level_deadline``). ``advance_doc`` is the whole control loop for one
document: it collects a level whose jobs all ended and submits the next, through a ``JobBackend``.
``SummarizeRun`` runs it over documents in memory; the service keeps runs in SQL and
advances them from there (``app.summarize.driver``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Protocol

from app.summarize.documents import Document

log = logging.getLogger(__name__)

MAX_LEVELS = 6
MAP_PROMPT = "Summarize this part of a longer document in two or three sentences.\n\n{text}"
SINGLE_PROMPT = "Summarize the following document in a few sentences.\n\n{text}"
REDUCE_PROMPT = ("These are summaries of consecutive parts of one document. Write one concise summary of the "
                 "whole document.\n\n{text}")
TERMINAL = {"succeeded", "failed", "cancelled", "expired"}


class JobBackend(Protocol):
    def submit(self, messages: list[dict[str, str]], max_tokens: int, deadline_at: datetime, app_id: str) -> str: ...

    def poll(self, job_ids: list[str]) -> dict[str, tuple[str, str | None, str | None]]:
        """job id -> (status, output_text, error)."""
        ...


@dataclass
class DocState:
    id: str
    level: int = 0
    text: str = ""  # this level's input
    pending: list[str] = field(default_factory=list)
    final: bool = False  # the pending job is the document's final summary
    chunks: int = 0  # level-0 chunks
    jobs: int = 0
    summary: str | None = None
    error: str | None = None

    @property
    def done(self) -> bool:
        return self.summary is not None or self.error is not None


@dataclass(frozen=True)
class Planner:
    """What a document's next level needs: where its jobs go, how its text is cut, the jobs' budget."""

    backend: JobBackend
    split: Callable[[str], list[str]]
    max_summary_tokens: int
    deadline_at: datetime


@dataclass(frozen=True)
class Advance:
    """What one step did to one document."""

    submitted: int = 0  # jobs created for its next level
    collected: int = 0  # jobs of its last level that ended (succeeded or not)


def advance_doc(doc: DocState, results: Mapping[str, tuple[str, str | None, str | None]],
                planner: Planner) -> Advance:
    """Collects ``doc``'s level when all its jobs ended and submits the next one.

    ``results`` maps job id -> (status, output_text, error); a job missing from it is still
    pending. A document whose jobs are not all terminal is left as it is, so calling this
    again with the same results after a crash does the same thing (the caller persists the
    document and the jobs it submitted together).
    """
    if doc.done:
        return Advance()
    collected = 0
    if doc.pending:
        states = [results.get(j, ("queued", None, None)) for j in doc.pending]
        if not all(s in TERMINAL for s, _t, _e in states):
            return Advance()
        collected = len(states)
        doc.pending = []
        bad = [(s, e) for s, _t, e in states if s != "succeeded"]
        if bad:
            doc.error = f"{len(bad)} job(s) {bad[0][0]}" + (f": {bad[0][1]}" if bad[0][1] else "")
            return Advance(collected=collected)
        outputs = [(t or "").strip() for _s, t, _e in states]
        if doc.final:
            doc.summary = outputs[0]
            return Advance(collected=collected)
        doc.text, doc.level = "\n\n".join(outputs), doc.level + 1
    return Advance(_plan(doc, planner), collected)


def _plan(doc: DocState, planner: Planner) -> int:
    if doc.level >= MAX_LEVELS:
        doc.error = "the summaries did not shrink below one chunk"
        return 0
    chunks = planner.split(doc.text) or [doc.text]
    if doc.level == 0:
        doc.chunks = len(chunks)
    if len(chunks) == 1:
        template = SINGLE_PROMPT if doc.level == 0 else REDUCE_PROMPT
        doc.final, app = True, "summarize-final"
    else:
        template, app = MAP_PROMPT, "summarize-map"
    for chunk in chunks:
        job_id = planner.backend.submit([{"role": "user", "content": template.format(text=chunk)}],
                                        planner.max_summary_tokens, planner.deadline_at, app)
        doc.pending.append(job_id)
    doc.jobs += len(chunks)
    return len(chunks)


def final_status(documents_succeeded: int) -> str:
    """A finished run's status: completed when at least one document has a summary."""
    return "completed" if documents_succeeded > 0 else "failed"


@dataclass
class SummarizeRun:
    """A whole run in memory (tests, scripts); the service keeps runs in SQL (``store``, ``driver``)."""

    id: str
    deadline_at: datetime
    max_summary_tokens: int
    docs: list[DocState]
    status: str = "running"  # running | completed | failed
    jobs_submitted: int = 0
    jobs_done: int = 0

    @classmethod
    def create(cls, run_id: str, documents: list[Document], deadline_at: datetime,
               max_summary_tokens: int) -> SummarizeRun:
        return cls(run_id, deadline_at, max_summary_tokens, [DocState(d.id, text=d.text) for d in documents])

    @property
    def docs_done(self) -> int:
        return sum(d.done for d in self.docs)

    def step(self, backend: JobBackend, split: Callable[[str], list[str]]) -> bool:
        """Submits ready work and collects finished jobs; True when every document is done."""
        pending = [j for d in self.docs for j in d.pending]
        results = backend.poll(pending) if pending else {}
        planner = Planner(backend, split, self.max_summary_tokens, self.deadline_at)
        for doc in self.docs:
            done = advance_doc(doc, results, planner)
            self.jobs_submitted += done.submitted
            self.jobs_done += done.collected
        if all(d.done for d in self.docs):
            self.status = final_status(sum(d.summary is not None for d in self.docs))
            return True
        return False

    def progress(self) -> dict:
        return Progress(self.id, self.status, self.deadline_at, len(self.docs), self.docs_done,
                        sum(d.error is not None for d in self.docs), self.jobs_submitted, self.jobs_done).as_dict()

    def results(self) -> list[dict]:
        return [result_line(d) for d in self.docs if d.done]


@dataclass(frozen=True)
class Progress:
    """A run's progress as ``GET /v1/summarize/{id}`` shows it."""

    id: str
    status: str  # running | completed | failed
    deadline_at: datetime
    documents: int
    documents_done: int  # with a summary or an error
    documents_failed: int
    jobs_submitted: int
    jobs_done: int  # ended, succeeded or not
    model: str | None = None  # the model or LoRA adapter its jobs run on (None: a run kept before it was recorded)

    def as_dict(self) -> dict:
        return {"id": self.id, "object": "summarization", "model": self.model, "status": self.status,
                "deadline_at": self.deadline_at.isoformat(), "documents": self.documents,
                "documents_done": self.documents_done, "documents_failed": self.documents_failed,
                "jobs_submitted": self.jobs_submitted, "jobs_done": self.jobs_done}


def result_line(doc: DocState) -> dict:
    """A finished document as one line of ``GET /v1/summarize/{id}/results``."""
    return {"id": doc.id, "summary": doc.summary, "error": doc.error, "chunks": doc.chunks, "levels": doc.level + 1,
            "jobs": doc.jobs}
