"""``coserve simulate``'s default sweep: a bracket around the capacity found on the experiment
itself, so the first plot shows the knee instead of a range past (or short of) capacity."""

from __future__ import annotations

import math

import pytest

from gpu_runtime.costmodel.profile import resolve_profile, scheduling_cost_model
from gpu_runtime.sim.capacity import find_capacity, sweep_around, throughput_guess


def _knee_at(capacity: float, calls: list[float]):
    def viol(qps: float) -> float:
        calls.append(qps)
        return 0.0 if qps <= capacity else min(1.0, (qps - capacity) / capacity)
    return viol


@pytest.mark.parametrize("guess", [0.05, 0.3, 2.0, 40.0])  # within 81x of the knee
def test_find_capacity_walks_from_any_guess_to_the_knee(guess):
    calls: list[float] = []
    found = find_capacity(_knee_at(2.0, calls), guess, target=0.01)
    assert 2.0 / 1.15 <= found <= 2.0 * 1.01  # 4 bisections of a 3x step: within ~12%
    assert len(calls) == len(set(calls)) and len(calls) <= 12  # each rate simulated once


def test_find_capacity_at_the_ends_of_its_range():
    assert find_capacity(lambda q: 0.5, 1.0, max_steps=4) == 0.0  # violates at every rate
    assert find_capacity(lambda q: 0.0, 1.0, grow=3.0, max_steps=4) == 81.0  # the highest rate tried


@pytest.mark.parametrize("capacity", [0.0485, 0.125, 0.9, 3.5, 17.0, 170.0])
def test_sweep_around_brackets_the_capacity_with_round_even_steps(capacity):
    rates = sweep_around(capacity)
    assert len(rates) == 8
    assert rates[0] <= 0.5 * capacity and rates[-1] >= 1.4 * capacity  # flat ground, knee, rise
    step = rates[0]
    assert all(r == pytest.approx(step * k) for k, r in enumerate(rates, 1))
    mantissa = step / 10 ** math.floor(math.log10(step))
    assert any(mantissa == pytest.approx(m) for m in (1.0, 2.0, 2.5, 5.0))


def test_sweep_around_needs_a_capacity():
    with pytest.raises(ValueError):
        sweep_around(0.0)


def test_throughput_guess_falls_with_longer_requests():
    cm = scheduling_cost_model(resolve_profile("cpu-smollm2-135m"))
    short, long = throughput_guess(cm, 100, 10), throughput_guess(cm, 1000, 200)
    assert short > long > 0
