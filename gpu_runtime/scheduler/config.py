"""Typed configuration of every scheduling policy, with defaults and help text."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256  # most requests holding KV (decoding or mid-prefill) at once
    kv_watermark: float = 0.01  # share of KV blocks kept free when admitting a new prompt
    queue: str = "fcfs"  # prefill ordering: fcfs | deadline | priority
    # KV admission reserves prompt + "predicted" output (the app's finished lengths, mean + 2 std; max_tokens
    # until 3 are known; re-reserved when a job outlives it; recompute preemption if the cache still runs
    # out) or prompt + "max_tokens" (never preempts, but a 4096-token max_tokens caps concurrency).
    kv_reserve: str = "predicted"
    # With a prefix cache, a prompt planned after another in the same step that shares its first blocks is
    # planned for the rest only, as vLLM's own scheduler does (it caches a block when it allocates it). Off for
    # coserve's policies: it fills a burst's first step with tails, and Alg. 1's budget, set by decode slack
    # alone, then made that step outlast the prompts' TTFT (BENCHMARKS, stop 38); vLLM computes the rest anyway.
    plan_shared_prefixes: bool = False


@dataclass
class SarathiConfig(SchedulerConfig):
    chunk_size: int = 256  # tokens per iteration, decodes included (Sarathi-Serve's token budget)
    order: str = "fcfs"  # fcfs | edf | srpf


@dataclass
class VLLMConfig(SchedulerConfig):
    max_num_batched_tokens: int = 8192  # whole prompts per prefill-only iteration


@dataclass
class VLLMV1Config(SchedulerConfig):
    max_num_batched_tokens: int = 2048  # tokens per step, decodes included (vLLM-CPU's default step cap)
    order: str = "fcfs"  # fcfs | priority (vLLM's scheduling_policy; priority: vllm_priority, then arrival)
    plan_shared_prefixes: bool = True  # vLLM's scheduler looks each prompt's hit up as it schedules it


@dataclass
class QoServeConfig(SchedulerConfig):
    queue: str = "priority"
    alpha_low_ms: float = 1.0  # ms/token at low load (close to EDF)
    alpha_high_ms: float = 8.0  # ms/token under overload (paper's best fixed value)
    adaptive_alpha: bool = True  # False: always alpha_high_ms
    safety: float = 1.2  # predicted batch time x safety must fit the minimum decode slack
    chunk_floor: int = 16  # smallest prefill budget in the search space
    chunk_ceiling: int | None = None  # None: where the cost model's prefill throughput saturates
    step_tokens: int | None = None  # most tokens a step runs, decodes included (vLLM's step cap); None: no cap
    saturation_fraction: float = 0.95  # share of peak prefill throughput that defines saturation
    kv_short_fraction: float = 0.1  # below this free-KV share only the lower half of the space is searched
    relegation: bool = True  # eager relegation (QoServe 3.4)
    preemption: bool = True  # selective preemption of prefills (QoServe 3.4)
    paid_guard: bool = True  # a paid prefill about to miss its deadline goes ahead of free jobs (QoServe 3.4)
    paid_guard_window: int = 16  # paid jobs the guard looks at per iteration, earliest latest-start first (bursty
    # A100 code run: 16, 64 and 256 leave the same paid jobs late)
    free_yields: bool = True  # a free job that would make a paid job late by running first is relegated
    # ... and free work yields to every waiting paid job while paid work arrives as fast as the saturated engine
    # serves, over the longest paid target (overload.py: sustained overload, not a burst)
    free_yields_overload: bool = True
    # ... and to relegated paid work: while a paid job is relegated, free jobs are relegated behind it and the
    # spare budget serves relegated paid jobs before free ones (a late paid job finishes before free work runs)
    free_yields_relegated_paid: bool = True
    # When a paid job is relegated: "hopeless" (it cannot meet its deadline even at the head of the queue) or
    # "violated" (QoServe 3.4 as printed: once late, and only if no free job waits); see relegation.py
    paid_relegation: str = "hopeless"
    # A relegated job with no output yet expires (finished_expired) once its deadline passed by this multiple
    # of its own TTFT/TTLT; None: relegated jobs wait for spare capacity however long it takes
    relegated_expiry: float | None = 2.0
    relegated_expiry_min_s: float = 60.0  # ... and at least this many seconds after its deadline
    risk_margin: float = 1.5  # predicted prefill time x margin must fit before the deadline, else "at risk"
