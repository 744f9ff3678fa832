"""Property-based tests of the QoServe policies over random but valid requests and engine states.

Each property cites the QoServe paper's equation or Alg. 1 line (ALGORITHMS.md) or the code's own promise.
Settings are deterministic (derandomize) and untimed; PROPS_EXAMPLES=300 searches harder locally.
"""

from __future__ import annotations

import math
import os

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gpu_runtime.engine import Engine
from gpu_runtime.executor.sim import SimExecutor
from gpu_runtime.qos import QoSClass, QoSSpec, TbtAnchor, Tier
from gpu_runtime.request import Request, RequestStatus
from gpu_runtime.sampling import SamplingParams
from gpu_runtime.scheduler.chunking import ChunkBudget, build_search_space, decode_slack, min_slack
from gpu_runtime.scheduler.priority import LoadAdaptiveAlpha, first_deadline, hybrid_priority
from gpu_runtime.scheduler.registry import create_scheduler
from gpu_runtime.scheduler.relegation import (
    PaidRelegation,
    WorkEstimate,
    is_violated,
    predicted_finish,
    should_relegate,
)
from gpu_runtime.scheduler.request_queue import PriorityQueue

from tests.unit.scheduler.helpers import COST

PROPS = settings(max_examples=int(os.environ.get("PROPS_EXAMPLES", "40")), derandomize=True, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SPACE = [16, 32, 64, 128, 256, 512, 1024, 2048]

seconds = st.floats(0.01, 10.0, allow_nan=False, allow_infinity=False)


@st.composite
def qos_specs(draw) -> QoSSpec:
    tier = draw(st.sampled_from(Tier))
    if draw(st.booleans()):
        return QoSSpec(QoSClass.BATCH, tier, ttlt_s=draw(st.floats(1.0, 600.0)))
    delivered = draw(st.sampled_from([0, 0, 0, 3]))
    return QoSSpec(QoSClass.INTERACTIVE, tier, ttft_s=draw(seconds), tbt_s=draw(st.floats(0.01, 0.2)),
                   tbt_anchor=draw(st.sampled_from(TbtAnchor)), delivered=delivered,
                   first_token_s=draw(st.floats(0.0, 5.0)) if delivered else None)


@st.composite
def requests(draw, rid: str, now: float = 10.0) -> Request:
    """A waiting request: arrived before ``now``, possibly part-way through its prompt."""
    prompt = draw(st.integers(1, 3000))
    max_tokens = draw(st.integers(1, 200))
    req = Request(rid, [1] * prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), draw(qos_specs()),
                  draw(st.floats(0.0, now)))
    req.num_computed_tokens = draw(st.integers(0, prompt - 1))
    req.predicted_output_len = draw(st.integers(1, max_tokens))
    return req


@st.composite
def decodes(draw, rid: str, now: float = 10.0) -> Request:
    """A running decode: prompt done, 1.. tokens out at increasing times no later than ``now``."""
    req = draw(requests(rid, now))
    outputs = draw(st.integers(1, max(1, req.sampling.max_tokens - 1)))
    start = draw(st.floats(req.arrival_time, now))
    gaps = draw(st.lists(st.floats(0.0, 0.3), min_size=outputs - 1, max_size=outputs - 1))
    times = [start]
    for g in gaps:
        times.append(min(now, times[-1] + g))
    req.num_computed_tokens = req.prompt_len + outputs - 1
    req.output_token_ids = [7] * outputs
    req.token_times = times
    req.status = RequestStatus.DECODING
    req.relegation_count = draw(st.sampled_from([0, 0, 0, 1]))
    return req


def request_lists(make, max_size: int = 8):
    return st.integers(0, max_size).flatmap(lambda n: st.tuples(*[make(f"r{i}") for i in range(n)]))


estimates = st.builds(WorkEstimate, iteration_s=st.floats(0.001, 1.0), budget=st.integers(16, 2048),
                      decode_step_s=st.floats(0.001, 0.5), interactive_step_s=st.floats(0.0, 0.3))


def _rerun_decode() -> Request:
    """The minimal counterexample to min_slack == min(decode_slack): an on-schedule rerun (3 tokens delivered by an
    earlier attempt, the first 0.5 s after arrival) with one token of its own out."""
    req = Request("r0", [1], SamplingParams(max_tokens=10, ignore_eos=True),
                  QoSSpec(QoSClass.INTERACTIVE, ttft_s=1.0, tbt_s=0.1, delivered=3, first_token_s=0.5), 0.0)
    req.num_computed_tokens, req.output_token_ids, req.token_times = 1, [7], [0.6]
    req.status = RequestStatus.DECODING
    return req


# ---- dynamic chunking (Alg. 1 lines 5-7) ----

@PROPS
@given(request_lists(decodes), st.floats(0.0, 12.0))
@example((_rerun_decode(),), 0.7)
def test_min_slack_is_the_minimum_of_each_decodes_slack(reqs, now):
    # QoServe 3.2: the budget follows the minimum slack of the running decodes (min_slack inlines decode_slack)
    expected = min((decode_slack(r, now) for r in reqs), default=math.inf)
    assert min_slack(reqs, now) == expected or math.isclose(min_slack(reqs, now), expected, abs_tol=1e-9)


@PROPS
@given(request_lists(decodes), st.floats(0.0, 12.0), st.floats(0.0, 1.0), st.integers(0, 4000),
       st.one_of(st.none(), st.integers(0, 5000)))
def test_budget_is_the_largest_chunk_of_the_space_that_fits_the_slack(reqs, now, kv_free, start, queued):
    # Alg. 1 lines 5-7: C = the largest c of the (KV-aware) space with predicted time(c) x safety <= min slack
    budget = ChunkBudget(COST, SPACE, safety=1.2, kv_short_fraction=0.1)
    choice = budget.choose(list(reqs), now, kv_free, start, queued)
    space = SPACE if kv_free >= 0.1 else SPACE[:len(SPACE) // 2]
    assert choice.budget in space and choice.budget >= 1
    assert choice.context_tokens == sum(r.num_computed_tokens for r in reqs)
    again = budget.choose(list(reqs), now, kv_free, start, queued)  # deterministic: same input, same choice
    assert again == choice


@PROPS
@given(st.floats(0.0, 0.5), st.floats(0.0, 0.5), st.integers(1, 50), st.floats(0.01, 0.2))
def test_budget_is_monotone_in_slack(t1, t2, outputs, tbt):
    # QoServe 3.2: more slack never means a smaller chunk (C is the largest size that fits the slack)
    req = Request("d", [1] * 100, SamplingParams(max_tokens=100, ignore_eos=True),
                  QoSSpec(QoSClass.INTERACTIVE, ttft_s=1.0, tbt_s=tbt), 0.0)
    req.num_computed_tokens, req.output_token_ids = 100 + outputs - 1, [7] * outputs
    req.token_times = [0.5 + i * min(tbt, 0.01) for i in range(outputs)]  # on schedule: slack = D_n - now
    early, late = sorted((t1, t2))
    budget = ChunkBudget(COST, SPACE)
    base = req.token_times[-1]
    s_early, s_late = decode_slack(req, base + early), decode_slack(req, base + late)
    c_early, c_late = budget.choose([req], base + early).budget, budget.choose([req], base + late).budget
    if s_early >= s_late:
        assert c_early >= c_late


@PROPS
@given(st.integers(1, 256), st.one_of(st.none(), st.integers(1, 8192)), st.floats(1.05, 2.0))
@example(17, 2176, 1.25)  # the floor rounded down to 16: a chunk below the configured smallest budget
@example(100, 201, 2.005)  # 200.5 rounded up to 208: a chunk above the ceiling
def test_search_space_is_sorted_from_floor_to_top(floor, ceiling, growth):
    # QoServe 3.2: a discrete space from a small floor up to the saturation chunk (Sarathi's deadline scheduler)
    space = build_search_space(COST, floor, ceiling, growth)
    assert space == sorted(set(space)) and space[0] >= 1
    assert space[0] >= floor and space[-1] == max(ceiling or space[-1], floor)


# ---- hybrid priority (eq. 4/5) ----

@PROPS
@given(request_lists(requests, 10), st.floats(0.0, 0.05))
def test_priority_queue_pops_in_hybrid_order_and_alpha_zero_is_edf(reqs, alpha):
    # eq. 4/5: lower P runs first; a = 0 is EDF by the first deadline (eq. 1 / eq. 3)
    q = PriorityQueue(lambda r: hybrid_priority(r, alpha))
    for r in reqs:
        q.push(r)
    popped = [q.pop() for _ in range(len(reqs))]
    keys = [hybrid_priority(r, alpha) for r in popped]
    assert keys == sorted(keys)
    assert [r.request_id for r in popped] == [r.request_id for r in sorted(
        reqs, key=lambda r: (hybrid_priority(r, alpha), reqs.index(r)))]  # ties: first pushed first (total order)
    for r in reqs:
        assert hybrid_priority(r, 0.0) == first_deadline(r)


@PROPS
@given(requests("a"), st.floats(0.0, 0.05), st.integers(1, 500))
def test_priority_grows_with_remaining_work(req, alpha, more):
    # eq. 4/5: P = deadline + a x remaining work, so more prompt left never runs earlier (SRPF side)
    before = hybrid_priority(req, alpha)
    req.prompt_token_ids = req.prompt_token_ids + [1] * more
    assert hybrid_priority(req, alpha) >= before


@PROPS
@given(st.lists(st.floats(0.0, 3.0), max_size=30))
def test_alpha_switches_only_across_the_hysteresis_band(loads):
    # QoServe 3.6: alpha ~1 ms/token at low load, the SRPF-like high value under overload, without flapping
    alpha = LoadAdaptiveAlpha()
    for load in loads:
        before = alpha.overloaded
        changed = alpha.update(load)
        assert changed == (alpha.overloaded != before)
        if changed:
            assert load > alpha.overload_at if alpha.overloaded else load < alpha.underload_at
        assert alpha.alpha_s == (alpha.high_ms if alpha.overloaded else alpha.low_ms) / 1000.0


# ---- eager relegation (Alg. 1 lines 12-15) ----

@PROPS
@given(requests("a"), st.floats(0.0, 20.0), estimates, st.integers(0, 3), st.sampled_from(PaidRelegation))
def test_relegation_rule_by_tier(req, now, est, free_waiting, paid):
    # QoServe 3.4: free jobs go when violated or predicted to violate; paid ones only as the rule says
    relegated = should_relegate(req, now, est, free_waiting, paid)
    hopeless = is_violated(req, now) or predicted_finish(req, now, est) > first_deadline(req)
    if req.qos.tier is Tier.FREE or paid is PaidRelegation.HOPELESS:
        assert relegated == hopeless
    else:
        assert relegated == (free_waiting == 0 and is_violated(req, now))
    if relegated:
        assert hopeless  # nobody is relegated who could still meet its deadline at the head of the queue


# ---- whole iterations: QoServe's scheduler in the own engine on a simulated executor ----

@st.composite
def arrivals(draw) -> list[Request]:
    n = draw(st.integers(1, 10))
    out = []
    for i in range(n):
        req = draw(requests(f"q{i}", now=2.0))
        req.num_computed_tokens = 0
        req.predicted_output_len = None
        out.append(req)
    return out


def _checked(scheduler, ex: SimExecutor, trace: list):
    schedule = scheduler.schedule

    def checked(now: float):
        out = schedule(now)
        chunks = [p.num_tokens for p in out.prefills]
        # Alg. 1 lines 10-23: prefill chunks fit the budget C; each is 1..what is left of its prompt
        assert sum(chunks) <= out.prefill_budget
        for p in out.prefills:
            assert 1 <= p.num_tokens <= p.request.prefill_remaining
        ids = [p.request.request_id for p in out.prefills]
        assert len(ids) == len(set(ids))  # one chunk per request per iteration
        # QoServe 3.2: every admitted decode runs each iteration (prefill never starves it; KV is reserved)
        assert {r.request_id for r in out.decodes} == set(scheduler.running)
        assert not set(ids) & set(scheduler.running)
        # a request sits in one queue: never both running and relegated, nor waiting and relegated
        rel = {r.request_id for r in scheduler.relegated}
        assert not rel & set(scheduler.running) and not rel & {r.request_id for r in scheduler.waiting}
        # QoServe 3.4: a newly relegated job is free tier, or paid and unable to meet its deadline even at the head
        # of the queue (checked with a pessimistic estimate: this pass's time and budget, 10 s per output token)
        worst = WorkEstimate(out.predicted_latency_s or 0.0, out.prefill_budget, 10.0, 10.0)
        for r in out.relegated:
            assert r.status is RequestStatus.RELEGATED
            assert r.qos.tier is Tier.FREE or should_relegate(r, now, worst, 0)
        assert ex.capacity().free_blocks >= 0
        trace.append((now, out.prefill_budget, tuple(zip(ids, chunks)), tuple(r.request_id for r in out.decodes),
                      tuple(r.request_id for r in out.relegated)))
        return out

    scheduler.schedule = checked


def _run(reqs: list[Request], kv_blocks: int) -> list:
    # the model's context fits the cache (vLLM refuses to start otherwise): a lone request can always decode
    ex = SimExecutor(COST, kv_blocks=kv_blocks, block_size=16, max_model_len=kv_blocks * 16)
    s = create_scheduler("qoserve", cost_model=COST, executor=ex, chunk_ceiling=512)
    trace: list = []
    _checked(s, ex, trace)
    engine = Engine(ex, s)
    for r in reqs:
        engine.add_request(r)
    engine.run_until_idle(max_steps=400)
    return trace


def _copy(reqs: list[Request]) -> list[Request]:
    return [Request(r.request_id, list(r.prompt_token_ids), r.sampling, r.qos, r.arrival_time) for r in reqs]


@settings(PROPS, max_examples=max(10, PROPS.max_examples // 3))
@given(arrivals(), st.integers(200, 2000))  # prompts up to 3000 tokens + 200 output
def test_iterations_keep_budget_kv_and_queue_invariants_and_are_deterministic(reqs, kv_blocks):
    # Alg. 1 as a whole: the invariants hold every iteration, and the same input gives the same schedule
    first = _run(_copy(reqs), kv_blocks)
    assert first == _run(_copy(reqs), kv_blocks)
