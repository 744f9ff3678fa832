"""The engine the worker builds plans with the executor's measured profile, not a made-up one."""

from __future__ import annotations

import pytest

from app.settings import Settings
from gpu_runtime.costmodel.base import decode_step_time
from gpu_runtime.costmodel.profile import CPU_PROFILE
from gpu_runtime.factory import build_engine


def test_cpu_engine_schedules_with_the_shipped_cpu_profile(tiny_model_dir):
    assert CPU_PROFILE.exists(), "the measured CPU profile of the default model must ship with the package"
    engine = build_engine(str(tiny_model_dir), device="cpu", kv_blocks=64, spec_policy="adaserve",
                          draft="prompt-lookup")
    cm = engine.scheduler.cost_model
    assert engine.executor.cost_model is cm and cm.name != "conservative-default"
    # the profile's batch-1 decode step is a CPU figure (tens of ms), not an A100's 12.5 ms
    assert 0.01 < decode_step_time(cm, 1, 512) < 0.5
    # AdaServe's verification budget comes from that curve
    assert engine.speculation.latency_curve is not None


def test_no_profile_falls_back_to_the_conservative_model(tiny_model_dir):
    engine = build_engine(str(tiny_model_dir), device="cpu", kv_blocks=64, cost_profile="none")
    assert engine.scheduler.cost_model.name == "conservative-default"
    assert engine.executor.cost_model is None


def test_scheduler_config_overrides_the_policys_fields(tiny_model_dir, monkeypatch):
    engine = build_engine(str(tiny_model_dir), device="cpu", kv_blocks=64, cost_profile="none",
                          scheduler_config={"relegated_expiry_min_s": 600.0})
    assert engine.scheduler.config.relegated_expiry_min_s == 600.0
    with pytest.raises(ValueError, match="unknown config keys"):
        build_engine(str(tiny_model_dir), device="cpu", kv_blocks=64, cost_profile="none",
                     scheduler_config={"relegated_expiry_min": 600.0})
    # the worker's setting: a JSON object in COSERVE_SCHEDULER_CONFIG
    monkeypatch.setenv("COSERVE_SCHEDULER_CONFIG", '{"relegated_expiry": null}')
    assert Settings().scheduler_config == {"relegated_expiry": None}
