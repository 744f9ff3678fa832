"""What a summarization run's settings and documents must allow: summaries that shrink, levels that end, a first
level of at most ``COSERVE_SUMMARIZE_MAX_JOBS`` jobs. ``check_shrinks`` and ``check_least_jobs`` answer in the
request (they need no tokenizer); the others need the documents split, which the run's first step does
(``driver``): a run they refuse ends ``failed`` with their message as its reason, before any job is written."""

from __future__ import annotations

import logging

from app.services import jobs as job_service
from app.summarize.pipeline import MAX_LEVELS, DocState, levels_needed

log = logging.getLogger(__name__)


def check_shrinks(max_summary_tokens: int, chunk_tokens: int, overlap_tokens: int,
                  asked_overlap: int | None = None) -> None:
    """Refuses summaries that may be longer than half a chunk's new text (``chunk_tokens`` less the overlap): then a
    level's joined summaries need at least twice fewer chunks than its text, so a document's levels end within
    ``pipeline.MAX_LEVELS`` where it is not too long for them (``check_depth``; longer summaries may not shrink,
    and the document fails after many jobs). ``asked_overlap``: the request's, where the run cut it (to a quarter of
    the chunk: ``service.run_chunks``), which the refusal names so."""
    most = (chunk_tokens - overlap_tokens) // 2
    if max_summary_tokens > most:
        cut = (f"; overlap_tokens={asked_overlap} is cut to {overlap_tokens}, a quarter of the chunk"
               if asked_overlap is not None and asked_overlap != overlap_tokens else "")
        raise job_service.JobValidationError(
            f"max_summary_tokens={max_summary_tokens} is more than half of the {chunk_tokens - overlap_tokens} new "
            f"tokens a chunk holds ({chunk_tokens} chunk tokens less {overlap_tokens} overlap{cut}): the summaries "
            f"might not shrink from level to level; give max_summary_tokens <= {most} or a larger chunk_tokens",
            param="max_summary_tokens")


def check_jobs(jobs: int, most: int, chunk_tokens: int) -> None:
    """Refuses a run whose first level makes more than ``most`` jobs (``COSERVE_SUMMARIZE_MAX_JOBS``): they are
    built in memory by one step and become runnable together in its commit."""
    if jobs > most:
        raise job_service.JobValidationError(
            f"the documents make {jobs} chunks of {chunk_tokens} tokens, a job each, and a run takes at most {most} "
            f"(COSERVE_SUMMARIZE_MAX_JOBS): give a larger chunk_tokens, or send the documents in several runs",
            param="documents")


def least_jobs(texts: list[str], chunk_tokens: int) -> int:
    """The fewest first-level jobs the documents can make, with no tokenizer: a document makes at least one chunk, and
    holds at least a token per word (whitespace-separated: the tokenizers of the model families coserve serves split
    text at whitespace before they merge; a token may hold a run of whitespace, " \n", but never two words), which
    its chunks of at most ``chunk_tokens`` tokens all cover."""
    return sum(max(1, -(-len(text.split()) // chunk_tokens)) for text in texts)


def check_least_jobs(texts: list[str], most: int, chunk_tokens: int) -> None:
    """Refuses in the request a run that makes more than ``most`` jobs whatever the tokenizer's counts
    (``least_jobs``); the first step still checks the exact count (``check_jobs``)."""
    least = least_jobs(texts, chunk_tokens)
    if least > most:
        raise job_service.JobValidationError(
            f"the documents hold {least} or more chunks of {chunk_tokens} tokens (a job each; a document's words are "
            f"a token each at least), and a run takes at most {most} (COSERVE_SUMMARIZE_MAX_JOBS): give a larger "
            f"chunk_tokens, or send the documents in several runs", param="documents")


def check_depth(docs: list[DocState], chunk_tokens: int, overlap_tokens: int, max_summary_tokens: int) -> None:
    """Refuses a document whose level-0 chunks may need more than ``pipeline.MAX_LEVELS`` levels to come down to one
    summary (it would fail at the last level, after all the jobs of the others)."""
    for doc in docs:
        levels = levels_needed(doc.chunks, chunk_tokens, overlap_tokens, max_summary_tokens)
        if levels > MAX_LEVELS:
            raise job_service.JobValidationError(
                f"document {doc.id!r} is {doc.chunks} chunks of {chunk_tokens} tokens: summaries of up to "
                f"{max_summary_tokens} tokens may take more than {MAX_LEVELS} levels to come down to one; give a "
                f"smaller max_summary_tokens or a larger chunk_tokens, or split the document", param="documents")
