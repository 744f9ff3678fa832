import pytest

from gpu_runtime.qos import (QoSClass, QoSSpec, TbtAnchor, Tier, completion_deadline, first_token_deadline,
                             relegation_rank, resolve_tier, token_deadline)


def test_deadlines_eq_1_to_3():
    q = QoSSpec(QoSClass.INTERACTIVE, ttft_s=6.0, tbt_s=0.05)
    assert first_token_deadline(10.0, q) == 16.0
    assert token_deadline(10.0, q, 3) == pytest.approx(16.1)
    b = QoSSpec(QoSClass.BATCH, ttlt_s=600.0)
    assert completion_deadline(10.0, b) == 610.0 and completion_deadline(10.0, q) is None


def test_first_token_anchor_starts_tbt_deadlines_at_an_early_first_token():
    from gpu_runtime.metrics import slo_met
    from gpu_runtime.request import Request
    from gpu_runtime.sampling import SamplingParams

    q = QoSSpec(QoSClass.INTERACTIVE, ttft_s=6.0, tbt_s=0.05, tbt_anchor=TbtAnchor.FIRST_TOKEN)
    assert token_deadline(10.0, q, 3, first_token_time=11.0) == pytest.approx(11.1)
    assert token_deadline(10.0, q, 3, first_token_time=17.0) == pytest.approx(16.1)  # late first token: eq. 2
    assert token_deadline(10.0, q, 3) == pytest.approx(16.1)  # no first token yet
    # A stream that stalls 1 s after an early first token met eq. 2 but not its pace.
    times = [11.0, 11.05, 12.05, 12.1]
    for anchor, met in ((TbtAnchor.ARRIVAL, True), (TbtAnchor.FIRST_TOKEN, False)):
        req = Request("r", [1] * 4, SamplingParams(max_tokens=4), QoSSpec(QoSClass.INTERACTIVE, ttft_s=6.0, tbt_s=0.05,
                                                                         tbt_anchor=anchor), 10.0)
        req.output_token_ids, req.token_times = [7] * 4, list(times)
        assert slo_met(req) is met


def test_tier_names_are_configurable_and_free_is_relegated_first():
    assert resolve_tier("Premium") is Tier.PAID and resolve_tier("low") is Tier.FREE
    assert resolve_tier(None) is Tier.PAID
    assert resolve_tier("gold", names={"gold": Tier.PAID, "bronze": Tier.FREE}) is Tier.PAID
    with pytest.raises(ValueError):
        resolve_tier("platinum")
    assert relegation_rank(Tier.FREE) < relegation_rank(Tier.PAID)
