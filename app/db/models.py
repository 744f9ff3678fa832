"""SQLAlchemy 2.0 typed models: the source of truth for tenants, jobs, files and batches.

Alembic (``migrations/``) owns the schema; ``tests/integration/test_migrations.py``
checks that these models and the migrated schema do not drift apart.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import (JSON, BigInteger, Boolean, DateTime, Float, ForeignKey, Index, Integer, String, Text,
                        UniqueConstraint, false, text, true)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship


def utcnow() -> datetime:
    return datetime.now(UTC)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON, datetime: DateTime(timezone=True)}


class JobKind(StrEnum):
    INTERACTIVE = "interactive"
    BATCH = "batch"


INVALID_REQUEST = "invalid_request"  # Job.error_code: the engine refused the request's parameters
# Job.status of a batch's job written while its batch fans out (app/batch/fanout.py), before the batch starts, is
# this prefix and the fan-out run's own mark: no JobStatus on purpose, so that nothing dispatches, runs, cancels,
# counts or lists it; the run turns its own into queued/dispatched when the batch starts, or they are deleted
STAGED = "staged"


class JobStatus(StrEnum):
    QUEUED = "queued"
    DISPATCHED = "dispatched"
    RUNNING = "running"
    RELEGATED = "relegated"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"

    @property
    def terminal(self) -> bool:
        return self in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED, JobStatus.EXPIRED)


class Tenant(Base):
    __tablename__ = "tenants"
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("ten"))
    name: Mapped[str] = mapped_column(String(200), unique=True)
    default_tier: Mapped[str] = mapped_column(String(32), default="paid")
    # rate limits of its API requests (app/services/rate_limits.py); null: none
    requests_per_minute: Mapped[int | None] = mapped_column(Integer, default=None)
    tokens_per_minute: Mapped[int | None] = mapped_column(Integer, default=None)
    # the Batch API's queue limit: prompt tokens of its batches' unfinished jobs (app/batch/queue_limit.py); null: none
    batch_queue_tokens: Mapped[int | None] = mapped_column(Integer, default=None)
    # an operator stopped it: its keys are refused (403) and its open work was cancelled
    disabled: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    api_keys: Mapped[list[ApiKey]] = relationship(back_populates="tenant")


class ApiKey(Base):
    __tablename__ = "api_keys"
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("key"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    key_hash: Mapped[str] = mapped_column(String(128), unique=True)  # sha256 hex; the key itself is never stored
    prefix: Mapped[str] = mapped_column(String(16))  # first characters, to tell keys apart in listings
    tier: Mapped[str | None] = mapped_column(String(32), default=None)  # overrides the tenant's default tier
    is_admin: Mapped[bool] = mapped_column(Boolean, default=False)
    revoked: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    tenant: Mapped[Tenant] = relationship(back_populates="api_keys")


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        UniqueConstraint("tenant_id", "idempotency_key", name="uq_jobs_tenant_idempotency"),
        Index("ix_jobs_tenant_created", "tenant_id", "created_at"),
        Index("ix_jobs_created", "created_at"),  # every tenant's usage by time (admin: Usage API, dashboard)
        Index("ix_jobs_status_lease", "status", "lease_expires_at"),
        # a status's jobs oldest first (the sweeper's queued ones, a page at a time); and a status alone
        Index("ix_jobs_status_created", "status", "created_at"),
        Index("ix_jobs_model_finished", "model", "finished_at"),  # workers' decode-length history reads
        Index("ix_jobs_finished", "finished_at"),  # the jobs finished lately (the dashboard's SLO chart)
        Index("ix_jobs_settled", "model", "settled_at", "finished_at"),  # /metrics: ends settled since its totals
        Index("ix_jobs_tenant_request", "tenant_id", "request_id"),  # a tenant's jobs by the request that sent them
        Index("ix_jobs_request", "request_id"),  # any tenant's (the admin dashboard's search)
        Index("ix_jobs_user_created", "user_id", "created_at"),  # the Usage API's user_ids filter, by time
        # a summarization run's jobs not ended, counted (each poll of the run's progress)
        Index("ix_jobs_summarization_run_status", "summarization_run_id", "status"),
        # a request's or a prompt's other jobs that ran (the Usage API); only the jobs that name one are indexed
        Index("ix_jobs_request_job", "request_job_id", sqlite_where=text("request_job_id IS NOT NULL"),
              postgresql_where=text("request_job_id IS NOT NULL")),
        Index("ix_jobs_prompt_job", "prompt_job_id", sqlite_where=text("prompt_job_id IS NOT NULL"),
              postgresql_where=text("prompt_job_id IS NOT NULL")),
    )
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("job"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    batch_id: Mapped[str | None] = mapped_column(ForeignKey("batches.id", ondelete="SET NULL"), index=True,
                                                 default=None)
    custom_id: Mapped[str | None] = mapped_column(String(200), default=None)  # Batch API line id
    # a Batch API line of several choices (n, or several prompts): this job's choice in OpenAI's order (prompt x n +
    # choice), by which the line's answer joins them; None for a line's only job
    choice_index: Mapped[int | None] = mapped_column(Integer, default=None)
    api_key_id: Mapped[str | None] = mapped_column(String(40), default=None)  # the key that submitted it (usage by key)
    # the client's end user: OpenAI's safety_identifier (or its older user), Anthropic's metadata.user_id (usage)
    user_id: Mapped[str | None] = mapped_column(String(256), default=None)
    idempotency_key: Mapped[str | None] = mapped_column(String(200), default=None)
    # the submitting request's X-Request-Id (given by the client, or made by the API: app.request_id)
    request_id: Mapped[str | None] = mapped_column(String(256), default=None)
    kind: Mapped[str] = mapped_column(String(16))  # JobKind
    tier: Mapped[str] = mapped_column(String(32))
    model: Mapped[str] = mapped_column(String(200))
    app_id: Mapped[str | None] = mapped_column(String(200), default=None)  # decode-length history key
    summarization_run_id: Mapped[str | None] = mapped_column(String(40), default=None)  # the run that submitted it
    # QoS
    ttft_ms: Mapped[float | None] = mapped_column(Float, default=None)
    tbt_ms: Mapped[float | None] = mapped_column(Float, default=None)
    tbt_anchor: Mapped[str | None] = mapped_column(String(16), default=None)  # interactive: "arrival" | "first-token"
    deadline_at: Mapped[datetime | None] = mapped_column(default=None)
    # input: a raw prompt or chat messages, and sampling params
    prompt: Mapped[str | None] = mapped_column(Text, default=None)
    # a prompt given as token ids (``prompt`` then holds their text, for display and echo): what the engine runs
    prompt_token_ids: Mapped[list[int] | None] = mapped_column(JSON, default=None)
    messages: Mapped[list[Any] | None] = mapped_column(JSON, default=None)
    tools: Mapped[list[Any] | None] = mapped_column(JSON, default=None)  # functions offered to the chat template
    # add_generation_prompt / continue_final_message / chat_template_kwargs where not the defaults
    template_options: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    response: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)  # an OpenAI request's fields kept
    sampling: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    endpoint: Mapped[str] = mapped_column(String(64), default="/v1/jobs")  # API shape to answer in
    stream: Mapped[bool] = mapped_column(Boolean, default=False)
    # what usage counts of it, as OpenAI bills a request of n choices or several prompts: its request (the
    # request's first job) and its prompt tokens (the prompt's first choice)
    counts_request: Mapped[bool] = mapped_column(Boolean, default=True, server_default=true())
    counts_prompt: Mapped[bool] = mapped_column(Boolean, default=True, server_default=true())
    # on a request's other jobs: its first job, and (a later choice of a prompt) the prompt's first choice, which
    # count the request and the prompt whenever any of their jobs ran (app/services/usage.py); None on a request's
    # only job, on the first ones themselves, and on jobs written before the link (they count where they ran)
    request_job_id: Mapped[str | None] = mapped_column(String(40), default=None)
    prompt_job_id: Mapped[str | None] = mapped_column(String(40), default=None)
    # state
    status: Mapped[str] = mapped_column(String(16), default=JobStatus.QUEUED)  # ix_jobs_status_created
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    dispatched_at: Mapped[datetime | None] = mapped_column(default=None)
    started_at: Mapped[datetime | None] = mapped_column(default=None)
    first_token_at: Mapped[datetime | None] = mapped_column(default=None)
    finished_at: Mapped[datetime | None] = mapped_column(default=None)
    # when the end stopped changing: at finished_at, or where the API cancelled a job an engine held, once its
    # worker wrote what it produced (None until then); /metrics keeps the totals of the jobs settled before a horizon
    settled_at: Mapped[datetime | None] = mapped_column(default=None)
    # output
    output_text: Mapped[str | None] = mapped_column(Text, default=None)
    finish_reason: Mapped[str | None] = mapped_column(String(32), default=None)
    # vLLM's stop_reason: the stop string (text) or stop token id (a number) that ended it; null for EOS or length
    stop_reason: Mapped[str | int | None] = mapped_column(JSON, nullable=True, default=None)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer, default=None)
    completion_tokens: Mapped[int | None] = mapped_column(Integer, default=None)
    # prompt tokens the engine found in its prefix cache (vLLM's num_cached_tokens; 0 on the own engine, which has none)
    cached_tokens: Mapped[int | None] = mapped_column(Integer, default=None)
    # prompt tokens it computed and wrote to that cache (vLLM's num_cache_creation_tokens; the Responses API's
    # cache_write_tokens; 0 on the own engine)
    cache_write_tokens: Mapped[int | None] = mapped_column(Integer, default=None)
    # what its prompt opens with, hashed: prefix routing sends jobs of one key to one worker (app.services.routing)
    route_key: Mapped[str | None] = mapped_column(String(16), default=None)
    # of the completion tokens, those the model spent thinking (a reasoning parser's jobs; else None)
    reasoning_tokens: Mapped[int | None] = mapped_column(Integer, default=None)
    # where the request asked for them: one per output token, gpu_runtime.logprobs.TokenLogprob.as_dict()
    output_logprobs: Mapped[list[Any] | None] = mapped_column(JSON, default=None)
    prompt_logprobs: Mapped[list[Any] | None] = mapped_column(JSON, default=None)  # the same per prompt token
    # the generated token ids, where the request asked for them (vLLM's return_token_ids)
    output_token_ids: Mapped[list[int] | None] = mapped_column(JSON, default=None)
    # per-job metrics
    queue_s: Mapped[float | None] = mapped_column(Float, default=None)  # submission to its first prompt chunk
    ttft_s: Mapped[float | None] = mapped_column(Float, default=None)
    tbt_p50_s: Mapped[float | None] = mapped_column(Float, default=None)
    tbt_p99_s: Mapped[float | None] = mapped_column(Float, default=None)
    ttlt_s: Mapped[float | None] = mapped_column(Float, default=None)
    slo_met: Mapped[bool | None] = mapped_column(Boolean, default=None)
    # the first deadline it missed when slo_met is False (gpu_runtime.metrics.DeadlineMiss.as_dict():
    # token, due_s, at_s, late_ms; seconds after arrival): what `coserve status` explains a miss with
    slo_miss: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    relegation_count: Mapped[int] = mapped_column(Integer, default=0)
    # execution bookkeeping (lease-based, see workers/lease.py)
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    worker_id: Mapped[str | None] = mapped_column(String(200), default=None)
    lease_expires_at: Mapped[datetime | None] = mapped_column(default=None)
    error: Mapped[str | None] = mapped_column(Text, default=None)
    # a failure's cause in a word: "invalid_request" when the engine refused the request's parameters (the
    # OpenAI routes answer it with a 400), else None (the engine or the worker failed)
    error_code: Mapped[str | None] = mapped_column(String(40), default=None)

    events: Mapped[list[JobEvent]] = relationship(back_populates="job", order_by="JobEvent.id",
                                                  cascade="all, delete-orphan")


class JobEvent(Base):
    """One state transition of a job (from -> to), with who did it and why."""

    __tablename__ = "job_events"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    from_status: Mapped[str | None] = mapped_column(String(16), default=None)
    to_status: Mapped[str] = mapped_column(String(16))
    at: Mapped[datetime] = mapped_column(default=utcnow)
    worker_id: Mapped[str | None] = mapped_column(String(200), default=None)
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    detail: Mapped[str | None] = mapped_column(Text, default=None)
    job: Mapped[Job] = relationship(back_populates="events")


class File(Base):
    """An uploaded or generated file (OpenAI Files API; purpose batch / batch_output), or a message batch's requests
    and results (purpose message_batch / message_batch_results: not in the Files API)."""

    __tablename__ = "files"
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("file"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    filename: Mapped[str] = mapped_column(String(500))
    purpose: Mapped[str] = mapped_column(String(32))
    bytes: Mapped[int] = mapped_column(BigInteger)  # a batch output file may pass 2 GiB (INTEGER: 2**31 - 1)
    path: Mapped[str] = mapped_column(String(1000))  # where the content lives under data_dir
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    deleted: Mapped[bool] = mapped_column(Boolean, default=False)
    # gone from the API at this time and deleted by the workers' sweeper (expires_after; null: kept)
    expires_at: Mapped[datetime | None] = mapped_column(default=None, index=True)


class Batch(Base):
    """OpenAI Batch API object; its lines become jobs with ``batch_id`` set."""

    __tablename__ = "batches"
    __table_args__ = (
        Index("uq_batches_tenant_idempotency", "tenant_id", "idempotency_key", unique=True),
    )
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("batch"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    endpoint: Mapped[str] = mapped_column(String(64))
    input_file_id: Mapped[str] = mapped_column(ForeignKey("files.id"))
    output_file_id: Mapped[str | None] = mapped_column(String(40), default=None)
    error_file_id: Mapped[str | None] = mapped_column(String(40), default=None)
    completion_window: Mapped[str] = mapped_column(String(16))
    # indexed: each sweep looks for the open batches (to finalize) and those left validating among every batch
    status: Mapped[str] = mapped_column(String(16), default="validating", index=True)
    tier: Mapped[str] = mapped_column(String(32))
    metadata_: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSON, default=None)
    total: Mapped[int] = mapped_column(Integer, default=0)
    completed: Mapped[int] = mapped_column(Integer, default=0)
    failed: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    in_progress_at: Mapped[datetime | None] = mapped_column(default=None)
    finalizing_at: Mapped[datetime | None] = mapped_column(default=None)
    completed_at: Mapped[datetime | None] = mapped_column(default=None)
    failed_at: Mapped[datetime | None] = mapped_column(default=None)
    expires_at: Mapped[datetime | None] = mapped_column(default=None)
    expired_at: Mapped[datetime | None] = mapped_column(default=None)
    cancelling_at: Mapped[datetime | None] = mapped_column(default=None)
    cancelled_at: Mapped[datetime | None] = mapped_column(default=None)
    errors: Mapped[list[Any] | None] = mapped_column(JSON, default=None)  # validation errors of the whole file
    output_expires_after_s: Mapped[int | None] = mapped_column(Integer, default=None)  # its output/error files'
    api_key_id: Mapped[str | None] = mapped_column(String(40), default=None)  # the key that created it: its jobs'
    # a message batch deleted (DELETE /v1/messages/batches/{id}): its API shows it no more, its files are gone; its
    # status stays how it ended, and its jobs stay its own
    deleted_at: Mapped[datetime | None] = mapped_column(default=None)
    # the model its lines' jobs run on, as the fan-out resolved it (OpenAI's Batch.model); None where they name
    # several (no one model processes the batch) or none yet (validating, failed before its fan-out, no valid line)
    model: Mapped[str | None] = mapped_column(String(200), default=None)
    idempotency_key: Mapped[str | None] = mapped_column(String(200), default=None)  # the create's Idempotency-Key
    request_digest: Mapped[str | None] = mapped_column(String(64), default=None)  # its body's: a retry's must match


class WebhookEndpoint(Base):
    """Where a tenant's events go (OpenAI's Webhook Endpoints API), and the secret that signs them."""

    __tablename__ = "webhook_endpoints"
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("we"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(200))
    url: Mapped[str] = mapped_column(String(2000))
    event_types: Mapped[list[Any]] = mapped_column(JSON)
    # signing keys (Standard Webhooks' whsec_...): kept as they are, since every delivery is signed with them
    secret: Mapped[str] = mapped_column(String(100))
    old_secret: Mapped[str | None] = mapped_column(String(100), default=None)  # still signs until old_secret_until
    old_secret_until: Mapped[datetime | None] = mapped_column(default=None)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)


PENDING_DELIVERY = text("delivered_at IS NULL AND failed_at IS NULL")


class WebhookDelivery(Base):
    """One event for one endpoint: sent by the workers until the endpoint answers 2xx or the attempts run out."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (
        # the due query's: pending rows only, however many delivered and given-up ones the table keeps
        Index("ix_webhook_deliveries_pending", "next_attempt_at", sqlite_where=PENDING_DELIVERY,
              postgresql_where=PENDING_DELIVERY),
        Index("ix_webhook_deliveries_created_at", "created_at"),  # the sweeper's retention
    )
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("wh"))  # webhook-id
    endpoint_id: Mapped[str] = mapped_column(ForeignKey("webhook_endpoints.id", ondelete="CASCADE"), index=True)
    event_id: Mapped[str] = mapped_column(String(40))
    type: Mapped[str] = mapped_column(String(64))
    body: Mapped[str] = mapped_column(Text)  # the JSON sent, the same bytes every attempt
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[datetime] = mapped_column(default=utcnow)
    delivered_at: Mapped[datetime | None] = mapped_column(default=None)
    failed_at: Mapped[datetime | None] = mapped_column(default=None)  # gave up
    last_status: Mapped[int | None] = mapped_column(Integer, default=None)
    last_error: Mapped[str | None] = mapped_column(Text, default=None)


class WorkerState(Base):
    """Heartbeat row of a live GPU worker (dashboard and /readyz)."""

    __tablename__ = "workers"
    id: Mapped[str] = mapped_column(String(200), primary_key=True)
    model: Mapped[str] = mapped_column(String(200))
    queue: Mapped[str] = mapped_column(String(200))
    device: Mapped[str] = mapped_column(String(64))
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    heartbeat_at: Mapped[datetime] = mapped_column(default=utcnow)
    draining: Mapped[bool] = mapped_column(Boolean, default=False)
    state: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)  # KV usage, spec policy, queues

    @property
    def served(self) -> tuple[str, ...]:
        """The models whose queues the worker consumes: its model and LoRA adapters (a row written before the
        worker recorded them: its model)."""
        return tuple((self.state or {}).get("served") or (self.model,))


class LoraAdapter(Base):
    """A LoRA adapter an admin loaded while coserve runs (``/v1/load_lora_adapter``): every worker of its model
    serves it, loading it from ``path`` on its first request."""

    __tablename__ = "lora_adapters"
    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    model: Mapped[str] = mapped_column(String(200))  # the served model it adapts, whose workers run its jobs
    path: Mapped[str] = mapped_column(Text)
    rank: Mapped[int] = mapped_column(Integer)
    # when it was last loaded: a load in place from the same path (new weights there) is a new version to a worker
    loaded_at: Mapped[datetime] = mapped_column(default=utcnow)


class UnloadedLoraAdapter(Base):
    """A runtime LoRA adapter an admin unloaded, and the model it adapted: its jobs still waiting go on that model's
    queue, whose workers fail them saying it was unloaded (no worker reads a queue of the adapter's name)."""

    __tablename__ = "unloaded_lora_adapters"
    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    model: Mapped[str] = mapped_column(String(200))
    unloaded_at: Mapped[datetime] = mapped_column(default=utcnow)


class MetricTotals(Base):
    """The finished jobs' series ``/metrics`` has summed, of the jobs that ended before ``horizon``: later scrapes
    add only the jobs ended since (app.observability.tally). One row per deployment (its model name)."""

    __tablename__ = "metric_totals"
    scope: Mapped[str] = mapped_column(String(40), primary_key=True)
    horizon: Mapped[datetime]
    # query name -> [[group key, sums], ...], and tally.MODELS -> the models counted in them
    totals: Mapped[dict[str, Any]] = mapped_column(JSON)


class Conversation(Base):
    """OpenAI's Conversations API: items that responses given the conversation read first and add their turn to."""

    __tablename__ = "conversations"
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("conv"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    meta: Mapped[dict[str, Any]] = mapped_column("metadata", JSON, default=dict)  # ("metadata" is SQLAlchemy's)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class ConversationEntry(Base):
    """A conversation's items in order: one item added by itself, or a response's turn (``job_id``), which
    stands for the response's input and output items once the response has completed."""

    __tablename__ = "conversation_entries"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)  # the order
    conversation_id: Mapped[str] = mapped_column(ForeignKey("conversations.id", ondelete="CASCADE"), index=True)
    item: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    job_id: Mapped[str | None] = mapped_column(String(40), default=None)
    deleted: Mapped[list[Any]] = mapped_column(JSON, default=list)  # ids of the turn's items deleted from it
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class SummarizationRun(Base):
    """A map-reduce summarization (``/v1/summarize``). Any process advances it from these rows
    (``app.summarize.driver``): the one holding its lease, one committed step at a time."""

    __tablename__ = "summarization_runs"
    __table_args__ = (
        Index("uq_summarization_runs_tenant_idempotency", "tenant_id", "idempotency_key", unique=True),
        Index("ix_summarization_runs_tenant_created", "tenant_id", "created_at"),  # a tenant's runs, newest first
        Index("ix_summarization_runs_created", "created_at"),  # every tenant's (the admin dashboard)
    )
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("sum"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    model: Mapped[str] = mapped_column(String(200))  # its jobs' model: only that model's workers (tokenizer) step it
    api_key_id: Mapped[str | None] = mapped_column(String(40), default=None)  # the key that started it: its jobs'
    tier: Mapped[str] = mapped_column(String(32))
    # running | completed | failed | cancelling | cancelled
    status: Mapped[str] = mapped_column(String(16), default="running", index=True)
    deadline_at: Mapped[datetime] = mapped_column()
    # the splitter as resolved at creation, so every process cuts the same chunks
    max_summary_tokens: Mapped[int] = mapped_column(Integer)
    chunk_tokens: Mapped[int] = mapped_column(Integer)
    overlap_tokens: Mapped[int] = mapped_column(Integer)
    documents: Mapped[int] = mapped_column(Integer, default=0)
    documents_done: Mapped[int] = mapped_column(Integer, default=0)
    documents_failed: Mapped[int] = mapped_column(Integer, default=0)
    jobs_submitted: Mapped[int] = mapped_column(Integer, default=0)
    jobs_done: Mapped[int] = mapped_column(Integer, default=0)
    # committed steps: a step commits only on the version it read, and only while it holds the lease
    version: Mapped[int] = mapped_column(Integer, default=0)
    lease_owner: Mapped[str | None] = mapped_column(String(200), default=None)
    lease_expires_at: Mapped[datetime | None] = mapped_column(default=None)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(default=None)
    idempotency_key: Mapped[str | None] = mapped_column(String(200), default=None)  # the request's Idempotency-Key
    request_digest: Mapped[str | None] = mapped_column(String(64), default=None)  # its body's: a retry's must match
    reason: Mapped[str | None] = mapped_column(Text, default=None)  # why it failed as a whole or was cancelled


class SummarizationDocument(Base):
    """One document of a run: its current level's text and the ids of that level's jobs."""

    __tablename__ = "summarization_documents"
    run_id: Mapped[str] = mapped_column(ForeignKey("summarization_runs.id", ondelete="CASCADE"), primary_key=True)
    position: Mapped[int] = mapped_column(Integer, primary_key=True)  # order in the request and the results
    doc_id: Mapped[str] = mapped_column(String(200))
    level: Mapped[int] = mapped_column(Integer, default=0)
    text: Mapped[str] = mapped_column(Text)  # this level's input
    pending: Mapped[list[Any]] = mapped_column(JSON, default=list)  # this level's job ids
    final: Mapped[bool] = mapped_column(Boolean, default=False)  # the pending job is the document's summary
    chunks: Mapped[int] = mapped_column(Integer, default=0)  # level-0 chunks
    jobs: Mapped[int] = mapped_column(Integer, default=0)
    summary: Mapped[str | None] = mapped_column(Text, default=None)
    error: Mapped[str | None] = mapped_column(Text, default=None)
    done: Mapped[bool] = mapped_column(Boolean, default=False)  # summary or error: steps skip it
    # per pending job, the retries its chunk had; jobs submitted again; when the failed ones go again; why they failed
    attempts: Mapped[list[Any]] = mapped_column(JSON, default=list, server_default="[]")
    retries: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    retry_at: Mapped[datetime | None] = mapped_column(default=None)
    retry_errors: Mapped[list[Any]] = mapped_column(JSON, default=list, server_default="[]")
