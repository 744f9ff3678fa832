"""OpenAI's Batch object and output-line shapes."""

from __future__ import annotations

from datetime import UTC, datetime
from collections.abc import Iterable
from typing import Any

from sqlalchemy import and_, false, func, or_, select
from sqlalchemy.orm import Session

from app.anthropic_schemas import ENDPOINT as MESSAGES, stored_message
from app.db.models import Batch, Job
from app.openai_schemas import merge_choices, stored_chat_answer, text_completion, with_token_ids
from app.responses_schemas import response_body
from app.services.transitions import as_utc
from app.services.truncation import fed_prompt
from app.services.usage import prompt_usage
from app.tool_calls import read_answer


def ts(dt: datetime | None) -> int | None:
    if dt is None:
        return None
    return int((dt if dt.tzinfo else dt.replace(tzinfo=UTC)).timestamp())


def batch_usage(session: Session, batch_ids: Iterable[str]) -> dict[str, dict[str, Any]]:
    """Each batch's ``usage``: the tokens of its jobs an engine ran (finished, or cancelled with the batch after
    producing tokens: those count too), a line's prompts billed as the Usage API bills them (``prompt_usage``: each
    once, where any of its choices ran), one grouped query for a page."""
    prompt = prompt_usage()
    rows = session.execute(select(Job.batch_id, prompt.input_tokens, prompt.cached_tokens,
                                  func.sum(Job.completion_tokens), func.sum(Job.reasoning_tokens))
                           .where(Job.batch_id.in_(list(batch_ids)),
                                  or_(Job.completion_tokens.is_not(None), prompt.ran_elsewhere))
                           .group_by(Job.batch_id))
    return {batch_id: _usage(*(int(n or 0) for n in sums)) for batch_id, *sums in rows}


def _usage(inputs: int = 0, cached: int = 0, outputs: int = 0, reasoning: int = 0) -> dict[str, Any]:
    return {"input_tokens": inputs, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": outputs,
            "output_tokens_details": {"reasoning_tokens": reasoning}, "total_tokens": inputs + outputs}


def batch_object(b: Batch, usage: dict[str, Any] | None = None,
                 counts: tuple[int, int] | None = None) -> dict[str, Any]:
    """The Batch object; ``usage`` from ``batch_usage`` (none: nothing finished yet); ``counts``: an open batch's
    requests (completed, failed) as counted now, where newer than its row's."""
    completed, failed = (b.completed, b.failed) if counts is None else (
        max(counts[0], b.completed or 0), max(counts[1], b.failed or 0))  # a request's end is final: counts only grow
    errors = {"object": "list", "data": b.errors} if b.errors else None
    return {"id": b.id, "object": "batch", "endpoint": b.endpoint, "model": b.model, "errors": errors,
            "input_file_id": b.input_file_id, "completion_window": b.completion_window, "status": b.status,
            "output_file_id": b.output_file_id, "error_file_id": b.error_file_id, "created_at": ts(b.created_at),
            "in_progress_at": ts(b.in_progress_at), "expires_at": ts(b.expires_at),
            "finalizing_at": ts(b.finalizing_at), "completed_at": ts(b.completed_at), "failed_at": ts(b.failed_at),
            "expired_at": ts(b.expired_at), "cancelling_at": ts(b.cancelling_at),
            "cancelled_at": ts(b.cancelled_at),
            "request_counts": {"total": b.total, "completed": completed, "failed": failed},
            "usage": usage or _usage(), "metadata": b.metadata_, "coserve": {"tier": b.tier}}


def output_line(jobs: list[Job]) -> dict[str, Any]:
    """A request's succeeded jobs (its choices, in order) as an output-file line: the body an online request would
    have returned, its choices indexed and its usage counting each prompt once (``merge_choices``)."""
    first, prompts = jobs[0], sum(j.counts_prompt is not False for j in jobs)  # None: unsaved, the default
    body = merge_choices([_body(j) for j in jobs], len(jobs) // max(1, prompts))
    return {"id": f"batch_req_{first.id}", "custom_id": first.custom_id,
            "response": {"status_code": 200, "request_id": first.id, "body": body}, "error": None}


def _body(job: Job) -> dict[str, Any]:
    """A succeeded job's answer, as its endpoint gives it online."""
    chat = job.endpoint == "/v1/chat/completions"
    text, reason = job.output_text or "", job.finish_reason or "stop"
    if job.endpoint == MESSAGES:  # a message batch's: the Message POST /v1/messages answers
        return stored_message(job)
    if job.endpoint == "/v1/responses":
        from app.settings import get_settings  # the tiers service_tier names (the process's settings)

        body = response_body(job, job.response or {}, get_settings().tiers, status=job.status,
                             answer=read_answer(job.id, job.sampling, text, reason),
                             prompt_tokens=job.prompt_tokens, completion_tokens=job.completion_tokens,
                             logprobs=job.output_logprobs, cached_tokens=job.cached_tokens,
                             cache_write_tokens=job.cache_write_tokens,
                             reasoning_tokens=job.reasoning_tokens)
    elif chat:
        body = stored_chat_answer(job, "chatcmpl-" + job.id, ts(job.finished_at) or 0)
    else:
        echo = {"echo": (job.prompt or "", job.prompt_logprobs)} if (job.sampling or {}).get("echo") else {}
        body = text_completion("cmpl-" + job.id, job.model, ts(job.finished_at) or 0, text, reason,
                               job.prompt_tokens, job.completion_tokens, logprobs=job.output_logprobs, **echo,
                               cached_tokens=job.cached_tokens, stop_reason=job.stop_reason, sampling=job.sampling,
                               prompt_logprobs=job.prompt_logprobs)
    if (job.sampling or {}).get("return_token_ids") and job.endpoint != "/v1/responses":  # vLLM's, as online
        from app.settings import get_settings

        with_token_ids(body, chat, fed_prompt(get_settings(), job), job.output_token_ids)
    return body


WINDOW_ENDED = "the batch's completion window ended before this request finished"


def job_error_line(job: Job, window_end: datetime | None = None) -> dict[str, Any]:
    """The error-file line of a request whose job did not succeed; ``window_end``: the batch's ``expires_at``."""
    code, message = _job_error(job, window_end)
    return {"id": f"batch_req_{job.id}", "custom_id": job.custom_id, "response": None,
            "error": {"code": code, "message": message}}


def _job_error(job: Job, window_end: datetime | None) -> tuple[str, str]:
    if job.status == "cancelled":
        return "batch_cancelled", "the request was cancelled with its batch"
    if job.status == "expired" and job.error is None:  # the batch's window stopped it (finalize.stop_jobs)
        return "batch_expired", WINDOW_ENDED
    if job.status == "expired":  # the scheduler gave up on it (workers/engine_thread.py _expiry writes its error)
        return _given_up(job, window_end)
    return job.error_code or "request_failed", f"generation failed: {job.error or 'unknown error'}"


def stopped_code(status: str, given_up_in_window: bool) -> str:
    """The error-file code of a job a cancel or an expiry stopped (``status``: cancelled or expired): one the
    scheduler gave up on while its batch's window was still open (``given_up_in_window``) is the server's failure
    (``server_error``), any other expiry the window's (``batch_expired``). Finalize's batch status and a message
    batch's counts read the codes from here too, so they say what the error file says."""
    if status == "cancelled":
        return "batch_cancelled"
    return "server_error" if given_up_in_window else "batch_expired"


def given_up_in_window(job: Job, window_end: datetime | None) -> bool:
    """Whether the scheduler gave up on ``job`` (expired with the worker's error; the window's stop sets none) before
    the batch's window ended (``window_end``: its ``expires_at``). SQL's twin: ``GIVEN_UP_IN_WINDOW``."""
    return (job.error is not None and window_end is not None and job.finished_at is not None
            and as_utc(job.finished_at) < as_utc(window_end))


# ``given_up_in_window`` of an expired job joined to its batch, as SQL (NULL where a time is missing: not in window)
GIVEN_UP_IN_WINDOW = func.coalesce(and_(Job.error.is_not(None), Job.finished_at < Batch.expires_at), false())


def _given_up(job: Job, window_end: datetime | None) -> tuple[str, str]:
    """A job the scheduler relegated under overload and then gave up on: ``batch_expired`` only where the batch's
    window had ended when it did (OpenAI expires a request only so); before that, the server's failure, as OpenAI
    types an overloaded server's answer (``server_error``), which the request may be sent again for."""
    tokens = job.completion_tokens
    how = f"after {tokens} of its tokens" if tokens else "before its first token"
    code = stopped_code(job.status, given_up_in_window(job, window_end))
    if code == "batch_expired":
        return code, f"{WINDOW_ENDED}: the server had relegated it under overload and gave up on it {how}"
    return code, (f"the server relegated this request under overload and gave up on it {how}, while the "
                  "batch's completion window was still open; it can be sent again")


def outran_window(job: Job, window_end: datetime | None) -> bool:
    """Whether ``job``'s error line says the batch's window ended before it finished (``batch_expired``)."""
    return job.status == "expired" and stopped_code(job.status, given_up_in_window(job, window_end)) == "batch_expired"


REFUSED_LINE = "batch_req_line_"  # an error-file line's id prefix where the validation refused its input line


def invalid_line(line_no: int, custom_id: str | None, code: str, message: str) -> dict[str, Any]:
    """The error-file line of an input line the validation refused. Its shape is every error line's, as OpenAI's and
    vLLM's batch output lines are: ``custom_id`` a string (vLLM's ``BatchRequestOutput`` requires one; "" where the
    line had none readable, which no valid line has) and ``error`` only ``code`` and ``message``. The line number is
    in its ``id`` and message: ``line`` belongs to the batch's own ``errors.data[]`` (OpenAI's ``BatchError``)."""
    return {"id": f"{REFUSED_LINE}{line_no}", "custom_id": custom_id or "", "response": None,
            "error": {"code": code, "message": message}}


def unrun_line(line_no: int, custom_id: str) -> dict[str, Any]:
    """The error-file line of a valid input line whose request a cancel stopped before its job started (a batch
    cancelled while validating): ``batch_cancelled``, as a cancelled job's line, named by its line as a refused one."""
    return invalid_line(line_no, custom_id, "batch_cancelled", "the request was cancelled with its batch before it ran")
