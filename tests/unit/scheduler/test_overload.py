"""Graceful overload (issue 18 item 3) on hand-built situations: hopeless paid jobs are relegated
early, batch jobs are admitted only at a pace that leaves the chunk alone, lost batch decodes do not
pin the chunk to the floor, relegated jobs expire with a clear status."""

import math

import pytest

from gpu_runtime.costmodel.base import saturation_tokens
from gpu_runtime.costmodel.features import BatchFeatures
from gpu_runtime.engine import Engine
from gpu_runtime.executor.sim import SimExecutor
from gpu_runtime.metrics import slo_met
from gpu_runtime.qos import Tier
from gpu_runtime.request import RequestStatus
from gpu_runtime.scheduler.chunking import ChunkBudget, build_search_space
from gpu_runtime.scheduler.interface import SchedulerOutput
from gpu_runtime.scheduler.registry import create_scheduler
from gpu_runtime.scheduler.relegation import expires_at

from tests.unit.scheduler.helpers import COST, batch, decoding, interactive

# 100-token chunks: 20 ms a pass with no decodes (10 ms + 100 x 0.1 ms)
SMALL = dict(chunk_ceiling=100, chunk_floor=100, adaptive_alpha=False, alpha_high_ms=0.0)


def _run(s, reqs, until: float = 5.0):
    ex = SimExecutor(COST)
    engine = Engine(ex, s)
    for r in reqs:
        engine.add_request(r)
    outs = []
    while engine.has_work and ex.now() < until:
        outs += engine.step()
    return outs


@pytest.mark.parametrize("rule, on_time", [("hopeless", True), ("violated", False)])
def test_a_hopeless_paid_job_stops_taking_the_budget_from_one_that_can_make_it(rule, on_time):
    # "a" is due first (EDF) but needs 10 passes (200 ms) of its 100 ms; "b" needs one pass and is due at
    # 150 ms. A free job waits throughout, so the paper's rule never relegates "a" (late or not) and "a"
    # holds the budget until b's deadline is gone; the hopeless rule sets "a" aside at once. (The paid
    # guard and free yielding are off: this is the relegation rule alone.)
    a = interactive("a", prompt=1000, ttft=0.10, max_tokens=2)
    b = interactive("b", prompt=100, ttft=0.15, max_tokens=2)
    free = interactive("f", prompt=100, ttft=30.0, tier=Tier.FREE, max_tokens=2)
    s = create_scheduler("qoserve", cost_model=COST, paid_relegation=rule, relegated_expiry=None, paid_guard=False,
                         free_yields=False, **SMALL)
    outs = _run(s, [a, b, free])
    assert slo_met(b) is on_time
    assert (a.relegation_count > 0) is on_time
    # nobody is lost: the relegated job finished with spare budget once the others were served
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in (a, b, free))
    assert not slo_met(a)
    assert any(o.event == "relegated" and o.request_id == "a" for o in outs) is on_time


def test_a_paid_job_that_can_still_make_it_is_not_relegated_under_load():
    # 5 paid jobs of one pass each, all due at 130 ms: the first 6 passes fit, so all of them make it
    jobs = [interactive(f"p{k}", prompt=100, ttft=0.13, max_tokens=1) for k in range(5)]
    s = create_scheduler("qoserve", cost_model=COST, **SMALL)
    _run(s, jobs)
    assert all(r.relegation_count == 0 and slo_met(r) for r in jobs)


def test_a_batch_job_is_admitted_only_if_it_decodes_in_time_beside_full_chunks():
    # Budget 256 (35.6 ms a pass); a pure decode step takes 10.1 ms. 40 predicted tokens due in 1.0 s fit at
    # the pure decode pace (0.4 s) but not beside full chunks (40 x 35.6 ms = 1.42 s), which the 300 prompt
    # tokens queued behind it fill: relegated before its decodes would cut every later chunk to the floor.
    s = create_scheduler("qoserve", cost_model=COST, chunk_ceiling=256, chunk_floor=16)
    tight = batch("tight", prompt=100, ttlt=1.0, max_tokens=40)
    tight.predicted_output_len = 40
    roomy = batch("roomy", prompt=300, ttlt=2.0, max_tokens=40)
    roomy.predicted_output_len = 40
    s.add_request(tight)
    s.add_request(roomy)
    out = s.schedule(0.0)
    assert [r.request_id for r in out.relegated] == ["tight"]
    assert out.prefills[0].request is roomy
    assert math.isclose(s._batch_pace(0, 0, beside=8192), COST.predict(BatchFeatures(256, 0, 256, 0, 0, 1, 256 * 128)))


def test_a_lost_batch_decode_does_not_pin_the_chunk_to_the_floor():
    space = build_search_space(COST, 16, 1024)
    cb = ChunkBudget(COST, space, safety=1.2)
    floor_pass = COST.predict(BatchFeatures(16, 1, 16, 0, 0, 2, 16 * 8))
    # 20 predicted tokens left, 0.2 s to its deadline: 10 ms a token, below the shortest pass (11.7 ms)
    lost = decoding(batch("lost", prompt=50, ttlt=10.0, max_tokens=100), outputs=80, times=[1.0] * 80)
    lost.predicted_output_len = 100
    assert 0.2 / 20 < floor_pass * 1.2
    choice = cb.choose([lost], now=9.8)
    assert choice.budget == space[-1] and choice.min_slack_s == math.inf
    # the same job with 2 s left keeps its pace (100 ms a token): the chunk shrinks to fit it
    choice = cb.choose([lost], now=8.0)
    assert choice.budget < space[-1] and math.isclose(choice.min_slack_s, 0.1)


def test_expiry_time_of_shed_work_and_of_a_job_mid_answer():
    assert expires_at(interactive("i", arrival=10.0, ttft=6.0), 2.0) == 10.0 + 18.0
    assert expires_at(interactive("i", arrival=10.0, ttft=6.0), 2.0, min_grace_s=60.0) == 10.0 + 66.0
    assert expires_at(batch("b", arrival=0.0, ttlt=600.0), 2.0, min_grace_s=60.0) == 1800.0
    # mid-answer (tokens streamed): twice the grace, after the later of its TTFT and its next token's deadline
    streaming = decoding(interactive("streaming", arrival=10.0, ttft=6.0, tbt=1.0), outputs=3, times=[11, 12, 13])
    assert expires_at(streaming, 2.0, min_grace_s=60.0) == 10.0 + 6.0 + 3 * 1.0 + 2 * 60.0
    assert expires_at(decoding(batch("b", ttlt=600.0), outputs=3, times=[1, 2, 3]), 2.0, 60.0) == 600.0 + 2400.0


def test_a_relegated_job_expires_with_a_clear_status_and_frees_its_kv():
    ex = SimExecutor(COST, kv_blocks=1024, block_size=16)
    s = create_scheduler("qoserve", cost_model=COST, executor=ex, relegated_expiry=2.0, relegated_expiry_min_s=0.0,
                         **SMALL)
    engine = Engine(ex, s)
    hopeless = interactive("gone", prompt=600, ttft=0.05, tier=Tier.FREE, max_tokens=2)
    small = batch("small", prompt=50, ttlt=30.0, max_tokens=200)
    for r in (hopeless, small):
        engine.add_request(r)
    outs = engine.step()  # relegated; the spare 50 tokens of the pass start its prompt (it holds KV now)
    assert [o.event for o in outs if o.request_id == "gone"] == ["relegated"]
    assert "gone" in s.started and ex.blocks.num_tokens("gone") == 50
    for k in range(3):  # then paid prompts take every pass: no spare budget until it expires
        engine.add_request(batch(f"big{k}", prompt=2000, ttlt=30.0, max_tokens=200))
    while engine.has_work and ex.now() < 0.2:  # expires 3 x 50 ms after arrival
        outs += engine.step()
    mine = [o for o in outs if o.request_id == "gone"]
    assert mine[-1].event == "expired" and mine[-1].finished
    assert mine[-1].status is RequestStatus.FINISHED_EXPIRED and mine[-1].metrics.slo_met is False
    assert hopeless.status is RequestStatus.FINISHED_EXPIRED and hopeless.finish_time >= 0.15
    assert "gone" not in s.relegated and "gone" not in s.started and s.num_unfinished == 4
    assert ex.blocks.num_tokens("gone") == 0 and "gone" not in s._holders  # its KV and its reservation are gone


def test_jobs_an_operator_resumed_or_that_run_again_do_not_expire():
    s = create_scheduler("qoserve", cost_model=COST, relegated_expiry=2.0, relegated_expiry_min_s=0.0, **SMALL)
    late = interactive("late", prompt=100, ttft=0.01, tier=Tier.FREE)
    busy = interactive("busy", prompt=100, ttft=100.0)
    s.add_request(late)
    s.add_request(busy)
    assert s.schedule(0.02).relegated == [late]  # expires at 0.03
    assert s.resume("late")
    out = s.schedule(1.0)
    assert out.expired == [] and late.status is not RequestStatus.FINISHED_EXPIRED
    # no expiry at all when it is switched off
    s = create_scheduler("qoserve", cost_model=COST, relegated_expiry=None, **SMALL)
    late = interactive("late", prompt=100, ttft=0.01, tier=Tier.FREE)
    s.add_request(late)
    s.add_request(interactive("busy", prompt=100, ttft=100.0))
    s.schedule(0.02)
    assert s.schedule(10.0).expired == []


def test_a_relegated_job_that_streamed_expires_with_its_tokens_later_than_a_fresh_one():
    # Overload that never ends: a paid prompt takes every pass's whole budget, so relegated work never runs. "mid"
    # streamed 3 tokens before its KV was released (a preemption): recomputing, it is behind its next token's deadline
    # (0.13 s) and is relegated beside "fresh", which has no token out. Expiry factor 2 (0.2 s of grace): fresh at
    # 0.1 + 0.2 s, mid mid-answer at 0.13 + 2 x 0.2 s, with its 3 tokens. Before, mid waited for ever.
    s = create_scheduler("qoserve", cost_model=COST, relegated_expiry=2.0, relegated_expiry_min_s=0.0, **SMALL)
    mid = decoding(interactive("mid", prompt=100, ttft=0.1, tbt=0.01, tier=Tier.FREE, max_tokens=50), outputs=3,
                   times=[0.05, 0.06, 0.07])
    mid.release_kv()
    mid.status = RequestStatus.WAITING
    fresh = interactive("fresh", prompt=100, ttft=0.1, tier=Tier.FREE)
    for r in (mid, fresh, interactive("busy", prompt=100_000, ttft=1000.0)):
        s.add_request(r)

    def step(now: float) -> SchedulerOutput:  # the engine computes the chunks planned
        out = s.schedule(now)
        assert [p.request.request_id for p in out.prefills] == ["busy"]
        for p in out.prefills:
            p.request.num_computed_tokens += p.num_tokens
        s.update_from_output(out, now)
        return out

    assert sorted(r.request_id for r in step(0.2).relegated) == ["fresh", "mid"]
    assert step(0.29).expired == []
    assert step(0.31).expired == [fresh]
    assert step(0.52).expired == []
    assert step(0.54).expired == [mid]
    assert mid.status is RequestStatus.FINISHED_EXPIRED and len(mid.output_token_ids) == 3
    assert s.queue_depths()["relegated"] == 0


@pytest.mark.parametrize("paid_lost", [True, False])
def test_free_work_yields_to_any_waiting_paid_job_once_a_paid_job_was_lost(paid_lost):
    # EDF order, 100-token passes of 20 ms. "p" could wait for the free job's one pass (due in 10 s), so
    # the free job normally goes first; once a paid job was relegated as hopeless ("a": 10 passes due in
    # 100 ms) paid demand outran capacity, and for one of a's targets the free job gives way to "p".
    s = create_scheduler("qoserve", cost_model=COST, **SMALL)
    jobs = [interactive("f", prompt=100, ttft=0.5, tier=Tier.FREE), interactive("p", prompt=100, ttft=10.0)]
    if paid_lost:
        jobs.append(interactive("a", prompt=1000, ttft=0.1))
    for r in jobs:
        s.add_request(r)
    out = s.schedule(0.0)
    relegated = sorted(r.request_id for r in out.relegated)
    assert relegated == (["a", "f"] if paid_lost else [])
    assert out.prefills[0].request.request_id == ("p" if paid_lost else "f")
    # a's target (100 ms) later, free work is back to yielding only when it would make a paid job late (a itself
    # still relegated is a rule of its own, off here: test_free_work_waits_behind_relegated_paid_work)
    s2 = create_scheduler("qoserve", cost_model=COST, free_yields_relegated_paid=False, **SMALL)
    for r in (interactive("a", arrival=0.0, prompt=1000, ttft=0.1), interactive("p", arrival=0.0, prompt=500,
                                                                                 ttft=10.0)):
        s2.add_request(r)
    s2.schedule(0.0)
    s2.add_request(interactive("f2", arrival=0.15, prompt=100, ttft=0.5, tier=Tier.FREE))
    assert s2.schedule(0.15).relegated == []


@pytest.mark.parametrize("rule", [True, False])
def test_free_work_waits_behind_relegated_paid_work(rule):
    # "a" (paid, 10 passes due in 100 ms) is hopeless and relegated; no paid job waits in line. With the rule on,
    # the free job "f" is relegated behind it and the step's budget (EDF, one 100-token pass) serves "a" first;
    # off, "f" takes the pass and "a" waits for spare budget.
    s = create_scheduler("qoserve", cost_model=COST, free_yields_relegated_paid=rule, **SMALL)
    s.add_request(interactive("a", prompt=1000, ttft=0.1))
    s.add_request(interactive("f", prompt=100, ttft=0.5, tier=Tier.FREE))
    out = s.schedule(0.0)
    assert sorted(r.request_id for r in out.relegated) == (["a", "f"] if rule else ["a"])
    assert [p.request.request_id for p in out.prefills][0] == ("a" if rule else "f")
    # once no paid job is relegated, free work runs in line again
    s.abort_request("a")
    s.add_request(interactive("g", arrival=0.05, prompt=100, ttft=0.5, tier=Tier.FREE))
    assert "g" not in [r.request_id for r in s.schedule(0.05).relegated]


def _overloaded_run(rule: str):
    from gpu_runtime.sim.simulator import Simulator, make_replica

    # 3 s of prompts at twice what 100-token passes can serve (one 100-token prompt per 10 ms against
    # ~20 ms a pass), one in five free; TTFT 0.3 s, expiry 0.1 s after the deadline
    reqs = []
    for k in range(300):
        tier = Tier.FREE if k % 5 == 0 else Tier.PAID
        reqs.append(interactive(f"{tier}{k}", arrival=k * 0.01, prompt=100, ttft=0.3, tbt=1.0, tier=tier,
                                max_tokens=2))
    rep = make_replica("r", "qoserve", COST, kv_blocks=100_000, relegated_expiry=0.0, relegated_expiry_min_s=0.1,
                       paid_relegation=rule, **SMALL)
    return Simulator([rep]).run(reqs)


def test_in_simulation_every_relegated_job_finishes_or_expires_and_the_summary_tells_them_apart():
    from gpu_runtime.sim.metrics import relegation_summary, summarize

    done = _overloaded_run("hopeless")
    rel = relegation_summary(done)
    assert all(r.status.finished for r in done)  # nothing left queued: finished or expired
    expired = [r for r in done if r.status is RequestStatus.FINISHED_EXPIRED]
    assert rel.expired == len(expired) > 0 and rel.unfinished == 0
    assert rel.finished + rel.expired == rel.relegated
    assert all(r.relegation_count and not r.output_token_ids for r in expired)
    s = summarize(done)
    paid, free = s.tiers["paid"], s.tiers["free"]
    # paid jobs kept in service all make it; the ones shed were shed early, free work first
    kept_paid_late = [r for r in done if r.qos.tier is Tier.PAID and not r.relegation_count and not slo_met(r)]
    assert kept_paid_late == []
    assert free.violation_rate > paid.violation_rate
    # the paper's rule leaves the paid jobs that cannot make it in line: they are served late instead
    kept = [r for r in _overloaded_run("violated") if r.qos.tier is Tier.PAID and not r.relegation_count]
    assert sum(not slo_met(r) for r in kept) > 50


def test_the_batch_pace_is_set_beside_a_saturating_chunk_not_a_larger_ceiling():
    # On vLLM the chunk ceiling is the engine's step cap (2048), far past where prefill throughput saturates;
    # a pass beside it is no pace a batch decode meets in practice (on the CPU profile it made every batch job
    # hopeless on arrival: 256 of 556 relegated at a load where every job finished on time)
    sat = saturation_tokens(COST, fraction=0.95)
    assert sat < 8192
    s = create_scheduler("qoserve", cost_model=COST, chunk_ceiling=8192)
    assert s.chunking.space[-1] == 8192
    saturated = COST.predict(BatchFeatures(sat, 0, sat, 0, 0, 1, sat * sat / 2))
    assert math.isclose(s._batch_pace(0, 0, beside=8192), saturated)


def test_started_free_work_behind_blocked_relegated_paid_work_runs_only_where_the_pass_would_run_nothing():
    # "d" decodes and "f", a free prompt started and then relegated, holds the second of two sequence slots, so
    # "p", paid and relegated (hopeless) at the head of the relegated queue, cannot be admitted. While the pass runs
    # something ("d"), "f" waits behind "p" (relegated paid work first). (Where it would run nothing, "f" continues:
    # only it could free what "p" waits for; tests/vllm/test_scheduler_properties.py pins that stall.)
    ex = SimExecutor(COST, kv_blocks=1024, block_size=16)
    s = create_scheduler("qoserve", cost_model=COST, executor=ex, max_num_seqs=2, **SMALL)
    d = interactive("d", prompt=50, ttft=10.0, tbt=1.0, max_tokens=50)
    f = interactive("f", prompt=300, ttft=10.0, tbt=1.0, tier=Tier.FREE)
    for r in (d, f):
        ex.add_request(r.request_id, r.sampling)
        s.add_request(r)
    first = s.schedule(0.0)
    assert [p.request.request_id for p in first.prefills] == ["d", "f"]
    for c in first.prefills:  # what the engine's pass did: "d"'s whole prompt and its first token, part of "f"'s
        c.request.num_computed_tokens += c.num_tokens
    d.output_token_ids, d.token_times = [7], [0.02]
    s.update_from_output(first, 0.02)
    assert d.status is RequestStatus.DECODING and "f" in s.started
    s._remove_waiting("f")  # relegated mid-prompt (as free work yielding to paid work would be)
    f.status = RequestStatus.RELEGATED
    s.relegated.push(f)
    p = interactive("p", arrival=0.02, prompt=100, ttft=0.001)
    ex.add_request(p.request_id, p.sampling)
    s.add_request(p)
    out = s.schedule(0.02)
    assert "p" in [r.request_id for r in out.relegated] and [r.request_id for r in out.decodes] == ["d"]
    assert "f" not in [c.request.request_id for c in out.prefills]
    s.abort_request("d")  # its slot frees: "p" is admitted before "f" goes on
    assert [c.request.request_id for c in s.schedule(0.04).prefills][0] == "p"
