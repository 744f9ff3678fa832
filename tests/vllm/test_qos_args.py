"""QoS in vLLM's extra_args: defaults, every key, and clear errors for bad values."""

from __future__ import annotations

import math

import pytest

from gpu_runtime.qos import QoSClass, QoSSpec, TbtAnchor, Tier
from gpu_runtime.vllm.qos_args import QoSArgsError, parse_qos, to_extra_args


def test_defaults_are_interactive_paid_in_seconds(monkeypatch):
    monkeypatch.delenv("COSERVE_DEFAULT_TTFT_MS", raising=False)
    monkeypatch.delenv("COSERVE_DEFAULT_TBT_MS", raising=False)
    q = parse_qos(None).qos
    assert (q.qos_class, q.tier, q.ttft_s, q.tbt_s) == (QoSClass.INTERACTIVE, Tier.PAID, 2.0, 0.2)


def test_batch_and_interactive_keys():
    batch = parse_qos({"qos_class": "batch", "deadline_s": 600, "tier": "low", "app_id": "summ"})
    assert batch.qos == QoSSpec(QoSClass.BATCH, Tier.FREE, ttlt_s=600.0) and batch.app_id == "summ"
    inter = parse_qos({"ttft_ms": 500, "tbt_ms": 50, "tbt_anchor": "first-token", "tier": "premium"}).qos
    assert (inter.ttft_s, inter.tbt_s, inter.tbt_anchor, inter.tier) == (0.5, 0.05, TbtAnchor.FIRST_TOKEN, Tier.PAID)


@pytest.mark.parametrize("args, fragment", [
    ({"qos_class": "bulk"}, "qos_class must be 'interactive' or 'batch'"),
    ({"ttft_ms": math.nan}, "ttft_ms must be a finite number > 0"),
    ({"tbt_ms": -5}, "tbt_ms must be a finite number > 0"),
    ({"ttft_ms": "fast"}, "ttft_ms must be a number"),
    ({"tier": "gold"}, "unknown tier 'gold'"),
    ({"qos_class": "batch", "tbt_ms": 50}, "tbt_ms applies to interactive requests"),
    ({"deadline_s": 60}, "deadline_s applies to batch requests"),
    ({"tbt_anchor": "later"}, "tbt_anchor must be"),
    ({"app_id": 5}, "app_id must be a string"),
])
def test_bad_values_say_what_to_fix(args, fragment):
    with pytest.raises(QoSArgsError, match=fragment.replace("(", r"\(")):
        parse_qos(args)


@pytest.mark.parametrize("qos", [QoSSpec(QoSClass.BATCH, Tier.FREE, ttlt_s=90.0),
                                 QoSSpec(QoSClass.INTERACTIVE, Tier.PAID, ttft_s=0.3, tbt_s=0.04,
                                         tbt_anchor=TbtAnchor.FIRST_TOKEN)])
def test_round_trip(qos):
    back = parse_qos(to_extra_args(qos, "app"))
    assert back.qos == qos and back.app_id == "app"


def test_a_reruns_delivered_tokens_travel_and_come_back():
    q = QoSSpec(QoSClass.INTERACTIVE, Tier.FREE, ttft_s=2.0, tbt_s=0.2, delivered=40, first_token_s=0.5)
    args = to_extra_args(q, "chat")
    assert (args["tokens_delivered"], args["first_token_s"]) == (40, 0.5)
    assert parse_qos(args).qos == q
    assert "tokens_delivered" not in to_extra_args(QoSSpec(QoSClass.BATCH, ttlt_s=60.0))
    with pytest.raises(QoSArgsError, match="tokens_delivered must be an integer >= 0"):
        parse_qos({"tokens_delivered": -1})
    with pytest.raises(QoSArgsError, match="first_token_s must be a finite number >= 0"):
        parse_qos({"tokens_delivered": 3, "first_token_s": "soon"})
