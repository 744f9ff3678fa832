import pytest

from gpu_runtime.qos import (QoSClass, QoSSpec, Tier, completion_deadline, first_token_deadline, relegation_rank,
                             resolve_tier, token_deadline)


def test_deadlines_eq_1_to_3():
    q = QoSSpec(QoSClass.INTERACTIVE, ttft_s=6.0, tbt_s=0.05)
    assert first_token_deadline(10.0, q) == 16.0
    assert token_deadline(10.0, q, 3) == pytest.approx(16.1)
    b = QoSSpec(QoSClass.BATCH, ttlt_s=600.0)
    assert completion_deadline(10.0, b) == 610.0 and completion_deadline(10.0, q) is None


def test_tier_names_are_configurable_and_free_is_relegated_first():
    assert resolve_tier("Premium") is Tier.PAID and resolve_tier("low") is Tier.FREE
    assert resolve_tier(None) is Tier.PAID
    assert resolve_tier("gold", names={"gold": Tier.PAID, "bronze": Tier.FREE}) is Tier.PAID
    with pytest.raises(ValueError):
        resolve_tier("platinum")
    assert relegation_rank(Tier.FREE) < relegation_rank(Tier.PAID)
