"""A profile's cost model scaled to the engine's measured steps (gpu_runtime/costmodel/calibration.py)."""

from __future__ import annotations

import pytest

from gpu_runtime.costmodel.calibration import InPlaceCalibration, ScaledCostModel
from gpu_runtime.costmodel.features import BatchFeatures
from gpu_runtime.costmodel.profile import conservative_cost_model

DECODES = BatchFeatures.of_shape(0, 0, 8, 256)
CHUNK = BatchFeatures.of_shape(128, 0, 4, 256)


def test_the_scaled_model_keeps_the_profiles_shape_at_a_measured_level():
    base = conservative_cost_model()
    model = ScaledCostModel(base, 1.8)
    assert model.predict(CHUNK) == pytest.approx(1.8 * base.predict(CHUNK))
    assert model.predict(CHUNK) / model.predict(DECODES) == pytest.approx(base.predict(CHUNK) / base.predict(DECODES))


def test_the_scale_becomes_the_median_ratio_of_measured_to_predicted_steps():
    base = conservative_cost_model()
    cal = InPlaceCalibration(ScaledCostModel(base), min_steps=8, every=4)
    for i in range(7):
        cal.observe(CHUNK if i % 2 else DECODES, 2.0 * base.predict(CHUNK if i % 2 else DECODES))
    assert cal.model.scale == 1.0  # too few steps yet
    cal.observe(DECODES, 50.0 * base.predict(DECODES))  # one stalled step: the median ignores it
    assert cal.model.scale == pytest.approx(2.0)
    for _ in range(300):  # the window moves: the engine got slower
        cal.observe(CHUNK, 3.0 * base.predict(CHUNK))
    assert cal.model.scale == pytest.approx(3.0)


def test_the_scale_stays_within_its_bounds_and_empty_steps_teach_nothing():
    base = conservative_cost_model()
    cal = InPlaceCalibration(ScaledCostModel(base), min_steps=1, every=1, bounds=(0.5, 4.0))
    cal.observe(DECODES, 100.0)
    assert cal.model.scale == 4.0
    cal.observe(BatchFeatures.of_shape(0, 0, 0, 0), 1.0)
    cal.observe(DECODES, 0.0)
    assert cal.steps == 1


def test_a_simulated_policy_calibrates_to_the_simulated_engine():
    """The simulator replays a calibrated worker: its policy's model follows the simulated steps' cost."""
    from gpu_runtime.qos import QoSClass, QoSSpec
    from gpu_runtime.request import Request
    from gpu_runtime.sampling import SamplingParams
    from gpu_runtime.sim.simulator import Simulator, make_replica

    plan = conservative_cost_model()
    engine = ScaledCostModel(plan, 2.5)  # the engine's steps cost 2.5x what the profile says
    rep = make_replica("r", "qoserve", engine, kv_blocks=4096, plan_cost_model=plan, calibrate=True)
    qos = QoSSpec(QoSClass.INTERACTIVE, ttft_s=600.0, tbt_s=50.0)
    reqs = [Request(f"r{i}", [1] * 64, SamplingParams(max_tokens=48, ignore_eos=True), qos, arrival_time=0.5 * i)
            for i in range(40)]
    Simulator([rep]).run(reqs)
    scaled = rep.engine.scheduler.cost_model
    assert isinstance(scaled, ScaledCostModel) and scaled.scale == pytest.approx(2.5)
    plain = make_replica("p", "qoserve", engine, kv_blocks=4096, plan_cost_model=plan)
    assert plain.engine.scheduler.cost_model is plan
