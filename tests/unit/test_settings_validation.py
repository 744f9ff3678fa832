"""Invalid settings fail when ``Settings`` is built, naming the setting, instead of later at run time."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from app.settings import DEFAULT_TIERS, Settings
from gpu_runtime.factory import resolve_device


@pytest.fixture(autouse=True)
def _no_env(monkeypatch, tmp_path):
    """Settings from the arguments and the tests' environment only: no COSERVE_* of the shell, no .env file."""
    import os

    for name in [k for k in os.environ if k.startswith("COSERVE_")]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)


BAD_ENV = [  # (environment variable, value, the field the error names)
    ("COSERVE_PORT", "70000", "port"),
    ("COSERVE_PORT", "-1", "port"),
    ("COSERVE_PORT", "0", "port"),
    ("COSERVE_DEFAULT_TIER", "gold", "COSERVE_DEFAULT_TIER"),
    ("COSERVE_TIERS", "[]", "tiers"),
    ("COSERVE_TIERS", '["free", "free"]', "tiers"),
    ("COSERVE_DEFAULT_TTFT_MS", "-5", "default_ttft_ms"),
    ("COSERVE_DEFAULT_TBT_MS", "0", "default_tbt_ms"),
    ("COSERVE_DEFAULT_MAX_TOKENS", "0", "default_max_tokens"),
    ("COSERVE_DEFAULT_BATCH_WINDOW_S", "-1", "default_batch_window_s"),
    ("COSERVE_LEASE_SECONDS", "0", "lease_seconds"),
    ("COSERVE_HEARTBEAT_SECONDS", "-1", "heartbeat_seconds"),
    ("COSERVE_SWEEP_SECONDS", "0", "sweep_seconds"),
    ("COSERVE_DEVICE", "tpu", "device"),
    ("COSERVE_DEVICE", "cuda:", "device"),
    ("COSERVE_DEVICE", "cuda:x", "device"),
    ("COSERVE_KV_BLOCKS", "-3", "kv_blocks"),
    ("COSERVE_KV_BLOCKS", "0", "kv_blocks"),
    ("COSERVE_INTERACTIVE_RESERVE", "-1", "interactive_reserve"),
]


@pytest.mark.parametrize(("env", "value", "field"), BAD_ENV)
def test_a_bad_value_in_the_environment_is_refused_naming_the_setting(monkeypatch, env, value, field):
    monkeypatch.setenv(env, value)
    with pytest.raises(ValidationError) as exc:
        Settings()
    assert field in str(exc.value), str(exc.value)
    assert value in str(exc.value) or env == "COSERVE_TIERS", str(exc.value)  # the value given is shown


@pytest.mark.parametrize(("env", "value", "field"), BAD_ENV)
def test_a_bad_value_as_an_argument_is_refused_too(env, value, field):
    import json

    name = env.removeprefix("COSERVE_").lower()
    arg = json.loads(value) if name in ("port", "tiers", "kv_blocks") else value
    with pytest.raises(ValidationError) as exc:
        Settings(**{name: arg})
    assert field in str(exc.value), str(exc.value)


def test_the_default_tier_error_says_what_to_fix():
    with pytest.raises(ValidationError, match=r"'gold' is not one of COSERVE_TIERS \['free', 'paid'\]"):
        Settings(default_tier="gold")
    with pytest.raises(ValidationError, match="COSERVE_TIERS needs at least one tier"):
        Settings(tiers=())


def test_a_heartbeat_too_slow_for_the_lease_is_refused():
    with pytest.raises(ValidationError, match=r"COSERVE_HEARTBEAT_SECONDS \(5\) must be at most half of "
                                              r"COSERVE_LEASE_SECONDS \(3\)"):
        Settings(lease_seconds=3, heartbeat_seconds=5)
    assert Settings(lease_seconds=3, heartbeat_seconds=1.5).heartbeat_seconds == 1.5


def test_an_interactive_reserve_that_leaves_batch_jobs_no_slot_is_refused():
    with pytest.raises(ValidationError, match=r"COSERVE_INTERACTIVE_RESERVE \(4\) must be less than "
                                              r"COSERVE_MAX_INFLIGHT \(4\)"):
        Settings(max_inflight=4, interactive_reserve=4)
    assert Settings(max_inflight=4, interactive_reserve=3).kept_for_interactive == 3
    assert Settings(max_inflight=4, interactive_reserve=0).kept_for_interactive == 0
    assert Settings().kept_for_interactive == 128  # an eighth of the default cap (1024)
    assert Settings(max_inflight=1).kept_for_interactive == 0  # a cap of one: the batch jobs' only slot


def test_the_defaults_construct():
    s = Settings()
    assert (s.port, s.device, s.default_tier, s.tiers, s.kv_blocks) == (8000, "auto", "paid", DEFAULT_TIERS, None)
    assert (s.lease_seconds, s.heartbeat_seconds, s.sweep_seconds) == (30.0, 5.0, 10.0)
    assert (s.default_ttft_ms, s.default_tbt_ms, s.default_max_tokens) == (2000.0, 200.0, 256)


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:0", "cuda:3"])
def test_the_documented_devices_are_accepted(device):
    assert Settings(device=device).device == device


def test_good_values_construct(monkeypatch, tmp_path):
    # as tests/conftest.py's make_settings and the workers it starts set them
    s = Settings(data_dir=tmp_path, device="cpu", lease_seconds=3.0, heartbeat_seconds=0.5, sweep_seconds=0.5,
                 default_max_tokens=16, backend="torch", kv_blocks=256, port=65535)
    assert (s.lease_seconds, s.sweep_seconds, s.kv_blocks, s.port) == (3.0, 0.5, 256, 65535)
    renamed = Settings(tiers=["bronze", "silver", "gold"], default_tier="gold")
    assert renamed.tiers == ("bronze", "silver", "gold") and renamed.default_tier == "gold"
    assert Settings(tiers=["paid"]).default_tier == "paid"
    monkeypatch.setenv("COSERVE_TIERS", '["free", "paid", "gold"]')
    monkeypatch.setenv("COSERVE_DEFAULT_TIER", "gold")
    monkeypatch.setenv("COSERVE_DEVICE", "cuda:1")
    monkeypatch.setenv("COSERVE_DEFAULT_BATCH_WINDOW_S", "0.5")
    s = Settings()
    assert (s.default_tier, s.device, s.default_batch_window_s) == ("gold", "cuda:1", 0.5)


@pytest.mark.parametrize("device", ["tpu", "gpu", "cuda:", "CPU", "mps", ""])
def test_resolve_device_refuses_an_unknown_device_naming_the_accepted(device):
    with pytest.raises(ValueError, match=r"unknown device .*'auto', 'cpu', 'cuda' or 'cuda:N'"):
        resolve_device(device)


def test_resolve_device_passes_the_known_through():
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("cuda:1") == "cuda:1"  # no GPU needed: the device is only named here
    assert resolve_device("auto") in ("cpu", "cuda")
