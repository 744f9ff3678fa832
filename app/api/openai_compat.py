"""OpenAI-compatible ``/v1/chat/completions`` and ``/v1/completions`` (streaming and not).

Each request becomes an interactive job (``submit_job``; a ``deadline`` extension field
makes it a deadline job). The answer follows the job's Redis stream: as server-sent
events in OpenAI's chunk format when ``stream`` is set, else once the job is terminal.
A client that hangs up before its answer is complete cancels the job (a stream by closing,
a plain request noticed while it waits); nothing else does: a Redis outage or a failure
here ends a stream with an error chunk, and a plain request then waits on SQL.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from contextlib import aclosing, contextmanager
from typing import Any, TypeVar

import anyio
from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response, StreamingResponse

from app.api.deps import CurrentPrincipal, SessionDep, SettingsDep, rate_limiter
from app.api.errors import openai_responses, stream_failure
from app.auth import Principal
from app.db.models import INVALID_REQUEST, Job, JobStatus
from app.openai_schemas import (BatchChatCompletionRequest, ChatCompletionRequest, CompletionRequest, OpenAIError,
                                OpenAIRoute, StreamOptions, charged, chat_answer, chat_echo, chat_logprobs,
                                choice_specs, completion_logprobs, echoes_alone, in_conversation, merge_choices,
                                known_sum, now_s, openai_param, openai_parsed, service_tier, text_completion, usage,
                                with_token_ids)
from app.services import jobs as job_service
from app.services import stored_completions
from app.services.answer_events import (ANOTHER_FAILED, KEEPALIVE_COMMENT, Begun, Failed, Finished, Held,
                                        Interrupted, Piece, abandon, abandoned_on_hangup, answer_events,
                                        held_comment, kept_alive)
from app.services.answer_events import ends as job_ends
from app.services.idempotency import IdempotencyConflict
from app.services.job_follow import cancel_abandoned
from app.services.model_info import ChatTemplateError
from app.services.rate_limits import (COUNTING, GENERATION, Decision, RateLimited, RateLimiter, rate_headers,
                                     take_request)
from app.services.truncation import fed_prompt
from app.services.workers import held_context_length
from app.settings import Settings
from app.tool_calls import Answer, read_answer

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=["openai"], route_class=OpenAIRoute)
sagemaker = APIRouter(tags=["openai"], route_class=OpenAIRoute)  # SageMaker's inference route, as vLLM serves it

T = TypeVar("T")
CHAT = "/v1/chat/completions"  # the endpoint of chat's jobs, batched chat's too (its QoS defaults, its answer's shape)
BATCHED_CHAT = CHAT + "/batch"  # the route batched chat's jobs come in by (their events name it)
# each route's request fields that set what a request may cost besides its prompt (named where it is too large for
# the tenant's tokens per minute): only its own (Messages and Responses have no n)
COST_FIELDS = {CHAT: "max_completion_tokens (or max_tokens) or n", "/v1/completions": "max_tokens or n",
               "/v1/responses": "max_output_tokens", "/v1/messages": "max_tokens"}


async def json_object(request: Request) -> dict[str, Any]:
    try:
        raw = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise OpenAIError(400, f"the body is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise OpenAIError(400, "the body must be a JSON object")
    return raw


def checked_body(model: type, raw: dict[str, Any]) -> Any:
    body = openai_parsed(model, raw)
    body.check()
    return body


async def read_body(request: Request, model: type) -> Any:
    """The body read as ``model`` and checked (a structural tag it carries compiled beforehand, off the event loop:
    ``errors.CheckedRoute``)."""
    return checked_body(model, await json_object(request))


def submit_openai_job(session, principal: Principal, settings: Settings, spec, endpoint: str, writer=None,
                      response: dict[str, Any] | None = None, limiter: RateLimiter | None = None,
                      charge: tuple[bool, bool] = (True, True), job_id: str | None = None) -> job_service.Submitted:
    """The request's job, its refusal in OpenAI's terms (``openai_refusals``); ``limiter``, ``charge`` and ``job_id``
    as ``submit_job``'s."""
    with openai_refusals(endpoint):
        return job_service.submit_job(session, principal, spec, settings, endpoint=endpoint, writer=writer,
                                      response=response, limiter=limiter, charge=charge, job_id=job_id)


@contextmanager
def openai_refusals(endpoint: str | None = None) -> Iterator[None]:
    """A submission's refusal in OpenAI's terms: 404 for an unknown model, 429 over the tenant's rate limits (naming
    the fields of ``endpoint``'s request that set its cost), else 400."""
    try:
        yield
    except RateLimited as exc:
        d = exc.decision
        raise OpenAIError(429, d.message(COST_FIELDS.get(endpoint, "max_tokens")), type=d.limit_hit,
                          code="rate_limit_exceeded", headers=d.headers()) from exc
    except job_service.JobValidationError as exc:
        # OpenAI's codes: 404 only for an unknown model; a request over the context is a 400
        # (context_length_exceeded), which the official client raises as BadRequestError
        raise OpenAIError(404 if exc.code == "model_not_found" else 400, str(exc), param=openai_param(exc.param),
                          code=exc.code) from exc


@contextmanager
def idempotency_conflicts() -> Iterator[None]:
    """An Idempotency-Key used before for another request as a 409 in OpenAI's terms (Anthropic's routes answer it
    in theirs)."""
    try:
        yield
    except IdempotencyConflict as exc:
        raise OpenAIError(409, str(exc), param="Idempotency-Key", code="idempotency_key_reused") from None


def charge_request(limiter: RateLimiter | None, principal: Principal, buckets: str = GENERATION) -> Decision | None:
    """One request of no tokens taken from its tenant's ``buckets`` (a batch's create: its generation requests');
    over the limit a 429 in OpenAI's terms, which Anthropic's routes answer in theirs. None where the tenant has no
    requests per minute."""
    with openai_refusals():
        return take_request(limiter, principal.tenant_id, principal.limits, buckets)


async def charge_count(request: Request, principal: Principal) -> Decision | None:
    """A token-counting request (count_tokens, input_tokens, /tokenize, /detokenize) taken from its tenant's
    counting bucket (``rate_limits.COUNTING``), before it tokenizes (``charge_request``)."""
    return await run_in_threadpool(charge_request, rate_limiter(request), principal, COUNTING)


def count_prompt_tokens(settings: Settings, spec, endpoint: str) -> int:
    """The tokens ``spec``'s prompt takes, as its job of ``endpoint`` would count them (a 404 for an unknown model, a
    400 for an adapter found but not servable or where the chat template refuses the messages)."""
    try:
        job_service.resolve_model(settings, spec.model)
    except job_service.JobValidationError as exc:
        raise OpenAIError(404 if exc.code == "model_not_found" else 400, str(exc), param="model",
                          code=exc.code) from exc
    try:
        return len(job_service.encode_spec(settings.model, spec, endpoint))
    except ChatTemplateError as exc:
        raise OpenAIError(400, str(exc), param="messages") from exc


# ---------------------------------------------------------------- following a job
DISCONNECT_POLL_S = 0.5  # how often a non-stream request looks whether its client is still there


async def unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T | None:
    """``work``'s result, or None once the client is found gone (``work`` is cancelled then)."""
    task = asyncio.ensure_future(work)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                return None
        return task.result()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.wait({task})


def job_error(status: str | None, error: str | None, code: str | None = None) -> OpenAIError:
    if code == INVALID_REQUEST:  # the engine refused the request's parameters: the client's to fix, as vLLM answers
        return OpenAIError(400, error or "the engine refused the request", code=INVALID_REQUEST)
    if status == JobStatus.CANCELLED:
        return OpenAIError(409, "the request was cancelled", type="cancelled", code="cancelled")
    if status == JobStatus.EXPIRED:  # why, where the worker said (set aside under overload, then given up on)
        why = f": {error}" if error else ""
        return OpenAIError(504, f"the request's deadline passed before it finished{why}", type="timeout",
                           code="deadline_exceeded")
    return OpenAIError(500, f"generation failed: {error or 'unknown error'}", type="server_error")


async def ends_of(request: Request, settings: Settings, jobs: list[Job]) -> list[Any] | Response:
    """The request's jobs' ends, once its first succeeded (its failure raised in OpenAI's terms); a 499 where the
    client left meanwhile (the jobs are stopped)."""
    ends = await unless_disconnected(request, job_ends(settings, jobs))
    if ends is None:  # nobody waits for the answer any more: stop generating it
        await abandon(settings, jobs)
        return Response(status_code=499)  # nginx's "client closed request"; no one reads it
    if ends[0].status != JobStatus.SUCCEEDED:
        raise job_error(ends[0].status, ends[0].data.get("error"), ends[0].data.get("code"))
    return ends


async def answer_of(request: Request, settings: Settings, job: Job) -> tuple[Any, Answer] | Response:
    """A one-job request's end and its answer (``ends_of``'s 499 where the client left)."""
    ends = await ends_of(request, settings, [job])
    if isinstance(ends, Response):
        return ends
    return ends[0], read_answer(job.id, job.sampling, ends[0].data["output_text"], ends[0].finish_reason)


def _sse(obj: dict[str, Any] | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n".encode()


def _sse_error(err: OpenAIError) -> bytes:
    return _sse({"error": {"message": err.message, "type": err.type, "param": None, "code": err.code}})


def _submit_choices(session, principal: Principal, settings: Settings, specs: list, endpoint: str,
                    writer=None, limiter: RateLimiter | None = None, n: int = 1,
                    metadata: dict[str, str] | None = None, store: bool = False, sent: list | None = None,
                    blame: Callable[[OpenAIError, int], OpenAIError] | None = None, via: str | None = None
                    ) -> tuple[list[Job], dict[str, str]]:
    """The jobs of a request's choices (``n`` per prompt), and the rate-limit headers of the answer; if one cannot
    be submitted, those already are stop. Every job is built (validated) before any is written, and the rate limits
    take the whole request at once before then (``charge_request``): the request once, each prompt's tokens once, as
    OpenAI's do, and every choice's ``max_tokens``. ``store``: the answer is kept as a stored chat completion, with
    ``metadata`` and the ``sent`` messages; ``blame``: job i's refusal in the request's terms (batched chat names
    its conversation); ``via``: the route the request came in by, where not ``endpoint`` (batched chat's)."""
    ids, kept = stored_completions.kept_fields(metadata, len(specs), sent) if store else ([None] * len(specs), None)
    built = []
    for i, spec in enumerate(specs):
        try:
            with openai_refusals():
                built.append(job_service.build_job(settings, principal, spec, endpoint=endpoint,
                                                   response=kept if i == 0 else None, job_id=ids[i]))
        except OpenAIError as exc:
            if blame is None:
                raise
            raise blame(exc, i) from exc
    for job, links in zip(built, job_service.choice_links([job.id for job in built], n), strict=True):
        for column, value in links.items():  # usage counts a request and a prompt once, as the limits do
            setattr(job, column, value)
    with openai_refusals(endpoint):
        rate = job_service.charge_request(limiter, principal, built)
    jobs: list[Job] = []
    try:
        for job in built:
            jobs.append(job_service.record_job(session, settings, job, via=via or endpoint, writer=writer).job)
    except Exception:
        for job in jobs:
            cancel_abandoned(settings, job.id, "another choice of the request could not be submitted")
        if rate is not None:  # refused after its charge (the database unavailable: a 503): the retry pays once
            job_service.give_back_request(limiter, principal, built)
        raise
    return jobs, rate_headers(rate)


async def _stream(settings: Settings, jobs: list[Job], chat: bool, options: StreamOptions,
                  n: int = 1) -> AsyncIterator[bytes]:
    """The jobs' tokens as OpenAI chunks, choice i = job i; ``n`` choices per prompt (usage counts a prompt once);
    ``options``: the usage chunk at the end, and each chunk's usage so far (vLLM's ``continuous_usage_stats``)."""
    include_usage, continuous_usage = options.include_usage, options.usage_in_every_chunk()
    cid = ("chatcmpl-" if chat else "cmpl-") + jobs[0].id
    created, model = now_s(), jobs[0].model
    obj = "chat.completion.chunk" if chat else "text_completion"
    # what every chunk says besides its choice, as the non-stream answer says it (OpenAI's chunks have both)
    head = {"id": cid, "object": obj, "created": created, "model": model, "system_fingerprint": None,
            "service_tier": service_tier(jobs[0].tier, settings.tiers)}
    # completions' echo: the prompt goes first, with its logprobs where asked (they come with the first token)
    echo = [bool((job.sampling or {}).get("echo")) and not chat for job in jobs]
    echoed = [0] * len(jobs)  # characters of the prompt sent, per choice (text_offset counts them)
    alone = [echoes_alone(job.sampling) for job in jobs]  # echo with max_tokens 0: the prompt, no generated text
    # vLLM's return_token_ids: the prompt's ids in a choice's first chunk, the generated ones as they come
    prompt_ids = await _prompt_ids(settings, jobs)
    prompt_said = [False] * len(jobs)

    def chunk(i: int, text: str | None, finish: str | None, generated: int, first: bool = False,
              logprobs: list[dict[str, Any]] | None = None, tool_calls: list[dict[str, Any]] | None = None,
              offset: int = 0, reasoning: str = "", token_ids: list[int] | None = None,
              stop_reason: str | int | None = None) -> dict[str, Any]:
        if chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if reasoning:
                delta["reasoning"] = reasoning  # a reasoning model's thinking (vLLM's delta field)
            if text:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = tool_calls  # each names its call's index
            choice = {"index": i, "delta": delta, "logprobs": chat_logprobs(logprobs), "finish_reason": finish}
        else:
            choice = {"index": i, "text": text or "",
                      "logprobs": completion_logprobs(logprobs, echoed[i] + offset), "finish_reason": finish}
        if finish is not None:  # vLLM's, on the chunk that ends the choice
            choice["stop_reason"] = stop_reason
        out = {**head, "choices": [choice]}
        if prompt_ids[i] is not None:
            choice["token_ids"] = token_ids or []
            if not prompt_said[i]:  # chat's first chunk carries them (top level); a completion's, in its choice
                (out if chat else choice)["prompt_token_ids"] = prompt_ids[i]
                prompt_said[i] = True
        if include_usage:
            out["usage"] = usage(jobs[i].prompt_tokens, generated) if continuous_usage else None
        return out

    prompt_tokens, completion_tokens, finished = [0] * len(jobs), 0, 0
    cached: list[int | None] = [None] * len(jobs)
    reasoning: list[int | None] = [None] * len(jobs)
    try:
        if chat:
            for i in range(len(jobs)):
                yield _sse(chunk(i, None, None, 0, first=True))
                if echoed_turn := chat_echo(jobs[i].messages, jobs[i].sampling):  # vLLM's chat echo: the last message
                    yield _sse(chunk(i, echoed_turn, None, 0))
        async with aclosing(answer_events(settings, jobs, chat)) as items:
            async for item in items:
                match item:
                    case Begun(choice=i) if echo[i]:  # the prompt of an echoing choice, once, before its text
                        prompt = jobs[i].prompt or ""
                        # the logprobs of the text, where asked (prompt_logprobs 0 alone asks for none: vLLM's)
                        asked = (jobs[i].sampling or {}).get("logprobs") is not None
                        yield _sse(chunk(i, prompt, None, 0, logprobs=(item.prompt_logprobs or []) if asked else None))
                        echo[i], echoed[i] = False, len(prompt)
                    case Piece(choice=i) if not alone[i]:
                        yield _sse(chunk(i, item.content, None, item.generated, logprobs=item.logprobs,
                                         tool_calls=item.calls, offset=item.offset, reasoning=item.reasoning,
                                         token_ids=item.token_ids))
                    case Held():  # said in a comment (OpenAI's clients skip them): no silent stall
                        yield held_comment(item)
                    case Interrupted():  # the stream could not be read on; the job goes on
                        yield _sse_error(OpenAIError(503, item.message, type="server_error", code="stream_interrupted"))
                        return  # no [DONE]: the answer is incomplete
                    case Failed(choice=i):
                        if len(jobs) > 1:  # the answer is lost without this choice: the others stop too, first
                            with anyio.CancelScope(shield=True):  # (the client may be gone at the next yield)
                                await abandon(settings, jobs, ANOTHER_FAILED)
                        yield _sse_error(job_error(item.status, item.error, item.code))
                    case Finished(choice=i):
                        yield _sse(chunk(i, None, item.answer.finish_reason, item.completion_tokens,
                                         token_ids=item.token_ids, stop_reason=item.stop_reason))
                        prompt_tokens[i], cached[i], reasoning[i] = (item.prompt_tokens, item.cached_tokens,
                                                                     item.reasoning_tokens)
                        completion_tokens += item.completion_tokens
                        finished += 1
        if include_usage and finished == len(jobs):
            yield _sse({**head, "choices": [],
                        "usage": usage(sum(prompt_tokens[::n]), completion_tokens, known_sum(cached[::n]),
                                       known_sum(reasoning))})
        yield _sse("[DONE]")
    except Exception as exc:  # a bug or a database error: say so to the client; the jobs themselves go on
        status, message = stream_failure(exc, jobs[0].id, f"GET /v1/jobs/{jobs[0].id}")
        yield _sse_error(OpenAIError(status, message, type="server_error", code="stream_interrupted"))


def _job_specs(body: ChatCompletionRequest | CompletionRequest, chat: bool, settings: Settings) -> list:
    """The request's job, or a completion's job per prompt. A chat's echo asks for the prompt's logprobs as vLLM's
    does (``echo_prompt_logprobs``), where the server runs vLLM: the own engine reports none."""
    if not chat:
        return [body.job_spec(**prompt, tiers=settings.tiers) for prompt in body.prompt_inputs()]
    return [body.with_echo_prompt_logprobs(body.job_spec(messages=body.chat_messages(), tiers=settings.tiers),
                                           settings.engine_backend)]


def _with_qos_defaults(settings: Settings, endpoint: str, specs: list) -> list:
    """The specs with ``endpoint``'s QoS defaults for the targets the request left out (interactive work only)."""
    if specs[0].kind != "interactive":
        return specs
    ttft_ms, tbt_ms = settings.interactive_defaults(endpoint)
    return [spec.model_copy(update={"ttft_ms": spec.ttft_ms or ttft_ms, "tbt_ms": spec.tbt_ms or tbt_ms})
            for spec in specs]


async def _complete(request: Request, session, principal: Principal, settings: Settings, chat: bool):
    raw = await json_object(request)
    body = checked_body(ChatCompletionRequest if chat else CompletionRequest, raw)
    endpoint = CHAT if chat else "/v1/completions"
    specs = _with_qos_defaults(settings, endpoint, _job_specs(body, chat, settings))
    writer = getattr(request.app.state, "job_writer", None)  # the API's group-commit writer
    n = body.n or 1  # choices per prompt; a prompt's choices are consecutive (OpenAI's index: prompt x n + choice)
    jobs, limit_headers = await run_in_threadpool(
        _submit_choices, session, principal, settings, [choice for spec in specs for choice in choice_specs(spec, n)],
        endpoint, writer, rate_limiter(request), n,
        *((body.metadata, True, body.messages) if chat and body.store else ()))
    charged(request, limit_headers)  # on every answer, an error after the submit (a job that failed) too
    headers = {"x-coserve-job-id": ",".join(job.id for job in jobs)}
    if body.stream:
        headers.update({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        chunks = _stream(settings, jobs, chat, body.stream_options or StreamOptions(), n)
        chunks = kept_alive(chunks, KEEPALIVE_COMMENT)  # the job may wait (queued, relegated) with nothing to send
        return StreamingResponse(abandoned_on_hangup(settings, jobs, chunks), media_type="text/event-stream",
                                 headers=headers)
    return await _answer(request, settings, jobs, chat, bool(specs[0].echo), n, headers)


async def _answer(request: Request, settings: Settings, jobs: list[Job], chat: bool, echo: bool, n: int,
                  headers: dict[str, str]) -> Response:
    """The non-stream answer: the jobs' choices merged (``n`` per prompt) once all have ended (``ends_of``'s error
    or 499 else); ``echo``: a completion's answer starts with its prompt."""
    ends = await ends_of(request, settings, jobs)
    if isinstance(ends, Response):
        return ends
    coserve = {"job_id": jobs[0].id} | ({"job_ids": [job.id for job in jobs]} if len(jobs) > 1 else {})
    extra = {"system_fingerprint": None, "service_tier": service_tier(jobs[0].tier, settings.tiers),
             "coserve": coserve}
    bodies = []
    for job, end in zip(jobs, ends, strict=True):
        head = (("chatcmpl-" if chat else "cmpl-") + jobs[0].id, jobs[0].model, now_s())
        counts = (end.data["prompt_tokens"], end.data["completion_tokens"], extra, end.data.get("logprobs"))
        cached = end.data.get("cached_tokens")
        if chat:
            bodies.append(chat_answer(*head, job.id, job.sampling, end.data["output_text"], end.finish_reason,
                                      *counts, echo=chat_echo(job.messages, job.sampling), cached_tokens=cached,
                                      reasoning_tokens=end.data.get("reasoning_tokens"),
                                      stop_reason=end.data.get("stop_reason"),
                                      prompt_logprobs=end.data.get("prompt_logprobs")))
        else:
            echoed = {"echo": (job.prompt or "", end.data.get("prompt_logprobs"))} if echo else {}
            bodies.append(text_completion(*head, end.data["output_text"], end.finish_reason or "stop", *counts,
                                          **echoed, cached_tokens=cached, stop_reason=end.data.get("stop_reason"),
                                          sampling=job.sampling, prompt_logprobs=end.data.get("prompt_logprobs")))
    for i, ids in enumerate(await _prompt_ids(settings, jobs)):
        if ids is not None:  # vLLM's return_token_ids
            with_token_ids(bodies[i], chat, ids, ends[i].data.get("output_token_ids"))
    return JSONResponse(merge_choices(bodies, n), headers=headers)


async def _prompt_ids(settings: Settings, jobs: list[Job]) -> list[list[int] | None]:
    """Each job's prompt ids as its worker feeds them, where it asked for them (vLLM's return_token_ids); no
    tokenizing, and no thread, where none did."""
    asked = [bool((job.sampling or {}).get("return_token_ids")) for job in jobs]
    if not any(asked):
        return [None] * len(jobs)

    def fed() -> list[list[int] | None]:
        context = held_context_length(settings)  # SQL at most once a second: off the event loop too
        return [fed_prompt(settings, j, context) if a else None for j, a in zip(jobs, asked)]

    return await run_in_threadpool(fed)


def documented_body(model: type) -> dict[str, Any]:
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
            **openai_responses(400, 401, 404, 409, 413, 429, 500, 504)}


@router.post("/chat/completions", responses=_ANSWERS, openapi_extra=documented_body(ChatCompletionRequest))
async def chat_completions(request: Request, session: SessionDep, principal: CurrentPrincipal,
                           settings: SettingsDep):
    """OpenAI chat completions; QoS extension fields: ttft_ms, tbt_ms, deadline, tier."""
    return await _complete(request, session, principal, settings, chat=True)


@router.post("/completions", responses=_ANSWERS, openapi_extra=documented_body(CompletionRequest))
async def completions(request: Request, session: SessionDep, principal: CurrentPrincipal, settings: SettingsDep):
    """OpenAI (legacy) text completions; same extension fields as chat."""
    return await _complete(request, session, principal, settings, chat=False)


# batched chat answers whole (no stream): 409/500/504 as chat's, where a conversation's job did not finish
_BATCH_ANSWERS = {200: {"description": "a chat completion, one choice per conversation in their order"},
                  **openai_responses(400, 401, 404, 409, 413, 429, 500, 504)}


@router.post("/chat/completions/batch", responses=_BATCH_ANSWERS,
             openapi_extra=documented_body(BatchChatCompletionRequest))
async def chat_completions_batch(request: Request, session: SessionDep, principal: CurrentPrincipal,
                                 settings: SettingsDep):
    """vLLM's batched chat: ``messages`` a list of conversations, each a chat job of its own (the request's other
    fields, tenant, tier and QoS), submitted together as chat's ``n`` choices are; the answer is one chat completion
    with a choice per conversation, indexed in their order, its usage their sum."""
    body = checked_body(BatchChatCompletionRequest, await json_object(request))
    specs = _with_qos_defaults(settings, CHAT, body.conversation_specs(settings.tiers))
    writer = getattr(request.app.state, "job_writer", None)
    jobs, limit_headers = await run_in_threadpool(
        _submit_choices, session, principal, settings, specs, CHAT, writer, rate_limiter(request),
        blame=in_conversation, via=BATCHED_CHAT)
    charged(request, limit_headers)  # on every answer, an error after the submit (a job that failed) too
    headers = {"x-coserve-job-id": ",".join(job.id for job in jobs)}
    return await _answer(request, settings, jobs, True, False, 1, headers)


@sagemaker.post("/invocations", responses=_ANSWERS)
async def invocations(request: Request, session: SessionDep, principal: CurrentPrincipal, settings: SettingsDep):
    """SageMaker's inference route, as vLLM serves it: a body with ``messages`` is a chat completion, one with
    ``prompt`` a completion."""
    raw = await json_object(request)
    if ("messages" in raw) == ("prompt" in raw):
        raise OpenAIError(400, "give messages (a chat completion) or prompt (a completion)", param="messages")
    return await _complete(request, session, principal, settings, chat="messages" in raw)
