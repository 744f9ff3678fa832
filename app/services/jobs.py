"""Job submission, lookup, listing and cancellation (used by every API that creates jobs).

``submit_job`` validates a ``JobCreate`` against the caller's key and the model, writes
the row (status ``queued``) and commits, and only then dispatches it.
"""

from __future__ import annotations

import base64
import logging
import secrets
from typing import Any
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import lru_cache
from types import SimpleNamespace

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError, InvalidRequestError
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import set_committed_value

from app import request_id
from app.auth import Principal
from app.context_overflow import ContextOverflow
from app.db import pagination
from app.db.models import STAGED, Job, JobEvent, JobKind, JobStatus, new_id
from app.db.session import DATABASE_ERRORS, database_unavailable, write_after_read, write_guard
from app.reasoning import CLOSE, OPEN
from app.schemas import MAX_BAD_WORDS, MAX_BAD_WORDS_TOKENS, MAX_WINDOW_S, JobCreate
from app.services import dispatch as dispatching
from app.services import lora_adapters, routing
from app.services.idempotency import IdempotencyConflict
from app.services.job_writer import JobWriter
from app.services.model_info import (ChatTemplateError, encode_input, get_tokenizer, has_think_tokens,
                                     token_id_bounds)
from app.services.rate_limits import Charge, Decision, RateLimited, RateLimiter, rate_headers
from app.services.transitions import NOT_TERMINAL, cancel_stamps, transition, utcnow
from app.services.truncation import fed_prompt
from app.services.workers import grammar_refusal, held_context_length
from app.settings import Settings
from app.tool_calls import AUTO_UNPARSED, forced_choice_unsupported, is_forced, template_tools
from app.wire import find_unstorable, storable
from gpu_runtime.sampling import NEUTRAL_PENALTIES, SamplingParams
from workers.celery_app import message_priority

log = logging.getLogger(__name__)


class JobValidationError(ValueError):
    """The job cannot be accepted as sent; the message says what to change (HTTP 422).

    ``param`` is the request field to blame and ``code`` an OpenAI-style error code, so each
    API can answer in its own shape without reading the message."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 overflow: ContextOverflow | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code
        self.overflow = overflow  # an over-long request's facts, for an API that words them its own way

    @classmethod
    def over_context(cls, overflow: ContextOverflow, param: str) -> JobValidationError:
        """OpenAI blames the input for an over-long request, whichever of it and max_tokens is cut."""
        return cls(overflow.openai_message(), param=param, code="context_length_exceeded", overflow=overflow)


class JobGone(LookupError):
    """The job's row was deleted after the request read it (a batch's fan-out drops the jobs of a batch that never
    starts): what acts on the job answers as for a job there is no such one (HTTP 404)."""

    def __init__(self, job_id: str) -> None:
        super().__init__(f"no job {job_id!r} (it was deleted meanwhile)")
        self.job_id = job_id


def reread(session: Session, job: Job) -> None:
    """``job`` as SQL holds it now (after a write that may have found nothing); ``JobGone`` where its row is gone."""
    job_id = job.id  # read before: a refresh that failed leaves nothing to read
    try:
        session.refresh(job)
    except InvalidRequestError:  # "Could not refresh instance": what refresh raises for a persistent job's row gone
        raise JobGone(job_id) from None


# the routes whose answers carry a reasoning model's thinking apart from the content (as vLLM's do)
REASONING_ENDPOINTS = ("/v1/chat/completions", "/v1/responses", "/v1/messages")
# the sampling fields jobs stored before they existed hold at these values
NEUTRAL_SAMPLING = {"top_k": 0, "min_p": 0.0, **NEUTRAL_PENALTIES, "structured_outputs": None, "tool_choice": None,
                    "tool_parser": None, "reasoning_parser": None, "include_reasoning": True,
                    "parallel_tool_calls": True, "logit_bias": None,
                    "min_tokens": 0, "stop_token_ids": [], "logprobs": None, "prompt_logprobs": None, "echo": False,
                    "include_stop_str_in_output": False, "allowed_token_ids": None, "bad_words": None,
                    "truncate_prompt_tokens": None, "cache_salt": None, "return_token_ids": False}

# what makes two submissions "the same request" under one Idempotency-Key
_IDENTITY = ("kind", "prompt", "prompt_token_ids", "messages", "tools", "template_options", "response", "sampling",
             "ttft_ms", "tbt_ms", "tbt_anchor", "app_id", "model", "tier")


def _same_request(existing: Job, new: Job) -> bool:
    def sampling(job: Job) -> dict:  # a seed the server drew differs on every submission
        return {k: v for k, v in {**NEUTRAL_SAMPLING, **job.sampling}.items() if k not in ("seed", "seed_drawn")}

    return (all(getattr(existing, f) == getattr(new, f) for f in _IDENTITY if f != "sampling")
            and sampling(existing) == sampling(new))


@dataclass(frozen=True)
class Submitted:
    job: Job
    created: bool  # False when an Idempotency-Key matched an earlier job
    rate: Decision | None = None  # what the tenant's rate limits said of it (None: not charged, no limits)

    def rate_headers(self) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-*`` headers for the answer (none without limits)."""
        return rate_headers(self.rate)


def resolve_tier(settings: Settings, principal: Principal, requested: str | None) -> str:
    tiers = list(settings.tiers)
    if requested is None:
        return principal.tier
    if requested not in tiers:
        raise JobValidationError(f"unknown tier {requested!r}; choose one of {tiers}", param="tier")
    # tiers are ordered from lowest to highest; a key may ask for its own tier or a lower one
    if principal.tier in tiers and tiers.index(requested) > tiers.index(principal.tier):
        raise JobValidationError(f"this API key allows tier {principal.tier!r} at most, not {requested!r}",
                                 param="tier")
    return requested


def resolve_model(settings: Settings, requested: str | None) -> str:
    """The model a request names (default: the server's), if the server serves it: its own or a LoRA adapter."""
    model = requested or settings.model_name
    if model in settings.model_aliases:  # as vLLM's served model names: the job and its answers carry the first
        return settings.model_name
    if not lora_adapters.is_served(settings, model):
        try:
            if lora_adapters.resolve(settings, model):  # an adapter of the resolver's directory, loaded now
                return model
        except lora_adapters.AdapterError as exc:  # 404: not this model's adapter; 400: found, but not servable
            raise JobValidationError(str(exc), param="model",
                                     code="model_not_found" if exc.status == 404 else None) from exc
        raise JobValidationError(f"unknown model {model!r}; this server serves "
                                 f"{', '.join(map(repr, lora_adapters.listed_models(settings)))}", param="model",
                                 code="model_not_found")
    return model


COMPLETIONS_MAX_TOKENS = 16  # OpenAI's legacy completions and vLLM's, for a request that sets no max_tokens


def default_max_tokens(settings: Settings, endpoint: str) -> int:
    """What a request without max_tokens may make (at most: less where the context leaves less)."""
    return COMPLETIONS_MAX_TOKENS if endpoint == "/v1/completions" else settings.default_max_tokens


def build_job(settings: Settings, principal: Principal, spec: JobCreate, **options: Any) -> Job:
    """Validates ``spec`` and returns an unsaved ``Job`` (raises ``JobValidationError``); ``options``: those of
    ``job_values``."""
    return Job(**job_values(settings, principal, spec, **options))


def job_values(settings: Settings, principal: Principal, spec: JobCreate, *, idempotency_key: str | None = None,
               batch_id: str | None = None, custom_id: str | None = None, endpoint: str = "/v1/jobs",
               count_tokens: bool = True, overdue_ok: bool = False, response: dict[str, Any] | None = None,
               job_id: str | None = None, prompt_tokens: int | None = None,
               context: int | None = None) -> dict[str, Any]:
    """Validates ``spec`` and returns its job's column values, what ``Job(**values)`` holds (raises
    ``JobValidationError``): a caller writing many rows at once (the batch fan-out) inserts them as they are, with no
    ORM object built and read back a row at a time. ``response``: an OpenAI request's own fields the answer keeps
    (Responses: ``app.responses_schemas.KEPT``; a stored chat completion's: ``app.services.stored_completions``);
    ``job_id``: the job's id where the caller chose it (a new one else); ``prompt_tokens``: its prompt's token count
    where the caller counted it already (``model_info.count_inputs``, many prompts a tokenizer call): the context
    checks use it, and the prompt is not tokenized again; ``context``: the context it is held to where the caller read
    it (``workers.held_context_length``) once for many jobs (a batch's fan-out), else it is read here;
    ``count_tokens`` False: the prompt is held only to the context's bound on characters (no tokenizer call)."""
    model = resolve_model(settings, spec.model)
    tier = resolve_tier(settings, principal, spec.tier)
    sampling = spec.sampling(default_max_tokens(settings, endpoint))
    if sampling["min_tokens"] > sampling["max_tokens"]:
        raise JobValidationError(f"min_tokens ({sampling['min_tokens']}) is more than max_tokens "
                                 f"({sampling['max_tokens']}, its default here); lower it or give max_tokens",
                                 param="min_tokens")
    if refused := engine_refusal(settings, sampling):
        if refused[0] == "structured_outputs" and is_forced(sampling["tool_choice"]):
            refused = ("tool_choice", forced_choice_unsupported(settings.tool_call_parser is not None))
        raise JobValidationError(refused[1], param=refused[0], code="unsupported_value")
    if sampling.get("structured_outputs") and settings.backend != "torch" and (why := grammar_refusal(settings)):
        raise JobValidationError(why, param="tool_choice" if is_forced(sampling["tool_choice"]) else
                                 "structured_outputs", code="unsupported_value")
    if sampling.get("thinking_token_budget") is not None and settings.reasoning_parser is None:
        # as vLLM refuses it without --reasoning-parser: nothing would tell where the thinking ends
        raise JobValidationError("thinking_token_budget needs a reasoning parser, which says where a model's thinking "
                                 "ends (COSERVE_REASONING_PARSER, vLLM's --reasoning-parser); this server has none: "
                                 "leave it unset", param="thinking_token_budget", code="unsupported_value")
    if sampling.get("thinking_token_budget") is not None and not thinking_budget_kept(settings):
        raise JobValidationError(f"thinking_token_budget needs a model whose tokenizer has {OPEN} and {CLOSE} "
                                 "tokens, which the reasoning parser ends the thinking with once the budget is spent; "
                                 f"{settings.model_name}'s has not: leave it unset", param="thinking_token_budget",
                                 code="unsupported_value")
    if sampling["temperature"] > 0 and sampling["seed"] is None:
        # a seed of our own: a rerun after a worker crash samples the same text again, so a
        # stream that resumes mid-way stays one generation (up to batch-dependent rounding); marked
        # drawn: vLLM-CPU applies a client's seed only (gpu_runtime.vllm.engine.seed_applies)
        sampling["seed"], sampling["seed_drawn"] = secrets.randbelow(2**62), True
    if sampling["tool_choice"] == "auto" and settings.tool_call_parser is None:
        # the model writes its calls in its own syntax, read with its parser
        raise JobValidationError(AUTO_UNPARSED, param="tool_choice", code="unsupported_value")
    if sampling["tool_choice"] is not None and settings.tool_call_parser is not None:
        sampling["tool_parser"] = settings.tool_call_parser  # its syntax, and its calls' id style (Mistral: 9 letters)
    if settings.reasoning_parser is not None and endpoint in REASONING_ENDPOINTS:
        sampling["reasoning_parser"] = settings.reasoning_parser  # its answers' thinking is read apart
    if spec.logit_bias:
        check_token_ids(settings.model, list(spec.logit_bias), "logit_bias")
    if spec.stop_token_ids:
        check_token_ids(settings.model, spec.stop_token_ids, "stop_token_ids")
    if spec.allowed_token_ids:
        check_token_ids(settings.model, spec.allowed_token_ids, "allowed_token_ids")
    if spec.bad_words:
        bad_word_sequences(settings.model, spec.bad_words)
    prompt = (spec.prompt if spec.prompt_token_ids is None
              else storable(token_prompt_text(settings.model, spec.prompt_token_ids)))  # ids may decode to a NUL
    now = utcnow()
    messages = [m.stored() for m in spec.messages] if spec.messages is not None else None
    job = dict(id=job_id or new_id("job"), tenant_id=principal.tenant_id, kind=spec.kind, tier=tier, model=model,
               app_id=spec.app_id, prompt=prompt, prompt_token_ids=spec.prompt_token_ids, sampling=sampling,
               endpoint=endpoint, stream=spec.stream,
               idempotency_key=idempotency_key, batch_id=batch_id, custom_id=custom_id,
               api_key_id=principal.key_id or None, user_id=spec.user, request_id=request_id.current(),
               status=JobStatus.QUEUED.value, created_at=now, attempt=0, relegation_count=0, counts_request=True,
               counts_prompt=True, messages=messages,
               tools=template_tools(spec.tools),
               template_options=spec.template_options(), response=response,
               route_key=routing.route_key(principal.tenant_id, model, prompt_cache_key=spec.prompt_cache_key,
                                           messages=messages, prompt=prompt, prompt_token_ids=spec.prompt_token_ids))
    if spec.kind == JobKind.INTERACTIVE:
        job["ttft_ms"] = spec.ttft_ms or settings.default_ttft_ms
        job["tbt_ms"] = spec.tbt_ms or settings.default_tbt_ms
        job["tbt_anchor"] = spec.tbt_anchor or settings.tbt_anchor
    else:
        window_s = spec.deadline_window_s or settings.default_batch_window_s
        deadline = spec.deadline_at or now + timedelta(seconds=window_s)
        if deadline <= now and not overdue_ok:
            raise JobValidationError(f"deadline_at {deadline.isoformat()} is in the past; give a future time",
                                     param="deadline_at")
        if deadline - now > timedelta(seconds=MAX_WINDOW_S):
            raise JobValidationError(f"deadline_at {deadline.isoformat()} is more than {MAX_WINDOW_S / 86400:.0f} "
                                     "days away; give a nearer deadline", param="deadline_at")
        job["deadline_at"] = deadline
    # the context's bound on characters needs no tokenizer call: checked where the prompt is not counted too
    limit = held_context_length(settings) if context is None else context
    chars = input_chars(spec)
    blame = "messages" if spec.messages is not None else "prompt"
    truncate = sampling.get("truncate_prompt_tokens")
    per_token = max_chars_per_token(settings.model)
    if truncate is None and chars > limit * per_token:  # OpenAI's and vLLM's words (app/context_overflow.py)
        raise JobValidationError.over_context(ContextOverflow(-(-chars // per_token), 0, limit, False, chars), blame)
    if not count_tokens and spec.max_tokens is not None:
        # a prompt takes a token at least, and no fewer than its characters over the longest token's: a max_tokens
        # that leaves it no room is refused here, as the fan-out that counts the prompt would refuse it
        least = max(1, -(-chars // per_token)) if truncate is None else 1
        if least + sampling["max_tokens"] > limit:
            raise JobValidationError.over_context(ContextOverflow(least, sampling["max_tokens"], limit, False), blame)
    if count_tokens:
        try:  # what the worker will feed (a count given holds where nothing cuts the prompt)
            n = (prompt_tokens if prompt_tokens is not None and truncate is None
                 else len(fed_prompt(settings, SimpleNamespace(**job), limit)))
        except ChatTemplateError as exc:
            raise JobValidationError(str(exc), param="messages") from exc
        if (spec.max_tokens is None or truncate == -1) and max(1, sampling["min_tokens"]) <= limit - n < \
                sampling["max_tokens"]:
            # unset (vLLM, OpenAI), or a prompt cut to fill the context (vLLM's truncate_prompt_tokens -1, which
            # keeps all but one token of it): what the context leaves, up to the asked or the default
            sampling["max_tokens"] = limit - n
        if n + sampling["max_tokens"] > limit:
            raise JobValidationError.over_context(ContextOverflow(n, sampling["max_tokens"], limit), blame)
        job["prompt_tokens"] = n
    return job



def engine_refusal(settings: Settings, sampling: dict) -> tuple[str, str] | None:
    """(param, message) for a sampling parameter the server's engine cannot apply, else None: what the own torch
    engine does not do where the server says it runs that engine (``COSERVE_BACKEND=torch``: with ``auto`` the
    API cannot know what its workers run, and a worker refuses it at admission, a 400 all the same), and min_p or
    logit_bias beside vLLM's speculative decoding (vLLM's sampler would drop them; its workers refuse them too)."""
    if settings.backend != "torch" and settings.spec_policy == "none":
        return None  # vLLM without speculation applies every parameter (the common case: no parsing)
    params = SamplingParams.from_job(sampling, settings.default_max_tokens)
    return params.own_engine_refusal() if settings.backend == "torch" else params.speculation_refusal()


def thinking_budget_kept(settings: Settings) -> bool:
    """Whether the server's vLLM engine keeps a thinking budget, given a reasoning parser: where the model's
    tokenizer has the think tokens the parser ends the thinking with, or where the operator's engine arguments set
    their own ``reasoning_config`` (they win over coserve's, as in the worker)."""
    from gpu_runtime.vllm.cli_args import operator_engine_args  # vLLM itself only where flags are set

    if "reasoning_config" in operator_engine_args(settings.vllm_engine_args, settings.vllm_args):
        return True
    return has_think_tokens(settings.model)


BIG_PROMPT_CHARS = 4096  # above this, callers on an event loop tokenize in a worker thread


PROMPT_ID_PARAMS = ("prompt", "tokens")  # ids of a text: the rest index the logits (vLLM bounds them so)


def check_token_ids(model: str, ids: list[int], param: str) -> None:
    """Raises ``JobValidationError`` for an id the model lacks, as vLLM bounds ``param``'s (``token_id_bounds``)."""
    prompt_bound, vocab = token_id_bounds(model)
    bound = prompt_bound if param in PROMPT_ID_PARAMS else vocab
    if bad := [i for i in ids if not 0 <= i < bound][:3]:
        raise JobValidationError(f"{param} token ids must be in [0, {bound}) for this model; got {bad}",
                                 param=param)


def bad_word_sequences(model: str, words: list[str]) -> list[list[int]]:
    """The token sequences vLLM forbids for ``bad_words`` (``SamplingParams.update_from_tokenizer``): each word (its
    leading whitespace dropped) as written, and with a leading space where that is another token of the same length;
    raises ``JobValidationError`` where a word tokenizes to nothing, or where there are more sequences than vLLM
    takes (VLLM_MAX_NUM_BAD_WORDS, 128 by default), as vLLM's server refuses them before it takes the request, or
    more tokens in all (VLLM_MAX_BAD_WORDS_TOTAL_TOKENS, 1024), which vLLM's GPU worker refuses only as it adds the
    request (the words past that bound are not tokenized)."""
    tokenizer, sequences, tokens = get_tokenizer(model), [], 0
    for word in dict.fromkeys(words):
        ids = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not ids:
            raise JobValidationError(f"bad_words entry {word!r} is empty or only whitespace: it tokenizes to no "
                                     "token, so it forbids nothing; leave it out", param="bad_words")
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        added = [ids, spaced] if spaced and spaced[0] != ids[0] and len(spaced) == len(ids) else [ids]
        sequences.extend(added)
        tokens += sum(map(len, added))
        if tokens > MAX_BAD_WORDS_TOKENS:
            raise JobValidationError(f"bad_words make {tokens} tokens or more (each word as written, and after a "
                                     "space where that is another token), more than the "
                                     f"{MAX_BAD_WORDS_TOKENS} vLLM takes in all; give fewer or shorter words",
                                     param="bad_words")
    if len(sequences) > MAX_BAD_WORDS:
        raise JobValidationError(f"bad_words make {len(sequences)} token sequences (each word as written, and after "
                                 f"a space where that is another token), more than the {MAX_BAD_WORDS} vLLM takes; "
                                 "give fewer words", param="bad_words")
    return sequences


def token_prompt_text(model: str, ids: list[int]) -> str:
    """The text of a prompt given as token ids (raises ``JobValidationError`` for an id the tokenizer lacks)."""
    check_token_ids(model, ids, "prompt")
    return get_tokenizer(model).decode(ids)


def encode_spec(model: str, spec: JobCreate, endpoint: str | None = None) -> list[int]:
    """Token ids of a job's input as its worker will feed it: the prompt, or the messages and the tools offered
    through the chat template with the job's template options, as vLLM's route ``endpoint`` (None: chat) renders
    them (raises ``ChatTemplateError``)."""
    if spec.prompt_token_ids is not None:
        return list(spec.prompt_token_ids)
    return encode_input(model, spec.prompt, [m.stored() for m in spec.messages] if spec.messages is not None else None,
                        template_tools(spec.tools), spec.template_options(), endpoint=endpoint)


def input_chars(spec: JobCreate) -> int:
    """Characters of the prompt or of all messages' contents (a cheap size before tokenizing)."""
    if spec.prompt_token_ids is not None:
        return 4 * len(spec.prompt_token_ids)  # decoded on the way in: about as costly as text of that size
    if spec.prompt is not None:
        return len(spec.prompt)
    return sum(len(m.content) for m in spec.messages or ())


@lru_cache(maxsize=8)
def max_chars_per_token(model: str) -> int:
    """The longest vocabulary entry: no text longer than context * this can fit the context.

    Byte-level BPE entries are one character per byte, so a decoded token never has more
    characters than its entry."""
    vocab = get_tokenizer(model).get_vocab()
    return max(8, max((len(t) for t in vocab), default=0))


def _by_idempotency_key(session: Session, tenant_id: str, key: str) -> Job | None:
    return session.scalars(select(Job).where(Job.tenant_id == tenant_id, Job.idempotency_key == key)).first()


def choice_links(ids: list[str], n: int) -> list[dict[str, Any]]:
    """What usage counts of each job of one request (``ids`` in order, ``n`` choices per prompt), as OpenAI bills
    it: the request on its first job and each prompt's tokens on the prompt's first choice (as the rate limits
    charge them), those firsts named by the other jobs, so the request and a prompt count whenever any of theirs
    ran (app/services/usage.py), once."""
    return [{"counts_request": i == 0, "counts_prompt": i % n == 0, "request_job_id": ids[0] if i else None,
             "prompt_job_id": ids[i - i % n] if i % n else None} for i in range(len(ids))]


def rate_charge(principal: Principal, job: Job, *, request: bool = True, prompt: bool = True) -> Charge | None:
    """What the job takes from its tenant's buckets (None: the tenant has no limits): ``request``, one request (a
    request's first job); ``prompt``, its prompt tokens (a prompt's first choice), with its ``max_tokens`` in any
    case."""
    if not principal.limits.any:
        return None
    tokens = ((job.prompt_tokens or 0) if prompt else 0) + int((job.sampling or {}).get("max_tokens") or 0)
    return Charge(principal.tenant_id, principal.limits, int(request), tokens)


def _earlier(existing: Job, job: Job) -> Submitted:
    """The answer to a repeated Idempotency-Key: the earlier job, for the same request only."""
    if not _same_request(existing, job):
        raise IdempotencyConflict(f"Idempotency-Key {job.idempotency_key!r} was already used for job "
                                  f"{existing.id} with a different request; use a new key")
    return Submitted(existing, created=False)


def submit_job(session: Session, principal: Principal, spec: JobCreate, settings: Settings, *,
               idempotency_key: str | None = None, batch_id: str | None = None, custom_id: str | None = None,
               endpoint: str = "/v1/jobs", dispatch: bool = True, writer: JobWriter | None = None,
               overdue_ok: bool = False, response: dict[str, Any] | None = None,
               limiter: RateLimiter | None = None, charge: tuple[bool, bool] = (True, True),
               job_id: str | None = None, prompt_tokens: int | None = None) -> Submitted:
    """Writes the job row, commits, then sends it to the workers (unless ``dispatch=False``).

    With a ``writer`` (the API's group-commit writer) the row is committed together with
    other concurrent submissions and the send happens right after, off the caller's thread;
    the returned job is then ``queued`` and becomes ``dispatched`` within milliseconds.
    ``overdue_ok`` accepts a deadline already past: a pipeline's later stage (summarization's
    reduce) must still run when earlier stages overran; the scheduler then treats it as late.
    ``limiter``: the tenant's rate limits apply (API requests; raises ``RateLimited`` over them), ``charge`` saying
    whether this job is its request's first and its prompt's first choice (``rate_charge``); the writer charges
    its batch in one call. A repeated idempotent request is not charged. ``prompt_tokens``: the prompt's count where
    the caller measured it (``build_job``).
    """
    existing = _by_idempotency_key(session, principal.tenant_id, idempotency_key) if idempotency_key else None
    # a retry whose deadline has passed since the first try still answers that job
    job = build_job(settings, principal, spec, idempotency_key=idempotency_key, batch_id=batch_id,
                    custom_id=custom_id, endpoint=endpoint, overdue_ok=overdue_ok or existing is not None,
                    response=response, job_id=job_id, prompt_tokens=prompt_tokens)
    job.counts_request, job.counts_prompt = charge  # usage counts a request and a prompt once, as the limits do
    if existing is not None:
        return _earlier(existing, job)
    cost = rate_charge(principal, job, request=charge[0], prompt=charge[1]) if limiter is not None else None
    return record_job(session, settings, job, via=endpoint, dispatch=dispatch, writer=writer, cost=cost,
                      limiter=limiter)


def charge_request(limiter: RateLimiter | None, principal: Principal, jobs: list[Job]) -> Decision | None:
    """Takes a whole request's cost from its tenant's buckets in one charge, before any of its jobs is written: one
    request, each prompt's tokens once and every choice's ``max_tokens`` (``counts_request``/``counts_prompt`` say
    which job counts which). Raises ``RateLimited``, taking nothing, where the total does not fit (too large where
    it never can); None where no limit applies."""
    cost = request_charge(principal, jobs) if limiter is not None else None
    if cost is None:
        return None
    decision = limiter.take_many([cost])[0]
    if not decision.allowed:
        raise RateLimited(decision)
    return decision


def give_back_request(limiter: RateLimiter | None, principal: Principal, jobs: list[Job]) -> None:
    """Gives ``charge_request``'s charge of ``jobs`` back: the request was refused after it (its jobs not written,
    or those written cancelled), so its client's retry is charged once."""
    if limiter is not None and (cost := request_charge(principal, jobs)) is not None:
        limiter.give_back([cost])


def request_charge(principal: Principal, jobs: list[Job]) -> Charge | None:
    """A whole request's cost (``charge_request``): None where no limit applies."""
    costs = [rate_charge(principal, job, request=bool(job.counts_request), prompt=bool(job.counts_prompt))
             for job in jobs]
    if not costs or costs[0] is None:
        return None
    return Charge(principal.tenant_id, principal.limits, sum(c.requests for c in costs), sum(c.tokens for c in costs))


def record_job(session: Session, settings: Settings, job: Job, *, via: str = "/v1/jobs", dispatch: bool = True,
               writer: JobWriter | None = None, cost: Charge | None = None,
               limiter: RateLimiter | None = None) -> Submitted:
    """Writes a built job's row and sends it to the workers, as ``submit_job`` says; ``via``: the route the request
    came in by, which its first event names (batched chat's: its jobs' endpoint is chat's). ``cost`` taken by
    ``limiter`` (raises ``RateLimited``) once the row is in, so a concurrent retry with the same Idempotency-Key,
    which finds the row there, is never charged nor refused."""
    if writer is not None and not job.idempotency_key and dispatch:
        written = writer.write(job, f"submitted via {via}", cost)
        return Submitted(written.job, created=True, rate=written.rate)
    rate = None
    # end the read snapshot (auth, idempotency lookup): the insert starts a write transaction
    session.commit()
    try:
        with write_guard(session):
            session.add(job)
            session.add(JobEvent(job_id=job.id, from_status=None, to_status=JobStatus.QUEUED.value,
                                 at=job.created_at, attempt=0, detail=f"submitted via {via}"))
            session.flush()  # a concurrent insert of the same Idempotency-Key fails here (or waits for it)
            if cost is not None:
                rate = limiter.take_many([cost])[0]
                if not rate.allowed:
                    raise RateLimited(rate)
            session.commit()
    except RateLimited:
        session.rollback()
        raise
    except IntegrityError:
        session.rollback()
        key = job.idempotency_key
        existing = _by_idempotency_key(session, job.tenant_id, key) if key else None
        if existing is None:
            raise
        return _earlier(existing, job)  # a concurrent submission with the same key won the insert
    if dispatch:
        _dispatch_written(session, settings, job)
    return Submitted(job, created=True, rate=rate)


def _dispatch_written(session: Session, settings: Settings, job: Job) -> None:
    """Sends a committed job to the workers. Where the database cannot mark it dispatched (``database_unavailable``),
    the job is accepted all the same: it stays queued, which the sweeper sends; a 503 here made its client submit it
    again, a second job."""
    redis_url = settings.redis_url
    if not redis_url:
        return
    queue = routing.job_queue(settings, job.model, job.route_key, job.kind)
    try:
        sent = dispatching.dispatch(session, redis_url, job.id, job.model, queue=queue,
                                    priority=message_priority(job.kind),
                                    send=dispatching.send_routed(settings, job.model))
    except DATABASE_ERRORS as exc:
        if not database_unavailable(exc):
            raise
        session.rollback()
        log.warning("job %s is written but the database could not mark it dispatched (%s); the sweeper sends it",
                    job.id, type(exc).__name__)
        return
    if sent:
        # dispatch() already wrote the row; reflect it in the answer without marking the object
        # dirty, so a later commit on this session cannot overwrite a worker's lease (running)
        set_committed_value(job, "status", JobStatus.DISPATCHED.value)


def get_job(session: Session, tenant_id: str | None, job_id: str, lock: bool = False) -> Job | None:
    """The job if it exists and belongs to ``tenant_id`` (None = any tenant, for admins); ``lock``: its row held
    for this transaction's write (PostgreSQL; SQLite's writers hold the whole database)."""
    job = session.get(Job, job_id, populate_existing=True, with_for_update=lock)
    if job is None or (tenant_id is not None and job.tenant_id != tenant_id):
        return None
    return job


def _encode_cursor(job: Job) -> str:
    return base64.urlsafe_b64encode(f"{job.created_at.isoformat()}|{job.id}".encode()).decode()


def _decode_cursor(cursor: str) -> tuple[datetime, str]:
    try:
        at, job_id = base64.urlsafe_b64decode(cursor.encode()).decode().split("|", 1)
        if find_unstorable(job_id) is not None:  # no job's id: PostgreSQL refuses a NUL in the comparison
            raise ValueError(job_id)
        return datetime.fromisoformat(at), job_id
    except Exception as exc:
        raise JobValidationError("invalid cursor; pass the next_cursor value of the previous page",
                                 param="cursor") from exc


def _db_time(session: Session, at: datetime) -> datetime:
    """SQLite stores naive UTC: compare with naive UTC there."""
    if session.bind.dialect.name != "sqlite":
        return at
    return at.astimezone(UTC).replace(tzinfo=None) if at.tzinfo else at


def list_jobs(session: Session, tenant_id: str, *, status: str | None = None, kind: str | None = None,
              tier: str | None = None, batch_id: str | None = None, request_id: str | None = None,
              created_after: datetime | None = None, created_before: datetime | None = None, limit: int = 20,
              cursor: str | None = None, offset: int | None = None) -> tuple[list[Job], str | None]:
    """Newest first; keyset pagination by (created_at, id), or plain offset.

    Filters combine with AND; ``created_after``/``created_before`` are exclusive bounds."""
    q = select(Job).where(Job.tenant_id == tenant_id, ~Job.status.startswith(STAGED))  # a fan-out's: not yet
    if status:
        q = q.where(Job.status == status)
    if kind:
        q = q.where(Job.kind == kind)
    if tier:
        q = q.where(Job.tier == tier)
    if batch_id:
        q = q.where(Job.batch_id == batch_id)
    if request_id:
        q = q.where(Job.request_id == request_id)
    if created_after is not None:
        q = q.where(Job.created_at > _db_time(session, created_after))
    if created_before is not None:
        q = q.where(Job.created_at < _db_time(session, created_before))
    if cursor:
        at, job_id = _decode_cursor(cursor)
        at = at.replace(tzinfo=None) if session.bind.dialect.name == "sqlite" else at
        q = q.where(pagination.after(Job, at, job_id))
    q = q.order_by(*pagination.in_order(Job)).limit(limit + 1)
    if offset:
        q = q.offset(offset)
    rows = list(session.scalars(q))
    more = len(rows) > limit
    rows = rows[:limit]
    return rows, (_encode_cursor(rows[-1]) if more and rows else None)


def cancel_job(session: Session, job: Job, *, detail: str = "cancelled by the user") -> JobStatus | None:
    """Marks a non-terminal job ``cancelled`` (commits); the worker aborts it in its engine. Returns the status it
    was cancelled from, as the guarded write found it (None: it had ended)."""
    cancelled_from = None
    with write_after_read(session):
        for status in NOT_TERMINAL:  # one guarded write per state, so that the one that matched is known
            if transition(session, job.id, status, JobStatus.CANCELLED, detail=detail,
                          values={**cancel_stamps(utcnow()), "finish_reason": "cancelled"}):
                cancelled_from = status
                break
        session.commit()
    reread(session, job)
    return cancelled_from
