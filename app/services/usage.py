"""Token usage by time bucket, as OpenAI's Usage API reports it (``/v1/organization/usage/completions``).

Counts the jobs an engine ran (those with an output token count: a job's prompt tokens are counted at submission, so
a job cancelled or refused before it ran has them too; one cancelled while it ran counts what it produced before the
cancel, or its prompt with no output where the engine had begun only that), by when they were submitted: input,
cached input and output tokens and requests, grouped by tenant (OpenAI's project), end user (the request's
``safety_identifier`` / ``user``, Anthropic's ``metadata.user_id``; null for a job without one), API key, model, batch
or service tier; coserve adds how many met their SLO, missed it and were relegated, counted by job (each choice of a
request).
Summed in SQL, so a month of jobs costs one grouped query.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, NamedTuple

from sqlalchemy import BigInteger, Integer, and_, case, cast, exists, func, or_, select
from sqlalchemy.orm import Session, aliased

from app.db.models import Job

BUCKET_WIDTHS = {"1m": 60, "1h": 3600, "1d": 86400}
BUCKETS_PER_PAGE = {"1m": (60, 1440), "1h": (24, 168), "1d": (7, 31)}  # OpenAI's default and largest page
GROUPS = ("project_id", "user_id", "api_key_id", "model", "batch", "service_tier")  # what a job records


@dataclass(frozen=True)
class UsageQuery:
    start: int  # unix seconds: the first bucket starts here
    end: int  # unix seconds, exclusive
    width: str  # a key of BUCKET_WIDTHS
    limit: int  # buckets in this page
    first: int = 0  # index of this page's first bucket
    group_by: tuple[str, ...] = ()
    tenant_ids: tuple[str, ...] | None = None  # None: every tenant
    user_ids: tuple[str, ...] | None = None  # the requests' end users
    api_key_ids: tuple[str, ...] | None = None
    models: tuple[str, ...] | None = None
    batch: bool | None = None  # only Batch API jobs (True) or none of them (False)

    @property
    def seconds(self) -> int:
        return BUCKET_WIDTHS[self.width]

    @property
    def buckets(self) -> int:
        """Buckets in the whole range (the last may end after ``end``)."""
        return max(0, -(-(self.end - self.start) // self.seconds))


def epoch(column: Any, dialect: str) -> Any:
    """Unix seconds of a stored UTC timestamp, in the database's own terms."""
    if dialect == "sqlite":
        return cast(func.strftime("%s", column), Integer)
    return cast(func.floor(func.extract("epoch", column)), BigInteger)


def completions_usage(session: Session, q: UsageQuery, service_tier: Any) -> dict[str, Any]:
    """One page of buckets (OpenAI's ``page`` of ``bucket`` objects); ``service_tier(tier)`` names a tier."""
    last = min(q.buckets, q.first + q.limit)
    lo, hi = q.start + q.first * q.seconds, min(q.end, q.start + last * q.seconds)
    dialect = session.get_bind().dialect.name
    bucket = ((epoch(Job.created_at, dialect) - q.start) // q.seconds).label("bucket")
    columns = {"project_id": Job.tenant_id, "user_id": Job.user_id, "api_key_id": Job.api_key_id, "model": Job.model,
               "batch": Job.batch_id.is_not(None), "service_tier": Job.tier}
    keys = [columns[g].label(g) for g in q.group_by]
    # a request of n choices or several prompts: one request, each prompt's tokens once (OpenAI's usage), whichever
    # of their jobs ran; a job that ended before it ran (expired in the queue) is no request, but it missed its SLO
    ran, request_ran, prompt = Job.completion_tokens.is_not(None), _any_ran(Job.request_job_id), prompt_usage()
    stmt = select(bucket, *keys, prompt.input_tokens, prompt.cached_tokens,
                  func.coalesce(func.sum(Job.completion_tokens), 0),
                  func.sum(case((and_(ran, Job.counts_request), 1), (and_(Job.counts_request, request_ran), 1),
                                else_=0)),
                  func.sum(case((Job.slo_met.is_(True), 1), else_=0)),
                  func.sum(case((Job.slo_met.is_(False), 1), else_=0)),
                  func.sum(case((Job.relegation_count > 0, 1), else_=0)))
    billed = or_(ran, Job.slo_met.is_not(None), prompt.ran_elsewhere, and_(Job.counts_request, request_ran))
    stmt = stmt.where(billed, Job.created_at >= _at(lo), Job.created_at < _at(hi))
    if q.tenant_ids is not None:
        stmt = stmt.where(Job.tenant_id.in_(q.tenant_ids))
    if q.user_ids is not None:
        stmt = stmt.where(Job.user_id.in_(q.user_ids))
    if q.api_key_ids is not None:
        stmt = stmt.where(Job.api_key_id.in_(q.api_key_ids))
    if q.models is not None:
        stmt = stmt.where(Job.model.in_(q.models))
    if q.batch is not None:
        stmt = stmt.where(Job.batch_id.is_not(None) if q.batch else Job.batch_id.is_(None))
    results: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for row in session.execute(stmt.group_by(bucket, *keys).order_by(bucket, *keys)):
        index, group, sums = int(row[0]), row[1:1 + len(keys)], row[1 + len(keys):]
        result = _result(sums)
        for name, value in zip(q.group_by, group, strict=True):
            result[name] = service_tier(value) if name == "service_tier" else bool(value) if name == "batch" else value
        results[index].append(result)
    data = [{"object": "bucket", "start_time": q.start + i * q.seconds, "end_time": q.start + (i + 1) * q.seconds,
             "results": results.get(i, [])} for i in range(q.first, last)]
    more = last < q.buckets
    return {"object": "page", "data": data, "has_more": more, "next_page": f"page_{last}" if more else None}


class PromptUsage(NamedTuple):
    """A prompt's tokens as billed, once, on its first choice's row, where any of its choices ran."""

    ran_elsewhere: Any  # the row bills a prompt its own job did not run: another choice of it did (select it too)
    input_tokens: Any  # the sum of the selected rows' prompts' input tokens
    cached_tokens: Any  # the sum of their cached tokens: the first choice's where it ran, else another's that did


def prompt_usage() -> PromptUsage:
    """The rule the Usage API and a Batch object's ``usage`` both bill prompts by (a request of n choices or several
    prompts: each prompt's tokens once, whichever of its choices ran)."""
    # CASE tries its branches in order: a job's other choices are looked up only where it did not run itself
    own = and_(Job.completion_tokens.is_not(None), Job.counts_prompt)
    choices = and_(Job.counts_prompt, _any_ran(Job.prompt_job_id))
    return PromptUsage(choices, func.sum(case((own, Job.prompt_tokens), (choices, Job.prompt_tokens), else_=0)),
                       func.sum(case((own, func.coalesce(Job.cached_tokens, 0)), (choices, _choices_cached()),
                                     else_=0)))


def _any_ran(link: Any) -> Any:
    """Whether any of the jobs that name this one by ``link`` (``Job.request_job_id``: its request's other jobs;
    ``Job.prompt_job_id``: its prompt's other choices) ran. Jobs written before the links name none: their first
    job counts where it ran, as it did."""
    other = aliased(Job)
    return exists(select(1).where(getattr(other, link.key) == Job.id, other.completion_tokens.is_not(None)))


def _choices_cached() -> Any:
    """The cached tokens of a prompt whose first choice did not run: those of one of its other choices that ran
    (the most, where several did)."""
    other = aliased(Job)
    return func.coalesce(select(func.max(other.cached_tokens)).where(
        other.prompt_job_id == Job.id, other.completion_tokens.is_not(None)).scalar_subquery(), 0)


def _result(sums: Any) -> dict[str, Any]:
    inputs, cached, outputs, requests, met, missed, relegated = (int(v or 0) for v in sums)
    return {"object": "organization.usage.completions.result", "input_tokens": inputs, "output_tokens": outputs,
            "input_cached_tokens": cached, "input_audio_tokens": 0, "output_audio_tokens": 0,
            "num_model_requests": requests, "project_id": None, "user_id": None, "api_key_id": None, "model": None,
            "batch": None, "service_tier": None,
            # coserve's: how many jobs met their SLO, missed it, and were relegated; a job per choice and prompt,
            # where num_model_requests counts a request once (which of its choices' SLOs is the request's: none)
            "num_slo_met": met, "num_slo_missed": missed, "num_relegated": relegated}


def _at(unix_s: int) -> datetime:
    return datetime.fromtimestamp(unix_s, UTC)
