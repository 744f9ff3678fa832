"""OpenAI-compatible ``/v1/chat/completions`` and ``/v1/completions`` (streaming and not).

Each request becomes an interactive job (``submit_job``; a ``deadline`` extension field
makes it a deadline job). The answer follows the job's Redis stream: as server-sent
events in OpenAI's chunk format when ``stream`` is set, else once the job is terminal.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import anyio
import anyio.to_thread
import redis.asyncio as aioredis
from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from app.api.deps import CurrentPrincipal, SessionDep, SettingsDep
from app.api.errors import openai_responses
from app.auth import Principal
from app.db.models import Job, JobStatus
from app.db.session import session_scope
from app.openai_schemas import (ChatCompletionRequest, CompletionRequest, OpenAIError, OpenAIRoute, chat_completion,
                                now_s, openai_param, text_completion, usage, validation_message)
from app.services import jobs as job_service
from app.services.notify import announce_cancel
from app.services.streaming import StreamEvent, follow_job
from app.settings import Settings

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=["openai"], route_class=OpenAIRoute)

POLL_S = 0.1  # SQL polling interval when no Redis is configured


async def _body(request: Request, model: type) -> Any:
    try:
        raw = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise OpenAIError(400, f"the body is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise OpenAIError(400, "the body must be a JSON object")
    try:
        body = model.model_validate(raw)
    except ValidationError as exc:
        message, param = validation_message(list(exc.errors()))
        raise OpenAIError(400, message, param=param) from exc
    body.check()
    return body


def _submit(session, principal: Principal, settings: Settings, spec, endpoint: str, writer=None) -> Job:
    try:
        return job_service.submit_job(session, principal, spec, settings, endpoint=endpoint, writer=writer).job
    except job_service.JobValidationError as exc:
        # OpenAI's codes: 404 only for an unknown model; a request over the context is a 400
        # (context_length_exceeded), which the official client raises as BadRequestError
        raise OpenAIError(404 if exc.code == "model_not_found" else 400, str(exc), param=openai_param(exc.param),
                          code=exc.code) from exc


# ---------------------------------------------------------------- following a job
def _terminal_event(url: str, job_id: str) -> StreamEvent | None:
    """SQL's view: an ``end`` event if the job is terminal (with its text), else None."""
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        if job is None or not JobStatus(job.status).terminal:
            return None
        return StreamEvent("end", attempt=job.attempt, status=job.status, finish_reason=job.finish_reason,
                           data={"prompt_tokens": job.prompt_tokens, "completion_tokens": job.completion_tokens,
                                 "output_text": job.output_text or "", "error": job.error, "from_sql": True})


async def job_events(settings: Settings, job_id: str) -> AsyncIterator[StreamEvent]:
    """The job's events until its terminal one (Redis stream; SQL when Redis is absent)."""
    url = settings.sqlalchemy_url
    if not settings.redis_url:
        while (end := await run_in_threadpool(_terminal_event, url, job_id)) is None:
            await asyncio.sleep(POLL_S)
        yield end
        return
    seen_terminal = False

    async def check_done() -> StreamEvent | None:
        # the worker commits SQL just before it publishes the stream's last events: only
        # trust SQL's "terminal" when the stream stayed silent on a second look
        nonlocal seen_terminal
        end = await run_in_threadpool(_terminal_event, url, job_id)
        if end is None:
            return None
        if seen_terminal or end.status != JobStatus.SUCCEEDED:
            return end
        seen_terminal = True
        return None

    client = aioredis.Redis.from_url(settings.redis_url)
    try:
        async for ev in follow_job(client, job_id, block_ms=500, check_done=check_done):
            yield ev
    finally:
        await client.aclose()


def _cancel_abandoned(settings: Settings, job_id: str) -> None:
    """The client went away mid-stream: stop generating for nobody."""
    try:
        with session_scope(settings.sqlalchemy_url) as s:
            job = s.get(Job, job_id)
            if job is not None and not JobStatus(job.status).terminal:
                if job_service.cancel_job(s, job, detail="client disconnected from the stream"):
                    announce_cancel(settings.redis_url, job)
    except Exception:
        log.exception("could not cancel abandoned job %s", job_id)


def _job_error(status: str | None, error: str | None) -> OpenAIError:
    if status == JobStatus.CANCELLED:
        return OpenAIError(409, "the request was cancelled", type="cancelled", code="cancelled")
    if status == JobStatus.EXPIRED:
        return OpenAIError(504, "the request's deadline passed before it finished", type="timeout",
                           code="deadline_exceeded")
    return OpenAIError(500, f"generation failed: {error or 'unknown error'}", type="server_error")


def _sse(obj: dict[str, Any] | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n".encode()


async def _stream(settings: Settings, job: Job, chat: bool, include_usage: bool) -> AsyncIterator[bytes]:
    cid = ("chatcmpl-" if chat else "cmpl-") + job.id
    created, model = now_s(), job.model
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(text: str | None, finish: str | None, first: bool = False) -> dict[str, Any]:
        if chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if text:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        out = {"id": cid, "object": obj, "created": created, "model": model, "choices": [choice]}
        if include_usage:
            out["usage"] = None
        return out

    delivered = 0
    done = False
    try:
        if chat:
            yield _sse(chunk(None, None, first=True))
        async for ev in job_events(settings, job.id):
            if ev.type == "delta" and ev.text:
                delivered += len(ev.text)
                yield _sse(chunk(ev.text, None))
            elif ev.type == "end":
                done = True
                if ev.status != JobStatus.SUCCEEDED:
                    err = _job_error(ev.status, ev.data.get("error"))
                    yield _sse({"error": {"message": err.message, "type": err.type, "param": None,
                                          "code": err.code}})
                    break
                if ev.data.get("from_sql"):  # ended through SQL: send what the stream missed
                    rest = (ev.data.get("output_text") or "")[delivered:]
                    if rest:
                        yield _sse(chunk(rest, None))
                yield _sse(chunk(None, ev.finish_reason or "stop"))
                if include_usage:
                    yield _sse({"id": cid, "object": obj, "created": created, "model": model, "choices": [],
                                "usage": usage(ev.data.get("prompt_tokens"), ev.data.get("completion_tokens"))})
                break
        yield _sse("[DONE]")
    finally:
        if not done:
            # SQL and Redis I/O: in a worker thread, never on the event loop; shielded, because this
            # runs while the disconnected response's task is being cancelled
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(_cancel_abandoned, settings, job.id)


async def _complete(request: Request, session, principal: Principal, settings: Settings, chat: bool):
    body = await _body(request, ChatCompletionRequest if chat else CompletionRequest)
    endpoint = "/v1/chat/completions" if chat else "/v1/completions"
    spec = body.job_spec(messages=body.chat_messages()) if chat else body.job_spec(prompt=body.prompt_text())
    if spec.kind == "interactive":  # this endpoint's QoS defaults for the targets the request left out
        ttft_ms, tbt_ms = settings.interactive_defaults(endpoint)
        spec = spec.model_copy(update={"ttft_ms": spec.ttft_ms or ttft_ms, "tbt_ms": spec.tbt_ms or tbt_ms})
    writer = getattr(request.app.state, "job_writer", None)  # the API's group-commit writer
    job = await run_in_threadpool(_submit, session, principal, settings, spec, endpoint, writer)
    headers = {"x-coserve-job-id": job.id}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        headers.update({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return StreamingResponse(_stream(settings, job, chat, include_usage), media_type="text/event-stream",
                                 headers=headers)
    end = None
    async for ev in job_events(settings, job.id):
        if ev.type == "end":
            end = ev
    row = await run_in_threadpool(_terminal_event, settings.sqlalchemy_url, job.id)
    status = row.status if row is not None else (end.status if end else None)
    if status != JobStatus.SUCCEEDED:
        raise _job_error(status, (row or end).data.get("error") if (row or end) else None)
    d = row.data
    extra = {"system_fingerprint": None, "coserve": {"job_id": job.id}}
    make = chat_completion if chat else text_completion
    content = make(("chatcmpl-" if chat else "cmpl-") + job.id, job.model, now_s(), d["output_text"],
                   row.finish_reason or "stop", d["prompt_tokens"], d["completion_tokens"], extra)
    return JSONResponse(content, headers=headers)


def _documented_body(model: type) -> dict[str, Any]:
    """The request body for the OpenAPI document: these routes parse it themselves (to answer
    every error in OpenAI's shape), so FastAPI cannot see it."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:  # the models are not recursive: their $defs can be written in place
        if isinstance(node, dict):
            if "$ref" in node:
                return inline(defs[node["$ref"].rsplit("/", 1)[-1]])
            return {k: inline(v) for k, v in node.items()}
        return [inline(v) for v in node] if isinstance(node, list) else node

    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}


# 200 is JSON, or server-sent events with stream: true; 409/500/504: the job was cancelled,
# failed or expired before it finished (a non-stream request waits for its end)
_ANSWERS = {200: {"content": {"text/event-stream": {}}, "description": "a completion, or its chunks as events"},
            **openai_responses(400, 401, 404, 409, 413, 500, 504)}


@router.post("/chat/completions", responses=_ANSWERS, openapi_extra=_documented_body(ChatCompletionRequest))
async def chat_completions(request: Request, session: SessionDep, principal: CurrentPrincipal,
                           settings: SettingsDep):
    """OpenAI chat completions; QoS extension fields: ttft_ms, tbt_ms, deadline, tier."""
    return await _complete(request, session, principal, settings, chat=True)


@router.post("/completions", responses=_ANSWERS, openapi_extra=_documented_body(CompletionRequest))
async def completions(request: Request, session: SessionDep, principal: CurrentPrincipal, settings: SettingsDep):
    """OpenAI (legacy) text completions; same extension fields as chat."""
    return await _complete(request, session, principal, settings, chat=False)
