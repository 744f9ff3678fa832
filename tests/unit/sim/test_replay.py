"""Real-time workloads scaled to a machine, their replay in the simulator, and the fidelity figures
(gpu_runtime/sim/replay.py), plus the request bodies ops/bench_realtime.py sends."""

from __future__ import annotations

import dataclasses
import math

import pytest

from app.schemas import JobCreate
from gpu_runtime.costmodel.profile import A100_PROFILE, scheduling_cost_model
from gpu_runtime.qos import QoSClass, QoSSpec, TbtAnchor, Tier
from gpu_runtime.sim.replay import (
    BucketStats,
    JobResult,
    bucket_stats,
    fidelity,
    realtime_requests,
    replay,
    scaled_rows,
    scaled_tiers,
)
from gpu_runtime.sim.workload import TraceRow, paper_tiers

ROWS = (TraceRow(0.0, 1000, 200), TraceRow(1.0, 7, 3), TraceRow(2.0, 40000, 16))


def test_scaled_rows_shrink_lengths_keep_one_token_and_cap_prompts():
    got = scaled_rows(ROWS, 1 / 16, max_prompt=2048)
    assert [(r.prompt_len, r.output_len) for r in got] == [(62, 12), (1, 1), (2048, 1)]
    assert [r.timestamp for r in got] == [0.0, 1.0, 2.0]


def test_scaled_tiers_shorten_batch_deadlines_only():
    tiers = paper_tiers(2.0, free_share=0.2)
    got = scaled_tiers(tiers, 0.1)
    for old, new in zip(tiers, got, strict=True):
        if old.qos.qos_class is QoSClass.BATCH:
            assert new.qos.ttlt_s == pytest.approx(old.qos.ttlt_s * 0.1)
        else:
            assert new.qos == old.qos
        assert (new.name, new.share, new.qos.tier) == (old.name, old.share, old.qos.tier)


def test_realtime_requests_ask_for_exactly_their_output_within_the_window():
    tiers = paper_tiers(1.0)
    reqs = realtime_requests(scaled_rows(ROWS, 0.5, 4096), qps=5.0, minutes=1.0, tiers=tiers, seed=3)
    assert 200 < len(reqs) < 400  # ~300 Poisson arrivals in 60 s
    assert all(0 <= r.arrival_time < 60 for r in reqs)
    assert all(r.sampling.max_tokens == r.stop_after and r.sampling.ignore_eos for r in reqs)
    assert {r.app_id for r in reqs} == {"trace-Q1", "trace-Q2", "trace-Q3"}
    again = realtime_requests(scaled_rows(ROWS, 0.5, 4096), qps=5.0, minutes=1.0, tiers=tiers, seed=3)
    assert [(r.arrival_time, r.prompt_len) for r in again] == [(r.arrival_time, r.prompt_len) for r in reqs]


def _job(bucket: str, qos: QoSSpec, arrival: float, ttft: float | None = 1.0, tbt50: float | None = 0.05,
         tbt99: float | None = 0.1, finished: bool = True, met: bool | None = True, prompt: int = 64,
         output: int = 8) -> JobResult:
    return JobResult(bucket, qos, arrival, prompt, output, finished, ttft, tbt50, tbt99,
                     None if ttft is None else ttft + 1, met)


INTERACTIVE = QoSSpec(QoSClass.INTERACTIVE, Tier.PAID, ttft_s=6.0, tbt_s=0.05, tbt_anchor=TbtAnchor.ARRIVAL)
BATCH = QoSSpec(QoSClass.BATCH, Tier.FREE, ttlt_s=60.0)


def test_bucket_stats_count_unfinished_and_missed_jobs_as_violations():
    jobs = [_job("Q1", INTERACTIVE, 0.0, ttft=1.0), _job("Q1", INTERACTIVE, 1.0, ttft=3.0, met=False),
            _job("Q2-free", BATCH, 2.0, ttft=None, tbt50=None, tbt99=None, finished=False, met=None)]
    stats = bucket_stats(jobs)
    assert stats["Q1"].n == 2 and stats["Q1"].violations == 1
    assert stats["Q1"].ttft_p50 == pytest.approx(2.0)
    assert stats["Q2-free"].violations == 1 and math.isnan(stats["Q2-free"].ttft_p50)


def test_fidelity_is_the_mean_absolute_percentage_error_over_defined_figures():
    measured = {"Q1": BucketStats(10, 0, 0, 1.0, 2.0, 0.05, 0.10), "Q2": BucketStats(5, 0, 0, 4.0, 8.0,
                                                                                      float("nan"), 0.2)}
    predicted = {"Q1": BucketStats(10, 0, 0, 1.1, 1.8, 0.05, 0.13), "Q2": BucketStats(5, 0, 0, 2.0, 8.0, 0.1, 0.2)}
    fid = fidelity(measured, predicted)
    assert len(fid.rows) == 7  # Q2's TBT p50 was not measured
    # 10%, 10%, 0%, 30% for Q1; 50%, 0%, 0% for Q2
    assert fid.mape == pytest.approx((0.1 + 0.1 + 0 + 0.3 + 0.5 + 0 + 0) / 7)


def test_replay_runs_the_same_arrivals_through_the_policy_and_stops_at_the_cut():
    cost_model = scheduling_cost_model(A100_PROFILE)
    jobs = [_job("Q1", INTERACTIVE, 0.1 * i, ttft=None, finished=False, met=None, prompt=256, output=16)
            for i in range(20)] + [_job("Q2-free", BATCH, 0.5, ttft=None, finished=False, met=None, output=32)]
    predicted = replay(jobs, "qoserve", cost_model, kv_blocks=4000, block_size=16)
    assert [p.arrival_s for p in predicted] == [j.arrival_s for j in jobs]
    assert all(p.finished and p.slo_met for p in predicted)
    assert all(p.ttft_s is not None and p.ttft_s > 0 for p in predicted)
    # TTLT covers the prompt and all 16 (32) output tokens
    assert all(p.ttlt_s > p.ttft_s for p in predicted)
    # queue time: arrival to the first prompt chunk, within the TTFT; some of the 20 prompts waited for others
    assert all(p.queue_s is not None and 0 <= p.queue_s < p.ttft_s for p in predicted)
    assert max(p.queue_s for p in predicted) > 0
    cut = replay(jobs, "qoserve", cost_model, kv_blocks=4000, block_size=16, until_s=0.5)
    assert any(not p.finished for p in cut)
    assert all(p.violated for p in cut if not p.finished)


@pytest.fixture(scope="module")
def bench():
    from ops import bench_realtime

    return bench_realtime


def test_request_bodies_are_valid_jobs_of_their_tier_and_class(bench):
    tiers = scaled_tiers(paper_tiers(2.8, free_share=0.2), 1 / 48)
    reqs = realtime_requests(scaled_rows(ROWS, 1 / 16, 2048), qps=2.0, minutes=1.0, tiers=tiers, seed=0)
    seen = set()
    for r in reqs:
        bucket = r.app_id.removeprefix("trace-")
        spec = JobCreate(**bench.job_body(r, bucket, "x"))
        assert spec.tier == str(r.qos.tier) and spec.max_tokens == r.sampling.max_tokens and spec.ignore_eos
        if r.qos.qos_class is QoSClass.INTERACTIVE:
            assert spec.kind == "interactive" and spec.ttft_ms == pytest.approx(r.qos.ttft_s * 1e3)
            assert spec.tbt_anchor == "arrival"
        else:
            assert spec.kind == "batch" and spec.deadline_window_s == pytest.approx(r.qos.ttlt_s)
        seen.add(bucket)
    assert seen == {t.name for t in tiers}


def test_saved_jobs_load_back_unchanged(bench):
    job = dataclasses.replace(_job("Q1-free", dataclasses.replace(INTERACTIVE, tier=Tier.FREE), 3.5), relegations=2,
                              status="succeeded")
    assert bench._job_from_json(bench._job_json(job)) == job
    timed = dataclasses.replace(job, queue_s=0.25)
    assert bench._job_from_json(bench._job_json(timed)) == timed
    older = {k: v for k, v in bench._job_json(timed).items() if k != "queue_s"}  # a run saved before queue times
    assert bench._job_from_json(older).queue_s is None


def test_a_replayed_job_reaches_the_engine_after_its_dispatch_hop():
    """A job the service took 0.5 s to hand to the worker starts no earlier in the replay; its TTFT still
    counts from submission, so the hop costs it 0.5 s of its deadline, as it did on the engine."""
    cost_model = scheduling_cost_model(A100_PROFILE)
    jobs = [_job("Q1", INTERACTIVE, 0.0, ttft=None, finished=False, met=None, prompt=256, output=4)]
    direct = replay(jobs, "qoserve", cost_model, kv_blocks=4000, block_size=16)[0]
    hop = replay([dataclasses.replace(jobs[0], dispatch_s=0.5)], "qoserve", cost_model, kv_blocks=4000,
                 block_size=16)[0]
    assert hop.ttft_s == pytest.approx(direct.ttft_s + 0.5) and hop.queue_s == pytest.approx(0.5)
    assert direct.queue_s == 0.0


def test_free_jobs_served_after_a_late_paid_job_left_do_not_count(bench):
    """A late paid job waits from 0 s to 10 s (its TTLT). A free job on time arrived at 5 s: it counts when its
    prompt ran (queue time 1 s: 6-7 s) while the paid job waited, not when its prompt only ran once the paid job
    had left (queue time 6 s: 11-12 s). Without a queue time its whole wait counts (an upper bound)."""
    free = dataclasses.replace(INTERACTIVE, tier=Tier.FREE)
    paid_late = _job("Q1-paid", INTERACTIVE, 0.0, ttft=9.0, met=False)  # TTLT 10 s
    on_time = _job("Q1-free", free, 5.0, ttft=7.0)
    assert bench.free_while_paid_late([paid_late, dataclasses.replace(on_time, queue_s=6.0)]) == 0
    assert bench.free_while_paid_late([paid_late, dataclasses.replace(on_time, queue_s=1.0, ttft_s=2.0)]) == 1
    assert bench.free_while_paid_late([paid_late, on_time]) == 1


def test_every_engine_policy_is_replayed_with_a_simulator_policy_of_the_registry(bench):
    from gpu_runtime.scheduler.registry import available

    assert set(bench.SIMULATED) == set(bench.POLICIES)
    assert set(bench.SIMULATED.values()) <= set(available())
    # vLLM's own schedulers are replayed with the v1 model, not v0's whole-prompt policy
    assert bench.SIMULATED["vllm-fcfs"] == "vllm-v1-fcfs" and bench.SIMULATED["vllm-priority"] == "vllm-v1-priority"
