"""Profiles fitted on a worker's step log: each step costs its latency plus the host time to the next."""

from __future__ import annotations

import pytest

from gpu_runtime.costmodel.features import BatchFeatures
from gpu_runtime.costmodel.profile import scheduling_cost_model
from gpu_runtime.vllm.step_log import StepLog, StepRecord, load_steps, profile_from_steps, step_costs


def shape(prefill: int, decodes: int) -> BatchFeatures:
    return BatchFeatures.of_shape(prefill, 0, decodes, 100)


def test_a_step_costs_its_latency_and_the_host_gap_after_it():
    steps = [StepRecord(0.0, 0.040, None, shape(64, 2)),
             StepRecord(0.050, 0.030, 0.010, shape(0, 3)),
             StepRecord(0.090, 0.030, 0.010, shape(0, 3)),
             StepRecord(5.0, 0.030, 4.880, shape(0, 3)),  # after an idle pause: the step before is left out
             StepRecord(5.04, 0.030, 0.010, shape(0, 3))]
    costs = step_costs(steps)
    assert [round(c, 3) for _, c in costs] == [0.050, 0.040, 0.040]
    assert costs[0][0] == shape(64, 2)


def test_log_round_trip_and_a_fitted_profile(tmp_path):
    path = tmp_path / "steps.jsonl"
    log = StepLog(path)
    t = 0.0
    # a made-up engine: 20 ms a step, 0.5 ms a prompt token, 2 ms a decode, 5 ms host time between steps
    for i in range(60):
        f = shape(32 * (i % 5), 1 + i % 7)
        latency = 0.020 + 0.0005 * f.num_prefill_tokens + 0.002 * f.num_decode_tokens
        log.write(StepRecord(t, latency, 0.005 if i else None, f, plan_scale=1.5 if i else None))
        t += latency + 0.005
    log.close()
    steps = load_steps(path)
    assert len(steps) == 60 and steps[0].gap_s is None and steps[1].features == shape(32, 2)
    assert steps[0].plan_scale is None and steps[1].plan_scale == 1.5  # what the calibrated policy planned with
    out = tmp_path / "profile.json"
    prof = profile_from_steps([path], name="in-place")
    prof.save(out)
    assert len(prof.samples) == 59 and prof.meta["host_gap_s_median"] == pytest.approx(0.005)
    model = scheduling_cost_model(out)
    assert model.predict(shape(96, 3)) == pytest.approx(0.020 + 0.048 + 0.006 + 0.005, rel=0.05)


def test_a_log_with_no_busy_stretch_is_refused(tmp_path):
    path = tmp_path / "steps.jsonl"
    log = StepLog(path)
    log.write(StepRecord(0.0, 0.03, None, shape(10, 0)))
    log.close()
    with pytest.raises(ValueError, match="no step with a known cost"):
        profile_from_steps([path])
