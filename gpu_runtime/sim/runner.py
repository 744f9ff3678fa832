"""One simulated experiment: a policy, a trace, an arrival process and a tier mix -> summary."""

from __future__ import annotations

import dataclasses
import logging
import random
from dataclasses import dataclass

from gpu_runtime.costmodel.base import CostModel
from gpu_runtime.qos import QoSClass, QoSSpec, Tier
from gpu_runtime.request import Request
from gpu_runtime.sim.metrics import RunSummary, summarize
from gpu_runtime.sim.simulator import Simulator, make_replica
from gpu_runtime.sim.workload import (
    TierSpec,
    TraceRow,
    build_requests,
    bursty_times,
    load_trace,
    poisson_times,
    trace_times,
)

log = logging.getLogger(__name__)

ARRIVALS = ("poisson", "trace", "bursty")
TRACES = ("conv", "code")  # the Azure 2023 traces the repository holds; any other trace is a CSV path
SILO = "silo"  # not a scheduler: each QoS bucket on a replica of its own (the siloed deployment QoServe compares)


@dataclass
class Experiment:
    trace: str = "conv"  # conv | code (Azure 2023) or a CSV path
    num_requests: int = 400  # subsample of the trace
    seed: int = 0
    kv_blocks: int = 30000
    block_size: int = 16
    max_prompt: int = 8192
    max_tokens: int = 4096  # what every request asks for; it stops at the trace's output length (EOS)
    noise: float = 0.0  # relative latency noise of the simulated executor
    arrivals: str = "poisson"  # poisson | trace (the trace's timestamps rescaled to the QPS) | bursty


def trace_rows(exp: Experiment) -> tuple[TraceRow, ...]:
    """The rows of ``exp.trace``: a bundled trace's name or a CSV path."""
    return load_trace(exp.trace) if exp.trace in TRACES else load_trace("custom", exp.trace)


def make_arrivals(exp: Experiment, tiers: list[TierSpec], qps: float | None = None,
                  bursty: tuple[float, float, float, float] | None = None,
                  mode: str | None = None) -> list[Request]:
    """Arrivals by ``mode`` (default ``exp.arrivals``; ``bursty`` given implies bursty):
    Poisson at ``qps``; the trace's own timestamps rescaled to ``qps``; or ``bursty`` =
    (low qps, high qps, period s, duration s)."""
    mode = mode or ("bursty" if bursty is not None else exp.arrivals)
    if mode not in ARRIVALS:
        raise ValueError(f"unknown arrivals {mode!r}; choose from {', '.join(ARRIVALS)}")
    rng = random.Random(exp.seed)
    rows = trace_rows(exp)
    if mode == "bursty":
        if bursty is None:
            raise ValueError("bursty arrivals need (low qps, high qps, period s, duration s)")
        times = bursty_times(bursty[3], bursty[0], bursty[1], bursty[2], rng)
    elif mode == "trace":
        assert qps is not None
        times = trace_times(rows, exp.num_requests, qps)
    else:
        assert qps is not None
        times = poisson_times(exp.num_requests, qps, rng)
    return build_requests(rows, times, tiers, rng, max_prompt=exp.max_prompt, max_tokens=exp.max_tokens)


def run_policy(policy: str, cost_model: CostModel, exp: Experiment, tiers: list[TierSpec], qps: float | None = None,
               bursty: tuple[float, float, float, float] | None = None, by: str = "tier",
               stop_above: float | None = None, **sched_config) -> RunSummary:
    """``stop_above``: end the run as soon as more than this share of its requests finished late (the
    summary then reports a violation rate above it; capacity search needs no more)."""
    return summarize(simulate(policy, cost_model, exp, tiers, qps, bursty, stop_above, **sched_config), by)


def policies() -> list[str]:
    """What ``run_policy`` simulates: every registered scheduler, and the silo baseline."""
    from gpu_runtime.scheduler.registry import available

    return [*available(), SILO]


def simulate(policy: str, cost_model: CostModel, exp: Experiment, tiers: list[TierSpec], qps: float | None = None,
             bursty: tuple[float, float, float, float] | None = None, stop_above: float | None = None,
             **sched_config) -> list[Request]:
    """``run_policy`` without the summary: every request as the run left it (for per-request reports)."""
    reqs = make_arrivals(exp, tiers, qps, bursty)
    limit = None if stop_above is None else int(stop_above * len(reqs))
    if policy == SILO:
        return _run_silo(reqs, cost_model, exp, tiers, max_violations=limit, **sched_config)
    rep = make_replica(policy, policy, cost_model, exp.kv_blocks, exp.block_size, exp.noise, exp.seed,
                       **sched_config)
    return Simulator([rep], max_violations=limit).run(reqs)


def silo_buckets(tiers: list[TierSpec]) -> list[QoSSpec]:
    """The QoS buckets a siloed deployment gives one replica each (Q1, Q2, Q3): tiers differing
    only in free/paid share a bucket."""
    out: list[QoSSpec] = []
    for t in tiers:
        key = dataclasses.replace(t.qos, tier=Tier.PAID)
        if key not in out:
            out.append(key)
    return out


def _run_silo(reqs: list[Request], cost_model: CostModel, exp: Experiment, tiers: list[TierSpec],
              interactive_chunk: int = 256, batch_chunk: int = 2048, max_violations: int | None = None,
              **_) -> list[Request]:
    """Siloed deployment (QoServe 4.1.2): one replica per QoS bucket, each with the full KV; Sarathi-FCFS
    with a small chunk for interactive buckets (Q1) and a big one for batch buckets (Q2, Q3).

    The replicas stand for separate machines, so capacity is compared per machine by the caller
    (``len(silo_buckets(tiers))`` machines)."""
    buckets = silo_buckets(tiers)
    reps = [make_replica(f"silo-{i}-{q.qos_class}", "sarathi-fcfs", cost_model, exp.kv_blocks, exp.block_size,
                         exp.noise, exp.seed,
                         chunk_size=interactive_chunk if q.qos_class is QoSClass.INTERACTIVE else batch_chunk)
            for i, q in enumerate(buckets)]
    index = {q: i for i, q in enumerate(buckets)}
    sim = Simulator(reps, router=lambda r: index[dataclasses.replace(r.qos, tier=Tier.PAID)],
                    max_violations=max_violations)
    return sim.run(reqs)
