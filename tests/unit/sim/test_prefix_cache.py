"""The simulator's prefix cache (vLLM's automatic prefix caching as a model): block names, residency and
eviction, and prompts that share a prefix planned and priced for what they do not find cached."""

import random

from gpu_runtime.costmodel.linear import PiecewiseLinearCostModel
from gpu_runtime.engine import Engine
from gpu_runtime.executor.prefix_cache import PrefixCache, block_hashes
from gpu_runtime.executor.sim import SimExecutor
from gpu_runtime.qos import QoSClass, QoSSpec, Tier
from gpu_runtime.request import Request
from gpu_runtime.sampling import SamplingParams
from gpu_runtime.scheduler.registry import create_scheduler

COST = PiecewiseLinearCostModel([0.010, 0.0, 1e-4, 0.0, 0.0, 0.0], 0.0)  # 10 ms a step + 0.1 ms a prompt token
QOS = QoSSpec(QoSClass.INTERACTIVE, Tier.PAID, ttft_s=60.0, tbt_s=5.0)


def test_a_block_is_named_by_everything_before_it():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7], 2)
    assert len(a) == 3  # full blocks only
    assert block_hashes([1, 2, 3, 4, 9, 9], 2)[:2] == a[:2] and block_hashes([1, 2, 3, 4, 9, 9], 2)[2] != a[2]
    assert block_hashes([0, 2, 3, 4], 2)[1] != a[1]  # the same tokens after another first block
    assert block_hashes([5, 6], 2, parent=a[1], start=0) == a[2:]  # chained from a parent


def test_idle_blocks_stay_until_the_pool_needs_their_memory_least_recently_freed_first():
    cache = PrefixCache()
    cache.hold([1, 2, 3])
    cache.hold([1, 2])  # a second holder of the first two
    cache.release([1, 2, 3])
    assert cache.num_idle == 1 and 3 in cache and cache.leading_hits([1, 2, 3, 4]) == 3
    cache.release([1, 2])  # freed tail first: 2 before 1
    assert cache.num_idle == 3
    assert cache.evict_to(1) == 2 and 1 in cache and 2 not in cache and 3 not in cache
    assert cache.leading_hits([1, 2, 3]) == 1


def run(prefix_caching: bool, prompts: list[list[int]], kv_blocks: int = 4096, policy: str = "qoserve",
        max_tokens: int = 4, salts: list[str | None] | None = None):
    priced = []  # the prompt tokens each pass computed (what the executor priced)

    class Counting(PiecewiseLinearCostModel):
        def predict(self, f):
            priced.append(f.num_prefill_tokens)
            return super().predict(f)

    ex = SimExecutor(Counting(COST.coef, COST.knee), kv_blocks=kv_blocks, block_size=16,
                     prefix_caching=prefix_caching)
    engine = Engine(ex, create_scheduler(policy, cost_model=COST, executor=ex))
    for i, ids in enumerate(prompts):
        engine.add_request(Request(f"r{i}", ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True), QOS,
                                   arrival_time=0.0, cache_salt=salts[i] if salts else None))
    done = {}
    while engine.has_work:
        for out in engine.step():
            if out.metrics is not None:
                done[out.request_id] = out.metrics
    return done, sum(priced), ex, engine.num_recomputes


def test_prompts_behind_one_system_prompt_compute_it_once_and_start_sooner():
    rng = random.Random(0)
    system = [rng.randrange(3, 1000) for _ in range(512)]
    prompts = [system + [rng.randrange(3, 1000) for _ in range(40)] for _ in range(16)]
    cold, cold_tokens, *_ = run(False, prompts)
    warm, warm_tokens, ex, _ = run(True, prompts)
    assert cold_tokens == 16 * 552
    # the first prompt computes it; every other finds it cached, those in the same pass too (vLLM names a block
    # when it allocates it), up to the end of its chunk where the budget cut the pass's last prompt short
    hits = sorted(m.num_cached_tokens for m in warm.values())
    assert hits[0] == 0 and hits.count(512) >= 14 and all(h % 16 == 0 and h > 0 for h in hits[1:])
    assert warm_tokens == cold_tokens - sum(hits) <= 552 + 15 * 40 + 512
    assert sum(m.ttft_s for m in warm.values()) < 0.6 * sum(m.ttft_s for m in cold.values())
    assert ex.prefix_cache.num_idle > 0  # finished requests' blocks stay cached while memory allows


def test_prompts_share_cached_blocks_within_their_cache_salt_only():
    """vLLM's cache_salt (the worker's: the tenant): the same system prompt is computed once per salt."""
    rng = random.Random(1)
    system = [rng.randrange(3, 1000) for _ in range(512)]
    prompts = [system + [rng.randrange(3, 1000) for _ in range(40)] for _ in range(8)]
    shared, shared_tokens, *_ = run(True, prompts)
    salted, salted_tokens, *_ = run(True, prompts, salts=["acme", "globex"] * 4)
    hits = {r: m.num_cached_tokens for r, m in salted.items()}
    assert sorted(hits.values())[:2] == [0, 0] and all(h > 0 for h in sorted(hits.values())[2:])  # one per salt
    assert salted_tokens == shared_tokens + 512  # the second tenant computed the system prompt again
    assert sum(m.num_cached_tokens for m in shared.values()) == sum(hits.values()) + 512


def test_a_request_whose_kv_was_released_finds_its_own_blocks_cached():
    """Recompute preemption (a pool the decodes outgrow): the released request's prompt blocks stay cached while
    the pool has free memory for them, so its recompute starts past them."""
    from gpu_runtime.scheduler.registry import create_scheduler as make

    ex = SimExecutor(COST, kv_blocks=12, block_size=4, prefix_caching=True)
    s = make("sarathi-fcfs", cost_model=COST, executor=ex, kv_watermark=0.0, chunk_size=64)
    for n in (9, 10, 11):  # the app's history: 12 output tokens reserved, 30 produced
        s.history.record("app", n)
    engine = Engine(ex, s)
    qos = QoSSpec(QoSClass.BATCH, Tier.PAID, ttlt_s=50.0)
    free = QoSSpec(QoSClass.BATCH, Tier.FREE, ttlt_s=100.0)
    reqs = [Request(rid, [10 * i + k for k in range(8)], SamplingParams(max_tokens=30, ignore_eos=True), q, 0.0,
                    app_id="app") for i, (rid, q) in enumerate((("f", free), ("p0", qos), ("p1", qos)))]
    for r in reqs:
        engine.add_request(r)
    recomputed = [o.request_id for o in engine.run_until_idle(max_steps=2000) if o.event == "recomputed"]
    assert recomputed and all(r.num_output_tokens == 30 for r in reqs)
    again = next(r for r in reqs if r.request_id == recomputed[0])
    assert again.num_cached_tokens == 4  # its prompt's one cacheable block (of 8 tokens: all but the last)
    assert ex.capacity().free_blocks == 12  # nothing leaked, shared blocks included
