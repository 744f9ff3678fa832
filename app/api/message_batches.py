"""Anthropic's Message Batches API (``/v1/messages/batches``: create, retrieve, list, cancel, delete, results), run
by the OpenAI Batch API's machinery (``app.batch``): the requests become batch-tier jobs due when the batch's
24 hours end, and their Messages are what ``POST /v1/messages`` answers. Errors come in Anthropic's shape with its
``request-id`` header (``AnthropicRoute``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Annotated, Any, BinaryIO

from fastapi import APIRouter, BackgroundTasks, Header, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import select
from sqlalchemy.orm import Session

from app.anthropic_schemas import ENDPOINT, in_messages_terms
from app.api.anthropic_messages import AnthropicRoute
from app.api.deps import CurrentPrincipal, SessionDep, SettingsDep, rate_limiter
from app.api.errors import anthropic_responses
from app.api.openai_compat import charge_request, idempotency_conflicts, openai_refusals
from app.auth import Principal
from app.batch import message_batches as mb
from app.batch import storage
from app.batch.creation import create_once, keyed_batch
from app.batch.fanout import cancel_and_count, expires_at_for, start_batch
from app.batch.finalize import drop_working_dir, fan_in_page, maybe_finalize
from app.batch.lines import MAX_LINES, InvalidLine, ParsedFile, ValidLine, parse_line
from app.db import pagination
from app.db.models import Batch, new_id
from app.db.session import write_after_read
from app.openai_schemas import OpenAIError, charged, parse_window
from app.services.idempotency import Idempotency
from app.services.jobs import job_values, resolve_tier
from app.services.rate_limits import MESSAGE_BATCHES, anthropic_rate_headers
from app.services.workers import grammar_backends, held_context_length
from app.services.transitions import utcnow
from app.settings import Settings

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/messages/batches", tags=["anthropic"], route_class=AnthropicRoute,
                   responses=anthropic_responses(401))


class BatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # docs.anthropic.com/en/api/creating-message-batches: 1 to 64 letters, digits, '-' and '_'
    custom_id: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$", description="names the request's result")
    params: dict[str, Any] = Field(description="a Messages request, as POST /v1/messages takes it (no stream)")


class MessageBatchCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    requests: list[BatchRequest] = Field(min_length=1, max_length=MAX_LINES)


def _own(session, principal, batch_id: str) -> Batch:
    row = session.get(Batch, batch_id, populate_existing=True)
    if row is None or row.tenant_id != principal.tenant_id or row.endpoint != ENDPOINT or row.deleted_at is not None:
        raise OpenAIError(404, f"No such message batch: {batch_id}", param="message_batch_id")
    return row


def _charge_call(request: Request, principal: Principal) -> None:
    """A Message Batches call taken from its tenant's Message Batches bucket (``rate_limits.MESSAGE_BATCHES``):
    retrieve, list, results, cancel and delete before they read or change anything, the create once its row is in;
    over the limit a 429 in Anthropic's shape. Its every answer, a 404 or 409 after it too, carries its
    ``anthropic-ratelimit-*`` headers (``charged``)."""
    charged(request, anthropic_rate_headers(charge_request(rate_limiter(request), principal, MESSAGE_BATCHES)))


def _results_url(request: Request, batch_id: str) -> str:
    return str(request.url_for("message_batch_results", message_batch_id=batch_id))


def _object(request: Request, session, batch: Batch, counts: dict[str, int] | None = None) -> dict[str, Any]:
    """``counts``: the batch's ``request_counts`` where the caller has them (a page's, counted at once)."""
    counts = mb.request_counts(session, batch) if counts is None else counts
    return mb.message_batch(batch, counts, _results_url(request, batch.id))


def _checked(requests: list[BatchRequest], settings: Settings, principal: Principal) -> ParsedFile:
    """Every request as POST /v1/messages checks it (the fan-out's own checks: ``parse_line``, then ``job_values``
    short of counting the prompt's tokens: an unknown model, a thinking budget the model cannot keep): a bad one is
    a refused line, an ``errored`` result once the batch ends, as Anthropic validates each request's params apart
    from the batch (it refused the whole batch with a 400); a custom_id used twice is a 400. Returns the input file's
    lines as ``parse_file`` reads them (line i + 1 is request i), for the fan-out not to parse them again."""
    seen: dict[str, int] = {}
    out = ParsedFile()
    context, backends = held_context_length(settings), grammar_backends(settings)  # read once for every request
    for i, item in enumerate(requests):
        if item.custom_id in seen:
            raise OpenAIError(400, f"requests.{i}: custom_id {item.custom_id!r} is also requests."
                                   f"{seen[item.custom_id]}'s; each request needs a unique custom_id",
                              param=f"requests.{i}.custom_id")
        seen[item.custom_id] = i
        line = mb.input_line(item.custom_id, item.params).decode()
        parsed = parse_line(i + 1, line, ENDPOINT, parse_window(mb.WINDOW), settings.tiers,  # its line in the file
                            settings.model, grammar_backends=backends)
        if isinstance(parsed, InvalidLine):  # its message names the line and the body: a result names the request
            why = parsed.message.removeprefix(f"line {i + 1}: ").removeprefix("invalid body: ")
        else:
            why = _refusal(settings, principal, parsed, context)
        if why is None:
            out.valid.append(parsed)
        else:  # the fan-out's refused line ("line N: " as its others': the result loses it)
            out.invalid.append(InvalidLine(i + 1, item.custom_id, f"line {i + 1}: {why}", "invalid_body"))
    return out


def _refusal(settings: Settings, principal: Principal, line: ValidLine, context: int) -> str | None:
    """Why the fan-out would refuse the request's job, in the Messages request's terms; None where it would not.
    Its prompt's tokens are counted by the fan-out alone (tokenizing every request would hold the answer); a prompt
    of more characters than the context's tokens can hold is refused here."""
    try:
        with openai_refusals():
            for spec in line.specs:
                job_values(settings, principal, spec, endpoint=ENDPOINT, count_tokens=False, context=context)
    except OpenAIError as exc:
        return in_messages_terms(exc).message
    return None


@router.post("", responses=anthropic_responses(400, 409, 413, 429))
def create_message_batch(body: MessageBatchCreate, request: Request, session: SessionDep,
                         principal: CurrentPrincipal, settings: SettingsDep, background: BackgroundTasks,
                         idempotency_key: Annotated[str | None, Header(max_length=200)] = None) -> dict[str, Any]:
    """Anthropic's batch of Messages requests: each checked now, then run as batch jobs within 24 hours. The create
    is one request of the tenant's Message Batches bucket and no tokens, as Anthropic counts every Message Batches
    call apart from messages, taken once its checks let it through and its row is in: a refused create is not
    charged and leaves no file. A create retried with the same Idempotency-Key (and body) answers the batch the
    first one made, uncharged, as ``POST /v1/batches`` does; one with a different body is a 409, and so is one whose
    batch was deleted since."""
    idempotency = Idempotency.of(idempotency_key, body)
    with idempotency_conflicts():
        earlier = keyed_batch(session, principal.tenant_id, idempotency)
    if earlier is not None:
        return _object(request, session, _kept(earlier, idempotency))
    parsed = _checked(body.requests, settings, principal)
    batch_id, now = new_id(mb.ID_PREFIX), utcnow()
    src = storage.new_file(settings.data_dir, principal.tenant_id, f"{batch_id}_input.jsonl",
                           storage.MESSAGE_BATCH_INPUT,
                           mb.input_lines((r.custom_id, r.params) for r in body.requests))
    batch = Batch(id=batch_id, tenant_id=principal.tenant_id, api_key_id=principal.key_id, endpoint=ENDPOINT,
                  input_file_id=src.id, completion_window=mb.WINDOW, status="validating",
                  tier=resolve_tier(settings, principal, None), total=len(body.requests), created_at=now,
                  expires_at=expires_at_for(now, mb.WINDOW))
    try:
        with idempotency_conflicts():
            made, created = create_once(session, batch, idempotency,
                                        lambda: _charge_call(request, principal), files=[src])
    except BaseException:  # refused (429), another body under the key (409): no row names the file
        Path(src.path).unlink(missing_ok=True)
        raise
    if not created:  # a concurrent create under the key won: this one's file is no batch's
        Path(src.path).unlink(missing_ok=True)
        return _object(request, session, _kept(made, idempotency))
    background.add_task(start_batch, settings, batch.id, parsed)  # its lines as checked: not parsed again
    return _object(request, session, batch)


def _kept(earlier: Batch, idempotency: Idempotency) -> Batch:
    """The batch a create retried under its key answers; a 409 where it was deleted since: the retry neither runs
    the requests again (a second batch) nor answers a batch that every other route says does not exist."""
    if earlier.deleted_at is not None:
        raise OpenAIError(409, f"Idempotency-Key {idempotency.key!r} made message batch {earlier.id}, which was "
                               "deleted since; use a new key for a new batch", param="Idempotency-Key")
    return earlier


@router.get("", responses=anthropic_responses(400, 429))
def list_message_batches(request: Request, session: SessionDep, principal: CurrentPrincipal,
                         settings: SettingsDep, limit: Annotated[int, Query(ge=1, le=1000)] = 20,
                         before_id: str | None = None, after_id: str | None = None) -> dict[str, Any]:
    """The tenant's message batches, newest first; ``after_id`` pages on to older ones, ``before_id`` back."""
    _charge_call(request, principal)
    if before_id and after_id:
        raise OpenAIError(400, "give before_id or after_id, not both", param="before_id")
    query = select(Batch).where(Batch.tenant_id == principal.tenant_id, Batch.endpoint == ENDPOINT,
                                Batch.deleted_at.is_(None))
    try:
        if before_id:  # the rows newer than the cursor, nearest first, then shown newest first
            rows = pagination.rows_after(session, query, Batch, principal.tenant_id, before_id, limit,
                                         newest_first=False)
            page = rows[:limit][::-1]
        else:
            rows = pagination.rows_after(session, query, Batch, principal.tenant_id, after_id, limit)
            page = rows[:limit]
    except pagination.UnknownCursor as exc:
        param = "before_id" if before_id else "after_id"
        raise OpenAIError(400, exc.says(param, "message batches"), param=param) from None
    fan_in_page(session, page, settings.data_dir, settings.redis_url)
    counts = mb.page_request_counts(session, page)
    return {"data": [_object(request, session, b, counts[b.id]) for b in page], "has_more": len(rows) > limit,
            "first_id": page[0].id if page else None, "last_id": page[-1].id if page else None}


@router.get("/{message_batch_id}", responses=anthropic_responses(404, 429))
async def get_message_batch(message_batch_id: str, request: Request, session: SessionDep,
                            principal: CurrentPrincipal, settings: SettingsDep) -> dict[str, Any]:
    def read() -> dict[str, Any]:
        _charge_call(request, principal)
        batch = _own(session, principal, message_batch_id)
        if batch.status in ("in_progress", "cancelling"):
            maybe_finalize(session, batch.id, settings.data_dir, settings.redis_url)
            session.refresh(batch)
        return _object(request, session, batch)

    return await run_in_threadpool(read)


@router.post("/{message_batch_id}/cancel", responses=anthropic_responses(404, 409, 429))
def cancel_message_batch(message_batch_id: str, request: Request, session: SessionDep,
                         principal: CurrentPrincipal, settings: SettingsDep,
                         background: BackgroundTasks) -> dict[str, Any]:
    """Requests not yet done are canceled; the batch is ``canceling`` until its running ones stop, then ended."""
    _charge_call(request, principal)
    batch = _own(session, principal, message_batch_id)
    if batch.status not in ("validating", "in_progress", "cancelling") or not cancel_and_count(
            session, settings, batch, background.add_task):
        raise OpenAIError(409, f"the message batch has ended ({batch.status}); there is nothing to cancel",
                          param="message_batch_id")
    return _object(request, session, batch)


@router.delete("/{message_batch_id}", responses=anthropic_responses(404, 409, 429))
def delete_message_batch(message_batch_id: str, request: Request, session: SessionDep,
                         principal: CurrentPrincipal, settings: SettingsDep) -> dict[str, Any]:
    """An ended batch, its results and its files. Its row stays, with ``deleted_at`` and the status it ended with,
    so its jobs stay its own: usage counts them as batch jobs (a row deleted would leave them no batch:
    ``jobs.batch_id`` is set null), and operators still see how it ended."""
    _charge_call(request, principal)
    batch = _own(session, principal, message_batch_id)
    if mb.processing_status(batch) != "ended":
        raise OpenAIError(409, f"the message batch is {mb.processing_status(batch)}; cancel it and delete it once "
                               "it has ended", param="message_batch_id")
    for file_id in (batch.input_file_id, batch.output_file_id, batch.error_file_id):
        if file_id and (row := storage.get_file(session, principal.tenant_id, file_id)) is not None:
            storage.delete_file(session, row)
    with write_after_read(session):
        batch.deleted_at = utcnow()
        session.commit()
    drop_working_dir(settings.data_dir, message_batch_id)
    return {"id": message_batch_id, "type": "message_batch_deleted"}


@router.get("/{message_batch_id}/results", name="message_batch_results", responses={
    200: {"content": {"application/x-jsonl": {}}, "description": "a result per request, one JSON object a line"},
    **anthropic_responses(404, 409, 429)})
def message_batch_results(message_batch_id: str, request: Request, session: SessionDep,
                          principal: CurrentPrincipal) -> Response:
    """Each request's result (``succeeded`` with its Message, ``errored``, ``canceled``, ``expired``) once the batch
    has ended, in the order of its requests. The download is one request, charged before its first byte: a large
    batch's results are never cut off by the limit midway."""
    _charge_call(request, principal)
    batch = _own(session, principal, message_batch_id)
    if mb.processing_status(batch) != "ended":
        raise OpenAIError(409, f"the message batch is {mb.processing_status(batch)}; its results come once its "
                               "processing_status is 'ended'", param="message_batch_id")

    with ExitStack() as opened:  # each file open before the answer starts: a deleted one is still a 404
        files = [opened.enter_context(handle) if (handle := _results_file(session, principal, file_id)) else None
                 for file_id in (batch.input_file_id, batch.output_file_id, batch.error_file_id)]
        lines = mb.results(*files, batch.errors, cancelled=batch.status == "cancelled")
        return StreamingResponse(_jsonl_pieces(lines, opened.pop_all()), media_type="application/x-jsonl")


def _results_file(session: Session, principal: Principal, file_id: str | None) -> BinaryIO | None:
    """A message batch's file, open to be read a line at a time (None: the batch has none); a 404 where it was
    deleted."""
    if file_id is None:
        return None
    row = storage.get_file(session, principal.tenant_id, file_id)
    try:
        if row is not None:
            return storage.open_content(row)
    except FileNotFoundError:  # its row not flagged yet: a DELETE under way
        pass
    raise OpenAIError(404, f"the message batch's file {file_id} was deleted; its results are gone",
                      param="message_batch_id")


def _jsonl_pieces(lines: Iterator[dict[str, Any]], files: ExitStack) -> Iterator[bytes]:
    """``lines`` as JSONL, about ``storage.CONTENT_PIECE_BYTES`` a piece, closing ``files`` once read (or once the
    client stops reading)."""
    with files:
        piece: list[bytes] = []
        held = 0
        for line in lines:
            piece.append(json.dumps(line).encode() + b"\n")
            held += len(piece[-1])
            if held >= storage.CONTENT_PIECE_BYTES:
                yield b"".join(piece)
                piece, held = [], 0
        if piece:
            yield b"".join(piece)
