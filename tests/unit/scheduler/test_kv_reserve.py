"""KV admission by predicted output length, re-reservation, and recompute preemption (SimExecutor)."""

from gpu_runtime.engine import Engine
from gpu_runtime.executor.sim import SimExecutor
from gpu_runtime.qos import Tier
from gpu_runtime.request import RequestStatus
from gpu_runtime.scheduler.registry import create_scheduler

from tests.unit.scheduler.helpers import COST, batch


def _scheduler(ex: SimExecutor, policy: str = "sarathi-fcfs", **config):
    s = create_scheduler(policy, cost_model=COST, executor=ex, kv_watermark=0.0, **config)
    for n in (9, 10, 11):  # the app's finished lengths: mean 10, std 1 -> 12 output tokens reserved
        s.history.record("app", n)
    return s


def _first_batch(s, ex, reqs):
    for r in reqs:
        ex.add_request(r.request_id, r.sampling)
        s.add_request(r)
    return [p.request.request_id for p in s.schedule(0.0).prefills]


def test_predicted_reserve_admits_what_a_max_tokens_reserve_refuses():
    def two():
        return [batch(n, prompt=100, max_tokens=100, app="app") for n in ("a", "b")]

    # 320 tokens of KV; max_tokens reserves 200 tokens each, the app's history 112 each
    ex = SimExecutor(COST, kv_blocks=20, block_size=16)
    assert _first_batch(_scheduler(ex, kv_reserve="max_tokens"), ex, two()) == ["a"]
    ex = SimExecutor(COST, kv_blocks=20, block_size=16)
    assert _first_batch(_scheduler(ex), ex, two()) == ["a", "b"]
    # an app without history reserves max_tokens
    ex = SimExecutor(COST, kv_blocks=20, block_size=16)
    s = _scheduler(ex)
    assert _first_batch(s, ex, [batch(n, prompt=100, max_tokens=100, app="new") for n in ("c", "d")]) == ["c"]


def test_a_job_past_its_reserve_is_reserved_again():
    ex = SimExecutor(COST, kv_blocks=100, block_size=16)
    s = _scheduler(ex)
    r = batch("a", prompt=20, max_tokens=100, app="app")
    _first_batch(s, ex, [r])
    before = s._footprint
    assert before == -(-(20 + 12) // 16) + 1
    r.num_computed_tokens, r.output_token_ids, r.token_times = 20 + 11, [7] * 12, [0.1] * 12
    r.status = RequestStatus.DECODING
    s.running["a"] = r
    out = s.schedule(0.2)
    s.update_from_output(out, 0.3)
    assert r.predicted_output_len == 24  # twice what it produced: fewer than 3 longer jobs known
    assert s._footprint == -(-(20 + 24) // 16) + 1 > before


def test_recompute_preemption_lets_every_job_finish_and_releases_the_least_urgent_first():
    # 48 tokens of KV; each job reserves 8 + 12 tokens but grows to 8 + 30: the cache runs out mid-decode
    ex = SimExecutor(COST, kv_blocks=12, block_size=4)
    s = _scheduler(ex, chunk_size=64)
    engine = Engine(ex, s)
    paid = [batch(f"p{i}", prompt=8, max_tokens=30, ttlt=50.0, app="app") for i in range(2)]
    free = batch("f", prompt=8, max_tokens=30, ttlt=100.0, app="app", tier=Tier.FREE)
    for r in (free, *paid):  # f and p0 are admitted first (6 blocks reserved each)
        engine.add_request(r)
    events = [o for o in engine.run_until_idle(max_steps=2000) if o.event == "recomputed"]
    assert all(r.status is RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 30 for r in (*paid, free))
    assert events and events[0].request_id == "f"  # free tier, latest deadline: released first
    assert free.num_recomputes >= 1
    assert ex.capacity().free_blocks == 12  # nothing leaked


def test_a_released_interactive_job_is_ordered_by_its_next_token_not_its_past_ttft():
    from gpu_runtime.scheduler.priority import first_deadline
    from gpu_runtime.scheduler.relegation import WorkEstimate, should_relegate
    from tests.unit.scheduler.helpers import decoding, interactive

    r = decoding(interactive("i", prompt=40, ttft=1.0, tbt=0.05, tier=Tier.PAID, max_tokens=100), 20, [0.5] * 20)
    r.release_kv()
    assert (r.prefill_target, r.prefill_remaining, r.num_computed_tokens) == (59, 59, 0)
    assert r.prefill_token_ids(38, 4) == [1, 1, 7, 7]  # the prompt, then the outputs being recomputed
    assert first_deadline(r) == r.next_token_deadline() == 1.0 + 20 * 0.05
    # long past its TTFT (1.0 s) but its first token came in time: not a violated job to relegate
    assert not should_relegate(r, 1.5, WorkEstimate(0.05, 256, 0.02), free_jobs_waiting=0)
