"""Validation of a Batch API input file (OpenAI JSONL: ``custom_id``, ``method``, ``url``, ``body``).

A message batch (Anthropic's, ``app/api/message_batches.py``) is kept as such a file of ``/v1/messages`` lines.

Line-level problems (bad JSON, wrong url, invalid body) reject that line only: it goes to
the error file with its line number and reason. Duplicate ``custom_id`` values fail the
whole file (OpenAI semantics). A line of ``n`` choices, or of several prompts (completions),
is a job per choice, as an online request is.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from io import BytesIO
from typing import Any, BinaryIO

from pydantic import ValidationError

from app import output_constraints
from app.anthropic_schemas import ENDPOINT as MESSAGES, MessagesRequest
from app.db.models import Job
from app.openai_schemas import (ChatCompletionRequest, CompletionRequest, OpenAIError, choice_specs, refuse_qos,
                                 validation_message)
from app.responses_schemas import ResponsesRequest
from app.schemas import JobCreate
from app.settings import DEFAULT_TIERS
from app.wire import find_unstorable, may_hold_unstorable, shown, unstorable_message

log = logging.getLogger(__name__)

ENDPOINTS = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
             "/v1/responses": ResponsesRequest, MESSAGES: MessagesRequest}
MAX_LINES = 50_000
CUSTOM_ID_CHARS: int = Job.__table__.c.custom_id.type.length  # what its job's column holds


@dataclass
class ValidLine:
    line_no: int
    custom_id: str
    specs: list[JobCreate]  # a job per choice: n per prompt, a prompt's together (OpenAI's index: prompt x n + choice)
    n: int = 1  # choices per prompt
    response: dict[str, Any] | None = None  # a Responses line's own fields (jobs.response)


@dataclass
class InvalidLine:
    line_no: int
    custom_id: str | None
    message: str
    code: str = "invalid_request"


@dataclass
class ParsedFile:
    valid: list[ValidLine] = field(default_factory=list)
    invalid: list[InvalidLine] = field(default_factory=list)
    file_errors: list[dict[str, Any]] = field(default_factory=list)  # fail the whole batch

    @property
    def total(self) -> int:
        return len(self.valid) + len(self.invalid)


def parse_line(line_no: int, text: str, endpoint: str, window_s: float, tiers: tuple[str, ...] = DEFAULT_TIERS,
               model: str | None = None, engine_backend: str | None = None,
               grammar_backends: tuple[str, ...] = output_constraints.DEFAULT_BACKENDS) -> ValidLine | InvalidLine:
    """One line of a batch's file as its jobs, or why it is refused; ``engine_backend``: what the workers run
    (``Settings.engine_backend``: a chat line's echo asks for the prompt's logprobs on vLLM's, as online);
    ``grammar_backends``: those the live workers' engines compile structured outputs with
    (``workers.grammar_backends``), a line's constraint is checked with each, as a request's is online."""
    with output_constraints.under(grammar_backends):
        return _parsed_line(line_no, text, endpoint, window_s, tiers, model, engine_backend)


def _parsed_line(line_no: int, text: str, endpoint: str, window_s: float, tiers: tuple[str, ...],
                 model: str | None, engine_backend: str | None) -> ValidLine | InvalidLine:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        return InvalidLine(line_no, None, f"line {line_no}: not valid JSON ({exc.msg})", "invalid_json")
    if not isinstance(obj, dict):
        return InvalidLine(line_no, None, f"line {line_no}: must be a JSON object", "invalid_json")
    # a lone surrogate ("\ud800") decodes but can be neither tokenized nor stored, and PostgreSQL stores no NUL: this
    # line fails here, before its job joins the batch's one insert (where it would fail them all)
    if may_hold_unstorable(text) and (found := find_unstorable(obj)) is not None:  # most lines: one C-level scan
        where, char = found
        custom_id = obj.get("custom_id")
        clean_id = custom_id if isinstance(custom_id, str) and where[:1] != ("custom_id",) else None
        return InvalidLine(line_no, clean_id,
                           f"line {line_no}: {'.'.join(map(str, where))} {unstorable_message(char)}",
                           "invalid_body" if where[:1] == ("body",) else "invalid_request")
    custom_id = obj.get("custom_id")
    cid = custom_id if isinstance(custom_id, str) else None
    if not cid:
        return InvalidLine(line_no, None, f"line {line_no}: 'custom_id' is missing or not a non-empty string",
                           "missing_custom_id")
    if len(cid) > CUSTOM_ID_CHARS:  # would fail the batch's one insert of its jobs
        return InvalidLine(line_no, cid, f"line {line_no}: 'custom_id' has {len(cid)} characters; at most "
                           f"{CUSTOM_ID_CHARS}", "invalid_custom_id")
    if obj.get("method", "POST") != "POST":
        return InvalidLine(line_no, cid, f"line {line_no}: method must be POST, not {shown(obj.get('method'))}",
                           "invalid_method")
    if obj.get("url") != endpoint:
        return InvalidLine(line_no, cid, f"line {line_no}: url {shown(obj.get('url'))} does not match the batch "
                           f"endpoint {endpoint!r}", "invalid_url")
    body = obj.get("body")
    if not isinstance(body, dict):
        return InvalidLine(line_no, cid, f"line {line_no}: 'body' must be a JSON object", "invalid_body")
    if body.get("stream"):
        return InvalidLine(line_no, cid, f"line {line_no}: stream is not supported in batches", "invalid_body")
    response = None
    try:
        if endpoint == MESSAGES:
            return ValidLine(line_no, cid, message_specs(body, window_s, tiers, model))
        req = ENDPOINTS[endpoint].model_validate(body)
        if hasattr(req, "check_unsupported"):  # a Responses line has no vLLM fields to refuse
            req.check_unsupported(BATCH_LINE_HINTS)
        req.check()
        refuse_qos(body, "a batch's requests", "the batch's completion_window ends")  # before its job is built
        if endpoint == "/v1/responses":
            if req.previous_response_id is not None or req.conversation is not None:
                raise OpenAIError(400, "previous_response_id and conversation are not supported in batches; give "
                                       "the whole input")
            response = req.kept([])
            req, spec = req.chat_request(body, [], tiers, batch_window_s=window_s)
        n = getattr(req, "n", None) or 1  # a Responses line answers one output
        if endpoint == "/v1/chat/completions":
            spec = req.job_spec(messages=req.chat_messages(), batch_window_s=window_s, tiers=tiers)
            specs = choice_specs(req.with_echo_prompt_logprobs(spec, engine_backend), n)
        elif endpoint == "/v1/completions":
            specs = [choice for prompt in req.prompt_inputs()
                     for choice in choice_specs(req.job_spec(**prompt, batch_window_s=window_s, tiers=tiers), n)]
        else:
            specs = [spec]
    except ValidationError as exc:
        message, _ = validation_message(list(exc.errors()))
        return InvalidLine(line_no, cid, f"line {line_no}: invalid body: {message}", "invalid_body")
    except OpenAIError as exc:
        return InvalidLine(line_no, cid, f"line {line_no}: invalid body: {exc.message}", "invalid_body")
    return ValidLine(line_no, cid, specs, n, response)


# a batch line's hints for vLLM's ordering fields: online, the 400 points to the QoS fields above, which a batch's
# line refuses (refuse_qos); what orders a batch's requests is their tier and the batch's completion_window
_BATCH_ORDER = (" (a batch's requests run as batch jobs, ordered by their tier and due when the batch's "
                "completion_window ends)")
BATCH_LINE_HINTS = {"vllm_xargs": _BATCH_ORDER, "priority": _BATCH_ORDER}


def message_specs(body: dict[str, Any], window_s: float, tiers: tuple[str, ...] = DEFAULT_TIERS,
                  model: str | None = None) -> list[JobCreate]:
    """A Messages request (a message batch's ``params``) as its batch job, with ``POST /v1/messages``'s checks
    (``model``: the served one, whose chat template says where system messages within the conversation go);
    raises pydantic's ValidationError or an OpenAIError naming the Messages field."""
    message = MessagesRequest.model_validate(body)
    message.check(body)
    refuse_qos(body, "a message batch's requests", "the batch's 24 hours end")
    _, spec = message.chat_request(body, tiers, batch_window_s=window_s, model=model)
    return [spec]


def parse_file(content: bytes, endpoint: str, window_s: float, tiers: tuple[str, ...] = DEFAULT_TIERS,
               model: str | None = None, engine_backend: str | None = None,
               grammar_backends: tuple[str, ...] = output_constraints.DEFAULT_BACKENDS) -> ParsedFile:
    """Every line of ``content`` parsed, held together (the fan-out reads a file a line at a time: ``parse_lines``)."""
    out = ParsedFile()
    handle = BytesIO(content)
    if (refused := file_refusal(handle)) is not None:
        out.file_errors.append(refused)
        return out
    for parsed in parse_lines(handle, endpoint, window_s, tiers, model, engine_backend, grammar_backends):
        (out.valid if isinstance(parsed, ValidLine) else out.invalid).append(parsed)
    out.file_errors += duplicate_errors((line.custom_id, line.line_no)
                                        for line in sorted(out.valid + out.invalid, key=lambda line: line.line_no))
    return out


def file_refusal(handle: BinaryIO) -> dict[str, Any] | None:
    """The error that fails the whole file before any line of it is parsed (not UTF-8, no requests, too many), read
    a line at a time; None where its lines are to be parsed."""
    try:
        count = sum(1 for _ in numbered_lines(handle))
    except UnicodeDecodeError:
        return {"code": "invalid_file", "message": "the file is not UTF-8 text", "line": None}
    if not count:
        return {"code": "empty_file", "message": "the file has no requests", "line": None}
    if count > MAX_LINES:
        return {"code": "too_many_requests", "line": None,
                "message": f"{count} requests; a batch takes at most {MAX_LINES}"}
    return None


def numbered_lines(handle: BinaryIO) -> Iterator[tuple[int, str]]:
    """The file's lines that are not blank, each with its number (blank ones counted), read a line at a time from
    its start. JSONL lines end at "\\n" only (str.splitlines() would also cut at U+2028, U+0085 and the like, which
    JSON strings may hold raw); a byte-order mark (Notepad's, PowerShell's) is not part of line 1. Raises
    UnicodeDecodeError at a line that is not UTF-8."""
    handle.seek(0)
    for i, raw in enumerate(iter(handle.readline, b"")):
        text = raw.removesuffix(b"\n").decode("utf-8-sig" if i == 0 else "utf-8")
        if text.strip():
            yield i + 1, text


def parse_lines(handle: BinaryIO, endpoint: str, window_s: float, tiers: tuple[str, ...] = DEFAULT_TIERS,
                model: str | None = None, engine_backend: str | None = None,
                grammar_backends: tuple[str, ...] = output_constraints.DEFAULT_BACKENDS,
                ) -> Iterator[ValidLine | InvalidLine]:
    """Each line of a file ``file_refusal`` passed, parsed in turn (``parse_line``): none is held after it."""
    for line_no, text in numbered_lines(handle):
        yield parse_line(line_no, text, endpoint, window_s, tiers, model, engine_backend, grammar_backends)


def duplicate_errors(custom_ids: Iterable[tuple[str | None, int]]) -> list[dict[str, Any]]:
    """The errors that fail a file whose lines (their custom_id and number, in order) repeat a custom_id: OpenAI's
    batches need each unique."""
    seen: dict[str, list[int]] = defaultdict(list)
    for cid, line_no in custom_ids:
        if cid:
            seen[cid].append(line_no)
    return [{"code": "duplicate_custom_id", "line": at[1], "param": "custom_id",
             "message": f"custom_id {cid!r} appears on lines {', '.join(map(str, at))}; each request needs a "
                        "unique custom_id"} for cid, at in seen.items() if len(at) > 1]
