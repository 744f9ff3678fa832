"""Sustained paid overload (issue 18: free work shed first): paid work arriving as fast as the engine serves
anything makes free work yield to every waiting paid job; a burst shorter than the window does not."""

import pytest

from gpu_runtime.metrics import slo_met
from gpu_runtime.qos import Tier
from gpu_runtime.scheduler.overload import PaidOverload

from tests.unit.scheduler.helpers import COST, batch, interactive

SMALL = dict(chunk_ceiling=100, chunk_floor=100, adaptive_alpha=False, alpha_high_ms=0.0)


def _engine_at(o: PaidOverload, start: float, end: float, tokens_per_s: float, step_s: float = 0.1,
               saturated: bool = True) -> None:
    for k in range(round((end - start) / step_s)):
        o.step_began(start + k * step_s, int(tokens_per_s * step_s), saturated)


def _paid_at(o: PaidOverload, start: float, end: float, tokens_per_s: float, target_s: float,
             every_s: float = 0.5) -> None:
    for k in range(round((end - start) / every_s)):
        o.paid_arrived(start + k * every_s, tokens_per_s * every_s, target_s)


@pytest.mark.parametrize("paid_rate, overloaded", [(1200.0, True), (800.0, False)])
def test_paid_demand_against_the_engines_own_rate(paid_rate, overloaded):
    o = PaidOverload()
    _engine_at(o, 0.0, 60.0, tokens_per_s=1000.0)  # the engine carries 1,000 tokens a second of stepping
    _paid_at(o, 0.0, 60.0, paid_rate, target_s=60.0)
    assert o.ratio(60.0) == pytest.approx(paid_rate / 1000.0, rel=0.02)
    assert o.update(60.0) is overloaded


def test_only_saturated_steps_measure_the_engines_rate():
    # saturated one second in four at 1,000 tokens a second; the rest of the time it keeps up with 300 a second,
    # which says how much work there was, not how much it could do
    o = PaidOverload()
    for k in range(60):
        _engine_at(o, 4.0 * k, 4.0 * k + 1.0, tokens_per_s=1000.0)
        _engine_at(o, 4.0 * k + 1.0, 4.0 * k + 4.0, tokens_per_s=300.0, saturated=False)
    _paid_at(o, 0.0, 240.0, 300.0, target_s=240.0)
    assert o.ratio(240.0) == pytest.approx(0.3, rel=0.05)
    # a lightly loaded engine, never saturated, is never overloaded however its steps compare with the arrivals
    light = PaidOverload()
    _engine_at(light, 0.0, 240.0, tokens_per_s=300.0, saturated=False)
    _paid_at(light, 0.0, 240.0, 300.0, target_s=240.0)
    assert light.ratio(240.0) == 0.0 and not light.update(240.0)


def test_a_burst_shorter_than_the_window_averages_out():
    # 60 s at twice the engine's rate, then 240 s at half of it: over the 300 s target the paid jobs fit
    o = PaidOverload()
    _engine_at(o, 0.0, 300.0, tokens_per_s=1000.0)
    _paid_at(o, 0.0, 60.0, 2000.0, target_s=300.0)
    _paid_at(o, 60.0, 300.0, 500.0, target_s=300.0)
    assert not o.update(300.0)
    # a window of 60 s would have called the burst an overload: at 60 s, over the 60 s seen so far, it is one
    o2 = PaidOverload()
    _engine_at(o2, 0.0, 60.0, tokens_per_s=1000.0)
    _paid_at(o2, 0.0, 60.0, 2000.0, target_s=300.0)
    assert o2.update(60.0)


def test_hysteresis_and_warmup():
    o = PaidOverload()
    _engine_at(o, 0.0, 100.0, tokens_per_s=1000.0)
    _paid_at(o, 0.0, 5.0, 5000.0, target_s=100.0)
    assert o.ratio(5.0) == 0.0 and not o.update(5.0)  # under a tenth of the window seen: no verdict yet
    _paid_at(o, 5.0, 100.0, 1000.0, target_s=100.0)
    assert o.update(100.0)  # (5 x 5,000 + 95 x 1,000) / 100 = 1,200 a second
    _engine_at(o, 100.0, 150.0, tokens_per_s=1000.0)
    _paid_at(o, 100.0, 150.0, 850.0, target_s=100.0)
    assert 0.9 <= o.ratio(150.0) < 1.0 and o.update(150.0)  # between off_at and on_at: stays on
    _engine_at(o, 150.0, 250.0, tokens_per_s=1000.0)
    _paid_at(o, 150.0, 250.0, 500.0, target_s=100.0)
    assert not o.update(250.0)


def _free_job_behind_sustained_paid_load(signal: bool):
    from gpu_runtime.sim.simulator import Simulator, make_replica

    # 100-token paid batch prompts every 15 ms for 3 s (6,700 tokens a second against the 5,000 that 100-token
    # passes of 20 ms carry), each due 10 s after it arrives: none is late or hopeless while it waits, so the
    # queue-based rules let an earlier-due free job go first. At 2 s a free interactive job arrives (TTFT 0.5 s).
    paid = [batch(f"p{k}", arrival=k * 0.015, prompt=100, ttlt=10.0, max_tokens=1, app="a") for k in range(200)]
    free = interactive("f", arrival=2.0, prompt=100, ttft=0.5, tier=Tier.FREE, max_tokens=1)
    rep = make_replica("r", "qoserve", COST, kv_blocks=100_000, free_yields_overload=signal, relegated_expiry=None,
                       **SMALL)
    Simulator([rep]).run(paid + [free])
    return free, paid


@pytest.mark.parametrize("signal", [True, False])
def test_free_work_yields_while_paid_work_alone_fills_the_engine(signal):
    free, paid = _free_job_behind_sustained_paid_load(signal)
    assert all(slo_met(p) for p in paid)
    assert free.status.finished  # relegated work still runs once the paid queue leaves budget spare
    assert (free.relegation_count > 0) is signal
    assert slo_met(free) is not signal
