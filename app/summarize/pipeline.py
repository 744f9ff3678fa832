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
from datetime import datetime, timedelta
from typing import NamedTuple, Protocol

from app.summarize.documents import Document
from app.wire import utc_z

log = logging.getLogger(__name__)

MAX_LEVELS = 6
MAP_PROMPT = "Summarize this part of a longer document in two or three sentences.\n\n{text}"
SINGLE_PROMPT = "Summarize the following document in a few sentences.\n\n{text}"
REDUCE_PROMPT = ("These are summaries of consecutive parts of one document. Write one concise summary of the "
                 "whole document.\n\n{text}")
TERMINAL = {"succeeded", "failed", "cancelled", "expired"}
INVALID_REQUEST = "invalid_request"  # a job's error_code where the engine refused the request itself (app.errors)
EMPTY = "empty"  # how a step sees a job that succeeded with no text (EOS at once, or only whitespace): no summary
RETRY_BACKOFF_CAP_S = 3600.0  # the longest wait before a retry, however many came before
RETRY_ERRORS_KEPT = 10  # the reasons of a document's retried jobs its results line keeps (the first ones)


class JobResult(NamedTuple):
    """An ended or pending job as a step sees it (``code``: its ``error_code``)."""

    status: str
    text: str | None = None
    error: str | None = None
    code: str | None = None


PENDING = JobResult("queued")  # a job a poll did not answer for


def as_outcome(result: JobResult) -> JobResult:
    """``result``, where a job that succeeded with no text is an ``EMPTY`` one: a summary of nothing would end the
    document with an empty summary, or leave its chunk out of the next level unsaid."""
    if result.status == "succeeded" and not (result.text or "").strip():
        return JobResult(EMPTY, None, "the model's answer had no text")
    return result


class JobBackend(Protocol):
    def submit(self, messages: list[dict[str, str]], max_tokens: int, deadline_at: datetime, app_id: str,
               prompt_tokens: int | None = None) -> str:
        """A job of ``messages``; ``prompt_tokens``: their token count as the worker feeds them, where the planner
        counted it (``Planner.count``; None: the backend counts)."""
        ...

    def poll(self, job_ids: list[str]) -> Mapping[str, JobResult]:
        """job id -> ``JobResult``."""
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
    attempts: list[int] = field(default_factory=list)  # per pending job: the retries its chunk had ([]: none yet)
    retries: int = 0  # jobs of its chunks submitted again after one failed
    retry_at: datetime | None = None  # its failed jobs are submitted again from then (a backoff)
    retry_errors: list[str] = field(default_factory=list)  # why the retried jobs failed (the first few)

    @property
    def done(self) -> bool:
        return self.summary is not None or self.error is not None

    def due(self, now: datetime) -> bool:
        """Not waiting out a retry's backoff."""
        return self.retry_at is None or self.retry_at <= now


@dataclass(frozen=True)
class Planner:
    """What a document's next level needs: where its jobs go, how its text is cut, the jobs' budget."""

    backend: JobBackend
    split: Callable[[str], list[str]]
    max_summary_tokens: int
    deadline_at: datetime
    now: datetime | None = None  # the step's time (backoffs); None: retries go out at once
    job_retries: int = 0  # times a failed job of one chunk is submitted again before its document fails
    retry_backoff_s: float = 0.0  # the wait before a chunk's first retry; doubled for each later one
    # the token count of each job's messages as its worker feeds them, a level's jobs in one call (None: the
    # backend counts each job's alone)
    count: Callable[[list[list[dict[str, str]]]], list[int]] | None = None


@dataclass(frozen=True)
class Advance:
    """What one step did to one document."""

    submitted: int = 0  # jobs created: its next level's, or its failed jobs' retries


def retry_refusal(result: JobResult) -> str | None:
    """Why a failed job is not worth submitting again (None: it is). A job the engine refused for its own request
    fails again the same way, and so does one that answered no text (``EMPTY``); a cancelled one was stopped on
    purpose (its run, its tenant, its owner). A job that
    failed otherwise (an engine error, every worker it met died: the job layer retried those ``max_attempts``
    times already) or expired (its deadline passed under load: a retry gets a fresh one) may succeed later."""
    if result.status == "cancelled":
        return "it was cancelled"
    if result.status == EMPTY:  # the jobs run at temperature 0 (``driver.JobCollector``)
        return "its jobs are greedy, so a retry would answer the same"
    if result.status == "failed" and result.code == INVALID_REQUEST:
        return "the engine refused its request"
    return None


def advance_doc(doc: DocState, results: Mapping[str, JobResult], planner: Planner) -> Advance:
    """Collects ``doc``'s level when all its jobs ended and submits the next one; a level with failed jobs submits
    those again (``planner.job_retries`` times per chunk, after a doubling backoff) or fails the document.

    ``results`` maps job id -> ``JobResult``; a job missing from it is still pending. A document whose jobs are
    not all terminal (or whose retry is not due) is left as it is, so calling this again with the same results
    after a crash does the same thing (the caller persists the document and the jobs it submitted together).
    """
    if doc.done:
        return Advance()
    if doc.pending:
        states = [results.get(j, PENDING) for j in doc.pending]
        if not all(r.status in TERMINAL for r in states):
            return Advance()
        states = [as_outcome(r) for r in states]
        attempts = doc.attempts if len(doc.attempts) == len(doc.pending) else [0] * len(doc.pending)
        bad = [i for i, r in enumerate(states) if r.status != "succeeded"]
        if bad:
            return Advance(_retry_or_fail(doc, states, attempts, bad, planner))
        outputs = [(r.text or "").strip() for r in states]  # none empty (``as_outcome``)
        doc.pending, doc.attempts = [], []
        if doc.final:
            doc.summary = outputs[0]
            return Advance()
        doc.text, doc.level = "\n\n".join(outputs), doc.level + 1
    return Advance(_plan(doc, planner))


def _describe(result: JobResult) -> str:
    return result.status + (f": {result.error}" if result.error else "")


def _retry_or_fail(doc: DocState, states: list[JobResult], attempts: list[int], bad: list[int],
                   planner: Planner) -> int:
    """A level whose jobs ended with some failed: the failed ones are submitted again (returns how many) when each
    may be retried and its backoff has passed; else the document fails, naming why and its retries."""
    for i in bad:
        refusal = retry_refusal(states[i])
        if refusal is None and attempts[i] >= planner.job_retries:
            refusal = f"its chunk had {attempts[i]} retries" if attempts[i] else "retries are off"
        if refusal is not None:
            tries = f" after {doc.retries} retried job(s)" if doc.retries else ""
            doc.error = f"{len(bad)} job(s) {states[i].status}{tries}; level {doc.level + 1} chunk {i + 1}: " \
                        f"{_describe(states[i])} (not retried: {refusal})"
            doc.pending, doc.attempts, doc.retry_at = [], [], None
            return 0
    now = planner.now
    if doc.retry_at is None and planner.retry_backoff_s > 0 and now is not None:
        wait = min(RETRY_BACKOFF_CAP_S, planner.retry_backoff_s * 2 ** max(attempts[i] for i in bad))
        doc.retry_at, doc.attempts = now + timedelta(seconds=wait), attempts
        return 0
    if now is not None and not doc.due(now):
        return 0
    prompts = _prompts(doc, planner)
    if len(prompts) != len(doc.pending):  # its text splits otherwise now (another tokenizer): no retry can match
        first = states[bad[0]]
        doc.error = f"{len(bad)} job(s) {first.status}: {_describe(first)} (not retried: the level's text no " \
                    f"longer splits into its {len(doc.pending)} chunk(s))"
        doc.pending, doc.attempts, doc.retry_at = [], [], None
        return 0
    for i, job_id in zip(bad, _submit(planner, [prompts[i] for i in bad])):
        if len(doc.retry_errors) < RETRY_ERRORS_KEPT:
            doc.retry_errors.append(f"level {doc.level + 1} chunk {i + 1}: {_describe(states[i])}")
        doc.pending[i] = job_id
        attempts[i] += 1
    doc.attempts, doc.retry_at = attempts, None
    doc.retries += len(bad)
    doc.jobs += len(bad)
    return len(bad)


def _prompts(doc: DocState, planner: Planner) -> list[tuple[str, str]]:
    """This level's jobs' prompts and app ids, one per chunk of its text."""
    chunks = planner.split(doc.text) or [doc.text]
    if len(chunks) == 1:
        template = SINGLE_PROMPT if doc.level == 0 else REDUCE_PROMPT
        return [(template.format(text=chunks[0]), "summarize-final")]
    return [(MAP_PROMPT.format(text=chunk), "summarize-map") for chunk in chunks]


def _submit(planner: Planner, prompts: list[tuple[str, str]]) -> list[str]:
    """A job per (prompt, app id), their token counts measured together where the planner can."""
    conversations = [[{"role": "user", "content": content}] for content, _app in prompts]
    counts = planner.count(conversations) if planner.count is not None else [None] * len(prompts)
    return [planner.backend.submit(messages, planner.max_summary_tokens, planner.deadline_at, app, prompt_tokens=n)
            for messages, (_content, app), n in zip(conversations, prompts, counts)]


def _plan(doc: DocState, planner: Planner) -> int:
    if doc.level >= MAX_LEVELS:
        doc.error = "the summaries did not shrink below one chunk"
        return 0
    prompts = _prompts(doc, planner)
    if doc.level == 0:
        doc.chunks = len(prompts)
    doc.final = len(prompts) == 1
    doc.pending = _submit(planner, prompts)
    doc.attempts = [0] * len(prompts)
    doc.jobs += len(prompts)
    return len(prompts)


def open_jobs(docs: list[DocState], results: Mapping[str, JobResult]) -> int:
    """Jobs the documents wait for that have not ended (one missing from ``results`` has not)."""
    return sum(1 for d in docs for j in d.pending if results.get(j, PENDING).status not in TERMINAL)


def levels_needed(chunks: int, chunk_tokens: int, overlap_tokens: int, max_summary_tokens: int) -> int:
    """The levels a document of ``chunks`` level-0 chunks takes where every summary is ``max_summary_tokens`` long
    (the most it can be): each level's joined summaries (a separator token between two) fill chunks of
    ``chunk_tokens - overlap_tokens`` new tokens."""
    levels, new = 1, max(1, chunk_tokens - overlap_tokens)
    while chunks > 1 and levels <= MAX_LEVELS:
        chunks = -(-chunks * (max_summary_tokens + 1) // new)
        levels += 1
    return levels


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

    def step(self, backend: JobBackend, split: Callable[[str], list[str]], job_retries: int = 0,
             count: Callable[[list[list[dict[str, str]]]], list[int]] | None = None) -> bool:
        """Submits ready work and collects finished jobs; True when every document is done. ``count``:
        ``Planner.count`` (a ``service.SqlBackend``'s own)."""
        pending = [j for d in self.docs for j in d.pending]
        results = backend.poll(pending) if pending else {}
        planner = Planner(backend, split, self.max_summary_tokens, self.deadline_at, job_retries=job_retries,
                          count=count)
        for doc in self.docs:
            self.jobs_submitted += advance_doc(doc, results, planner).submitted
        self.jobs_done = self.jobs_submitted - open_jobs(self.docs, results)
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
    documents_done: int  # ended: with a summary or an error
    documents_failed: int  # of those, the ones with an error (done - failed: summarized)
    jobs_submitted: int
    jobs_done: int  # ended, succeeded or not
    model: str | None = None  # the model or LoRA adapter its jobs run on (None: a run kept before it was recorded)
    reason: str | None = None  # why a run failed as a whole or was cancelled

    def as_dict(self) -> dict:
        return {"id": self.id, "object": "summarization", "model": self.model, "status": self.status,
                "reason": self.reason, "deadline_at": utc_z(self.deadline_at), "documents": self.documents,
                "documents_done": self.documents_done, "documents_failed": self.documents_failed,
                "jobs_submitted": self.jobs_submitted, "jobs_done": self.jobs_done}


def result_line(doc: DocState) -> dict:
    """A finished document as one line of ``GET /v1/summarize/{id}/results``."""
    return {"id": doc.id, "summary": doc.summary, "error": doc.error, "chunks": doc.chunks, "levels": doc.level + 1,
            "jobs": doc.jobs, "retries": doc.retries, "retry_errors": doc.retry_errors}
