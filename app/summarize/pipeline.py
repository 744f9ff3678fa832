"""Map-reduce summarization over deadline (batch-class) jobs.

Each document is split to fit the model's context (``split.TokenSplitter``). One chunk:
one final job. Several: a map job per chunk, then the joined chunk summaries are treated
as the next level's text (split again if still too long) until one final job remains.
All jobs carry the run's deadline as their TTLT deadline, so the scheduler fits them
around interactive traffic. ``SummarizeRun.step`` is the whole control loop: it submits
what is ready and collects what finished, through a ``JobBackend``.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
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


@dataclass
class SummarizeRun:
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

    def step(self, backend: JobBackend, split) -> bool:
        """Submits ready work and collects finished jobs; True when every document is done."""
        pending = [j for d in self.docs for j in d.pending]
        results = backend.poll(pending) if pending else {}
        for doc in self.docs:
            if doc.done:
                continue
            if doc.pending:
                states = [results.get(j, ("queued", None, None)) for j in doc.pending]
                if not all(s in TERMINAL for s, _t, _e in states):
                    continue
                self.jobs_done += len(states)
                bad = [(s, e) for s, _t, e in states if s != "succeeded"]
                if bad:
                    doc.error = f"{len(bad)} job(s) {bad[0][0]}" + (f": {bad[0][1]}" if bad[0][1] else "")
                    doc.pending = []
                    continue
                outputs = [(t or "").strip() for _s, t, _e in states]
                doc.pending = []
                if doc.final:
                    doc.summary = outputs[0]
                    continue
                doc.text, doc.level = "\n\n".join(outputs), doc.level + 1
            self._plan(doc, backend, split)
        if all(d.done for d in self.docs):
            self.status = "completed" if any(d.summary is not None for d in self.docs) else "failed"
            return True
        return False

    def _plan(self, doc: DocState, backend: JobBackend, split) -> None:
        if doc.level >= MAX_LEVELS:
            doc.error = "the summaries did not shrink below one chunk"
            return
        chunks = split(doc.text) or [doc.text]
        if doc.level == 0:
            doc.chunks = len(chunks)
        if len(chunks) == 1:
            template = SINGLE_PROMPT if doc.level == 0 else REDUCE_PROMPT
            doc.final, app = True, "summarize-final"
        else:
            template, app = MAP_PROMPT, "summarize-map"
        for chunk in chunks:
            job_id = backend.submit([{"role": "user", "content": template.format(text=chunk)}],
                                    self.max_summary_tokens, self.deadline_at, app)
            doc.pending.append(job_id)
        doc.jobs += len(chunks)
        self.jobs_submitted += len(chunks)

    def progress(self) -> dict:
        return {"id": self.id, "object": "summarization", "status": self.status,
                "deadline_at": self.deadline_at.isoformat(), "documents": len(self.docs),
                "documents_done": self.docs_done, "documents_failed": sum(d.error is not None for d in self.docs),
                "jobs_submitted": self.jobs_submitted, "jobs_done": self.jobs_done}

    def results(self) -> list[dict]:
        return [{"id": d.id, "summary": d.summary, "error": d.error, "chunks": d.chunks, "levels": d.level + 1,
                 "jobs": d.jobs} for d in self.docs if d.done]

    def as_dict(self) -> dict:
        out = asdict(self)
        out["deadline_at"] = self.deadline_at.isoformat()
        return out
