"""OpenAI-compatible request bodies and the OpenAI error shape.

The request models accept what the official ``openai`` client sends (``service_tier`` picks coserve's
tier) plus coserve's QoS extension fields (``ttft_ms``, ``tbt_ms``, ``deadline``, ``tier``) and vLLM's
sampling extensions (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``stop_token_ids``,
``include_stop_str_in_output``, ``allowed_token_ids``, ``bad_words``, ``truncate_prompt_tokens``, ``cache_salt``,
``structured_outputs``, ``add_special_tokens``), and turn into a ``JobCreate``. OpenAI fields coserve does not
implement (best_of, suffix, functions) and vLLM's (``VllmUnsupported``) are declared, so a request that sets one to
anything but its default gets a 400 with ``code="unsupported_value"`` instead of an answer that silently ignored
it; fields unknown to both are ignored.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Annotated, Any, ClassVar, Literal

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator
from starlette.exceptions import HTTPException

from app import structural_tag
from app.api.errors import CheckedRoute, blamed, loc_param, validation_errors
from app.schemas import (MAX_SEED, MAX_TARGET_MS, MAX_TOP_K, MAX_WINDOW_S, MIN_SEED, TEMPLATE_DEFAULTS, Alternatives,
                         ChatMessage, JobCreate, StructuredOutputs, alternatives_range)
from app.settings import DEFAULT_TIERS
from app.tool_calls import MAX_TOOLS, read_answer
from app.wire import Metadata, Text, as_given, json_safe, shown
from gpu_runtime.logprobs import MAX_TOP_LOGPROBS
from gpu_runtime.sampling import CONSTRAINT_OPTIONS, PENALTY_LIMIT

log = logging.getLogger(__name__)

MAX_CHOICES = 16  # n: choices per request, each generated as a job of its own
GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: a temperature under it samples greedily
MAX_PROMPTS = MAX_CHOICES * 4  # jobs of one request with several prompts (completions' prompts x n, batched chat's)
WINDOW_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd])\s*$")
WINDOW_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_window(text: str) -> float:
    """'24h' / '30m' / '2h' / '7d' / '90s' -> seconds (raises ValueError)."""
    m = WINDOW_RE.match(text or "")
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"invalid window {shown(text)}; use a number and a unit s/m/h/d, e.g. '24h', '30m', "
                         "'7d'")
    seconds = float(m.group(1)) * WINDOW_UNITS[m.group(2)]
    if seconds > MAX_WINDOW_S:
        raise ValueError(f"window {text!r} is longer than {MAX_WINDOW_S / 86400:.0f} days; give a shorter one")
    return seconds


# ---------------------------------------------------------------- errors
class OpenAIError(Exception):
    """Raised in OpenAI-compatible routes; rendered as ``{"error": {...}}``."""

    def __init__(self, status_code: int, message: str, *, type: str | None = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status_code, self.message, self.type, self.param, self.code = status_code, message, type, param, code
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        out = error_response(self.status_code, self.message, type=self.type, param=self.param, code=self.code)
        out.headers.update(self.headers)
        return out


# OpenAI's SDKs retry a 409 (a lock that may clear) unless the answer says not to; coserve's 409s are states a retry
# cannot change (a cancelled job, an ended batch), and a retried completion would generate the cancelled job again
FINAL = {"x-should-retry": "false"}


def error_response(status_code: int, message: str, *, type: str | None = None, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    if type is None:
        type = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                429: "rate_limit_error"}.get(status_code,
                                             "invalid_request_error" if status_code < 500 else "server_error")
    # json_safe: a message may quote what the client sent (a lone surrogate cannot be encoded)
    return JSONResponse(json_safe({"error": {"message": message, "type": type, "param": param, "code": code}}),
                        status_code=status_code, headers=FINAL if status_code == 409 else None)


# the names pydantic gives a union's plain members in an error's location
_MEMBER_TYPES = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "bytes"})


def _written(part: Any) -> bool:
    """Whether an error location's part is one the client wrote (a field, an index), not pydantic's name for a
    union's member (``str``, ``list[int]``, ``function-after[check_text(), str]``) or for a dict's key (``[key]``)."""
    return not isinstance(part, str) or (part not in _MEMBER_TYPES and "[" not in part)


LISTED_ERRORS = 5  # a message lists this many of its errors and counts the rest: one per item of a list is no bound


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """One message for pydantic's errors, and the field to blame: the first one's, or where a union's member that
    took the value further failed in it (``stop.0`` of a list ``stop`` holding a number, not ``stop``). It lists the
    first ``LISTED_ERRORS`` and how many more there are: a batch's 1,300-item ``stop`` of numbers made one 8 times
    its line's size, whose error file could grow to many times its input's."""
    parts, param, more = [], None, set()
    for e in map(blamed, errors):
        if e.get("type") == "json_invalid":  # FastAPI's loc is ("body", <character offset>): no field
            part = (e["msg"] if e.get("loc") == ["body"] else
                    f"the body is not valid JSON: {(e.get('ctx') or {}).get('error')}")
        else:
            where = loc_param([p for p in e.get("loc", ()) if _written(p)])
            if param is None or (where or "").startswith(param + "."):
                param = where
            part = f"{where or 'body'}: {str(e.get('msg')).removeprefix('Value error, ')}"
        if part in parts:  # a union's members may each fail the same way
            continue
        if len(parts) < LISTED_ERRORS:
            parts.append(part)
        else:
            more.add(part)
    return "; ".join(parts + ([f"and {len(more)} more"] if more else [])), param


# OpenAI's codes for a value past a limit, as its API answers them (17 metadata pairs: object_above_max_properties,
# a 513-character metadata value: string_above_max_length); any other invalid value is invalid_value
_LIMIT_CODES = {"string_too_long": "string_above_max_length", "too_long": "array_above_max_length"}


def validation_code(errors: list[dict[str, Any]]) -> str:
    """OpenAI's ``code`` for pydantic's ``errors`` (their first's): the same on every route, whichever parses."""
    first = errors[0] if errors else {}
    if first.get("type") == "too_long" and (first.get("ctx") or {}).get("field_type") == "Dictionary":
        return "object_above_max_properties"
    return _LIMIT_CODES.get(first.get("type"), "invalid_value")


def invalid_request(errors: list[dict[str, Any]]) -> OpenAIError:
    """The 400 for pydantic's ``errors``: ``validation_message``'s message and field, ``validation_code``'s code."""
    message, param = validation_message(errors)
    return OpenAIError(400, message, param=param, code=validation_code(errors))


def openai_parsed(model: type[BaseModel], body: Any) -> Any:
    """``body`` validated as ``model``; a 400 in OpenAI's shape that names the field where it is not."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise invalid_request(list(exc.errors())) from exc


def charged(request: Request, headers: dict[str, str]) -> None:
    """Marks ``request`` as charged to its tenant's rate limits: every answer ``OpenAIRoute`` gives it carries the
    charge's rate-limit ``headers``, a refusal after the charge (a 404, a 409) too, as OpenAI's and Anthropic's
    errors tell a client where its limit stands."""
    request.state.charge_headers = headers


def _charge_headers(request: Request) -> dict[str, str]:
    """The rate-limit headers of ``request``'s charge (``charged``); none where it was not charged."""
    return getattr(request.state, "charge_headers", {})


class OpenAIRoute(CheckedRoute):
    """A route whose errors (auth, validation, HTTPException) come out in OpenAI's shape (``error``'s), and whose
    answers, errors included, carry its charge's rate-limit headers where the call was charged (``charged``)."""

    def error(self, exc: OpenAIError) -> Response:
        """The answer to a refusal (a subclass writes it in another API's shape)."""
        return exc.response()

    def error_to(self, request: Request, exc: OpenAIError) -> Response:
        """The answer to ``request``'s refusal (a subclass answering two APIs' clients picks the shape by it)."""
        return self.error(exc)

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def wrapped(request: Request) -> Response:
            try:
                answer = await handler(request)
            except OpenAIError as exc:
                answer = self.error_to(request, exc)
            except RequestValidationError as exc:
                answer = self.error_to(request, invalid_request(validation_errors(exc)))
            except HTTPException as exc:  # Starlette's: FastAPI raises it too (a body it cannot read)
                answer = self.error_to(request, OpenAIError(exc.status_code, str(exc.detail), type=None,
                                                            headers=dict(exc.headers or {})))
            for name, value in _charge_headers(request).items():  # the answer's own (a 429's) stand
                answer.headers.setdefault(name, value)
            return answer

        return wrapped


# ---------------------------------------------------------------- requests
class StreamOptions(BaseModel):
    include_usage: bool = False  # a last chunk with the request's usage (and ``usage: null`` on the others)
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk has its choice's usage so far

    def usage_in_every_chunk(self) -> bool:
        return self.include_usage and self.continuous_usage_stats


class QoSExtension(BaseModel):
    """coserve's extension fields (pass with ``extra_body`` from the openai client)."""

    model_config = ConfigDict(allow_inf_nan=False)  # NaN/Infinity parse from JSON; no target is either

    ttft_ms: float | None = Field(None, gt=0, le=MAX_TARGET_MS)
    tbt_ms: float | None = Field(None, gt=0, le=MAX_TARGET_MS)
    tbt_anchor: Literal["arrival", "first-token"] | None = Field(
        None, description="when token n is due: 'arrival' (+ TTFT + (n-1) TBT) or 'first-token' (+ (n-1) TBT)")
    deadline: float | str | None = Field(
        None, description="makes it a deadline (batch-class) job: seconds from now, a window like '2h', or an ISO time")
    tier: Text | None = None
    # OpenAI's own field for the same idea: "flex" is the lowest tier (free: relegated first under load),
    # "priority" the highest (paid), "fast" OpenAI's other name for it, "auto"/"default" the key's tier
    service_tier: Literal["auto", "default", "flex", "priority", "fast"] | None = None
    app_id: Text | None = Field(None, max_length=200)
    ignore_eos: bool = False

    def job_tier(self, tiers: tuple[str, ...] = DEFAULT_TIERS) -> str | None:
        """The tier asked for: ``tier``, or OpenAI's ``service_tier`` among ``tiers`` (the configured ones, lowest
        first): ``flex`` the lowest, ``priority`` (or ``fast``, as OpenAI takes it) the highest."""
        service = {"flex": tiers[0], "priority": tiers[-1], "fast": tiers[-1]}.get(self.service_tier or "auto")
        if self.tier is not None and service is not None and self.tier != service:
            raise OpenAIError(400, f"tier {self.tier!r} and service_tier {self.service_tier!r} disagree; give one",
                              param="service_tier")
        return self.tier or service

    @field_validator("deadline", mode="before")
    @classmethod
    def _deadline(cls, v: Any) -> Any:
        # checked before the float | str union: its two errors would blame "deadline.float"/"deadline.str"
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError("deadline must be a finite number of seconds, a window like '2h' or an ISO time")
        if isinstance(v, bool) or not isinstance(v, int | float | str | None):
            raise ValueError("deadline must be seconds from now, a window like '2h' or an ISO time")
        return v


class SamplingFields(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False)

    model: Text | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: Text | list[Text] | None = None
    seed: int | None = Field(None, ge=MIN_SEED, le=MAX_SEED)
    n: int | None = None
    presence_penalty: float | None = Field(None, ge=-PENALTY_LIMIT, le=PENALTY_LIMIT)
    frequency_penalty: float | None = Field(None, ge=-PENALTY_LIMIT, le=PENALTY_LIMIT)
    logit_bias: dict[str, float] | None = None  # token id (as text) -> bias; JobCreate checks both
    # vLLM's sampling extensions, which its OpenAI server takes beside OpenAI's fields (extra_body)
    top_k: int | None = Field(None, ge=-1, le=MAX_TOP_K)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    min_tokens: int | None = Field(None, ge=0)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    return_token_ids: bool | None = None  # vLLM's: the prompt's and the answer's token ids in the answer
    truncate_prompt_tokens: int | None = None
    cache_salt: Text | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[Text] | None = None
    # vLLM's: at most this many thinking tokens, then the reasoning parser's end of thinking is forced (-1: no limit)
    thinking_token_budget: StrictInt | None = Field(None, ge=-1)
    # chat: true/false (top_logprobs says how many alternatives); completions: the number of alternatives
    logprobs: bool | int | None = None
    # structured output: OpenAI's response_format, or vLLM's structured_outputs (one constraint, JobCreate's form)
    response_format: dict[str, Any] | None = None
    structured_outputs: StructuredOutputs | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: Text | None = Field(None, max_length=256)  # the end user, as safety_identifier (OpenAI's older name)
    safety_identifier: Text | None = Field(None, max_length=256)  # OpenAI's: the end user (the Usage API's user_id)
    prompt_cache_key: Text | None = Field(None, max_length=1024)  # OpenAI's: routes alike requests to one cache

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        return v


def _is_default(value: Any, defaults: tuple[Any, ...]) -> bool:
    # ``x == False`` is True for 0 too, so compare with ``is`` for booleans
    return any(value is d if isinstance(d, bool) or d is None else (value == d and not isinstance(value, bool))
               for d in defaults)


# what to do instead, where the server has another way
UNSUPPORTED_HINTS = {
    "priority": " (the API key's tier, or service_tier / tier, orders the work, with the QoS targets ttft_ms, tbt_ms "
                "and deadline)",
    "vllm_xargs": " (give coserve's QoS fields ttft_ms, tbt_ms, deadline and tier in the body itself)",
    "chat_template": " (the server applies its own, COSERVE_CHAT_TEMPLATE; chat_template_kwargs reach it)",
    "truncation_side": " (truncate_prompt_tokens keeps the prompt's last tokens)",
    "logprob_token_ids": " (logprobs / top_logprobs report the most likely tokens)",
    "documents": " (put the documents' text in the messages)",
    "modalities": " (this server answers in text only)",
    "audio": " (this server answers in text only)",
    "web_search_options": " (this server does not search the web)",
    "moderation": " (this server runs no moderation model: nothing is screened or blocked; screen the input and the "
                  "answer yourself, e.g. with a moderation endpoint)",
    "request_id": " (the answer's id is its job's here; send your id as the X-Request-Id header: the answer's "
                  "x-request-id echoes it, the jobs keep it, GET /v1/jobs?request_id= finds them and the API's log "
                  "lines name it)",
    "kv_transfer_params": " (this server has no KV connector: it prefills and decodes each request itself; send "
                          "the request whole, without a prefill leg)",
    "ec_transfer_params": " (this server has no encoder-cache connector: it takes text only)",
    "mm_processor_kwargs": " (this server takes text only, and vLLM refuses it unless started with "
                           "--trust-request-mm-kwargs)",
    "media_io_kwargs": " (this server takes text only, and vLLM refuses it unless started with "
                       "--trust-request-mm-kwargs)",
    "verbosity": " (ask for the length you want in the messages, or cap it with max_completion_tokens)",
    **{f"guided_{kind}": f" (vLLM removed its guided-decoding fields and ignores them, leaving the text unconstrained: "
                         f"give structured_outputs.{kind}{also} instead)"
       for kind, also in (("json", ", or response_format json_schema"), ("regex", ""), ("choice", ""),
                          ("grammar", ""))},
    "guided_whitespace_pattern": " (vLLM removed its guided-decoding fields and ignores them; a JSON constraint here "
                                 "takes vLLM's default whitespace)"}


def merged_constraint(formatted: StructuredOutputs, given: StructuredOutputs | None) -> StructuredOutputs:
    """vLLM's ``structured_outputs_from_response_format``: ``response_format``'s constraint (``formatted``) replaces
    ``structured_outputs``' one (``given``) of the same kind, whose options (e.g. disable_any_whitespace) it keeps;
    two constraints of different kinds are refused (vLLM's "only one kind of structured outputs constraint")."""
    if given is None:
        return formatted
    wanted, held = constraint_kind(formatted), constraint_kind(given)
    if held != wanted:
        raise OpenAIError(400, f"response_format constrains the text to {wanted} and structured_outputs to {held}: "
                               f"send one of them, or a structured_outputs.{wanted} (with its options) beside "
                               f"response_format, which then replaces it", param="response_format")
    return formatted.model_copy(update={k: v for k, v in given.fields().items() if k in CONSTRAINT_OPTIONS})


def constraint_kind(constraint: StructuredOutputs) -> str:
    """The field of vLLM's that holds the constraint (json, regex, choice, grammar, json_object, structural_tag)."""
    return next(k for k in constraint.fields() if k not in CONSTRAINT_OPTIONS)


class UnsupportedFields(BaseModel):
    """OpenAI fields an endpoint has that coserve does not implement (accepted only at their defaults)."""

    # field -> values that mean "not used" (what clients send when they do not set it); each endpoint's own
    unsupported: ClassVar[dict[str, tuple[Any, ...]]] = {}
    refused_by: ClassVar[str] = "this server"  # who does not support them, as the 400 says
    hints: ClassVar[dict[str, str]] = {}  # the endpoint's own hints, before the shared ones (UNSUPPORTED_HINTS)

    def check_unsupported(self, hints: dict[str, str] | None = None) -> None:
        """A 400 naming the first unsupported field the request sets; ``hints``: the caller's own, before the
        endpoint's and the shared ones (a batch's line is told what a batch's request takes)."""
        given = self.model_fields_set  # a field the request left out holds its default, None: never refused
        for name, defaults in self.unsupported.items():
            if name not in given:
                continue
            value = getattr(self, name)
            if not _is_default(value, defaults):
                hint = (hints or {}).get(name) or self.hints.get(name) or UNSUPPORTED_HINTS.get(name, "")
                raise OpenAIError(400, f"{as_given(name, value)} is not supported by {self.refused_by}; leave "
                                       f"{name} unset{hint}", param=name, code="unsupported_value")


class VllmUnsupported(BaseModel):
    """vLLM's request fields coserve does not implement: declared, so that setting one is a 400 that names it
    instead of an answer that silently went without it."""

    priority: Any = None  # coserve's tiers and QoS targets order the work: a request cannot rank itself
    use_beam_search: Any = None
    length_penalty: Any = None
    chat_template: Any = None  # the server's template (COSERVE_CHAT_TEMPLATE), which its workers apply too
    skip_special_tokens: Any = None
    spaces_between_special_tokens: Any = None
    return_tokens_as_token_ids: Any = None
    logits_processors: Any = None
    vllm_xargs: Any = None  # coserve's QoS fields are the request's own (ttft_ms, tbt_ms, deadline, tier)
    truncation_side: Any = None
    logprob_token_ids: Any = None
    # each changes the answer where vLLM applies it: answering without it would pass for having applied it
    repetition_detection: Any = None
    watermarking: Any = None
    # names vLLM's answer (chatcmpl-<request_id>); coserve's answer ids are its jobs' (stored completions, GET
    # /v1/jobs/{id}): the X-Request-Id header is the id a request keeps here
    request_id: Any = None
    # disaggregated prefill (vLLM's KV connector) and encoder-cache transfer (its EC connector): coserve's workers
    # have neither, and a prefill leg answered without them hands its decode leg nothing to continue from
    kv_transfer_params: Any = None
    ec_transfer_params: Any = None
    # the multimodal processor's and media loader's options: vLLM refuses them unless started with
    # --trust-request-mm-kwargs; coserve takes text only
    mm_processor_kwargs: Any = None
    media_io_kwargs: Any = None
    # vLLM's removed guided decoding: its server ignores them, so the text goes unconstrained where they asked for a
    # constraint (its log alone says so); the client hears it here (guided_decoding_backend constrains nothing)
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_whitespace_pattern: Any = None

    unsupported: ClassVar[dict[str, tuple[Any, ...]]] = {
        "priority": (None, 0), "use_beam_search": (None, False), "length_penalty": (None, 1, 1.0),
        "chat_template": (None,), "skip_special_tokens": (None, True), "spaces_between_special_tokens": (None, True),
        "return_tokens_as_token_ids": (None, False),
        "logits_processors": (None, []), "vllm_xargs": (None, {}),
        "truncation_side": (None, "left"), "logprob_token_ids": (None, []), "repetition_detection": (None,),
        "watermarking": (None, False), "request_id": (None,), "kv_transfer_params": (None, {}),
        "ec_transfer_params": (None, {}), "mm_processor_kwargs": (None, {}), "media_io_kwargs": (None, {}),
        **dict.fromkeys(("guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_whitespace_pattern"),
                        (None,))}


class _Base(QoSExtension, SamplingFields, VllmUnsupported, UnsupportedFields):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    # vLLM's: each prompt token's logprob with this many alternatives, answered in vLLM's form (token ids and
    # ranks): a completion's choice carries them, a chat answer at its top
    prompt_logprobs: Alternatives = None
    # vLLM's: the tokenizer's special tokens (e.g. BOS) added to the prompt text, on top of what a chat template
    # writes (None: each endpoint's default, chat's False, completions' True; token ids are fed as they are)
    add_special_tokens: bool | None = None
    # vLLM's: a stream's tokens batched a chunk per this many; coserve streams each piece as the engine makes it
    # (1, and any value unstreamed, where vLLM ignores it, change nothing)
    stream_interval: int | None = Field(None, ge=1)
    # vLLM's, taken and not applied: neither changes the text or the answer's shape. session_id labels vLLM's
    # KV-cache events (coserve publishes none); return_token_offsets is answered on vLLM's /render routes only
    session_id: str | None = None
    return_token_offsets: bool | None = None

    def check(self) -> None:
        self.check_unsupported()
        if self.truncation_side == "left" and self.truncate_prompt_tokens is not None:  # (alone it cuts nothing)
            raise OpenAIError(400, "truncation_side='left' is not supported with truncate_prompt_tokens: vLLM then "
                                   "cuts after tokenizing, the BOS the tokenizer adds gone; leave truncation_side "
                                   "unset (the prompt keeps its last tokens and that BOS)", param="truncation_side",
                              code="unsupported_value")
        if self.stream and (self.stream_interval or 1) > 1:
            raise OpenAIError(400, f"stream_interval={self.stream_interval} is not supported by this server: it "
                                   "streams each piece of text as the engine makes it; leave stream_interval unset "
                                   "(or 1), or join the chunks on the client", param="stream_interval",
                              code="unsupported_value")
        if self.n is not None and not 1 <= self.n <= MAX_CHOICES:
            raise OpenAIError(400, f"n must be between 1 and {MAX_CHOICES}", param="n")
        if (self.n or 1) > 1 and self.temperature is not None and self.temperature < GREEDY_BELOW:
            raise OpenAIError(400, f"n must be 1 when using greedy sampling (temperature 0), got {self.n}: its "
                                   "choices would all be the same text (as vLLM's, refused); send n 1, or a "
                                   "temperature above 0 for choices that differ", param="n")
        if self.stream_options is not None and not self.stream:
            raise OpenAIError(400, "stream_options is only allowed with stream=true", param="stream_options")
        if self.prompt_logprobs and self.stream:  # vLLM's protocol takes 0 with stream (a chunk carries none)
            raise OpenAIError(400, "prompt_logprobs above 0 are not available with stream: true (as vLLM's); leave "
                                   "stream unset, or prompt_logprobs 0 or unset", param="prompt_logprobs")

    def echo_fields(self) -> dict[str, Any]:
        """The job fields of OpenAI completions' echo (none elsewhere)."""
        return {}

    def tool_fields(self) -> dict[str, Any]:
        """The job fields of chat's tool calling (none elsewhere)."""
        return {}

    def reasoning_fields(self) -> dict[str, Any]:
        """The job fields of chat's reasoning options (none elsewhere)."""
        return {}

    def template_fields(self) -> dict[str, Any]:
        """The job fields of chat's template options (none elsewhere)."""
        return {}

    def output_constraint(self) -> StructuredOutputs | None:
        """The constraint of ``response_format`` (text, json_object, json_schema or vLLM's structural_tag) or
        ``structured_outputs``; both, as vLLM merges them (``merged_constraint``)."""
        fmt = self.response_format
        kind = (fmt or {}).get("type", "text")
        if kind == "text":
            return self.structured_outputs
        return merged_constraint(self._format_constraint(fmt, kind), self.structured_outputs)

    @staticmethod
    def _format_constraint(fmt: dict[str, Any], kind: str) -> StructuredOutputs:
        """The constraint of a ``response_format`` other than text."""
        if kind == "json_object":
            try:
                return StructuredOutputs(json_object=True)
            except ValidationError as exc:  # the workers' backend does not take it (outlines)
                message = "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in exc.errors())
                raise OpenAIError(400, f"response_format {message}", param="response_format") from None
        if kind == "json_schema":
            schema = (fmt.get("json_schema") or {}).get("schema")
            if not isinstance(schema, dict):
                raise OpenAIError(400, "response_format json_schema needs json_schema.schema, a JSON schema object",
                                  param="response_format")
            try:
                return StructuredOutputs(json=schema)
            except ValidationError as exc:
                message = "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in exc.errors())
                raise OpenAIError(400, f"response_format json_schema.schema: {message}",
                                  param="response_format") from exc
        if kind == "structural_tag":
            try:
                return StructuredOutputs(structural_tag=structural_tag.of_response_format(fmt))
            except ValidationError as exc:  # the tag's shape is right, xgrammar cannot compile it
                message = "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in exc.errors())
                raise OpenAIError(400, f"response_format {message}", param="response_format") from None
            except ValueError as exc:  # its shape is wrong
                raise OpenAIError(400, f"response_format {exc}", param="response_format") from None
        raise OpenAIError(400, f"response_format type {shown(kind)} is not supported; use 'text', 'json_object', "
                               "'json_schema' or 'structural_tag'", param="response_format", code="unsupported_value")

    def job_spec(self, *, prompt: str | None = None, messages: list[ChatMessage] | None = None,
                 batch_window_s: float | None = None, deadline_at: datetime | None = None,
                 prompt_token_ids: list[int] | None = None, tiers: tuple[str, ...] = DEFAULT_TIERS) -> JobCreate:
        """The job for this request; a ``deadline`` (or a Batch API window) makes it batch-class; ``tiers``: the
        configured ones, lowest first (what ``service_tier`` names)."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        common = dict(model=self.model, prompt=prompt, messages=messages, prompt_token_ids=prompt_token_ids,
                      tier=self.job_tier(tiers), app_id=self.app_id, prompt_cache_key=self.prompt_cache_key,
                      user=self.safety_identifier or self.user,
                      max_tokens=self.max_completion_tokens or self.max_tokens,
                      temperature=self.temperature if self.temperature is not None else 1.0,
                      top_p=self.top_p if self.top_p is not None else 1.0, stop=stops, seed=self.seed,
                      ignore_eos=self.ignore_eos, stream=bool(self.stream), structured_outputs=self.output_constraint(),
                      logprobs=self.logprob_count(), prompt_logprobs=self.prompt_logprobs,
                      logit_bias=self.logit_bias or None,
                      **self.reasoning_fields(),
                      **self.tool_fields(), **self.template_fields(),
                      **{k: v for k in ("top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                                        "min_tokens", "stop_token_ids", "include_stop_str_in_output",
                                        "return_token_ids", "truncate_prompt_tokens", "cache_salt",
                                        "add_special_tokens", "allowed_token_ids", "bad_words")
                         if (v := getattr(self, k)) is not None},
                      **({} if self.thinking_token_budget in (None, -1)
                         else {"thinking_token_budget": self.thinking_token_budget}))
        common |= self.echo_fields()  # completions' echo may set max_tokens (the prompt alone: one token, as vLLM)
        window, at = batch_window_s, deadline_at
        if self.deadline is not None and window is None and at is None:
            window, at = _deadline(self.deadline)
        try:
            if window is not None or at is not None:
                if self.ttft_ms or self.tbt_ms or self.tbt_anchor:
                    raise OpenAIError(400, "give either deadline or ttft_ms/tbt_ms/tbt_anchor", param="deadline")
                return JobCreate(kind="batch", deadline_window_s=window, deadline_at=at, **common)
            return JobCreate(kind="interactive", ttft_ms=self.ttft_ms, tbt_ms=self.tbt_ms, tbt_anchor=self.tbt_anchor,
                             **common)
        except ValidationError as exc:
            errors = list(exc.errors())
            message, param = validation_message(errors)
            raise OpenAIError(400, message, param=openai_param(param), code=validation_code(errors)) from exc


def choice_specs(spec: JobCreate, n: int | None) -> list[JobCreate]:
    """The jobs of a request's ``n`` choices: the same request, a seeded one with seeds seed, seed + 1, ... (each
    choice reproducible and unlike the others); unseeded, each job draws a seed of its own when it samples."""
    if not n or n == 1:
        return [spec]
    if spec.seed is None:
        return [spec] * n
    return [spec.model_copy(update={"seed": (spec.seed + i) % (MAX_SEED + 1)}) for i in range(n)]


def merge_choices(bodies: list[dict[str, Any]], n: int = 1) -> dict[str, Any]:
    """One response of the bodies of a request's choices (one job each; ``n`` per prompt, a prompt's together):
    their choices indexed in order, the completion tokens summed, each prompt's tokens counted once (OpenAI's
    usage)."""
    body = bodies[0]
    if len(bodies) > 1:
        body["choices"] = [{**b["choices"][0], "index": i} for i, b in enumerate(bodies)]
        body["usage"] = usage(sum(b["usage"]["prompt_tokens"] for b in bodies[::n]),
                              sum(b["usage"]["completion_tokens"] for b in bodies),
                              known_sum(b["usage"].get("prompt_tokens_details", {}).get("cached_tokens")
                                        for b in bodies[::n]),
                              known_sum(b["usage"].get("completion_tokens_details", {}).get("reasoning_tokens")
                                        for b in bodies))
    return body


def openai_param(param: str | None) -> str | None:
    """The request's name for a job field (the job's deadline fields come from ``deadline``)."""
    if param in ("deadline_at", "deadline_window_s"):
        return "deadline"
    return param


def _deadline(value: float | str) -> tuple[float | None, datetime | None]:
    if isinstance(value, int | float):
        if not math.isfinite(value) or value <= 0:
            raise OpenAIError(400, "deadline must be positive seconds", param="deadline")
        if value > MAX_WINDOW_S:
            raise OpenAIError(400, f"deadline {value:g}s is longer than {MAX_WINDOW_S / 86400:.0f} days; "
                              "give a shorter one", param="deadline")
        return float(value), None
    try:
        return parse_window(value), None
    except ValueError:
        pass
    try:
        at = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError as exc:
        raise OpenAIError(400, f"invalid deadline {value!r}: seconds, a window ('2h') or an ISO time",
                          param="deadline") from exc
    if at.tzinfo is None:
        raise OpenAIError(400, "deadline needs a timezone", param="deadline")
    return None, at


# an interactive job's targets, a deadline job's time, and the job's own deadline and kind (JobCreate's names, as
# POST /v1/jobs takes them; a request would ignore them): a request whose window is its deadline takes none, its job
# a batch job due when the window ends (a batch's requests: an OpenAI batch's completion_window, a message batch's 24
# hours; a background response's background_options.completion_window)
BATCH_QOS = ("ttft_ms", "tbt_ms", "tbt_anchor", "deadline", "deadline_at", "deadline_window_s", "kind")


def refuse_qos(body: dict[str, Any], requests: str, due: str) -> None:
    """A 400 naming the first QoS field ``body`` (a batch's request, a windowed background response) gives, saying
    what ``requests`` take: they run as batch jobs due when ``due``. Checked before a job is built: the window would
    make it a deadline job, and a target beside that deadline would read 'give either deadline or ttft_ms/...', as
    if a deadline were taken."""
    if given := [name for name in BATCH_QOS if body.get(name) is not None]:
        raise OpenAIError(400, f"{given[0]}: {requests} run as batch jobs due when {due}, and take no "
                               f"{', '.join(BATCH_QOS[:-1])} or {BATCH_QOS[-1]}; leave it out", param=given[0])


# the content parts read as text, as vLLM's chat reads them (the Responses API's names too): type -> its text's key
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
              "thinking": "thinking"}  # vLLM's own part (its text under "thinking"), read as text too
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]  # vLLM's values


class ChatCompletionRequest(_Base):
    messages: list[dict[str, Any]] = Field(min_length=1)
    top_logprobs: Alternatives = None
    # tool calling: JobCreate checks the tools and a forced choice ("auto" is answered here)
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's chat extensions: how the messages go through the chat template (JobCreate checks them)
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool | None = None  # vLLM's: the answer starts with the last message where it is the assistant's
    # how hard a reasoning model thinks: as vLLM, the chat template's reasoning_effort and enable_thinking
    reasoning_effort: ReasoningEffort | None = None
    include_reasoning: bool | None = None  # vLLM's: false leaves the thinking out of the answer
    # OpenAI's stored chat completions: the answer is kept, to list and retrieve (app.services.stored_completions)
    store: bool | None = None
    metadata: Metadata | None = None
    # not implemented: the deprecated functions API (tools replaced it), OpenAI's audio and web search, vLLM's
    # documents (the chat template's RAG input) and prompt_text (the rendered prompt in the answer)
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    modalities: Any = None
    audio: Any = None
    web_search_options: Any = None
    documents: Any = None
    return_prompt_text: Any = None
    verbosity: Any = None  # OpenAI's: how long the answer is (medium, the default, is taken)
    # OpenAI's moderation of the input and the answer: answered without it, a blocked text would pass for screened
    moderation: Any = None
    # OpenAI's predicted output, taken and not applied: a latency hint, the text is the model's all the same
    prediction: dict[str, Any] | None = None

    unsupported: ClassVar[dict[str, tuple[Any, ...]]] = {
        **_Base.unsupported, "functions": (None, []), "function_call": (None, "none"),
        "modalities": (None, ["text"]), "audio": (None,),
        "web_search_options": (None,), "documents": (None, []), "return_prompt_text": (None, False),
        "verbosity": (None, "medium"), "moderation": (None,)}

    def check(self) -> None:
        super().check()
        self.check_tools()

    def check_tools(self) -> None:
        """An empty tools list refused, as vLLM's chat request (``check_tool_usage``) and OpenAI refuse it."""
        if self.tools == []:
            raise OpenAIError(400, "tools is an empty list: give at least one tool, or leave it out (as vLLM's and "
                                   "OpenAI's chat completions, which refuse tools: [])", param="tools")

    def tool_fields(self) -> dict[str, Any]:
        choice = self.tool_choice
        if "tool_choice" not in self.model_fields_set and self.tools:
            # OpenAI's default where tools are given; an explicit null (the openai SDK sends tool_choice=None as one)
            # stays none, as vLLM's chat request keeps it: the tools reach the template and the answer is text
            choice = "auto"
        # an empty list is kept: a template reads [] apart from none (vLLM's Messages API gives it [])
        return {"tools": self.tools, "tool_choice": choice,
                "parallel_tool_calls": True if self.parallel_tool_calls is None else self.parallel_tool_calls}

    def reasoning_fields(self) -> dict[str, Any]:
        return {"include_reasoning": False} if self.include_reasoning is False else {}

    def template_fields(self) -> dict[str, Any]:
        fields = {k: v for k in TEMPLATE_DEFAULTS if (v := getattr(self, k)) is not None}
        if self.reasoning_effort is not None:  # the request's own chat_template_kwargs win, as they are explicit
            fields["chat_template_kwargs"] = {"reasoning_effort": self.reasoning_effort,
                                              "enable_thinking": self.reasoning_effort != "none",
                                              **fields.get("chat_template_kwargs", {})}
        return fields

    def echo_fields(self) -> dict[str, Any]:
        last = self.messages[-1] if self.messages else {}
        return {"echo": True} if self.echo and isinstance(last, dict) and last.get("role") == "assistant" else {}

    def echo_prompt_logprobs(self) -> int | None:
        """The prompt's logprobs vLLM's ``echo`` asks for where ``prompt_logprobs`` does not: ``top_logprobs``
        alternatives (0 unset), answered at the top level; None without echo, and for a stream, whose chunks carry
        none (computing them would only keep the prompt from the prefix cache)."""
        if not self.echo or self.prompt_logprobs is not None or self.stream:
            return None
        return self.top_logprobs or 0

    def with_echo_prompt_logprobs(self, spec: JobCreate, engine_backend: str | None) -> JobCreate:
        """``spec`` asking for the prompt's logprobs ``echo`` asks for (``echo_prompt_logprobs``) where the engine is
        vLLM's (``Settings.engine_backend``): the own engine reports none."""
        if (asked := self.echo_prompt_logprobs()) is None or engine_backend != "vllm":
            return spec
        return spec.model_copy(update={"prompt_logprobs": asked})

    def logprob_count(self) -> int | None:
        """Alternatives per token to report (``top_logprobs``) where ``logprobs`` is true, else None."""
        if self.logprobs is not None and not isinstance(self.logprobs, bool):
            raise OpenAIError(400, "logprobs is true or false here; top_logprobs says how many alternatives",
                              param="logprobs")
        if not self.logprobs:
            if self.top_logprobs:
                raise OpenAIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
            return None
        return self.top_logprobs or 0

    def chat_messages(self, at: str = "messages") -> list[ChatMessage]:
        """The messages as chat jobs take them; a refusal names the field within them, ``at`` where they are in the
        request (batched chat's ``messages.<i>``)."""
        out = []
        for i, m in enumerate(self.messages):
            role = m.get("role")
            content, texts = m.get("content"), None
            if isinstance(content, list):  # content parts: only text is supported
                texts = []
                for j, part in enumerate(content):
                    key = TEXT_PARTS.get(part.get("type")) if isinstance(part, dict) else None
                    if key is None:
                        raise OpenAIError(400, "only text content parts are supported (type "
                                               f"{', '.join(map(repr, TEXT_PARTS))})", param=f"{at}.{i}.content")
                    text = part.get(key)
                    if text is None:  # vLLM leaves out a part without its text
                        continue
                    if not isinstance(text, str):
                        raise OpenAIError(400, f"{at}.{i}.content.{j}.{key} must be a string",
                                          param=f"{at}.{i}.content.{j}.{key}")
                    texts.append(text)
                content = "\n".join(texts)  # as vLLM joins a string-format template's text parts
            if content is None:
                content, texts = "", []  # no parts, for a template that loops over them (vLLM's)
            try:
                out.append(ChatMessage(role=role, content=content, parts=texts, tool_calls=m.get("tool_calls"),
                                       tool_call_id=m.get("tool_call_id"), name=m.get("name"),
                                       tools=developer_tools(m.get("tools"), f"{at}.{i}.tools")
                                       if role == "developer" else None,  # as vLLM's parser
                                       # as vLLM's chat parser: an assistant's alone, others' dropped
                                       reasoning=m.get("reasoning") if role == "assistant" else None))
            except ValidationError as exc:
                # name the field that failed (the role, the content or both), not always the role
                raise invalid_request([{**e, "loc": (at, i, *e["loc"])} for e in exc.errors()]) from exc
        return out


class BatchChatCompletionRequest(ChatCompletionRequest):
    """vLLM's batched chat (``POST /v1/chat/completions/batch``): chat's fields, ``messages`` a list of
    conversations, each run on its own as a chat request of the other fields and answered as one choice. It takes no
    stream, tools, beam search, ``n`` above 1 or ``store``."""

    messages: list[Annotated[list[dict[str, Any]], Field(min_length=1)]] = Field(  # type: ignore[assignment]
        min_length=1, max_length=MAX_PROMPTS)

    # vLLM refuses n above 1 and a tool_choice but "none"; it takes stream and tools and answers without them (whole,
    # no tool offered to the template): a 400 here, not an answer that passes for having applied them
    unsupported: ClassVar[dict[str, tuple[Any, ...]]] = {
        **ChatCompletionRequest.unsupported, "stream": (None, False), "tools": (None, []),
        "tool_choice": (None, "none"), "n": (None, 1), "store": (None, False)}
    refused_by: ClassVar[str] = "batched chat"
    hints: ClassVar[dict[str, str]] = {
        "stream": " (its answer comes whole, as vLLM's; or stream each conversation on /v1/chat/completions)",
        "tools": " (vLLM's offers the model none; or send each conversation to /v1/chat/completions)",
        "tool_choice": " (as vLLM's, it takes 'none' alone)",
        "n": " (as vLLM's, each conversation gets one choice; or send each conversation to /v1/chat/completions "
             "with n)",
        "store": " (a stored completion is one conversation's; send each to /v1/chat/completions)"}

    def check_tools(self) -> None:
        """tools: none or [] (``check_unsupported``), as vLLM's batched chat takes them: it reads no tools."""

    def conversation_specs(self, tiers: tuple[str, ...]) -> list[JobCreate]:
        """Each conversation's job, as chat makes it; a refusal names its conversation (``messages.<i>``): within
        its messages where raised, of them all by ``in_conversation``. No tools reach the template (vLLM's batched
        chat gives it none, tools: [] too)."""
        fields = {**dict(self), "tools": None}  # validated: each conversation's request is these with its messages
        specs = []
        for i, messages in enumerate(self.messages):
            chat = ChatCompletionRequest.model_construct(self.model_fields_set, **{**fields, "messages": messages})
            try:
                specs.append(chat.job_spec(messages=chat.chat_messages(at=f"messages.{i}"), tiers=tiers))
            except OpenAIError as exc:
                raise in_conversation(exc, i) from exc
        return specs


FUNCTION_FIELDS = ("name", "description", "parameters", "strict")  # OpenAI's FunctionDefinition's, in its order


def developer_tools(tools: Any, at: str) -> list[dict[str, Any]] | None:
    """A developer message's own tools as vLLM's chat parser gives them to the template: each validated as OpenAI's
    ``ChatCompletionFunctionToolParam`` (its keys in that type's order, others left out); ``at``: where they are.
    Malformed ones are refused (vLLM hands them to the template as given, where a template reading them fails)."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise OpenAIError(400, f"{at} must be a list of function tools", param=at)
    out = []
    for j, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        named = isinstance(function, dict) and isinstance(function.get("name"), str)
        if not named or tool.get("type") != "function":
            raise OpenAIError(400, f'{at}.{j} must be {{"type": "function", "function": {{"name": ...}}}}',
                              param=f"{at}.{j}")
        out.append({"function": {k: function[k] for k in FUNCTION_FIELDS if k in function}, "type": "function"})
    return out


def in_conversation(exc: OpenAIError, i: int) -> OpenAIError:
    """A conversation's refusal of its messages as a whole (its chat template's, its length's) in batched chat's
    terms: of ``messages.<i>``. One within them names its place already (``chat_messages``' ``at``); other fields
    are the request's own."""
    if exc.param != "messages":
        return exc
    where = f"messages.{i}"
    return OpenAIError(exc.status_code, f"{where}: {exc.message}", type=exc.type, param=where, code=exc.code,
                       headers=exc.headers)


def chat_job(body: dict[str, Any], tiers: tuple[str, ...], in_terms: Callable[[OpenAIError], OpenAIError],
             batch_window_s: float | None = None) -> tuple[ChatCompletionRequest, JobCreate]:
    """``body`` (another API's request written as chat: Responses, Messages) as a chat request and its job, with
    chat's checks; ``in_terms`` writes an error in the other API's field names. An empty ``tools`` is set after
    them, which refuse it on chat's own route: vLLM's Messages route sets its tools, [] too, on the chat request it
    built (``_convert_tools``), and the template is given []."""
    try:
        no_tools = body.get("tools") == []
        chat = ChatCompletionRequest.model_validate({k: v for k, v in body.items() if k != "tools"} if no_tools
                                                    else body)
        chat.check()
        if no_tools:
            chat.tools = []
        return chat, chat.job_spec(messages=chat.chat_messages(), tiers=tiers, batch_window_s=batch_window_s)
    except ValidationError as exc:
        raise in_terms(invalid_request(list(exc.errors()))) from exc
    except OpenAIError as exc:
        raise in_terms(exc) from exc


class CompletionRequest(_Base):
    # text, or token ids (OpenAI's array of tokens: what evaluation harnesses send); one prompt per request
    prompt: Text | list[Text] | list[int] | list[list[int]]
    # echo: the answer repeats the prompt (with logprobs, the prompt's too); not implemented: best-of-n, insertion
    echo: bool | None = None
    max_tokens: int | None = Field(None, ge=0)  # 0: with echo, the prompt alone (vLLM's)
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None
    prompt_embeds: Any = None  # vLLM's prompt given as embeddings

    unsupported: ClassVar[dict[str, tuple[Any, ...]]] = {
        **_Base.unsupported, "best_of": (None, 1), "suffix": (None, ""), "prompt_embeds": (None, [])}


    def logprob_count(self) -> int | None:
        """``logprobs``: the alternatives per token to report (None: no logprobs)."""
        if self.logprobs is None or self.logprobs is False:
            return None
        if self.logprobs is True:
            raise OpenAIError(400, f"logprobs is the number of alternatives per token, 0-{MAX_TOP_LOGPROBS}",
                              param="logprobs")
        if not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise OpenAIError(400, f"logprobs: {alternatives_range(self.logprobs)}", param="logprobs")
        return self.logprobs

    def check(self) -> None:
        super().check()
        if self.max_tokens == 0 and not self.echo:
            raise OpenAIError(400, "max_tokens 0 generates nothing: it is for echo: true (the answer is the prompt "
                                   "alone, with its logprobs where logprobs is set, as vLLM answers it); give "
                                   "max_tokens of at least 1", param="max_tokens")
        if self.max_tokens == 0 and self.min_tokens:  # the job's max_tokens 1 would name a number the client never sent
            raise OpenAIError(400, f"min_tokens ({self.min_tokens}) is more than max_tokens (0: with echo, the prompt "
                                   "alone, nothing generated); leave min_tokens unset", param="min_tokens")

    def echo_fields(self) -> dict[str, Any]:
        """The prompt's side of the answer: its echo, whose logprobs echo with logprobs asks for where
        ``prompt_logprobs`` does not (as vLLM takes them)."""
        if not self.echo:
            return {}
        # vLLM's echo with max_tokens 0: one token is generated (the prompt's logprobs come with it), none answered
        alone = {"echo_only": True, "max_tokens": 1} if self.max_tokens == 0 else {}
        asked = self.logprob_count() if self.prompt_logprobs is None else self.prompt_logprobs
        return {"echo": True, "prompt_logprobs": asked, **alone}

    def prompt_inputs(self) -> list[dict[str, Any]]:
        """``job_spec``'s prompt argument for each prompt: ``{"prompt": text}`` or ``{"prompt_token_ids": ids}``."""
        prompt = self.prompt
        several = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
        prompts = prompt if several else [prompt]
        if len(prompts) * (self.n or 1) > MAX_PROMPTS:
            raise OpenAIError(400, f"at most {MAX_PROMPTS} completions per request (prompts x n)", param="prompt")
        out = []
        for one in prompts:
            if isinstance(one, list):
                if not one:
                    raise OpenAIError(400, "prompt must not be empty", param="prompt")
                out.append({"prompt_token_ids": one})
            else:
                out.append({"prompt": one})
        return out


# ---------------------------------------------------------------- responses
def service_tier(tier: str, tiers: tuple[str, ...]) -> str:
    """OpenAI's name for the tier a job ran at: the lowest tier is ``flex``, the highest ``priority``."""
    if len(tiers) > 1 and tier == tiers[0]:
        return "flex"
    return "priority" if len(tiers) > 1 and tier == tiers[-1] else "default"


def list_page(rows: list[Any], after: str | None, limit: int, written: Callable[[Any], dict[str, Any]]) -> dict:
    """OpenAI's ``list`` object: up to ``limit`` of ``rows`` (in order, each with an ``id``) after the one whose id
    is ``after`` (none after an id it does not hold), each as ``written`` writes it."""
    if after:
        ids = [r.id for r in rows]
        rows = rows[ids.index(after) + 1:] if after in ids else []
    page = rows[:limit]
    return {"object": "list", "data": [written(r) for r in page], "has_more": len(rows) > limit,
            "first_id": page[0].id if page else None, "last_id": page[-1].id if page else None}


def now_s() -> int:
    return int(time.time())


def usage(prompt_tokens: int | None, completion_tokens: int | None,
          cached_tokens: int | None = None, reasoning_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage; ``cached_tokens`` (the prompt tokens the engine's prefix cache held) and
    ``reasoning_tokens`` (the completion tokens a reasoning model thought in) where known."""
    p, c = int(prompt_tokens or 0), int(completion_tokens or 0)
    out: dict[str, Any] = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": int(cached_tokens)}
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": int(reasoning_tokens)}
    return out


def known_sum(counts: Iterable[int | None]) -> int | None:
    """The sum of the counts that are known (None: none is)."""
    known = [c for c in counts if c is not None]
    return sum(known) if known else None


def _logprob_item(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8", "replace"))}


def chat_logprobs(entries: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """A chat choice's ``logprobs`` from a job's stored ones (``TokenLogprob.as_dict()``; None: not asked for)."""
    if entries is None:
        return None
    return {"content": [{**_logprob_item(e["token"], e["logprob"]),
                         "top_logprobs": [_logprob_item(t, lp) for t, lp in e["top"]]} for e in entries],
            "refusal": None}


def completion_logprobs(entries: list[dict[str, Any]] | None, offset: int = 0) -> dict[str, Any] | None:
    """A completion choice's ``logprobs``; ``offset``: characters of the text before the first entry's token."""
    if entries is None:
        return None
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [None if e["logprob"] is None else _with_chosen(e) for e in entries],
            "text_offset": offsets}


def vllm_prompt_logprobs(entries: list[dict[str, Any]] | None) -> list[dict[str, dict[str, Any]] | None] | None:
    """A job's stored prompt logprobs in vLLM's form (its completion choice's ``prompt_logprobs``): per prompt token,
    None for the first (nothing precedes it), else the token's id -> its logprob, rank and text, then each
    alternative's likewise (rank: its place). None where the engine did not say the token ids."""
    if not entries or any(e.get("id") is None for e in entries):
        return None
    out: list[dict[str, dict[str, Any]] | None] = []
    for e in entries:
        if e["logprob"] is None:
            out.append(None)
            continue
        step = {str(e["id"]): {"logprob": e["logprob"], "rank": e.get("rank"), "decoded_token": e["token"]}}
        for rank, (token_id, (text, logprob)) in enumerate(zip(e.get("top_ids") or (), e["top"], strict=False), 1):
            step.setdefault(str(token_id), {"logprob": logprob, "rank": rank, "decoded_token": text})
        out.append(step)
    return out


def prompt_logprobs_field(sampling: dict[str, Any] | None, entries: list[dict[str, Any]] | None) -> dict[str, Any]:
    """vLLM's ``prompt_logprobs`` field (a completion's choice's, a chat answer's top level): of its stored
    ``entries`` where the job asked for the prompt's logprobs (``sampling``: the job's), else null, as vLLM's
    answers always carry it (its response classes serialize every field)."""
    if (sampling or {}).get("prompt_logprobs") is None:
        return {"prompt_logprobs": None}
    return {"prompt_logprobs": vllm_prompt_logprobs(entries)}


def _with_chosen(entry: dict[str, Any]) -> dict[str, float]:
    """A legacy completion's ``top_logprobs`` entry: the ``logprobs`` likeliest tokens and the chosen one, whatever
    its rank (OpenAI's legacy API, vLLM: up to ``logprobs`` + 1 tokens)."""
    top = {t: lp for t, lp in entry["top"]}
    return top if entry["token"] in top else {entry["token"]: entry["logprob"], **top}


def chat_completion(cid: str, model: str, created: int, content: str | None, finish_reason: str | None,
                    prompt_tokens: int | None, completion_tokens: int | None,
                    extra: dict[str, Any] | None = None,
                    logprobs: list[dict[str, Any]] | None = None,
                    tool_calls: list[dict[str, Any]] | None = None,
                    cached_tokens: int | None = None, reasoning: str | None = None,
                    reasoning_tokens: int | None = None, stop_reason: str | int | None = None) -> dict[str, Any]:
    """``tool_calls``: the calls the text was read as (``content``: the text before them, or None);
    ``reasoning``: a reasoning model's thinking, as vLLM's message carries it; ``stop_reason``: vLLM's, the stop
    string or token id that ended it."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning"] = reasoning
    if tool_calls is not None:
        message["tool_calls"] = tool_calls
    body = {"id": cid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": chat_logprobs(logprobs),
                         "finish_reason": finish_reason, "stop_reason": stop_reason}],
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens, reasoning_tokens)}
    if extra:
        body.update(extra)
    return body


def with_token_ids(body: dict[str, Any], chat: bool, prompt_ids: list[int], output_ids: list[int] | None
                   ) -> dict[str, Any]:
    """A one-choice answer ``body`` with vLLM's ``return_token_ids``: the choice's generated ids, and the prompt's
    (chat: at the top, a completion: in its choice)."""
    choice = body["choices"][0]
    choice["token_ids"] = output_ids or []
    (body if chat else choice)["prompt_token_ids"] = prompt_ids
    return body


def echoes_alone(sampling: dict[str, Any] | None) -> bool:
    """Whether a completion's answer is its prompt alone (echo with max_tokens 0, as vLLM answers it)."""
    return bool((sampling or {}).get("echo_only"))


def chat_echo(messages: list[dict[str, Any]] | None, sampling: dict[str, Any] | None) -> str:
    """What a chat answer starts with: the last message, where the job echoes it (vLLM's chat ``echo``)."""
    return messages[-1]["content"] if messages and (sampling or {}).get("echo") else ""


def chat_answer(cid: str, model: str, created: int, job_id: str, sampling: dict[str, Any] | None, text: str,
                engine_reason: str | None, prompt_tokens: int | None, completion_tokens: int | None,
                extra: dict[str, Any] | None = None, logprobs: list[dict[str, Any]] | None = None,
                echo: str = "", cached_tokens: int | None = None,
                reasoning_tokens: int | None = None, stop_reason: str | int | None = None,
                prompt_logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A chat job's answer as OpenAI's body: its text read as content and tool calls (``read_answer``), its
    content after ``echo`` (``chat_echo``); where the job asked for them, the prompt's logprobs at the top, as
    vLLM's chat answer carries them."""
    answer = read_answer(job_id, sampling, text, engine_reason)
    content = echo + answer.content if echo and answer.content is not None else answer.content
    body = chat_completion(cid, model, created, content, answer.finish_reason, prompt_tokens,
                           completion_tokens, extra, logprobs, tool_calls=answer.tool_calls,
                           cached_tokens=cached_tokens, reasoning=answer.reasoning, reasoning_tokens=reasoning_tokens,
                           stop_reason=stop_reason)
    return body | prompt_logprobs_field(sampling, prompt_logprobs)


def stored_chat_answer(job: Any, cid: str, created: int, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """A finished chat job's answer as OpenAI's body, from what the job stored (a batch's output line, a stored
    chat completion)."""
    return chat_answer(cid, job.model, created, job.id, job.sampling, job.output_text or "",
                       job.finish_reason or "stop", job.prompt_tokens, job.completion_tokens, extra,
                       logprobs=job.output_logprobs,
                       echo=chat_echo(job.messages, job.sampling), cached_tokens=job.cached_tokens,
                       reasoning_tokens=job.reasoning_tokens, stop_reason=job.stop_reason,
                       prompt_logprobs=job.prompt_logprobs)


def text_completion(cid: str, model: str, created: int, text: str, finish_reason: str | None,
                    prompt_tokens: int | None, completion_tokens: int | None,
                    extra: dict[str, Any] | None = None, logprobs: list[dict[str, Any]] | None = None,
                    echo: tuple[str, list[dict[str, Any]] | None] | None = None,
                    cached_tokens: int | None = None, stop_reason: str | int | None = None,
                    sampling: dict[str, Any] | None = None,
                    prompt_logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """``echo``: the prompt and its logprobs, which the text and the logprobs then start with; ``stop_reason``:
    vLLM's, the stop string or token id that ended it; ``sampling``: the job's (``echo_only``: the prompt alone;
    ``prompt_logprobs``: the job asked for the prompt's logprobs, which ``prompt_logprobs`` are)."""
    if echoes_alone(sampling):  # vLLM's echo with max_tokens 0: the token generated is not answered
        text, logprobs = "", None if logprobs is None else []
    if echo is not None:
        prompt, prompt_logprobs = echo
        text = prompt + text
        if logprobs is not None:
            logprobs = (prompt_logprobs or []) + logprobs
    body = {"id": cid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": completion_logprobs(logprobs),
                         "finish_reason": finish_reason, "stop_reason": stop_reason}],
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}
    body["choices"][0].update(prompt_logprobs_field(sampling, prompt_logprobs))  # as vLLM's choice carries them
    if extra:
        body.update(extra)
    return body


EndpointKind = Literal["/v1/chat/completions", "/v1/completions", "/v1/responses"]
