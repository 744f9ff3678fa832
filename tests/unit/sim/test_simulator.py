import random

import pytest

from gpu_runtime.costmodel.linear import PiecewiseLinearCostModel
from gpu_runtime.engine import Engine
from gpu_runtime.executor.base import BatchPlan, DecodeEntry, PrefillChunk
from gpu_runtime.executor.sim import SimExecutor
from gpu_runtime.qos import QoSClass, QoSSpec, Tier
from gpu_runtime.request import Request
from gpu_runtime.sampling import SamplingParams
from gpu_runtime.scheduler.registry import create_scheduler
from gpu_runtime.sim.acceptance import GeometricAcceptance
from gpu_runtime.sim.capacity import capacity_search
from gpu_runtime.sim.metrics import relegation_summary, summarize
from gpu_runtime.sim.simulator import Simulator, make_replica
from gpu_runtime.sim.workload import bursty_times, load_trace, paper_tiers, poisson_times, trace_times
from gpu_runtime.speculation.token_tree import TokenTree

COST = PiecewiseLinearCostModel([0.010, 0.0, 1e-4, 0.0, 0.0, 0.0], 0.0)


def test_sim_executor_advances_the_clock_by_the_predicted_latency_and_tracks_kv():
    ex = SimExecutor(COST, kv_blocks=10, block_size=16)
    ex.add_request("a", SamplingParams())
    res = ex.step(BatchPlan([PrefillChunk("a", 0, [1] * 40, sample=True)]))
    assert res.tokens == {"a": [7]}
    assert ex.now() == pytest.approx(0.010 + 40e-4)
    assert ex.capacity().free_blocks == 7
    ex.step(BatchPlan(decodes=[DecodeEntry("a", 40, 7)]))
    assert ex.now() == pytest.approx(0.010 + 40e-4 + 0.010 + 1e-4)
    ex.free("a")
    assert ex.capacity().free_blocks == 10


def test_sim_executor_samples_tree_acceptance_and_frees_rejected_slots():
    acc = GeometricAcceptance(alphas=[1.0])  # every first child accepted
    ex = SimExecutor(COST, kv_blocks=100, block_size=4, acceptance=acc)
    ex.add_request("a", SamplingParams())
    ex.step(BatchPlan([PrefillChunk("a", 0, [1] * 8, sample=True)]))
    tree = TokenTree([5, 6, 9], [-1, 0, -1], [0.999, 0.99, 0.001])
    res = ex.step(BatchPlan(decodes=[DecodeEntry("a", 8, 7, tree)]))
    assert res.accepted_nodes["a"][:1] == [0]
    assert len(res.tokens["a"]) == len(res.accepted_nodes["a"]) + 1
    assert ex.blocks.num_tokens("a") == 9 + len(res.accepted_nodes["a"])


def test_arrival_processes():
    rng = random.Random(0)
    t = poisson_times(2000, 4.0, rng)
    assert t == sorted(t) and 2000 / t[-1] == pytest.approx(4.0, rel=0.1)
    b = bursty_times(400.0, 1.0, 5.0, 100.0, random.Random(1))
    low = sum(1 for x in b if x < 100)
    high = sum(1 for x in b if 100 <= x < 200)
    assert high > 2.5 * low


def test_trace_loading_and_rescaled_timestamps():
    rows = load_trace("code")
    assert len(rows) > 1000 and all(r.prompt_len >= 1 and r.output_len >= 1 for r in rows[:100])
    times = trace_times(rows, 500, qps=2.0)
    assert times[0] == 0.0 and times[-1] == pytest.approx(250.0, rel=0.01)


def _requests(n, gap, prompt=200, out=20, tier=Tier.PAID):
    return [Request(f"r{i}", [1] * prompt, SamplingParams(max_tokens=out, ignore_eos=True),
                    QoSSpec(QoSClass.INTERACTIVE, tier, ttft_s=1.0, tbt_s=0.05), i * gap) for i in range(n)]


def test_simulator_runs_the_engine_and_meets_slos_at_low_load():
    rep = make_replica("r", "qoserve", COST, kv_blocks=2000)
    done = Simulator([rep]).run(_requests(20, gap=0.5))
    s = summarize(done)
    assert s.n == 20 and s.violations == 0
    assert all(r.num_output_tokens == 20 for r in done)
    assert rep.executor.capacity().free_blocks == 2000


def test_overload_causes_violations_and_capacity_search_brackets_them():
    def viol(qps):
        rep = make_replica("r", "sarathi-fcfs", COST, kv_blocks=4000)
        return summarize(Simulator([rep]).run(_requests(60, gap=1.0 / qps))).violation_rate

    assert viol(1.0) == 0.0 and viol(200.0) > 0.2
    best = capacity_search(viol, 1.0, 200.0, target=0.01, iters=5)
    assert 1.0 <= best < 200.0 and viol(best) <= 0.01


def test_paper_tiers_scale_and_split_free_share():
    tiers = paper_tiers(scale=2.0, free_share=0.2)
    assert sum(t.share for t in tiers) == pytest.approx(1.0)
    q1 = next(t for t in tiers if t.name == "Q1-paid")
    assert q1.qos.ttft_s == 12.0 and q1.qos.tbt_s == 0.1
    assert {t.qos.tier for t in tiers} == {Tier.PAID, Tier.FREE}


def test_engine_with_sim_executor_and_scheduler_directly():
    ex = SimExecutor(COST, kv_blocks=500)
    eng = Engine(ex, create_scheduler("sarathi-edf", cost_model=COST, executor=ex))
    for r in _requests(5, gap=0.0):
        eng.add_request(r)
    outs = eng.run_until_idle(max_steps=1000)
    assert sum(o.finished for o in outs) == 5


def test_trace_timestamps_wrap_around_without_going_back_in_time():
    rows = load_trace("code")[:50]
    times = trace_times(rows, 170, qps=1.0)  # more than three laps of the 50-row trace
    assert all(a <= b for a, b in zip(times, times[1:], strict=False))
    assert times[0] == 0.0 and times[-1] == pytest.approx(170.0)


def test_make_arrivals_modes():
    from gpu_runtime.sim.runner import Experiment, make_arrivals

    tiers = paper_tiers()
    exp = Experiment(trace="code", num_requests=40, seed=1)
    poisson = make_arrivals(exp, tiers, qps=2.0)
    trace = make_arrivals(exp, tiers, qps=2.0, mode="trace")
    bursty = make_arrivals(exp, tiers, bursty=(1.0, 5.0, 10.0, 40.0))
    assert len(poisson) == len(trace) == 40 and len(bursty) > 40
    for reqs in (poisson, trace, bursty):
        times = [r.arrival_time for r in reqs]
        assert times == sorted(times)
    assert trace[-1].arrival_time == pytest.approx(20.0)
    with pytest.raises(ValueError):
        make_arrivals(exp, tiers, qps=2.0, mode="uniform")


def test_trace_requests_ask_for_max_tokens_and_stop_at_the_hidden_trace_length():
    from gpu_runtime.sim.workload import build_requests

    rows = load_trace("conv")[:30]
    reqs = build_requests(rows, [0.1 * i for i in range(12)], paper_tiers(), random.Random(0), max_prompt=300,
                          max_tokens=4096)
    assert all(r.sampling.max_tokens == 4096 and not r.sampling.ignore_eos for r in reqs)
    truth = {r.request_id: r.stop_after for r in reqs}
    assert len(set(truth.values())) > 1  # the trace's lengths, not one cap
    rep = make_replica("r", "qoserve", COST, kv_blocks=20000)
    done = Simulator([rep]).run(reqs)
    assert all(r.status.finished and r.num_output_tokens == truth[r.request_id] for r in done)
    assert rep.executor.stop_after == {} and rep.executor.capacity().free_blocks == 20000
    # the scheduler learned lengths from finished requests (it never saw ``stop_after``)
    hist = rep.engine.scheduler.history.stats
    assert sum(s.n for s in hist.values()) == len(reqs)


def test_silo_runs_one_replica_per_qos_bucket(monkeypatch):
    from gpu_runtime.sim import runner
    from gpu_runtime.sim.runner import Experiment, run_policy, silo_buckets

    assert len(silo_buckets(paper_tiers())) == 3
    assert len(silo_buckets(paper_tiers(free_share=0.2))) == 3  # free and paid of a bucket share its replica
    seen = {}

    def spy(reps, router, **kw):
        seen["chunks"] = [r.engine.scheduler.config.chunk_size for r in reps]
        sim = Simulator(reps, router=router, **kw)
        seen["sim"] = sim
        return sim

    monkeypatch.setattr(runner, "Simulator", spy)
    exp = Experiment(trace="conv", num_requests=30, seed=0, max_prompt=256, max_tokens=64)
    s = run_policy("silo", COST, exp, paper_tiers(0.5, free_share=0.2), qps=4.0)
    assert s.n == 30
    assert seen["chunks"] == [256, 2048, 2048]  # Q1 interactive small chunk, Q2 and Q3 batch big chunks
    for r in seen["sim"].requests.values():
        assert (seen["sim"].router(r) == 0) == (r.qos.qos_class is QoSClass.INTERACTIVE)


def test_simulator_stops_once_too_many_requests_finished_late():
    reqs = _requests(80, gap=0.001)  # a burst far above what one replica prefills within a 1 s TTFT
    full = summarize(Simulator([make_replica("r", "sarathi-fcfs", COST, kv_blocks=4000)]).run(reqs))
    assert full.violation_rate > 0.2
    sim = Simulator([make_replica("r", "sarathi-fcfs", COST, kv_blocks=4000)], max_violations=2)
    early = summarize(sim.run(_requests(80, gap=0.001)))
    assert sim.stopped_early and len(sim.finished) < 80
    assert early.violations > 2  # unfinished count as violations: still above the limit the search compares
    calm = Simulator([make_replica("r", "sarathi-fcfs", COST, kv_blocks=4000)], max_violations=0)
    assert summarize(calm.run(_requests(10, gap=0.5))).violations == 0 and not calm.stopped_early


def test_relegated_free_jobs_resume_after_a_burst_and_paid_ones_keep_their_deadlines():
    # A burst of free prompts (12k tokens, ~1.2 s of prefill against a 1 s TTFT), then a few paid ones:
    # the free jobs that cannot make it are relegated, the paid ones meet their TTFT, and the relegated
    # jobs are served once the burst has passed.
    def req(i, tier, t, prompt):
        return Request(f"{tier}{i}", [1] * prompt, SamplingParams(max_tokens=20, ignore_eos=True),
                       QoSSpec(QoSClass.INTERACTIVE, tier, ttft_s=1.0, tbt_s=0.2), t)

    reqs = [req(i, Tier.FREE, i * 1e-3, 600) for i in range(20)] + [req(i, Tier.PAID, 0.6, 400) for i in range(5)]
    done = Simulator([make_replica("r", "qoserve", COST, kv_blocks=4000)]).run(reqs)
    s = summarize(done)
    assert s.tiers["paid"].violations == 0 and s.tiers["free"].violations > 0
    rel = relegation_summary(done, low_phase=lambda t: t > 1.0)
    assert rel.relegated > 0 and rel.relegated_paid == 0
    assert rel.finished == rel.relegated and rel.unfinished == 0  # every relegated job came back and finished
    # the last job arrives at 0.6 s: they finished after the arrivals (the drain), in no phase of them
    assert rel.finished_after_arrivals == rel.finished and rel.finished_in_low == 0
    assert all(r.num_output_tokens == 20 for r in done)


def test_a_request_groups_by_its_trace_bucket_with_or_without_a_tier_in_its_app_id():
    from gpu_runtime.sim.metrics import tier_key

    def req(app_id):
        return Request("r", [1], SamplingParams(max_tokens=1), QoSSpec(QoSClass.BATCH, ttlt_s=1.0), 0.0,
                       app_id=app_id)

    buckets = [tier_key(req(a), by="bucket") for a in ("trace-Q1", "trace-Q2-paid", "trace-Q3-free")]
    assert buckets == ["Q1", "Q2", "Q3"]


def test_arrivals_during_a_step_that_emptied_the_replica_are_batched_into_the_next_step():
    # one-token jobs of 100 prompt tokens every 15 ms; a pass of one of them takes 20 ms and finishes it, so the
    # replica is idle at the end of every step with the arrivals of those 20 ms not yet handed over. The next
    # step must see them all at once (they share a pass: two take 30 ms), not start one job per step behind
    # the clock, falling 5 ms further behind with every job.
    reqs = [Request(f"r{k}", [1] * 100, SamplingParams(max_tokens=1, ignore_eos=True),
                    QoSSpec(QoSClass.BATCH, Tier.PAID, ttlt_s=100.0), k * 0.015) for k in range(60)]
    rep = make_replica("r", "sarathi-fcfs", COST, kv_blocks=100_000, chunk_size=2048)
    done = Simulator([rep]).run(reqs)
    assert len({round(r.token_times[0], 9) for r in done}) < len(done)  # some jobs share a pass
    assert max(r.token_times[0] - r.arrival_time for r in done) < 0.08  # one job a pass: the last waits 0.3 s
