"""Real-time runs and their replay in the simulator (simulator fidelity).

A real-time run sends trace requests to a real engine in wall-clock time, with token counts
scaled down to what the machine can serve (``scaled_rows``) and every request asking for exactly
its scaled output length. ``replay`` puts the same arrivals, lengths and QoS through the
simulator with the same policy code, and ``bucket_stats`` / ``fidelity`` set predicted beside
measured: TTFT and TBT p50/p99 per bucket, violations, and the mean absolute percentage error.
A replayed job reaches the simulated engine when the measured one reached the worker (the
service's dispatch hop, where recorded); its deadlines count from submission, as they did.
"""

from __future__ import annotations

import dataclasses
import random
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from gpu_runtime.costmodel.base import CostModel
from gpu_runtime.metrics import request_metrics
from gpu_runtime.qos import QoSClass, QoSSpec
from gpu_runtime.sampling import SamplingParams
from gpu_runtime.scheduler.registry import config_fields
from gpu_runtime.sim.simulator import Simulator, make_replica
from gpu_runtime.sim.workload import SimRequest, TierSpec, TraceRow, build_requests, poisson_times


# a policy the vLLM worker runs -> the simulator's model of it (coserve's own policies are the same code in both)
SIMULATED = {"qoserve": "qoserve", "sarathi-edf": "sarathi-edf", "vllm-fcfs": "vllm-v1-fcfs",
             "vllm-priority": "vllm-v1-priority"}


def vllm_limits(policy: str, max_num_batched_tokens: int, max_num_seqs: int) -> dict[str, int]:
    """The simulated ``policy``'s config as a vLLM engine's step limits bound it there: QoServe's chunk ceiling and
    vLLM's step cap are the engine's max_num_batched_tokens, the requests holding KV its max_num_seqs."""
    fields = config_fields(policy)
    return {k: v for k, v in (("chunk_ceiling", max_num_batched_tokens),
                              ("max_num_batched_tokens", max_num_batched_tokens),
                              ("max_num_seqs", max_num_seqs)) if k in fields}


def scaled_rows(rows: tuple[TraceRow, ...], length_scale: float, max_prompt: int) -> tuple[TraceRow, ...]:
    """The trace with prompt and output token counts times ``length_scale`` (at least 1 each)."""
    return tuple(TraceRow(r.timestamp, min(max_prompt, max(1, round(r.prompt_len * length_scale))),
                          max(1, round(r.output_len * length_scale))) for r in rows)


def scaled_tiers(tiers: list[TierSpec], deadline_scale: float) -> list[TierSpec]:
    """Batch tiers with their completion deadlines (TTLT) times ``deadline_scale``; interactive ones unchanged."""
    out = []
    for t in tiers:
        if t.qos.qos_class is QoSClass.BATCH:
            assert t.qos.ttlt_s is not None
            t = dataclasses.replace(t, qos=dataclasses.replace(t.qos, ttlt_s=t.qos.ttlt_s * deadline_scale))
        out.append(t)
    return out


def realtime_requests(rows: tuple[TraceRow, ...], qps: float, minutes: float, tiers: list[TierSpec],
                      seed: int = 0) -> list[SimRequest]:
    """Poisson arrivals at ``qps`` for ``minutes``; each asks for exactly its output length (``max_tokens``
    = the row's output, EOS ignored), which a real engine can be told and a simulated one stops at."""
    rng = random.Random(seed)
    times = [t for t in poisson_times(int(qps * minutes * 60 * 1.5) + 10, qps, rng) if t < minutes * 60]
    reqs = build_requests(rows, times, tiers, rng)
    for r in reqs:
        r.sampling = SamplingParams(max_tokens=r.stop_after or 1, ignore_eos=True)
    return reqs


@dataclass(frozen=True)
class JobResult:
    """One job of a run, measured or predicted. Times are seconds; ``arrival_s`` counts from the run's start."""

    bucket: str  # the tier's name in the mix, e.g. Q1-paid
    qos: QoSSpec
    arrival_s: float
    prompt_tokens: int
    output_tokens: int  # asked for
    finished: bool
    ttft_s: float | None
    tbt_p50_s: float | None
    tbt_p99_s: float | None
    ttlt_s: float | None
    slo_met: bool | None
    relegations: int = 0
    status: str = ""
    queue_s: float | None = None  # arrival to its first prompt chunk (None: not recorded, or never scheduled)
    dispatch_s: float | None = None  # arrival to the worker's lease: the API -> Redis -> Celery hop (None: unknown)

    @property
    def violated(self) -> bool:
        return not (self.finished and self.slo_met)


def replay(jobs: list[JobResult], policy: str, cost_model: CostModel, kv_blocks: int, block_size: int,
           until_s: float | None = None, plan_cost_model: CostModel | None = None,
           **sched_config) -> list[JobResult]:
    """The same arrivals, lengths and QoS through the simulator under ``policy``; the run stops at
    ``until_s`` (what is unfinished then stays unfinished, as in the measured run). Passes take
    ``cost_model``'s time; the policy plans with ``plan_cost_model`` (default: the same), as the
    engine's policy planned with its own profile."""
    reqs = []
    for i, j in enumerate(jobs):
        sp = SamplingParams(max_tokens=j.output_tokens, ignore_eos=True)
        reqs.append(SimRequest(f"replay-{i}", [1] * j.prompt_tokens, sp, j.qos, j.arrival_s,
                               app_id=f"trace-{j.bucket}", stop_after=j.output_tokens))
    rep = make_replica(policy, policy, cost_model, kv_blocks, block_size, plan_cost_model=plan_cost_model,
                       **sched_config)
    # a measured job reached the engine only after the service's dispatch hop; its deadlines count from submission
    dispatched = {r.request_id: r.arrival_time + j.dispatch_s for r, j in zip(reqs, jobs, strict=True)
                  if j.dispatch_s is not None}
    done = Simulator([rep], max_time=until_s).run(reqs, reaches_engine=dispatched)
    by_id = {r.request_id: r for r in done}
    out = []
    for i, j in enumerate(jobs):
        r = by_id[f"replay-{i}"]
        m = request_metrics(r)
        out.append(dataclasses.replace(j, finished=r.status.finished, ttft_s=m.ttft_s, tbt_p50_s=m.tbt_p50_s,
                                       tbt_p99_s=m.tbt_p99_s, ttlt_s=m.ttlt_s, slo_met=m.slo_met,
                                       relegations=r.relegation_count, status=str(r.status), queue_s=m.queue_s))
    return out


@dataclass(frozen=True)
class BucketStats:
    """TTFT p50/p99 over a bucket's jobs; TBT p50 = median of the jobs' median gaps, TBT p99 = the
    99th percentile of the jobs' p99 gaps (the worker records per-job percentiles, not every gap)."""

    n: int
    violations: int
    relegated: int
    ttft_p50: float
    ttft_p99: float
    tbt_p50: float
    tbt_p99: float

    @property
    def violation_rate(self) -> float:
        return self.violations / self.n if self.n else 0.0


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def bucket_stats(jobs: list[JobResult]) -> dict[str, BucketStats]:
    groups: dict[str, list[JobResult]] = defaultdict(list)
    for j in jobs:
        groups[j.bucket].append(j)
    out = {}
    for name in sorted(groups):
        js = groups[name]
        ttft = [j.ttft_s for j in js if j.ttft_s is not None]
        p50 = [j.tbt_p50_s for j in js if j.tbt_p50_s is not None]
        p99 = [j.tbt_p99_s for j in js if j.tbt_p99_s is not None]
        out[name] = BucketStats(len(js), sum(j.violated for j in js), sum(1 for j in js if j.relegations),
                                _pct(ttft, 50), _pct(ttft, 99), _pct(p50, 50), _pct(p99, 99))
    return out


FIDELITY_METRICS = ("ttft_p50", "ttft_p99", "tbt_p50", "tbt_p99")


@dataclass(frozen=True)
class Fidelity:
    """Predicted beside measured, per bucket and metric: (measured, predicted, absolute % error)."""

    rows: list[tuple[str, str, float, float, float]]

    @property
    def mape(self) -> float:
        errs = [r[4] for r in self.rows]
        return float(np.mean(errs)) if errs else float("nan")


def fidelity(measured: dict[str, BucketStats], predicted: dict[str, BucketStats]) -> Fidelity:
    """Absolute percentage errors of the simulator's TTFT/TBT p50 and p99 per bucket (where both are defined)."""
    rows = []
    for bucket, m in measured.items():
        p = predicted.get(bucket)
        if p is None:
            continue
        for name in FIDELITY_METRICS:
            mv, pv = getattr(m, name), getattr(p, name)
            if np.isfinite(mv) and np.isfinite(pv) and mv > 0:
                rows.append((bucket, name, mv, pv, abs(pv - mv) / mv))
    return Fidelity(rows)
