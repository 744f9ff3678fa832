"""OpenAI's Responses API: ``POST /v1/responses`` (plain and streamed), ``GET`` and ``DELETE
/v1/responses/{id}``.

A response is a chat job (``app.responses_schemas`` writes the request as chat and the job as a Response):
it runs, is followed, cancelled when its client hangs up and refused as chat completions are. Its id names
its job (``resp_<hex>`` is ``job_<hex>``). ``previous_response_id`` continues a stored response's
conversation: its messages (less its instructions and system input, as vLLM) and its answer come before the new
input, after the new instructions; ``conversation`` puts a conversation's items there, one response at a time
(``app.services.conversations.take_turn``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response, StreamingResponse

from app.api.deps import CurrentPrincipal, SessionDep, SettingsDep, WithLogprobs, rate_limiter
from app.api.errors import openai_responses, stream_failure
from app.api.openai_compat import (answer_of, charge_count, count_prompt_tokens, documented_body, job_error,
                                   read_body, submit_openai_job)
from app.auth import Principal
from app.db.models import Job, JobStatus, new_id
from app.db.session import read_then_write, write_after_read
from app.openai_schemas import OpenAIError, OpenAIRoute, charged
from app.responses_schemas import (LOGPROBS_INCLUDE, InputTokensRequest, ResponsesRequest, call_item, call_status,
                                   chat_call, history_of, in_responses_terms, item_page, job_id_of, message_item,
                                   own_input_items, reasoning_item, response_body, stored_answer, token_logprobs)
from app.services import conversations
from app.services import jobs as job_service
from app.services.answer_events import (KEEPALIVE_COMMENT, Failed, Finished, Held, Interrupted, Piece,
                                        abandoned_on_hangup, answer_events, held_comment, kept_alive)
from app.services.job_follow import stream_expired
from app.services.rate_limits import rate_headers
from app.services.truncation import fit_context, fit_response
from app.services.cancel import cancel
from app.settings import Settings
from app.tool_calls import Answer

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=["openai"], route_class=OpenAIRoute)

ENDPOINT = "/v1/responses"
Event = tuple[str, str] | bytes  # a stream event's type, and its other fields as JSON (``_event``); or a comment


def _stored(session, principal: Principal, resp_id: str, param: str | None = None) -> Job:
    """The tenant's stored response ``resp_id`` (404; or, where the body gave the id as ``param``, its
    ``previous_response_id``, a 400 naming it with OpenAI's code for a response not, or no longer, stored: clients
    read it to send the whole conversation instead)."""
    job_id = job_id_of(resp_id)
    job = job_service.get_job(session, principal.tenant_id, job_id) if job_id else None
    if job is None or job.endpoint != ENDPOINT or not (job.response or {}).get("store", True):
        raise OpenAIError(400 if param else 404, f"no stored response {resp_id!r}", param=param,
                          code="previous_response_not_found" if param else "response_not_found")
    return job


def _history(session, principal: Principal, resp_id: str) -> list[dict[str, Any]]:
    job = _stored(session, principal, resp_id, param="previous_response_id")
    if job.status != JobStatus.SUCCEEDED:
        raise OpenAIError(400, f"response {resp_id!r} is {job.status}; continue from a completed one",
                          param="previous_response_id")
    return history_of(job.messages or [], job.response or {}, stored_answer(job))


def _conversation_history(session, principal: Principal, conv_id: str) -> list[dict[str, Any]]:
    return conversations.history(session, conversations.find(session, principal.tenant_id, conv_id,
                                                             param="conversation"))


def _prior_turns(session, principal: Principal, body: ResponsesRequest) -> list[dict[str, Any]]:
    """The messages before the request's own: its previous response's conversation, or its conversation's."""
    if body.previous_response_id is not None:
        return _history(session, principal, body.previous_response_id)
    if body.conversation_id is not None:
        return _conversation_history(session, principal, body.conversation_id)
    return []


def _take_turn(settings: Settings, principal: Principal, conv_id: str, job_id: str,
               store: bool) -> list[dict[str, Any]]:
    """The conversation's messages, read as response ``job_id`` takes its turn, in one transaction with the
    conversation's row locked: a second response on it meanwhile is refused (``conversations.take_turn``)."""
    with read_then_write(settings.sqlalchemy_url) as s:
        conv = conversations.find(s, principal.tenant_id, conv_id, param="conversation", lock=True)
        return conversations.take_turn(s, conv, job_id, store)


def _give_back_turn(settings: Settings, conv_id: str, job_id: str) -> None:
    with read_then_write(settings.sqlalchemy_url) as s:
        conversations.give_back_turn(s, conv_id, job_id)


async def _turns_before(session, principal: Principal, settings: Settings, body: ResponsesRequest,
                        job_id: str) -> list[dict[str, Any]]:
    """``_prior_turns`` of a response to be submitted as job ``job_id``: on a conversation, its turn taken."""
    if body.conversation_id is not None:
        return await run_in_threadpool(_take_turn, settings, principal, body.conversation_id, job_id,
                                       body.store)
    return await run_in_threadpool(_prior_turns, session, principal, body)


def _error(status: str, error: str | None, code: str | None) -> dict[str, Any]:
    """A Response's ``error``: what the chat routes would answer for the job's end, as code and message."""
    err = job_error(status, error, code)
    return {"code": err.code or err.type, "message": err.message}


def _retrieved(job: Job, settings: Settings, logprobs: bool = False) -> dict[str, Any]:
    """The stored response as retrieved; ``logprobs``: with the token logprobs it kept, where the retrieval's
    ``include`` asks (OpenAI's include adds what it names on each read, not once for good at create)."""
    kept = job.response or {}
    # a cancelled response is no error (OpenAI's error is null there: its status says it was cancelled)
    ended = job.status in (JobStatus.FAILED, JobStatus.EXPIRED)
    error = _error(job.status, job.error, job.error_code) if ended else None
    # succeeded, or cancelled while it ran: the output produced (so far), and its usage (billed, as OpenAI bills it)
    if job.status == JobStatus.SUCCEEDED or (job.status == JobStatus.CANCELLED and job.completion_tokens is not None):
        return response_body(job, kept, settings.tiers, answer=stored_answer(job), prompt_tokens=job.prompt_tokens,
                             completion_tokens=job.completion_tokens,
                             logprobs=job.output_logprobs if logprobs else None,
                             cached_tokens=job.cached_tokens, reasoning_tokens=job.reasoning_tokens, error=error,
                             cache_write_tokens=job.cache_write_tokens)
    return response_body(job, kept, settings.tiers, error=error)


async def _events(settings: Settings, job: Job, kept: dict[str, Any], asked_logprobs: bool) -> AsyncIterator[Event]:
    """The job as the Responses API's typed events, without their sequence numbers: created, the output items'
    text and call arguments as they come, then completed (or incomplete, failed; an ``error`` event where the
    stream broke). The same job's events are the same events every time its stream is read (their token logprobs
    where the reader's ``include`` asks, ``asked_logprobs``, and the job computed them)."""
    items: list[dict[str, Any]] = []  # the output items opened, in order (reasoning, a message, function calls)
    thought: dict[str, Any] | None = None  # the reasoning item while it is open
    thinking = ""  # its text so far
    message: dict[str, Any] | None = None  # the message item while it is open
    text = ""  # its text so far
    calls: dict[int, dict[str, Any]] = {}  # the call items by the call's index
    computed = (job.sampling or {}).get("logprobs") is not None
    logprobs: list[dict[str, Any]] | None = [] if asked_logprobs and computed else None
    pending = 0  # of them, those not yet sent with a text delta
    generated = 0  # output tokens so far

    def close_message(status: str = "completed") -> list[Event]:
        nonlocal message
        if message is None:
            return []
        at, item = items.index(message), message_item(job.id, text, status, logprobs=logprobs)
        items[at], message = item, None
        part = item["content"][0]
        return [_event("response.output_text.done", item_id=item["id"], output_index=at, content_index=0,
                       text=text, logprobs=part["logprobs"]),
                _event("response.content_part.done", item_id=item["id"], output_index=at, content_index=0,
                       part=part),
                _event("response.output_item.done", output_index=at, item=item)]

    def close_thought(status: str = "completed") -> list[Event]:
        nonlocal thought
        if thought is None:
            return []
        at, item = items.index(thought), reasoning_item(job.id, thinking, status)
        items[at], thought = item, None
        return [_event("response.reasoning_text.done", item_id=item["id"], output_index=at, content_index=0,
                       text=thinking),
                _event("response.content_part.done", item_id=item["id"], output_index=at, content_index=0,
                       part={"type": "reasoning_text", "text": thinking}),
                _event("response.output_item.done", output_index=at, item=item)]

    def think(reasoning: str) -> list[Event]:
        nonlocal thought, thinking
        out: list[Event] = []
        if thought is None:
            thought = reasoning_item(job.id, "", status="in_progress")
            items.append(thought)
            out += [_event("response.output_item.added", output_index=len(items) - 1, item=thought),
                    _event("response.content_part.added", item_id=thought["id"], output_index=len(items) - 1,
                           content_index=0, part={"type": "reasoning_text", "text": ""})]
        thinking += reasoning
        return out + [_event("response.reasoning_text.delta", item_id=thought["id"], output_index=items.index(thought),
                             content_index=0, delta=reasoning)]

    def open_message() -> list[Event]:
        nonlocal message
        message = message_item(job.id, "", status="in_progress")
        items.append(message)
        at = len(items) - 1
        return [_event("response.output_item.added", output_index=at, item=message),
                _event("response.content_part.added", item_id=message["id"], output_index=at, content_index=0,
                       part={"type": "output_text", "text": "", "annotations": []})]

    def pieces(reasoning: str, content: str, deltas: list[dict[str, Any]] | None) -> list[Event]:
        nonlocal text, pending
        out: list[Event] = think(reasoning) if reasoning else []
        if content:
            if message is None:
                out += close_thought() + open_message()
            text += content
            sent, pending = token_logprobs(logprobs[len(logprobs) - pending:]) if pending else [], 0
            out.append(_event("response.output_text.delta", item_id=message["id"],
                              output_index=items.index(message), content_index=0, delta=content, logprobs=sent))
        for delta in deltas or ():
            k = delta["index"]
            if "id" in delta:  # a call opens: the thinking and the message before it are done
                out += close_thought() + close_message()
                call = {**delta, "function": {**delta["function"], "arguments": ""}}
                calls[k] = call_item(call, status="in_progress")
                items.append(calls[k])
                out.append(_event("response.output_item.added", output_index=len(items) - 1, item=calls[k]))
            if arguments := delta["function"].get("arguments"):
                calls[k]["arguments"] += arguments
                out.append(_event("response.function_call_arguments.delta", item_id=calls[k]["id"],
                                  output_index=items.index(calls[k]), delta=arguments))
        return out

    def close_calls(status: str = "completed") -> list[Event]:
        out = []
        for item in calls.values():
            at = items.index(item)
            item["status"] = call_status(item["arguments"], status)
            out += [_event("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                           arguments=item["arguments"]),
                    _event("response.output_item.done", output_index=at, item=item)]
        return out

    try:
        # a background response is queued until it runs; a plain one is under way (as OpenAI and vLLM say)
        created = "queued" if kept.get("background") else "running"
        yield _event("response.created", response=response_body(job, kept, settings.tiers, status=created))
        yield _event("response.in_progress", response=response_body(job, kept, settings.tiers, status="running"))
        async with aclosing(answer_events(settings, [job])) as answer:
            async for item in answer:
                match item:
                    case Piece():
                        generated = item.generated
                        if logprobs is not None and item.logprobs:
                            logprobs += item.logprobs
                            pending += len(item.logprobs)
                        for out in pieces(item.reasoning, item.content, item.calls):
                            yield out
                    case Held():  # an SSE comment, unnumbered (OpenAI's clients skip them): no silent stall
                        yield held_comment(item)
                    case Interrupted():  # the stream could not be read on; the job goes on
                        yield _event("error", code="stream_interrupted", param=None, message=item.message)
                    case Failed(status=JobStatus.CANCELLED) if not items:  # cancelled before any output: none,
                        # and no usage, as GET shows it (no empty message the stream never announced)
                        yield _event("response.failed", response=response_body(
                            job, kept, settings.tiers, status=JobStatus.CANCELLED))
                    case Failed(status=JobStatus.CANCELLED):  # the output so far stays, as GET shows it
                        for out in close_thought("incomplete") + close_message("incomplete") + close_calls(
                                "incomplete"):
                            yield out
                        so_far = Answer(text or None, [chat_call(c) for c in calls.values()] or None, "stop",
                                        thinking or None)
                        yield _event("response.failed", response=response_body(
                            job, kept, settings.tiers, status=JobStatus.CANCELLED, answer=so_far,
                            prompt_tokens=job.prompt_tokens, completion_tokens=generated, logprobs=logprobs))
                    case Failed():
                        yield _event("response.failed", response=response_body(
                            job, kept, settings.tiers, status=item.status,
                            error=_error(item.status, item.error, item.code)))
                    case Finished():
                        # an answer with neither text nor calls has an empty message
                        opened = [] if calls or any(i["type"] == "message" for i in items) else open_message()
                        cut = "incomplete" if item.answer.finish_reason == "length" else "completed"
                        for out in close_thought(cut) + opened + close_message(cut) + close_calls(cut):
                            yield out
                        body = response_body(job, kept, settings.tiers, status=JobStatus.SUCCEEDED,
                                             answer=item.answer, prompt_tokens=item.prompt_tokens,
                                             completion_tokens=item.completion_tokens, logprobs=logprobs,
                                             cached_tokens=item.cached_tokens,
                                             cache_write_tokens=item.cache_write_tokens,
                                             reasoning_tokens=item.reasoning_tokens)
                        yield _event("response.completed" if body["status"] == "completed" else "response.incomplete",
                                     response=body)
    except Exception as exc:  # a bug or a database error: say so; the job itself goes on
        _status, message = stream_failure(exc, job.id, f"GET /v1/responses/{job.id}")
        yield _event("error", code="stream_interrupted", param=None, message=message)


def _event(kind: str, **fields: Any) -> Event:
    """An event of ``kind``, its fields written now (the items they show change as the answer grows)."""
    return kind, json.dumps(fields, separators=(",", ":"))


async def _numbered(events: AsyncIterator[Event], starting_after: int | None = None) -> AsyncIterator[bytes]:
    """``events`` as server-sent events, numbered from 0 in order; those up to ``starting_after`` are left out
    (a client that resumes a stream has them). Where the events end before ``starting_after`` (the stream lost
    events, after a Redis restart, and its text comes whole from SQL, in fewer events than were first sent), an
    ``error`` event says so, instead of an empty answer a client takes for the rest of the response."""
    number = -1
    async with aclosing(events) as typed:
        async for event in typed:
            if isinstance(event, bytes):  # a comment: no event of the response's, so no number
                yield event
                continue
            kind, fields = event
            number += 1
            if starting_after is None or number > starting_after:
                rest = "}" if fields == "{}" else "," + fields[1:]
                yield f'event: {kind}\ndata: {{"type":{json.dumps(kind)},"sequence_number":{number}{rest}\n\n'.encode()
    if starting_after is not None and number < starting_after:
        message = (f"this response's stream has {number + 1} events, none after sequence_number {starting_after}: "
                   "starting_after is past its end, or its events were lost (a Redis restart) and it was rebuilt "
                   "from the stored response in fewer events; GET the response for it")
        fields = json.dumps({"code": "stream_rebuilt", "message": message, "param": "starting_after"})
        yield f'event: error\ndata: {{"type":"error","sequence_number":{number + 1},{fields[1:]}\n\n'.encode()


_ANSWERS = {200: {"content": {"text/event-stream": {}}, "description": "a Response, or its events with stream: true"},
            **openai_responses(400, 401, 404, 409, 413, 429, 500, 504)}
_ANSWERS_GET = {200: _ANSWERS[200], **openai_responses(400, 401, 404)}
_STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@router.post("/responses", responses=_ANSWERS, openapi_extra=documented_body(ResponsesRequest))
async def create_response(request: Request, session: SessionDep, principal: CurrentPrincipal,
                          settings: SettingsDep):
    """OpenAI's Responses API; coserve's QoS fields (ttft_ms, tbt_ms, deadline, tier) as on chat; a background
    response's ``background_options.completion_window`` of 2h or 8h is a batch job due that window after it arrives."""
    body = await read_body(request, ResponsesRequest)
    job_id = new_id("job")
    history = await _turns_before(session, principal, settings, body, job_id)
    try:
        chat, kept, submitted = await _submit(request, session, principal, settings, body, history, job_id)
    except BaseException:  # a conversation's turn taken for a job never submitted
        if body.conversation_id is not None:
            await run_in_threadpool(_give_back_turn, settings, body.conversation_id, job_id)
        raise
    job = submitted.job
    charged(request, submitted.rate_headers())  # on every answer, an error after the submit (a job that failed) too
    headers = {"x-coserve-job-id": job.id}
    if chat.stream:
        asked = LOGPROBS_INCLUDE in (body.include or ())
        events = kept_alive(_numbered(_events(settings, job, kept, asked)), KEEPALIVE_COMMENT)
        if not body.background:  # a background response runs on when its client hangs up (GET resumes it)
            events = abandoned_on_hangup(settings, [job], events)
        return StreamingResponse(events, media_type="text/event-stream", headers=headers | _STREAM_HEADERS)
    if body.background:  # the client polls GET /v1/responses/{id}; nothing here waits for the job
        return JSONResponse(response_body(job, kept, settings.tiers, status="queued"), headers=headers)
    answered = await answer_of(request, settings, job)
    if isinstance(answered, Response):
        return answered
    end, answer = answered
    return JSONResponse(response_body(job, kept, settings.tiers, status=JobStatus.SUCCEEDED, answer=answer,
                                      prompt_tokens=end.data["prompt_tokens"],
                                      completion_tokens=end.data["completion_tokens"],
                                      logprobs=end.data.get("logprobs"),
                                      cached_tokens=end.data.get("cached_tokens"),
                                      cache_write_tokens=end.data.get("cache_write_tokens"),
                                      reasoning_tokens=end.data.get("reasoning_tokens")), headers=headers)


async def _submit(request: Request, session, principal: Principal, settings: Settings, body: ResponsesRequest,
                  history: list[dict[str, Any]], job_id: str):
    """The response's chat request, what its job keeps of it, and the job submitted as ``job_id``."""
    raw = await request.json()
    chat, spec = body.chat_request(raw, history, settings.tiers)
    if spec.kind == "interactive":
        ttft_ms, tbt_ms = settings.interactive_defaults(ENDPOINT)
        spec = spec.model_copy(update={"ttft_ms": spec.ttft_ms or ttft_ms, "tbt_ms": spec.tbt_ms or tbt_ms})
    kept = body.kept(history)
    if body.truncation == "auto":  # the oldest turns go where the conversation outgrew the context
        spec = await run_in_threadpool(fit_response, settings, spec, kept)
    writer = getattr(request.app.state, "job_writer", None)
    try:
        submitted = await run_in_threadpool(submit_openai_job, session, principal, settings, spec, ENDPOINT, writer,
                                            kept, rate_limiter(request), job_id=job_id)
    except OpenAIError as exc:  # the job's checks name chat's fields
        raise in_responses_terms(exc, raw) from exc
    return chat, kept, submitted


@router.post("/responses/input_tokens", responses=openai_responses(400, 401, 404, 429),
             openapi_extra=documented_body(InputTokensRequest))
async def count_input_tokens(request: Request, session: SessionDep, principal: CurrentPrincipal,
                             settings: SettingsDep):
    """The tokens a Responses request's input would take: its conversation or previous response, instructions,
    input and tools through the model's chat template, as its job would count them (after ``truncation: "auto"``
    dropped the oldest turns, where asked); a request of the tenant's token-counting requests per minute."""
    body = await read_body(request, InputTokensRequest)
    charged(request, rate_headers(await charge_count(request, principal)))
    history = await run_in_threadpool(_prior_turns, session, principal, body)
    raw = await request.json()
    _, spec = body.chat_request(raw, history, settings.tiers)  # as _submit's
    try:
        count = await run_in_threadpool(_input_tokens, settings, spec, body.kept(history)["input_from"],
                                        body.truncation)
    except OpenAIError as exc:  # the chat template's refusal names chat's messages
        raise in_responses_terms(exc, raw) from exc
    return {"object": "response.input_tokens", "input_tokens": count}


@router.post("/responses/compact", responses=openai_responses(401, 404))
async def compact_response(_principal: CurrentPrincipal) -> None:
    """OpenAI's ``client.responses.compact`` is not offered: a 404 as for a path not served (without this route the
    path would be read as a response id, a 405 no SDK types), saying what does the job here."""
    raise OpenAIError(404, "Invalid URL (POST /v1/responses/compact): compacting a conversation is not offered here; "
                      "truncation: \"auto\" drops its oldest turns where it outgrows the context",
                      code="unsupported_endpoint")


def _input_tokens(settings: Settings, spec, input_from: int, truncation: str | None) -> int:
    if truncation == "auto":
        spec, _ = fit_context(settings, spec, input_from)
    return count_prompt_tokens(settings, spec, ENDPOINT)


@router.get("/responses/{response_id}", responses=_ANSWERS_GET)
async def get_response(response_id: str, session: SessionDep, principal: CurrentPrincipal, settings: SettingsDep,
                       logprobs: WithLogprobs, stream: bool = False,
                       starting_after: Annotated[int | None, Query(ge=0)] = None):
    """A stored response: its output once the job is done, its status meanwhile; with ``stream``, its events
    from the start (those after the event numbered ``starting_after``), live while it runs. A response's
    events can be read again until an hour after it ended (the job's stream expires then). Its token logprobs
    (those it kept, asked for at create) only where ``include`` asks again."""
    job = await run_in_threadpool(_stored, session, principal, response_id)
    if not stream:
        return _retrieved(job, settings, logprobs)
    if starting_after is not None and JobStatus(job.status).terminal and await stream_expired(settings, job.id):
        raise OpenAIError(400, f"the events of response {response_id!r} have expired (they are kept for an hour "
                               "after it ends): read it without stream, or stream it again from the start",
                          param="starting_after")
    return StreamingResponse(kept_alive(_numbered(_events(settings, job, job.response or {}, logprobs),
                                                  starting_after), KEEPALIVE_COMMENT),
                             media_type="text/event-stream", headers={"x-coserve-job-id": job.id} | _STREAM_HEADERS)


@router.get("/responses/{response_id}/input_items", responses=openai_responses(400, 401, 404))
def list_input_items(response_id: str, session: SessionDep, principal: CurrentPrincipal, _logprobs: WithLogprobs,
                     limit: Annotated[int, Query(ge=1, le=100)] = 20,
                     order: Literal["asc", "desc"] = "desc", after: str | None = None):
    """The response's input (not the conversation it continued, nor its instructions) as items, newest first
    unless ``order=asc``; ``after``: an item id, the page starts past it (``include``: as GET's, checked; given
    items have no logprobs to include)."""
    job = _stored(session, principal, response_id)
    return item_page(own_input_items(job), limit, order, after, f"no input item {after!r} in response {response_id!r}")


@router.post("/responses/{response_id}/cancel", responses=openai_responses(400, 401, 404))
def cancel_response(response_id: str, session: SessionDep, principal: CurrentPrincipal, settings: SettingsDep):
    """Stops a background response that has not ended (one that has is a 400, as vLLM and OpenAI answer it)."""
    job = _stored(session, principal, response_id)
    if not (job.response or {}).get("background"):
        raise OpenAIError(400, "only a background response can be cancelled (a plain one stops when its client "
                               "hangs up)", param="response_id")
    if not cancel(session, settings, job, "cancelled by the client"):
        state = _retrieved(job, settings)["status"]
        raise OpenAIError(400, f"response {response_id!r} has already ended ({state}): only a queued or running "
                               "one can be cancelled", param="response_id")
    return _retrieved(job, settings)


@router.delete("/responses/{response_id}", responses=openai_responses(401, 404))
def delete_response(response_id: str, session: SessionDep, principal: CurrentPrincipal):
    """Forgets a stored response: it can no longer be retrieved or continued (its job stays in /v1/jobs)."""
    job = _stored(session, principal, response_id)
    with write_after_read(session):
        job.response = {**(job.response or {}), "store": False}
        session.commit()
    return {"id": response_id, "object": "response", "deleted": True}
