"""One simulated experiment: a policy, a trace, an arrival process and a tier mix -> summary."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass

from gpu_runtime.costmodel.base import CostModel
from gpu_runtime.qos import QoSClass
from gpu_runtime.sim.metrics import RunSummary, summarize
from gpu_runtime.sim.simulator import Simulator, make_replica
from gpu_runtime.sim.workload import TierSpec, build_requests, bursty_times, load_trace, poisson_times

log = logging.getLogger(__name__)


@dataclass
class Experiment:
    trace: str = "conv"  # conv | code (Azure 2023) or a CSV path
    num_requests: int = 400  # subsample of the trace
    seed: int = 0
    kv_blocks: int = 30000
    block_size: int = 16
    max_prompt: int = 8192
    noise: float = 0.0  # relative latency noise of the simulated executor


def make_arrivals(exp: Experiment, tiers: list[TierSpec], qps: float | None = None,
                  bursty: tuple[float, float, float, float] | None = None):
    """Poisson at ``qps``, or ``bursty`` = (low qps, high qps, period s, duration s)."""
    rng = random.Random(exp.seed)
    rows = load_trace(exp.trace) if exp.trace in ("conv", "code") else load_trace("custom", exp.trace)
    if bursty is not None:
        times = bursty_times(bursty[3], bursty[0], bursty[1], bursty[2], rng)
    else:
        assert qps is not None
        times = poisson_times(exp.num_requests, qps, rng)
    return build_requests(rows, times, tiers, rng, max_prompt=exp.max_prompt)


def run_policy(policy: str, cost_model: CostModel, exp: Experiment, tiers: list[TierSpec], qps: float | None = None,
               bursty: tuple[float, float, float, float] | None = None, by: str = "tier",
               **sched_config) -> RunSummary:
    reqs = make_arrivals(exp, tiers, qps, bursty)
    if policy == "silo":
        return _run_silo(reqs, cost_model, exp, by, **sched_config)
    rep = make_replica(policy, policy, cost_model, exp.kv_blocks, exp.block_size, exp.noise, exp.seed,
                       **sched_config)
    done = Simulator([rep]).run(reqs)
    return summarize(done, by)


def _run_silo(reqs, cost_model, exp, by, interactive_chunk: int = 256, batch_chunk: int = 2048,
              **_) -> RunSummary:
    """Siloed deployment: two replicas with the full KV each, interactive on Sarathi-FCFS(chunk small), batch on (chunk large).

    Two replicas stand for two machines, so capacity is compared per machine by the caller."""
    reps = [make_replica("silo-interactive", "sarathi-fcfs", cost_model, exp.kv_blocks, exp.block_size, exp.noise,
                         exp.seed, chunk_size=interactive_chunk),
            make_replica("silo-batch", "sarathi-fcfs", cost_model, exp.kv_blocks, exp.block_size, exp.noise,
                         exp.seed, chunk_size=batch_chunk)]
    sim = Simulator(reps, router=lambda r: 0 if r.qos.qos_class is QoSClass.INTERACTIVE else 1)
    return summarize(sim.run(reqs), by)
