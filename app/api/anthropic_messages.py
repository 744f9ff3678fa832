"""Anthropic's Messages API, as vLLM serves it: ``POST /v1/messages`` (plain and streamed) and ``POST
/v1/messages/count_tokens``.

A message is a chat job (``app.anthropic_schemas`` writes the request as chat and the answer as a Message): it
runs, is followed, cancelled when its client hangs up and refused as chat completions are, and its errors come
in Anthropic's shape. Anthropic's SDKs send their key as ``x-api-key``, which coserve takes as a bearer key.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response, StreamingResponse

from app.anthropic_schemas import (ENDPOINT, CountTokensRequest, MessagesRequest, error_body, in_messages_terms,
                                   message_body, message_of, stop_of, thinking_signature, tool_use_block,
                                   usage_of)
from app import request_id
from app.api.deps import CurrentPrincipal, SessionDep, SettingsDep, rate_limiter
from app.api.errors import anthropic_error, anthropic_responses, anthropic_sdk, stream_failure
from app.api.openai_compat import (answer_of, charge_count, count_prompt_tokens, documented_body, job_error,
                                   json_object, submit_openai_job)
from app.db.models import Job
from app.openai_schemas import FINAL, OpenAIError, OpenAIRoute, charged, openai_parsed
from app.services.answer_events import (HELD, Failed, Finished, Held, Interrupted, Piece, abandoned_on_hangup,
                                        answer_events, kept_alive)
from app.services.rate_limits import RateLimited, anthropic_rate_headers
from app.settings import Settings
from app.tool_input import StreamedInput

log = logging.getLogger(__name__)


class AnthropicRoute(OpenAIRoute):
    """A route whose errors come out in Anthropic's shape (``{"type": "error", "error": {...}, "request_id"}``), and
    whose answers carry Anthropic's ``request-id`` header (its SDKs show it as ``_request_id``) and its
    ``anthropic-ratelimit-*`` headers, not OpenAI's ``x-ratelimit-*``."""

    def error(self, exc: OpenAIError) -> Response:
        headers = exc.headers | (FINAL if exc.status_code == 409 else {})  # its SDKs read x-should-retry too
        if isinstance(limited := exc.__cause__, RateLimited):
            headers = ({k: v for k, v in headers.items() if not k.startswith("x-ratelimit-")}
                       | limited.decision.anthropic_headers())
        # the request's id in the body and the header: here too for a 500, which the app-wide handler answers
        return anthropic_error(exc.status_code, exc.message, headers)

    def get_route_handler(self) -> Callable:
        return with_request_id_header(super().get_route_handler())


class SharedPathRoute(OpenAIRoute):
    """A route of a path both APIs' SDKs call (``/v1/models``, ``/v1/files``): its errors in Anthropic's shape, and
    its answers with Anthropic's ``request-id`` header, to Anthropic's SDK (``errors.anthropic_sdk``: its
    ``anthropic-version`` header), else in OpenAI's shape, as the framework's errors on those paths
    (``errors.error_api``)."""

    def error_to(self, request: Request, exc: OpenAIError) -> Response:
        return AnthropicRoute.error(self, exc) if anthropic_sdk(request.headers) else self.error(exc)  # type: ignore

    def get_route_handler(self) -> Callable:
        return with_request_id_header(super().get_route_handler(), lambda request: anthropic_sdk(request.headers))


def with_request_id_header(handler: Callable, to: Callable[[Request], bool] = lambda _request: True) -> Callable:
    """``handler`` whose answers to the requests ``to`` picks carry Anthropic's ``request-id`` header, the request's
    id (docs.anthropic.com/en/api/errors: on every answer; its SDKs read ``_request_id`` there, not from
    ``x-request-id``)."""

    async def with_request_id(request: Request) -> Response:
        response = await handler(request)
        if to(request) and (rid := request_id.current()) is not None:
            response.headers["request-id"] = rid
        return response

    return with_request_id


router = APIRouter(prefix="/v1", tags=["anthropic"], route_class=AnthropicRoute)


async def _read(request: Request, model: type[MessagesRequest]) -> tuple[MessagesRequest, dict[str, Any]]:
    raw = await json_object(request)
    body = openai_parsed(model, raw)
    body.check(raw)
    return body, raw


def _sse(kind: str, fields: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, separators=(',', ':'))}\n\n".encode()


def _sse_error(err: OpenAIError) -> bytes:
    return _sse("error", {"error": error_body(err.status_code, err.message)["error"]})


async def _events(settings: Settings, job: Job) -> AsyncIterator[bytes]:
    """The job as the Messages API's stream: message_start, each content block (thinking, text, a tool call)
    opened, added to and stopped in turn, then message_delta (why it ended, the usage) and message_stop; an
    ``error`` event where the job failed or the stream broke."""
    blocks: list[str] = []  # the blocks opened, by index: "thinking", "text", or a tool call's id
    calls: dict[int, int] = {}  # a tool call's index in the answer -> its block's index
    inputs: dict[int, StreamedInput] = {}  # a tool call's index in the answer -> its input as streamed so far
    open_block: int | None = None

    def start(kind: str, block: dict[str, Any]) -> list[bytes]:
        nonlocal open_block
        out = stop()
        blocks.append(kind)
        open_block = len(blocks) - 1
        return out + [_sse("content_block_start", {"index": open_block, "content_block": block})]

    def stop() -> list[bytes]:
        """The open block's stop; a thinking block's signature first, as vLLM's stream sends it (a client keeps it
        to send the block back)."""
        nonlocal open_block
        if open_block is None:
            return []
        at, open_block = open_block, None
        out = [_sse("content_block_stop", {"index": at})]
        if blocks[at] == "thinking":
            signature = {"type": "signature_delta", "signature": thinking_signature(job.id, at)}
            out.insert(0, _sse("content_block_delta", {"index": at, "delta": signature}))
        return out

    def add(kind: str, delta: dict[str, Any]) -> list[bytes]:
        # a thinking block opens without a signature, as vLLM's does: its one comes in the delta before its stop
        out = [] if open_block is not None and blocks[open_block] == kind else start(kind, {
            "thinking": {"type": "thinking", "thinking": ""},
            "text": {"type": "text", "text": ""}}[kind])
        return out + [_sse("content_block_delta", {"index": open_block, "delta": delta})]

    def pieces(item: Piece) -> list[bytes]:
        out = add("thinking", {"type": "thinking_delta", "thinking": item.reasoning}) if item.reasoning else []
        if item.content:
            out += add("text", {"type": "text_delta", "text": item.content})
        for delta in item.calls or ():
            if "id" in delta:  # a call opens: its block, its arguments as they come while the SDK reads them
                out += start(delta["id"], tool_use_block(delta, None))
                calls[delta["index"]], inputs[delta["index"]] = open_block, StreamedInput()
            if partial := inputs[delta["index"]].more(delta["function"].get("arguments") or ""):
                out.append(_sse("content_block_delta", {"index": calls[delta["index"]], "delta": {
                    "type": "input_json_delta", "partial_json": partial}}))
        return out

    try:
        start_usage = usage_of(job.prompt_tokens, 0, None)
        yield _sse("message_start", {"message": message_body(job.id, job.model, content=[], stop=(None, None),
                                                             usage=start_usage)})
        yield _sse("ping", {})
        async with aclosing(answer_events(settings, [job])) as answer:
            async for item in answer:
                match item:
                    case Piece():
                        for out in pieces(item):
                            yield out
                    case Held():  # a ping (Anthropic's SDKs skip them) that says so: no silent stall
                        yield _sse("ping", {"status": item.status, "detail": HELD[item.status]})
                    case Interrupted():  # the stream could not be read on; the job goes on
                        yield _sse_error(OpenAIError(503, item.message))
                    case Failed():
                        yield _sse_error(job_error(item.status, item.error, item.code))
                    case Finished():
                        for out in stop():
                            yield out
                        end = stop_of(item.answer.finish_reason, item.stop_reason, item.answer.tool_calls)
                        yield _sse("message_delta", {
                            "delta": {"stop_reason": end[0], "stop_sequence": end[1]},
                            "usage": usage_of(item.prompt_tokens, item.completion_tokens, item.cached_tokens,
                                              item.cache_write_tokens)})
                        yield _sse("message_stop", {})
    except Exception as exc:  # a bug or a database error: say so; the job itself goes on
        yield _sse_error(OpenAIError(*stream_failure(exc, job.id, f"GET /v1/jobs/{job.id}")))


_ANSWERS = {200: {"content": {"text/event-stream": {}}, "description": "a Message, or its events with stream: true"},
            **anthropic_responses(400, 401, 404, 409, 413, 429, 500, 503, 504)}


@router.post("/messages", responses=_ANSWERS, openapi_extra=documented_body(MessagesRequest))
async def create_message(request: Request, session: SessionDep, principal: CurrentPrincipal, settings: SettingsDep):
    """Anthropic's Messages API; coserve's QoS fields (ttft_ms, tbt_ms, deadline, tier) as on chat."""
    body, raw = await _read(request, MessagesRequest)
    chat, spec = body.chat_request(raw, settings.tiers, model=settings.model)
    if spec.kind == "interactive":
        ttft_ms, tbt_ms = settings.interactive_defaults(ENDPOINT)
        spec = spec.model_copy(update={"ttft_ms": spec.ttft_ms or ttft_ms, "tbt_ms": spec.tbt_ms or tbt_ms})
    writer = getattr(request.app.state, "job_writer", None)
    try:
        submitted = await run_in_threadpool(submit_openai_job, session, principal, settings, spec, ENDPOINT, writer,
                                            None, rate_limiter(request))
    except OpenAIError as exc:  # named as the Messages field (thinking.budget_tokens); a 429 keeps its cause
        if (named := in_messages_terms(exc)) is exc:
            raise
        raise named from exc.__cause__
    job = submitted.job
    charged(request, anthropic_rate_headers(submitted.rate))  # on every answer, a failed job's error too
    headers = {"x-coserve-job-id": job.id}
    if chat.stream:
        events = abandoned_on_hangup(settings, [job], kept_alive(_events(settings, job), _sse("ping", {})))
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers=headers | {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    answered = await answer_of(request, settings, job)
    if isinstance(answered, Response):
        return answered
    end, answer = answered
    message = message_of(job.id, job.model, answer, end.data.get("stop_reason"), end.data["prompt_tokens"],
                         end.data["completion_tokens"], end.data.get("cached_tokens"),
                         end.data.get("cache_write_tokens"))
    return JSONResponse(message, headers=headers)


@router.post("/messages/count_tokens", responses=anthropic_responses(400, 401, 404, 429),
             openapi_extra=documented_body(CountTokensRequest))
async def count_tokens(request: Request, settings: SettingsDep, principal: CurrentPrincipal):
    """The tokens a Messages request's system prompt, messages and tools take through the model's chat template,
    as its job would count them; a request of the tenant's requests per minute apart from its messages' (as
    Anthropic limits count_tokens apart from them)."""
    body, raw = await _read(request, CountTokensRequest)
    _, spec = body.chat_request(raw, settings.tiers, count_only=True, model=settings.model)
    charged(request, anthropic_rate_headers(await charge_count(request, principal)))
    return {"input_tokens": await run_in_threadpool(count_prompt_tokens, settings, spec, ENDPOINT)}
