"""Stored chat completions (OpenAI's ``store``): a chat request given ``store: true`` keeps its answer, for
``/v1/chat/completions`` to list, retrieve, update (its metadata) and delete, and its messages to list.

A stored completion is its first choice's job. That job's ``response`` field holds ``store``, the request's
``metadata`` and the ids of every choice's job (``choices``, chosen before they were submitted). It shows once
every choice has succeeded: OpenAI keeps what the model answered, not a failed or cancelled request. A delete
forgets it (``store`` false); its jobs stay in ``/v1/jobs``.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select, true
from sqlalchemy.orm import Session

from app.db import pagination
from app.db.models import Job, JobStatus, new_id
from app.openai_schemas import TEXT_PARTS, OpenAIError, merge_choices, service_tier, stored_chat_answer
from app.responses_schemas import item_page
from app.services.jobs import get_job
from app.wire import as_utc

ENDPOINT = "/v1/chat/completions"
PREFIX = "chatcmpl-"
SCAN_ROWS = 64  # stored completions read a query while a page is filled


def kept_fields(metadata: dict[str, str] | None, choices: int,
                messages: list[Any] | None = None) -> tuple[list[str], dict[str, Any]]:
    """The job ids of a stored request's ``choices`` and what its first job keeps (the others keep nothing): with
    the metadata, each of the request's ``messages`` as sent (``sent_message``)."""
    ids = [new_id("job") for _ in range(choices)]
    return ids, {"store": True, "metadata": metadata or {}, "choices": ids,
                 "sent": [sent_message(m) for m in messages or ()]}


def sent_message(message: Any) -> dict[str, Any]:
    """What a job's chat messages lose of a message as sent: its role (a developer's read system in a job stored
    before jobs kept it), its content parts (read joined), as OpenAI's ``content_parts`` (null where the content was
    a string), and a null content (an assistant's with only tool calls, read "")."""
    message = message if isinstance(message, dict) else {}
    content = message.get("content")
    parts = None
    if isinstance(content, list):
        parts = [{"type": "text", "text": part[key]} for part in content if isinstance(part, dict)
                 and (key := TEXT_PARTS.get(part.get("type"))) and isinstance(part.get(key), str)]
    return {"role": message.get("role"), "content_parts": parts, **({"content": None} if content is None else {})}


def completion_id(job: Job) -> str:
    return PREFIX + job.id


def _job_id(cid: str) -> str | None:
    return cid.removeprefix(PREFIX) if cid.startswith(PREFIX + "job_") else None


def _chat_job(session: Session, tenant_id: str, cid: str, lock: bool = False) -> Job | None:
    """The tenant's chat job a completion id names, stored or not (None where it names none); ``lock``: as
    ``get_job``'s."""
    job_id = _job_id(cid)
    job = get_job(session, tenant_id, job_id, lock) if job_id else None
    return job if job is not None and job.endpoint == ENDPOINT else None


def _choices_of(session: Session, jobs: list[Job]) -> dict[str, list[Job]]:
    """Each of ``jobs`` whose every choice succeeded, by id: its choices' jobs, in order. The other choices of all of
    them are read in one query (a page's, not one a completion)."""
    wanted = {job.id: (job.response or {}).get("choices") or [job.id] for job in jobs}
    other_ids = {i for ids in wanted.values() for i in ids[1:]}
    others = {j.id: j for j in session.scalars(select(Job).where(Job.id.in_(other_ids)))} if other_ids else {}
    kept = {}
    for job in jobs:
        choices = [job, *(others.get(i) for i in wanted[job.id][1:])]
        if all(j is not None and j.status == JobStatus.SUCCEEDED for j in choices):
            kept[job.id] = choices
    return kept


def _choices(session: Session, job: Job) -> list[Job] | None:
    """Every choice's job, in order, where all of them succeeded (else None)."""
    return _choices_of(session, [job]).get(job.id)


def find(session: Session, tenant_id: str, cid: str, lock: bool = False) -> Job:
    """The tenant's stored completion ``cid`` (its first choice's job), finished or not (404 where none); ``lock``:
    its row held for a write of what it keeps (the metadata, whether it is stored), so two such writes do not
    undo each other on PostgreSQL."""
    job = _chat_job(session, tenant_id, cid, lock)
    if job is None or not (job.response or {}).get("store"):
        raise OpenAIError(404, f"no stored chat completion {cid!r} (only a chat completion created with "
                               "store: true is kept)", param="completion_id", code="not_found")
    return job


def finished(session: Session, tenant_id: str, cid: str, lock: bool = False) -> list[Job]:
    """The stored completion's jobs, one per choice (404 until every choice has succeeded); ``lock``: ``find``'s."""
    job = find(session, tenant_id, cid, lock)
    jobs = _choices(session, job)
    if jobs is None:
        raise OpenAIError(404, f"chat completion {cid!r} has not finished, or did not succeed: it is kept once "
                               "every choice has its answer", param="completion_id", code="not_found")
    return jobs


def completion_body(jobs: list[Job], tiers: tuple[str, ...]) -> dict[str, Any]:
    """The stored completion as OpenAI retrieves it: the chat completion, with its metadata."""
    first = jobs[0]
    cid, created = completion_id(first), int(as_utc(first.created_at).timestamp())
    coserve = {"job_id": first.id} | ({"job_ids": [j.id for j in jobs]} if len(jobs) > 1 else {})
    extra = {"system_fingerprint": None, "service_tier": service_tier(first.tier, tiers),
             "metadata": (first.response or {}).get("metadata") or {}, "coserve": coserve}
    return merge_choices([stored_chat_answer(j, cid, created, dict(extra)) for j in jobs], len(jobs))


def page(session: Session, tenant_id: str, tiers: tuple[str, ...], *, limit: int, order: str,
         after: str | None = None, model: str | None = None,
         metadata: dict[str, str] | None = None) -> dict[str, Any]:
    """OpenAI's list of the tenant's stored completions, oldest first unless ``order`` is desc, past the one
    ``after`` names (a 400 where the tenant never had it), of ``model`` and holding every pair of ``metadata``."""
    desc = order == "desc"
    query = select(Job).where(Job.tenant_id == tenant_id, Job.endpoint == ENDPOINT,
                              Job.status == JobStatus.SUCCEEDED, Job.response["store"].as_boolean() == true())
    if model is not None:
        query = query.where(Job.model == model)
    query = query.order_by(*pagination.in_order(Job, desc))
    mark = None
    if after is not None:  # a cursor: the completion need not be stored still (deleted meanwhile)
        mark = _chat_job(session, tenant_id, after)
        if mark is None:
            raise OpenAIError(400, f"no chat completion {after!r} to list after", param="after")
    data: list[dict[str, Any]] = []
    while len(data) <= limit:
        query_after = query if mark is None else query.where(pagination.after(Job, mark.created_at, mark.id, desc))
        rows = session.scalars(query_after.limit(SCAN_ROWS)).all()
        tagged = [job for job in rows if all(((job.response or {}).get("metadata") or {}).get(k) == v
                                             for k, v in (metadata or {}).items())]
        kept = _choices_of(session, tagged)
        for job in tagged:
            if job.id in kept:
                data.append(completion_body(kept[job.id], tiers))
                if len(data) > limit:
                    break
        if len(rows) < SCAN_ROWS:
            break
        mark = rows[-1]
    shown = data[:limit]
    return {"object": "list", "data": shown, "first_id": shown[0]["id"] if shown else None,
            "last_id": shown[-1]["id"] if shown else None, "has_more": len(data) > limit}


def message_page(job: Job, limit: int, order: str, after: str | None) -> dict[str, Any]:
    """The stored completion's request messages as OpenAI lists them (ids ``<completion id>-<index>``)."""
    cid = completion_id(job)
    sent = (job.response or {}).get("sent") or []  # none kept before: as the job read them
    items = [{"id": f"{cid}-{i}", "role": m.get("role"), "content": m.get("content"), "name": m.get("name"),
              "content_parts": None, **{k: m[k] for k in ("tool_calls", "tool_call_id") if k in m},
              **(sent[i] if i < len(sent) else {})}
             for i, m in enumerate(job.messages or [])]
    return item_page(items, limit, order, after, f"no message {after!r} in chat completion {cid!r}")
