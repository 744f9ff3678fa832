"""OpenAI's Conversations API over SQL: a conversation's items are its own (added with it or later) and the turns
of the responses given it, in order. A response's turn (its input items, then its output) shows once the
response has completed; a failed, cancelled or unfinished one adds nothing yet. One response at a time runs on a
conversation: it takes its turn as it reads the items (``take_turn``)."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from app.db.models import Conversation, ConversationEntry, Job, JobStatus, utcnow
from app.openai_schemas import OpenAIError
from app.responses_schemas import (answer_status, input_items, input_messages, listed_messages, output_items,
                                   own_input_items, stored_answer, text_part)
from app.wire import as_utc

MAX_ITEMS = 20  # items one request may add (OpenAI's limit)
# a turn taken whose job is not written within this long was never submitted: it no longer locks its conversation
SUBMIT_S = 60


def conversation_body(conv: Conversation) -> dict[str, Any]:
    return {"id": conv.id, "object": "conversation", "created_at": int(as_utc(conv.created_at).timestamp()),
            "metadata": conv.meta or {}}


def find(session: Session, tenant_id: str, conv_id: str, param: str | None = None, lock: bool = False) -> Conversation:
    """The tenant's conversation ``conv_id`` (404, or 400 naming ``param`` where a request's field gave it); ``lock``:
    its row held until the transaction ends, so a write of its items or metadata and its deletion come one after
    the other on PostgreSQL (SQLite's writers hold the whole database)."""
    conv = session.get(Conversation, conv_id, with_for_update=lock)
    if conv is None or conv.tenant_id != tenant_id:
        raise OpenAIError(400 if param else 404, f"no conversation {conv_id!r}", param=param,
                          code="conversation_not_found")
    return conv


def new_items(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Items a client adds, checked as a response's input is and written as stored items with ids of their own."""
    try:
        messages = listed_messages(items)
    except OpenAIError as exc:  # it names the field as ``input...``: here it is ``items...`` (not input_text)
        param = "items" + (exc.param or "input").removeprefix("input")
        raise OpenAIError(400, exc.message.replace(exc.param or "input", param, 1), param=param,
                          code=exc.code) from exc
    return input_items("job_" + uuid.uuid4().hex[:24], messages)


def add_items(session: Session, conv: Conversation, items: list[dict[str, Any]]) -> None:
    session.add_all([ConversationEntry(conversation_id=conv.id, item=item) for item in items])


def take_turn(session: Session, conv: Conversation, job_id: str, store: bool = True) -> list[dict[str, Any]]:
    """The conversation as chat messages for response ``job_id``, whose turn it adds at once (shown once the response
    has completed): with ``conv``'s row locked (``find(lock=True)``) no other response reads the same turns. A 400
    ``conversation_locked`` while an earlier response on it has not ended, as OpenAI answers. A response not stored
    (``store`` false) reads the conversation and adds nothing to it: its items are kept nowhere, as OpenAI keeps
    them."""
    listed = entries(session, conv)
    jobs = turn_jobs(session, listed)
    if any(_unended(entry, jobs) for entry in listed):
        raise OpenAIError(400, f"another response is currently operating on conversation {conv.id!r}; try again once "
                               "it has ended", param="conversation", code="conversation_locked")
    messages = history(session, conv)
    if store:
        session.add(ConversationEntry(conversation_id=conv.id, job_id=job_id))
    return messages


def _unended(entry: ConversationEntry, jobs: dict[str, Job]) -> bool:
    """Whether the entry is the turn of a response still queued or running, or one whose job is being submitted."""
    if entry.job_id is None:
        return False
    job = jobs.get(entry.job_id)
    if job is None:  # taken, its job not yet written (or never: the API stopped in between)
        return as_utc(entry.created_at) > utcnow() - timedelta(seconds=SUBMIT_S)
    return not JobStatus(job.status).terminal


def give_back_turn(session: Session, conv_id: str, job_id: str) -> None:
    """Takes out the turn of response ``job_id`` where its job was not submitted (a submitted one's turn stays)."""
    if session.get(Job, job_id) is None:
        session.execute(delete(ConversationEntry).where(ConversationEntry.conversation_id == conv_id,
                                                        ConversationEntry.job_id == job_id))


def entries(session: Session, conv: Conversation) -> list[ConversationEntry]:
    return list(session.scalars(select(ConversationEntry).where(ConversationEntry.conversation_id == conv.id)
                                .order_by(ConversationEntry.id)))


def turn_jobs(session: Session, listed: list[ConversationEntry]) -> dict[str, Job]:
    """The jobs of the entries' turns, by id, read in one query (not one a turn)."""
    ids = [entry.job_id for entry in listed if entry.job_id is not None]
    return {job.id: job for job in session.scalars(select(Job).where(Job.id.in_(ids)))} if ids else {}


def turn_items(job: Job | None, logprobs: bool = False) -> list[dict[str, Any]]:
    """A response's input and output items, once it has completed (its output ``incomplete`` where
    ``max_output_tokens`` cut it, as the response's own); ``logprobs``: its message's token logprobs, where the
    response kept them (``include`` ``message.output_text.logprobs``)."""
    if job is None or job.status != JobStatus.SUCCEEDED:
        return []
    answer = stored_answer(job)
    return own_input_items(job) + output_items(job.id, answer, job.output_logprobs if logprobs else None,
                                               status=answer_status(answer))


def items_of(session: Session, conv: Conversation,
             logprobs: bool = False) -> list[tuple[ConversationEntry, dict[str, Any]]]:
    """The conversation's items in order, each with the entry it comes from (``logprobs``: ``turn_items``')."""
    out = []
    listed = entries(session, conv)
    jobs = turn_jobs(session, listed)
    for entry in listed:
        if entry.item is not None:
            out.append((entry, _as_listed(entry.item)))
        else:
            out += [(entry, item) for item in turn_items(jobs.get(entry.job_id), logprobs)
                    if item["id"] not in (entry.deleted or ())]
    return out


def _as_listed(item: dict[str, Any]) -> dict[str, Any]:
    """A stored item as the SDK types it: an item stored before its assistant text parts had their annotations
    gets them (``text_part``)."""
    if item.get("type") != "message":
        return item
    return {**item, "content": [text_part(item["role"], part["text"]) for part in item["content"]]}


def history(session: Session, conv: Conversation) -> list[dict[str, Any]]:
    """The conversation as chat messages, for a response that continues it."""
    items = [item for _, item in items_of(session, conv)]
    return input_messages(items) if items else []


def delete_conversation(session: Session, conv: Conversation) -> None:
    """The conversation and its entries (the responses given it stay)."""
    session.execute(delete(ConversationEntry).where(ConversationEntry.conversation_id == conv.id))
    session.delete(conv)


def find_item(session: Session, conv: Conversation, item_id: str,
              logprobs: bool = False) -> tuple[ConversationEntry, dict[str, Any]]:
    """The conversation's item ``item_id`` and the entry it comes from (404 where there is none; ``logprobs``:
    ``turn_items``')."""
    found = next(((entry, item) for entry, item in items_of(session, conv, logprobs) if item["id"] == item_id),
                 None)
    if found is None:
        raise OpenAIError(404, f"no item {item_id!r} in conversation {conv.id!r}", code="item_not_found")
    return found


def delete_item(session: Session, conv: Conversation, item_id: str) -> None:
    """Takes the item out of the conversation (a response's item is hidden from its turn; 404: no such item)."""
    entry, _ = find_item(session, conv, item_id)
    if entry.item is not None:
        session.delete(entry)
    else:
        entry.deleted = [*(entry.deleted or ()), item_id]
