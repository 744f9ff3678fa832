"""Stream pace (TbtAnchor.FIRST_TOKEN) through the engine: QoServe + SimExecutor."""

import pytest

from gpu_runtime.engine import Engine
from gpu_runtime.executor.sim import SimExecutor
from gpu_runtime.metrics import slo_met
from gpu_runtime.qos import TbtAnchor
from gpu_runtime.scheduler.registry import create_scheduler

from tests.unit.scheduler.helpers import COST, interactive


def _serve(anchor: TbtAnchor):
    ex = SimExecutor(COST, kv_blocks=4096, block_size=16)
    engine = Engine(ex, create_scheduler("qoserve", cost_model=COST, executor=ex))
    chat = interactive("chat", prompt=16, ttft=5.0, tbt=0.05, max_tokens=40, anchor=anchor)
    long = interactive("long", prompt=6000, ttft=5.0, tbt=0.05, max_tokens=4, anchor=anchor)
    engine.add_request(chat)
    engine.add_request(long)
    engine.run_until_idle(max_steps=5000)
    gaps = [b - a for a, b in zip(chat.token_times, chat.token_times[1:], strict=False)]
    return chat, long, gaps


def test_eq2_spends_an_early_first_tokens_slack_mid_stream_and_first_token_anchor_does_not():
    chat, long, gaps = _serve(TbtAnchor.ARRIVAL)
    # The chat's first token came ~4.8 s early; eq. 2 lets the 6000-token prompt's chunks stall it.
    assert chat.token_times[0] < 0.5 and max(gaps) > 0.2
    assert slo_met(chat) and slo_met(long)  # eq. 2 counts that as met

    chat, long, gaps = _serve(TbtAnchor.FIRST_TOKEN)
    t0 = chat.token_times[0]
    assert all(t <= t0 + i * 0.05 + 1e-9 for i, t in enumerate(chat.token_times))  # token i due i TBT after the first
    assert max(gaps) < 0.1  # so no stall: one gap may use what earlier, faster ones saved
    assert slo_met(chat) and slo_met(long)
    assert long.token_times[0] <= long.arrival_time + 5.0  # the long prompt still meets its TTFT
    assert len(chat.token_times) == 40 and len(long.token_times) == 4


def test_the_anchor_setting_takes_the_two_anchors_and_defaults_to_eq2():
    from app.settings import Settings

    assert Settings().tbt_anchor == "arrival"
    assert TbtAnchor(Settings(tbt_anchor="first-token").tbt_anchor) is TbtAnchor.FIRST_TOKEN
    with pytest.raises(ValueError):
        Settings(tbt_anchor="first_token")


def test_speculation_gets_the_time_the_schedulers_slack_leaves_in_the_pass():
    from gpu_runtime.sim.acceptance import GeometricAcceptance
    from gpu_runtime.speculation.registry import create_policy

    ex = SimExecutor(COST, kv_blocks=4096, block_size=16, acceptance=GeometricAcceptance([0.6]), seed=0)
    policy = create_policy("adaserve")
    engine = Engine(ex, create_scheduler("qoserve", cost_model=COST, executor=ex), policy)
    chat = interactive("chat", prompt=16, ttft=5.0, tbt=0.05, max_tokens=40, anchor=TbtAnchor.FIRST_TOKEN)
    long = interactive("long", prompt=6000, ttft=5.0, tbt=0.05, max_tokens=4, anchor=TbtAnchor.FIRST_TOKEN)
    engine.add_request(chat)
    engine.add_request(long)
    spares = []
    while engine.has_work:
        decoding_beside_the_prompt = long.num_output_tokens == 0 and chat.num_output_tokens > 0
        engine.step()
        if decoding_beside_the_prompt:
            spares.append(policy.pass_spare_s)
    assert spares and all(s is not None and 0.0 <= s < 0.05 for s in spares)
    t0 = chat.token_times[0]
    assert all(t <= t0 + i * 0.05 + 1e-9 for i, t in enumerate(chat.token_times))
    assert slo_met(chat) and slo_met(long)
