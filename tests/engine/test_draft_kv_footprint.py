"""A speculating job's KV on the own engine (tiny torch model) and on the simulator stays within the footprint KV
admission reserves (prompt + max_tokens in blocks, and one block more): a decode's draft tree takes slots only for its
pass and is cut to that block near the job's end, a chain stops at max_tokens on both executors, and with
``kv_reserve=max_tokens`` no job is released to make room for another's tree. A draft model's pool, which mirrors
the target's blocks, holds what it can of a draft call's beams and cuts the rest instead of failing the step."""

from __future__ import annotations

import random

import pytest

from gpu_runtime.costmodel.profile import default_cost_model
from gpu_runtime.engine import Engine
from gpu_runtime.executor.base import BatchPlan, DraftEntry, PrefillChunk
from gpu_runtime.executor.drafters.model_runner import DraftModelRunner
from gpu_runtime.executor.sim import SimExecutor
from gpu_runtime.executor.torch import TorchExecutor
from gpu_runtime.request import RequestStatus
from gpu_runtime.scheduler.base import footprint_blocks
from gpu_runtime.scheduler.registry import create_scheduler
from gpu_runtime.sim.acceptance import GeometricAcceptance
from tests.engine.conftest import make_request, tiny_llama
from tests.engine.spec_helpers import NoisyTreeDrafter, VerifyAll
from workers.engine_thread import engine_state

BLOCK = 2  # small blocks: a tree of 24 nodes passes the footprint's block of slack by 11 blocks
PROMPT, MAX_TOKENS = 4, 14  # 18 tokens: a footprint of 9 + 1 blocks
FOOTPRINT = -(-(PROMPT + MAX_TOKENS) // BLOCK) + 1


def _executor(kind: str, tiny_model, width: int, blocks: int):
    if kind == "sim":
        return SimExecutor(default_cost_model(), kv_blocks=blocks, block_size=BLOCK,
                           acceptance=GeometricAcceptance([0.95]), seed=0)
    drafter = NoisyTreeDrafter({}, vocab=97, hit=0.0, seed=5, max_nodes=6 * width)
    return TorchExecutor.from_model(tiny_model, kv_blocks=blocks, block_size=BLOCK, drafter=drafter)


def _peak_blocks(ex) -> dict[str, int]:
    """Records the most blocks each request held at once (a pass's draft slots included)."""
    peak: dict[str, int] = {}
    allocate = ex.blocks.allocate

    def recording(request_id: str, n: int):
        got = allocate(request_id, n)
        table = ex.blocks.tables.get(request_id)
        if table is not None:
            peak[request_id] = max(peak.get(request_id, 0), len(table.blocks))
        return got

    ex.blocks.allocate = recording
    return peak


@pytest.mark.parametrize("kind", ["sim", "torch"])
@pytest.mark.parametrize("width", [1, 4])  # a chain of 6 drafts, a tree of up to 24 nodes (12 blocks)
def test_a_speculating_job_holds_no_more_kv_than_its_footprint_and_max_tokens_never_preempts(
        tiny_model, kind, width):
    ex = _executor(kind, tiny_model, width, blocks=2 * FOOTPRINT)  # two jobs' footprints: no block spare
    peak = _peak_blocks(ex)
    sched = create_scheduler("sarathi-fcfs", default_cost_model(), ex, kv_watermark=0.0, kv_reserve="max_tokens")
    policy = VerifyAll(depth=6, width=width)
    engine = Engine(ex, sched, policy)
    rng = random.Random(1)
    reqs = [make_request([rng.randrange(3, 97) for _ in range(PROMPT)], max_tokens=MAX_TOKENS) for _ in range(3)]
    assert footprint_blocks(reqs[0], MAX_TOKENS, BLOCK) == FOOTPRINT
    for r in reqs:
        engine.add_request(r)
    events = [o.event for o in engine.run_until_idle(max_steps=2000)]
    assert all(r.status is RequestStatus.FINISHED_LENGTH and r.num_output_tokens == MAX_TOKENS for r in reqs)
    assert policy.steps > 0  # drafts were verified
    assert "recomputed" not in events  # max_tokens reserved: no job released for another's drafts
    assert set(peak) == {r.request_id for r in reqs} and max(peak.values()) <= FOOTPRINT, peak
    if width == 1:  # a chain stops at max_tokens: its drafts reach prompt + max_tokens - 1 slots at most
        assert max(peak.values()) <= -(-(PROMPT + MAX_TOKENS - 1) // BLOCK)
    assert ex.capacity().free_blocks == 2 * FOOTPRINT


def test_the_simulator_cuts_a_tree_to_the_depth_the_own_engine_does(tiny_model):
    """Both executors verify no tree deeper than the remaining max_tokens - 1 (``tree_depth_limit``)."""
    sim = SimExecutor(default_cost_model(), kv_blocks=64, block_size=BLOCK, acceptance=GeometricAcceptance([0.8]))
    own = TorchExecutor.from_model(tiny_model, kv_blocks=64, block_size=BLOCK,
                                   drafter=NoisyTreeDrafter({}, vocab=97, hit=0.0, seed=5, max_nodes=64))
    depths = {}
    for name, ex in (("sim", sim), ("own", own)):
        req = make_request(list(range(5, 12)), max_tokens=4)  # 1 token from the prefill, 3 left: depth <= 2
        ex.add_request(req.request_id, req.sampling)
        ex.step(BatchPlan(prefills=[PrefillChunk(req.request_id, 0, req.prompt_token_ids, True)]))
        tree = ex.draft([DraftEntry(req.request_id, 6, 2)]).trees[req.request_id]
        depths[name] = max(tree.depths())
    assert depths == {"sim": 2, "own": 2}


def _greedy_with_draft_model(blocks: int, width: int) -> tuple[dict[str, list[int]], DraftModelRunner, VerifyAll]:
    runner = DraftModelRunner(tiny_llama(seed=1, layers=1), block_size=BLOCK)  # its pool: the target's block count
    ex = TorchExecutor.from_model(tiny_llama(), kv_blocks=blocks, block_size=BLOCK, drafter=runner)
    sched = create_scheduler("sarathi-fcfs", default_cost_model(), ex, kv_watermark=0.0, kv_reserve="max_tokens")
    policy = VerifyAll(depth=6, width=width)
    engine = Engine(ex, sched, policy)
    assert engine_state(engine)["draft_pool_short"] == 0
    rng = random.Random(1)
    reqs = [make_request([rng.randrange(3, 97) for _ in range(PROMPT)], max_tokens=MAX_TOKENS) for _ in range(4)]
    for r in reqs:
        engine.add_request(r)
    engine.run_until_idle(max_steps=2000)
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in reqs)
    assert ex.capacity().free_blocks == blocks and runner.blocks.num_free == blocks
    # the worker's heartbeat carries the count (coserve:spec_decode_num_draft_pool_short, per worker)
    assert engine_state(engine)["draft_pool_short"] == runner.num_pool_short
    return {r.request_id: r.output_token_ids for r in reqs}, runner, policy


@pytest.mark.parametrize("width", [2, 4])
def test_a_draft_model_whose_pool_cannot_hold_every_beam_drafts_shallower_trees_instead_of_failing_the_step(width):
    """The draft model's KV pool mirrors the target's blocks, which admission counts, but a draft call also takes
    ``width`` scratch slots per depth for every request at once: with the target's pool full of admitted jobs those
    do not fit. The requests it cannot hold draft shallower trees or none (counted), and the outputs stay those of
    the run with room to spare."""
    ample, roomy, _ = _greedy_with_draft_model(200, width)
    tight, runner, policy = _greedy_with_draft_model(2 * FOOTPRINT, width)
    assert roomy.num_pool_short == 0
    assert runner.num_pool_short > 0 and policy.steps > 0
    assert list(tight.values()) == list(ample.values())


def test_the_draft_pool_reserves_every_drafted_request_s_beams_before_the_first_depth_runs():
    """Two requests each fit the draft pool alone, not together: the second drafts a shallower tree."""
    runner = DraftModelRunner(tiny_llama(seed=1, layers=1), num_blocks=7, block_size=4)
    ex = TorchExecutor.from_model(tiny_llama(), kv_blocks=32, block_size=4, drafter=runner)
    for rid in ("a", "b"):
        ex.add_request(rid, make_request([5]).sampling)
        ex.step(BatchPlan(prefills=[PrefillChunk(rid, 0, list(range(10, 18)), True)]))
    trees = ex.draft([DraftEntry("a", 4, 2), DraftEntry("b", 4, 2)]).trees  # 9 tokens + 6 scratch: 4 blocks each
    assert (max(trees["a"].depths()), max(trees["b"].depths())) == (4, 2)  # b: 9 + 2 scratch in the 3 blocks left
    assert runner.num_pool_short == 1 and runner.blocks.num_free == 7 - 2 * 3
