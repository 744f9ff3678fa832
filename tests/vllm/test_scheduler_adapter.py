"""coserve's policies inside vLLM's scheduler, on hand-built vLLM requests (no model runs)."""

from __future__ import annotations

import json
import time

import pytest

from tests.vllm.conftest import answer_step, run_step, vllm_request

BATCH_FAR = {"qos_class": "batch", "deadline_s": 3600}


@pytest.mark.parametrize("policy, first", [("qoserve", "chat"), ("vllm-fcfs", "batch")])
def test_waiting_order_is_hybrid_priority_not_arrival(make_scheduler, policy, first):
    """A batch job with an hour's deadline arrived first; the interactive prompt due in a second runs first
    under QoServe, while vLLM's own FCFS (the same class, policy vllm-fcfs) keeps the arrival order."""
    s = make_scheduler(policy, max_batched=64)
    now = time.time()
    reqs = {"batch": vllm_request(64, BATCH_FAR, arrival=now - 1),
            "chat": vllm_request(64, {"ttft_ms": 1000, "tbt_ms": 100}, arrival=now)}
    for r in reqs.values():
        s.add_request(r)
    out, _ = run_step(s)
    assert list(out.num_scheduled_tokens) == [reqs[first].request_id]


def test_prefill_budget_follows_decode_slack(make_scheduler):
    """With a decode due in 30 ms, the chunk beside it is cut to what the cost model fits in that slack;
    with nothing due, the next prompt takes the whole step."""
    s = make_scheduler("qoserve", max_batched=512)
    tight = vllm_request(16, {"ttft_ms": 10_000, "tbt_ms": 30, "tbt_anchor": "first-token"}, max_tokens=64)
    s.add_request(tight)
    run_step(s)  # its prompt: now it decodes every step
    long_prompt = vllm_request(480, {"ttft_ms": 60_000, "tbt_ms": 1000})
    s.add_request(long_prompt)
    out, _ = run_step(s)
    chunk = out.num_scheduled_tokens.get(long_prompt.request_id, 0)
    assert out.num_scheduled_tokens[tight.request_id] == 1
    assert 0 < chunk < 480, out.num_scheduled_tokens
    assert s.last_step[2] == chunk  # the budget the policy chose is what vLLM ran

    s2 = make_scheduler("qoserve", max_batched=512)
    other = vllm_request(480, {"ttft_ms": 60_000, "tbt_ms": 1000})
    s2.add_request(other)
    out2, _ = run_step(s2)
    assert out2.num_scheduled_tokens[other.request_id] == 480


def test_without_chunked_prefill_the_policys_chunk_runs_as_the_whole_prompt(make_scheduler):
    """Where vLLM runs no prompt in chunks (``--no-enable-chunked-prefill``, or a model vLLM cannot chunk), it skips a
    prompt longer than the step's budget. The chunk the policy cut beside a tight decode becomes the whole prompt,
    which runs that step, instead of waiting for the decode to finish."""
    s = make_scheduler("qoserve", max_batched=512, chunked_prefill=False)
    tight = vllm_request(16, {"ttft_ms": 10_000, "tbt_ms": 30, "tbt_anchor": "first-token"}, max_tokens=64)
    s.add_request(tight)
    run_step(s)
    long_prompt = vllm_request(480, {"ttft_ms": 60_000, "tbt_ms": 1000})
    s.add_request(long_prompt)
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {tight.request_id: 1, long_prompt.request_id: 480}
    out, _ = run_step(s)  # both decode on, and the policy's mirror knows the prompt is done
    assert out.num_scheduled_tokens == {tight.request_id: 1, long_prompt.request_id: 1}


def test_which_seeds_reach_vllm_where_seeded_prompts_must_run_whole(make_scheduler):
    """On the CPU a client's seed reaches vLLM's sampler where coserve's policy runs and the prompt with its output
    fits a step; the scheduler drops it otherwise (vLLM's own policies, a longer prompt), and the engine does not
    pass a seed the server drew for reruns (every sampled prompt would run whole). Elsewhere every seed goes."""
    from vllm import SamplingParams as VLLMSampling
    from vllm.sampling_params import SamplingType

    from gpu_runtime.qos import QoSClass, QoSSpec
    from gpu_runtime.request import Request
    from gpu_runtime.sampling import SamplingParams
    from gpu_runtime.vllm.engine import seed_applies

    def job(drawn: bool) -> Request:
        return Request("r", [1, 2, 3], SamplingParams(max_tokens=16, temperature=1.0, seed=3, seed_drawn=drawn),
                       QoSSpec(QoSClass.BATCH, ttlt_s=3600.0), 0.0)

    assert seed_applies(job(False), whole_seeded=True) and not seed_applies(job(True), whole_seeded=True)
    assert seed_applies(job(False), whole_seeded=False) and seed_applies(job(True), whole_seeded=False)

    def seed_kept(policy: str, prompt: int, max_tokens: int = 16, temperature: float = 1.0) -> bool:
        s = make_scheduler(policy, max_batched=512)
        r = vllm_request(prompt, {"ttft_ms": 60_000, "tbt_ms": 1000})
        r.sampling_params = VLLMSampling(max_tokens=max_tokens, seed=7, temperature=temperature,
                                         extra_args=r.sampling_params.extra_args)
        s.add_request(r)
        kept = r.sampling_params.seed == 7
        # vLLM caches the type the model runner seeds a generator by: a dropped seed must not leave it RANDOM_SEED
        # (the step failed: "manual_seed expected a long, but got NoneType"; or the prompt waited for ever to run
        # whole)
        assert (r.sampling_params.sampling_type is SamplingType.RANDOM_SEED) == (kept and temperature > 0)
        return kept

    assert seed_kept("qoserve", 496)  # 496 + 16: one step
    assert not seed_kept("qoserve", 497)
    assert not seed_kept("vllm-fcfs", 100)  # vLLM's own policy cuts prompts as they go
    assert seed_kept("vllm-fcfs", 497, temperature=0.0)  # greedy: no generator, nothing to rewind


def test_a_seeded_prompt_runs_whole_where_vllm_cannot_rewind_its_generator(make_scheduler):
    """On the CPU vLLM cannot rewind a seeded request's generator after a part of its prompt ran (the step fails,
    and every request in it): the policy's chunk of a seeded prompt becomes the whole prompt, an unseeded one is
    still cut, and a seeded prompt the step has no room for waits until one has."""
    from vllm import SamplingParams

    def seeded(n: int, temperature: float = 1.0):
        r = vllm_request(n, {"ttft_ms": 60_000, "tbt_ms": 1000})
        r.sampling_params = SamplingParams(max_tokens=8, seed=7, temperature=temperature,
                                           extra_args=r.sampling_params.extra_args)
        return r

    s = make_scheduler("qoserve", max_batched=512)
    assert s.whole_seeded  # this machine is a CPU
    tight = vllm_request(16, {"ttft_ms": 10_000, "tbt_ms": 30, "tbt_anchor": "first-token"}, max_tokens=64)
    s.add_request(tight)
    run_step(s)
    plain, greedy, lucky = vllm_request(480, {"ttft_ms": 60_000, "tbt_ms": 1000}), seeded(480, 0.0), seeded(300)
    s.add_request(plain)
    out, _ = run_step(s)
    assert 0 < out.num_scheduled_tokens[plain.request_id] < 480  # cut beside the tight decode, as ever
    s.add_request(greedy)  # a seed without sampling (temperature 0): no generator, cut as ever
    while greedy.request_id not in out.num_scheduled_tokens:
        out, _ = run_step(s)
    assert 0 < out.num_scheduled_tokens[greedy.request_id] < 480
    s.add_request(lucky)
    for _ in range(40):
        out, _ = run_step(s)
        if lucky.request_id in out.num_scheduled_tokens:
            break
    assert out.num_scheduled_tokens[lucky.request_id] == 300, out.num_scheduled_tokens  # whole, never a part

    s = make_scheduler("qoserve", max_batched=512)
    tight = [vllm_request(16, {"ttft_ms": 10_000, "tbt_ms": 30, "tbt_anchor": "first-token"}, max_tokens=64)
             for _ in range(10)]
    for r in tight:
        s.add_request(r)
    run_step(s)
    s.add_request(big := seeded(504))  # 504 + 8 output tokens: one step, but not beside ten decodes
    out, _ = run_step(s)
    assert big.sampling_params.seed == 7 and big.request_id not in out.num_scheduled_tokens, out.num_scheduled_tokens
    while any(r.request_id in s.requests for r in tight):  # until the decodes are done: never a part of it
        out, _ = run_step(s)
        assert out.num_scheduled_tokens.get(big.request_id, 504) == 504, out.num_scheduled_tokens
    if big.request_id not in out.num_scheduled_tokens:
        out, _ = run_step(s)
    assert out.num_scheduled_tokens.get(big.request_id) == 504, out.num_scheduled_tokens


def test_free_job_past_its_deadline_is_relegated_then_resumed(make_scheduler):
    """A free prompt already past its TTFT waits behind paid work and is reported; it runs once load drops."""
    s = make_scheduler("qoserve", max_batched=64)
    now = time.time()
    late_free = vllm_request(64, {"tier": "free", "ttft_ms": 100, "tbt_ms": 100}, arrival=now - 5)
    paid = vllm_request(64, {"tier": "paid", "ttft_ms": 2000, "tbt_ms": 200}, arrival=now, max_tokens=2)
    s.add_request(late_free)
    s.add_request(paid)
    out, _ = run_step(s)
    assert list(out.num_scheduled_tokens) == [paid.request_id]
    assert (late_free.request_id, "relegated") in s.events
    assert s.queue_depths()["relegated"] == 1
    for _ in range(6):  # the paid job finishes; spare budget goes to the relegated one
        out, _ = run_step(s)
        if late_free.request_id in out.num_scheduled_tokens:
            break
    assert late_free.request_id in out.num_scheduled_tokens


def test_a_rerun_on_pace_is_not_relegated_though_its_ttft_is_long_past(make_scheduler):
    """A rerun going on from 100 tokens its earlier attempt streamed (the first 50 ms after arrival): its TTFT deadline
    passed 5 s ago, but token 101 is due 5 s from now (eq. 2 over the whole answer), so it runs; a fresh job as late
    is relegated."""
    s = make_scheduler("qoserve", max_batched=512)
    now = time.time()
    late = {"tier": "free", "ttft_ms": 100, "tbt_ms": 100}
    fresh = vllm_request(64, late, arrival=now - 5)
    rerun = vllm_request(164, late | {"tokens_delivered": 100, "first_token_s": 0.05}, arrival=now - 5)
    s.add_request(fresh)
    s.add_request(rerun)
    out, _ = run_step(s)
    assert rerun.request_id in out.num_scheduled_tokens
    assert (fresh.request_id, "relegated") in s.events
    assert (rerun.request_id, "relegated") not in s.events


def test_a_lone_batch_job_on_the_cpu_profile_is_not_relegated(make_scheduler):
    """vLLM's step cap (4,096 tokens) and the shipped CPU profile: 440 tokens due in a minute decode in ~13 s on an
    idle engine. Priced beside a saturating chunk (0.22 s a token: 97 s), the job was relegated on arrival."""
    from gpu_runtime.costmodel.profile import PROFILE_DIR

    s = make_scheduler("qoserve", max_batched=4096, profile=str(PROFILE_DIR / "cpu-avx512-smollm2-135m-vllm.json"))
    job = vllm_request(64, {"qos_class": "batch", "deadline_s": 60}, max_tokens=440)
    s.add_request(job)
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {job.request_id: 64}
    assert s.queue_depths()["relegated"] == 0 and (job.request_id, "relegated") not in s.events


def test_a_relegated_job_past_its_expiry_ends_as_an_abort_with_an_expired_event(make_scheduler):
    """Relegated and then given up on (deadline + max(2 x TTFT, 60 s) passed): vLLM frees it and reports it;
    the event says it expired, so the worker records expired, not cancelled."""
    from vllm.v1.request import RequestStatus

    s = make_scheduler("qoserve", max_batched=64)
    gone = vllm_request(64, {"tier": "free", "ttft_ms": 100, "tbt_ms": 100}, arrival=time.time() - 61)
    busy = vllm_request(64, {"ttft_ms": 2000, "tbt_ms": 200}, max_tokens=50)
    s.add_request(gone)
    s.add_request(busy)
    run_step(s)
    assert (gone.request_id, "relegated") in s.events
    out, engine_out = run_step(s)
    assert (gone.request_id, "expired") in s.events
    assert gone.status == RequestStatus.FINISHED_ABORTED and gone.request_id not in s.requests
    assert gone.request_id not in s.mirrors and s.coserve_policy.queue_depths()["relegated"] == 0
    assert gone.request_id not in out.num_scheduled_tokens
    ends = [o for eco in engine_out.values() for o in eco.outputs if o.request_id == gone.request_id]
    assert len(ends) == 1 and ends[0].finish_reason is not None


@pytest.mark.parametrize("policy", ["qoserve", "vllm-fcfs"])
def test_a_prompts_first_chunk_is_reported_once_and_only_to_a_reader(make_scheduler, policy):
    """The worker's engine learns when each prompt's first chunk ran (the job's queue time ends there): one
    "started" event per request, in the step that ran its first chunk, under coserve's policies and vLLM's own.
    A plain `vllm serve` has no reader: the scheduler keeps no events at all."""
    s = make_scheduler(policy, max_batched=64)
    first = vllm_request(96, {"ttft_ms": 5000, "tbt_ms": 500}, max_tokens=4)
    s.add_request(first)
    run_step(s)  # 64 of its 96 prompt tokens
    assert [e for e in s.events if e[1] == "started"] == [(first.request_id, "started")]
    s.events.clear()
    later = vllm_request(16, {"ttft_ms": 5000, "tbt_ms": 500}, max_tokens=4)
    s.add_request(later)
    for _ in range(3):
        run_step(s)
    assert [e for e in s.events if e[1] == "started"] == [(later.request_id, "started")]

    quiet = make_scheduler(policy, max_batched=64, report_events=False)
    late_free = vllm_request(64, {"tier": "free", "ttft_ms": 100, "tbt_ms": 100}, arrival=time.time() - 5)
    quiet.add_request(late_free)
    quiet.add_request(vllm_request(64, {"ttft_ms": 2000, "tbt_ms": 200}, max_tokens=2))
    run_step(quiet)
    assert not quiet.events


def test_operator_resume_brings_a_relegated_job_back(make_scheduler):
    s = make_scheduler("qoserve", max_batched=64)
    late_free = vllm_request(64, {"tier": "free", "ttft_ms": 100, "tbt_ms": 100}, arrival=time.time() - 5)
    s.add_request(late_free)
    s.add_request(vllm_request(64, {"ttft_ms": 2000, "tbt_ms": 200}, max_tokens=50))
    run_step(s)
    assert s.queue_depths()["relegated"] == 1
    s.resume(late_free.request_id)
    run_step(s)
    assert (late_free.request_id, "resumed") in s.events and s.queue_depths()["relegated"] == 0


def test_bad_qos_finishes_as_an_error_and_leaves_the_rest(make_scheduler):
    from vllm.v1.request import RequestStatus

    s = make_scheduler("qoserve")
    bad = vllm_request(16, {"tier": "gold"})
    good = vllm_request(16, {"tier": "free"})
    s.add_request(bad)
    s.add_request(good)
    out, engine_out = run_step(s)
    assert bad.request_id not in out.num_scheduled_tokens and good.request_id in out.num_scheduled_tokens
    assert bad.status == RequestStatus.FINISHED_ERROR
    errors = [o for eco in engine_out.values() for o in eco.outputs if o.request_id == bad.request_id]
    assert errors and errors[0].finish_reason is not None


def test_finished_requests_leave_the_policy_and_teach_lengths(make_scheduler):
    s = make_scheduler("qoserve")
    reqs = [vllm_request(16, {"app_id": "a"}, max_tokens=3) for _ in range(3)]
    for r in reqs:
        s.add_request(r)
    for _ in range(5):
        run_step(s)
    assert not s.mirrors and s.coserve_policy.num_unfinished == 0
    assert s.coserve_policy.history.predict("a", 100) <= 5  # three jobs of 3 tokens: mean + 2 std


def test_abort_removes_the_mirror(make_scheduler):
    from vllm.v1.request import RequestStatus

    s = make_scheduler("qoserve")
    r = vllm_request(16)
    s.add_request(r)
    run_step(s)
    s.finish_requests(r.request_id, RequestStatus.FINISHED_ABORTED)
    assert r.request_id not in s.mirrors and s.coserve_policy.num_unfinished == 0


def test_sarathi_budget_is_a_token_budget(make_scheduler):
    """sarathi-fcfs through the same setting: decodes take one token of chunk_size each, prompts the rest."""
    s = make_scheduler("sarathi-fcfs", max_batched=512)
    first = vllm_request(16, max_tokens=64)
    s.add_request(first)
    run_step(s)
    big = vllm_request(480)
    s.add_request(big)
    out, _ = run_step(s)
    assert out.num_scheduled_tokens[big.request_id] == 256 - 1  # SarathiConfig.chunk_size minus one decode


def _two_decodes_under_chain_2(make_scheduler, proposed: int):
    """A QoServe scheduler whose drafter proposes ``proposed`` tokens a decode and whose policy keeps two (chain-2),
    with two requests past their prompts."""
    from gpu_runtime.costmodel.profile import conservative_cost_model
    from gpu_runtime.vllm.speculation import DraftLengths

    s = make_scheduler("qoserve")
    s.num_spec_tokens = proposed
    s.drafts = DraftLengths("chain-2", conservative_cost_model(), longest_draft=proposed)
    a, b = vllm_request(16, max_tokens=32), vllm_request(16, max_tokens=32)
    s.add_request(a)
    s.add_request(b)
    run_step(s)  # prompts; now both decode
    return s, a, b


def test_draft_tokens_are_trimmed_per_request_to_the_policys_choice(make_scheduler):
    """vLLM proposed 6 draft tokens per decode; chain-2 verifies two of them, and the budget counts them."""
    s, a, b = _two_decodes_under_chain_2(make_scheduler, proposed=6)
    a.spec_token_ids = [1, 2, 3, 4, 5, 6]
    b.spec_token_ids = []  # no n-gram match: nothing to verify
    out, _ = run_step(s)
    assert out.scheduled_spec_decode_tokens == {a.request_id: [1, 2]}
    assert out.num_scheduled_tokens == {a.request_id: 3, b.request_id: 1}
    assert s.drafts.kept == {a.request_id: 2}
    # the step's output (run_step's runner accepts no draft token): position 1 was tried and missed, in the pooled
    # rates and in those of 6-token proposals
    from gpu_runtime.speculation.draft_acceptance import size_class

    assert s.drafts.acceptance.pooled.seen[:2] == [1, 0]
    assert s.drafts.acceptance.by_size[size_class(6)].seen[:2] == [1, 0] and len(s.drafts.acceptance.by_size) == 1
    assert s.drafts.acceptance.conditionals(2, proposed=6)[0] < 0.6  # below the prior: the next chains' path probs


def _answer_with(s, out, sampled: dict[str, list[int]]):  # noqa: ANN001 - a CoserveScheduler, its step
    """The model runner's answer to the step ``out``: ``sampled`` tokens per request (a prompt's chunk: none)."""
    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(out.num_scheduled_tokens)
    return s.update_from_output(out, ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                                       sampled_token_ids=[sampled.get(r, []) for r in ids]))


@pytest.mark.parametrize("drafter", ["ngram", "draft_model"])
def test_a_decodes_drafts_count_in_its_kv_room_so_the_policy_chooses_whom_to_preempt(make_scheduler, drafter):
    """Two decodes, each verifying vLLM's 4 drafts, outgrow the KV their short predicted lengths reserved (the app's
    answers were 1 token). On the step where the 4 drafts of each pass a block and only one block is free, the
    policy counted one token a decode, which fit the blocks they hold: vLLM found no room and preempted its last
    running request, the paid chat. Counting the drafts, the policy releases the least urgent one, the free job,
    before vLLM schedules, and vLLM preempts nothing. A draft-model drafter (EAGLE's too) writes KV past the tokens
    a step verifies: vLLM allocates 4 lookahead slots per request beside each prompt chunk and decode, which the
    policy counts as well (counting the tokens alone, it found the decodes room vLLM did not)."""
    s = make_scheduler("qoserve", max_batched=64, blocks=6, spec_tokens=4, drafter=drafter)  # 5 blocks of 16 tokens
    assert s.num_lookahead_tokens == (4 if drafter == "draft_model" else 0)
    for _ in range(3):
        s.coserve_policy.history.record("short", 1)
    free = vllm_request(14, {"ttft_ms": 2_000, "tbt_ms": 1000, "tier": "free", "app_id": "short"}, max_tokens=40)
    paid = vllm_request(14, {"ttft_ms": 30_000, "tbt_ms": 1000, "app_id": "short"}, max_tokens=40)
    s.add_request(free)
    s.add_request(paid)
    run_step(s)  # both prompts (2 blocks each with a lookahead): the free job's, due first, runs first
    assert [r.request_id for r in s.running] == [free.request_id, paid.request_id]
    for _ in range(40):
        for r in s.running:
            r.spec_token_ids = [1, 2, 3, 4]  # run_step's model accepts none of them
        out, _ = run_step(s)
        if out.preempted_req_ids:
            break
    assert s.kv.released == [free.request_id]  # the policy's choice, not vLLM's
    assert out.preempted_req_ids == {free.request_id}
    assert out.num_scheduled_tokens == {paid.request_id: 5} and paid in s.running


def test_where_vllm_itself_must_preempt_it_takes_the_policys_first_victim(make_scheduler, monkeypatch):
    """The policy frees KV before vLLM runs out, so vLLM's own recompute preemption (``running[-1]``) fires only
    where the policy's block count differs from vLLM's allocator (prefix-cache hits, lookahead slots, a KV
    connector). Here the KV view is made to count no block for a decode: the policy plans both decodes, and on the
    step where each needs a new block and one is free, vLLM preempts. The free job started first (its deadline was
    first), so it came first in vLLM's running order, and vLLM preempted the paid chat that started after it. Now
    the decodes are shown to vLLM least urgent last (the policy's victim order), and vLLM takes the free job."""
    s = make_scheduler("qoserve", max_batched=64, blocks=4)  # 3 blocks of 16 tokens
    for _ in range(3):
        s.coserve_policy.history.record("short", 1)  # footprints of 1 block: both prompts are admitted
    free = vllm_request(15, {"ttft_ms": 2_000, "tbt_ms": 1000, "tier": "free", "app_id": "short"}, max_tokens=20)
    paid = vllm_request(15, {"ttft_ms": 30_000, "tbt_ms": 1000, "app_id": "short"}, max_tokens=20)
    s.add_request(free)
    s.add_request(paid)
    run_step(s)  # both prompts, a block each: the free job's, due first, runs first
    assert set(s.running) == {free, paid} and s.running[0] is free
    monkeypatch.setattr(s.kv, "blocks_needed", lambda request_id, n: 0)  # the policy's count off by design
    out, _ = run_step(s)  # the 16th token of each fills its first block
    assert not out.preempted_req_ids
    out, _ = run_step(s)  # the 17th of each needs a second block: one is free
    assert not s.kv.released  # the policy saw room for both: vLLM's own preemption decides
    assert out.preempted_req_ids == {free.request_id}, out.preempted_req_ids
    assert out.num_scheduled_tokens == {paid.request_id: 1} and s.running == [paid]


def test_where_vllm_itself_must_preempt_it_takes_a_free_decode_before_a_paid_prompts_last_chunk(make_scheduler,
                                                                                                 monkeypatch):
    """A started prompt is a victim as a decode is: the paid chat's last chunk and the free job's decode need a block
    each and one is free (the KV view counts none, the policy's count off by design). The started prompts stood after
    the decodes in vLLM's running order, so vLLM preempted the paid chat's prompt (``running[-1]``) and decoded the
    free job; now decodes and started prompts go least urgent last together, and vLLM takes the free job."""
    s = make_scheduler("qoserve", max_batched=16, blocks=4)  # 3 blocks of 16 tokens, 16 tokens a step
    for _ in range(3):
        s.coserve_policy.history.record("short", 1)  # footprints of 1 and 2 blocks: both prompts are admitted
    free = vllm_request(15, {"ttft_ms": 2_000, "tbt_ms": 1000, "tier": "free", "app_id": "short"}, max_tokens=20)
    paid = vllm_request(24, {"ttft_ms": 30_000, "tbt_ms": 1000, "app_id": "short"}, max_tokens=20)
    s.add_request(free)
    s.add_request(paid)
    out, _ = run_step(s)  # the free job's prompt, due first, and a token of the chat's: a block each
    assert out.num_scheduled_tokens == {free.request_id: 15, paid.request_id: 1}
    monkeypatch.setattr(s.kv, "blocks_needed", lambda request_id, n: 0)
    out, _ = run_step(s)  # the free job's 16th token and the chat's next 15 fill their blocks
    assert out.num_scheduled_tokens == {free.request_id: 1, paid.request_id: 15} and not out.preempted_req_ids
    out, _ = run_step(s)  # the free job's 17th token and the chat's last 8 need a block each: one is free
    assert not s.kv.released  # the policy saw room for both: vLLM's own preemption decides
    assert out.preempted_req_ids == {free.request_id}, out.preempted_req_ids
    assert out.num_scheduled_tokens == {paid.request_id: 8} and s.running == [paid]


def test_a_started_prompt_cut_short_stays_last_where_vllm_may_run_out(make_scheduler, monkeypatch):
    """vLLM gives a running request its rest as far as the step's budget goes: a started prompt whose chunk is less
    than its rest gets exactly its chunk only as the budget's last. Where the step may run out of KV, the decodes
    go in the victim order, and the paid chat's prompt, cut short, stays after the free job's decode though the free
    job is the first victim: before it, it would take the decode's token (vLLM's first victim is then that prompt)."""
    s = make_scheduler("qoserve", max_batched=16, blocks=5)  # 4 blocks of 16 tokens, 16 tokens a step
    for _ in range(3):
        s.coserve_policy.history.record("short", 1)  # footprints of 1 and 3 blocks: both prompts are admitted
    free = vllm_request(15, {"ttft_ms": 2_000, "tbt_ms": 1000, "tier": "free", "app_id": "short"}, max_tokens=20)
    paid = vllm_request(40, {"ttft_ms": 30_000, "tbt_ms": 1000, "app_id": "short"}, max_tokens=20)
    s.add_request(free)
    s.add_request(paid)
    run_step(s)
    run_step(s)  # the chat's prompt holds a block, 24 tokens left; the free job's decode fills its block
    keyed = []
    key = s.coserve_policy.victim_key
    monkeypatch.setattr(s.coserve_policy, "victim_key", lambda req: keyed.append(req.request_id) or key(req))
    out, _ = run_step(s)  # 2 blocks free: fewer than the step may take
    assert out.num_scheduled_tokens == {free.request_id: 1, paid.request_id: 15}
    assert s.running == [free, paid]
    assert keyed == [free.request_id]  # the step was tight, the chat's prompt not keyed


def test_with_room_for_the_steps_worst_case_the_decodes_keep_vllms_order_unkeyed(make_scheduler, monkeypatch):
    """The victim order costs a key per decode per step; it matters only where vLLM's allocator could find no room.
    With blocks free for every running request's tokens, lookahead and a block edge, the decodes keep the order
    they started in and no victim key is computed."""
    s = make_scheduler("qoserve", max_batched=64, blocks=64)
    paid = vllm_request(15, {"ttft_ms": 30_000, "tbt_ms": 1000}, max_tokens=20)
    free = vllm_request(15, {"ttft_ms": 2_000, "tbt_ms": 1000, "tier": "free"}, max_tokens=20)
    s.add_request(paid)
    run_step(s)
    s.add_request(free)
    run_step(s)
    keyed = []
    monkeypatch.setattr(s.coserve_policy, "victim_key", lambda req: keyed.append(req) or (0,))
    out, _ = run_step(s)  # both decode
    assert set(out.num_scheduled_tokens) == {paid.request_id, free.request_id}
    assert keyed == [] and s.running == [paid, free]


def test_vllms_priority_baseline_preempts_its_lowest_priority_request(make_scheduler):
    """``vllm-priority`` is vLLM's own scheduler, untouched: where KV runs out it preempts the running request of
    the lowest priority (the largest ``priority``, then the latest arrival). vLLM reads its order from the
    scheduler's ``policy`` attribute, which coserve's scheduler took for its own policy (None here): vLLM preempted
    the end of its running list as FCFS does, the urgent request that started last."""
    s = make_scheduler("vllm-priority", max_batched=64, blocks=4)  # 3 blocks of 16 tokens
    low = vllm_request(15, max_tokens=20)
    low.priority = 1
    s.add_request(low)
    run_step(s)  # its prompt
    urgent = vllm_request(15, max_tokens=20)
    urgent.priority = 0
    s.add_request(urgent)
    run_step(s)  # its prompt beside the other's decode: running in the order they started
    assert s.running == [low, urgent]
    out, _ = run_step(s)  # the first takes the last free block
    assert not out.preempted_req_ids
    out, _ = run_step(s)  # the urgent one needs a block: none is free
    assert out.preempted_req_ids == {low.request_id}, out.preempted_req_ids
    assert out.num_scheduled_tokens == {urgent.request_id: 1}


@pytest.mark.parametrize("drafter", ["draft_model", "ngram"])
def test_the_kv_view_counts_the_blocks_vllm_allocates_with_its_lookahead(make_scheduler, drafter):
    """What the policy is told a prompt's first chunk and a decode take is what vLLM's allocate_slots takes: with a
    draft-model drafter the 4 lookahead slots too (a 14-token prompt: 2 blocks, not 1); with the n-gram drafter
    none."""
    s = make_scheduler("qoserve", max_batched=64, blocks=40, spec_tokens=4, drafter=drafter)
    held = lambda r: len(s.kv_cache_manager.coordinator.get_blocks(r.request_id)[0])  # noqa: E731
    prompt = vllm_request(14, max_tokens=40)
    s.add_request(prompt)
    planned = s.kv.blocks_needed(prompt.request_id, 14)
    run_step(s)
    assert planned == held(prompt) == (2 if drafter == "draft_model" else 1)
    for _ in range(20):  # decodes of a token and 4 drafts, none accepted: each adds a token
        prompt.spec_token_ids = [1, 2, 3, 4]
        before, planned = held(prompt), s.kv.blocks_needed(prompt.request_id, 5)
        run_step(s)
        assert held(prompt) - before == planned, prompt.num_computed_tokens


def _run_with_every_draft(s, in_flight=None, steps: int = 200) -> tuple[set, int]:  # noqa: ANN001
    """Steps until nothing is left, every decode verifying vLLM's whole draft step (the model accepts none of it):
    the requests preempted on the way, and the most KV blocks one request held. Scheduling asynchronously, each
    step is scheduled before the one ``in_flight`` is answered (vLLM's placeholders stand for its token and
    drafts)."""
    from vllm.v1.outputs import ModelRunnerOutput

    held = lambda r: len(s.kv_cache_manager.coordinator.get_blocks(r.request_id)[0])  # noqa: E731
    pipelined = s.scheduler_config.async_scheduling
    preempted, peak = set(), 0
    for _ in range(steps):
        if not s.requests:
            break
        if not pipelined:
            for r in s.running:
                if r.num_computed_tokens >= r.num_prompt_tokens:
                    r.spec_token_ids = list(range(1, 1 + s.num_spec_tokens))
        out = s.schedule()
        preempted |= out.preempted_req_ids | set(s.kv.released)
        peak = max([peak] + [held(r) for r in s.running])
        if not pipelined:
            answer_step(s, out)
            continue
        if in_flight is not None:  # its prompts' last chunks and decodes each sampled a token
            ids = [r for r in in_flight.num_scheduled_tokens if r in s.requests]
            s.update_from_output(in_flight, ModelRunnerOutput(req_ids=ids, req_id_to_index={
                r: i for i, r in enumerate(ids)}, sampled_token_ids=[[7] for _ in ids]))
        in_flight = out
    return preempted, peak


@pytest.mark.parametrize(("drafter", "pipelined", "blocks"), [("draft_model", False, 7), ("ngram", False, 6),
                                                             ("none", False, 4), ("draft_model", True, 8)])
def test_a_jobs_footprint_is_every_block_vllm_gives_it_with_drafts_and_lookahead(make_scheduler, monkeypatch,
                                                                                 drafter, pipelined, blocks):
    """vLLM allocates, on a request's last decode, the slots of its prompt, its output but the last token, the 20
    drafts it verifies and (a draft-model or EAGLE drafter) 20 lookahead slots: 14 + 49 + 20 + 20 tokens, 7 blocks
    (6 with the n-gram drafter, 4 without drafts); scheduling asynchronously, the 20 drafts of the step in flight
    too (8 blocks). Admission reserves exactly those; it reserved prompt + max_tokens + a block of slack (64
    tokens: 5 blocks), which held no drafter's."""
    monkeypatch.setenv("COSERVE_KV_RESERVE", "max_tokens")
    spec = {"spec_tokens": 20, "drafter": drafter} if drafter != "none" else {}
    s = make_scheduler("qoserve", max_batched=64, blocks=40, async_scheduling=pipelined, **spec)
    job = vllm_request(14, max_tokens=50)
    s.add_request(job)
    out = s.schedule()  # the prompt: admitted, its footprint reserved
    reserved = s.coserve_policy._holders[job.request_id]
    if not pipelined:
        answer_step(s, out)
    preempted, peak = _run_with_every_draft(s, out if pipelined else None)
    assert not preempted and job.request_id not in s.requests  # it finished
    assert peak == reserved == blocks


def test_the_footprint_admits_no_more_jobs_than_vllm_holds_with_drafts_and_lookahead(make_scheduler, monkeypatch):
    """max_tokens reserve never preempts: two 14-token jobs of max_tokens 50 each reach 7 blocks in vLLM with 20
    drafts and 20 lookahead slots per decode; 11 blocks hold one. Reserving 5 blocks each, the policy admitted both,
    and vLLM (or the policy on its behalf) preempted one of them on the way; reserving what vLLM allocates, the
    second waits for the first to finish and nobody is preempted."""
    monkeypatch.setenv("COSERVE_KV_RESERVE", "max_tokens")
    s = make_scheduler("qoserve", max_batched=64, blocks=12, spec_tokens=20, drafter="draft_model")
    jobs = [vllm_request(14, {"ttft_ms": 60_000, "tbt_ms": 10_000}, max_tokens=50) for _ in range(2)]
    for job in jobs:
        s.add_request(job)
    preempted, _ = _run_with_every_draft(s)
    assert not preempted
    assert not s.requests  # both finished


def test_a_static_chains_share_of_the_drafts_leaves_the_rest_of_the_step_to_prompts(make_scheduler):
    """vLLM proposed 6 drafts for the decode and chain-2 verifies 2 of them, which is known before the step is
    planned: the 64-token step runs the decode, its 2 drafts and 61 prompt tokens (57 when the budget left the 6
    proposed their tokens, 4 of them unused)."""
    from gpu_runtime.costmodel.profile import conservative_cost_model
    from gpu_runtime.vllm.speculation import DraftLengths

    s = make_scheduler("qoserve", max_batched=64)
    s.num_spec_tokens = 6
    s.drafts = DraftLengths("chain-2", conservative_cost_model(), longest_draft=6)
    chat = {"ttft_ms": 60_000, "tbt_ms": 10_000}
    d = vllm_request(16, chat, max_tokens=32)
    s.add_request(d)
    run_step(s)
    prompt = vllm_request(400, chat)
    s.add_request(prompt)
    d.spec_token_ids = [1, 2, 3, 4, 5, 6]
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {d.request_id: 3, prompt.request_id: 61}
    assert out.total_num_scheduled_tokens == 64


def test_drafts_accepted_on_a_requests_last_step_count_in_full(make_scheduler):
    """A request 2 tokens short of max_tokens verifies 4 drafts and the model accepts them all (5 tokens with the
    bonus): vLLM keeps 2, and the policy learns 4 accepted. Counted from the kept tokens, it learnt 1 (a miss at
    the second position), and the acceptance rates it ranks chains by drifted low on every request's end."""
    from gpu_runtime.costmodel.profile import conservative_cost_model
    from gpu_runtime.vllm.speculation import DraftLengths

    s = make_scheduler("qoserve")
    s.num_spec_tokens = 4
    s.drafts = DraftLengths("chain-4", conservative_cost_model(), longest_draft=4)
    seen = {}
    observe = s.drafts.observe
    s.drafts.observe = lambda accepted, now: seen.update(accepted) or observe(accepted, now)
    r = vllm_request(16, max_tokens=3)
    s.add_request(r)
    run_step(s)  # the prompt, and its first token
    r.spec_token_ids = [1, 2, 3, 4]
    out = s.schedule()
    assert out.scheduled_spec_decode_tokens == {r.request_id: [1, 2, 3, 4]}
    _answer_with(s, out, {r.request_id: [1, 2, 3, 4, 5]})
    assert r.is_finished() and len(r.output_token_ids) == 3  # vLLM kept what max_tokens allows
    assert seen == {r.request_id: 4}
    assert s.drafts.acceptance.pooled.seen == [1, 1, 1, 1]


def test_drafts_a_request_did_not_verify_are_no_miss(make_scheduler):
    """Both decodes kept 2 drafts, and only one verified them (vLLM preempted the other when its KV ran out):
    the acceptance rates learn from the one that ran."""
    s, a, b = _two_decodes_under_chain_2(make_scheduler, proposed=2)
    a.spec_token_ids, b.spec_token_ids = [1, 2], [1, 2]
    s.schedule()
    assert s.drafts.kept == {a.request_id: 2, b.request_id: 2}
    s.drafts.observe({a.request_id: 2}, time.time())
    assert s.drafts.acceptance.pooled.seen == [1, 1]
    assert s.drafts.acceptance.pooled.rates[0] > 0.7  # a's hit; b counted as a miss pulled it below the prior


def test_nightjar_can_choose_no_speculation(make_scheduler):
    from gpu_runtime.costmodel.profile import conservative_cost_model
    from gpu_runtime.vllm.speculation import DraftLengths

    s = make_scheduler("qoserve")
    s.num_spec_tokens = 4
    s.drafts = DraftLengths("nightjar", conservative_cost_model(), longest_draft=4)
    s.drafts.policy.bandit.choose = lambda batch, switch_cost=0.0, mixed=False: 0  # the verdict under load
    r = vllm_request(16, max_tokens=32)
    s.add_request(r)
    run_step(s)
    r.spec_token_ids = [5, 6, 7, 8]
    out, _ = run_step(s)
    assert out.scheduled_spec_decode_tokens == {} and out.num_scheduled_tokens == {r.request_id: 1}


@pytest.mark.parametrize("policy, async_scheduling", [("vllm-fcfs", False), ("vllm-priority", False),
                                                      ("qoserve", True)])
def test_a_speculation_policy_that_cannot_run_is_not_reported_as_running(make_scheduler, monkeypatch, caplog,
                                                                         policy, async_scheduling):
    """Under vLLM's own scheduler, or with async scheduling (a GPU drafter's default), vLLM's own draft lengths
    run: the worker's state says so, naming the policy asked for and why, and the start-up log warns. It reported
    the policy asked for as if it ran."""
    import logging

    from gpu_runtime.vllm.engine import _Executor, _SpeculationView

    monkeypatch.setenv("COSERVE_SPEC_POLICY", "nightjar")
    with caplog.at_level(logging.WARNING, logger="gpu_runtime.vllm.scheduler"):
        s = make_scheduler(policy, spec_tokens=4, async_scheduling=async_scheduling)
    assert s.drafts is None and "COSERVE_SPEC_POLICY=nightjar does not run" in caplog.text
    state = _SpeculationView("nightjar", s).state()
    assert state["policy"] == "vllm" and state["draft_tokens"] == 4
    assert state["not_running"] == "nightjar" and state["why"] == s.spec_not_running
    assert _Executor(s, 512).draft_on_device  # vLLM's drafter is loaded


def test_the_worker_reports_the_speculation_that_runs_and_its_drafter_alike(make_scheduler, monkeypatch):
    """Nightjar's own state and the worker's draft_on_device agree (the worker said the draft was off)."""
    from gpu_runtime.vllm.engine import _Executor, _SpeculationView

    assert _SpeculationView("none", make_scheduler("qoserve")).state() == {"policy": "none", "engine": "vllm"}
    assert not _Executor(make_scheduler("qoserve"), 512).draft_on_device
    monkeypatch.setenv("COSERVE_SPEC_POLICY", "nightjar")
    s = make_scheduler("qoserve", spec_tokens=4)
    state = _SpeculationView("nightjar", s).state()
    assert state["policy"] == "nightjar" and "not_running" not in state and s.spec_not_running is None
    assert state["draft_on_device"] is _Executor(s, 512).draft_on_device is True


def test_policy_config_overrides_come_from_coserve_scheduler_config(make_scheduler, monkeypatch):
    monkeypatch.setenv("COSERVE_SCHEDULER_CONFIG", '{"relegated_expiry": null, "chunk_floor": 32}')
    sched = make_scheduler()
    assert sched.coserve_policy.config.relegated_expiry is None and sched.coserve_policy.config.chunk_floor == 32
    assert sched.coserve_policy.config.max_num_seqs == 16  # vLLM's own limits still reach the policy
    monkeypatch.setenv("COSERVE_SCHEDULER_CONFIG", '{"relegated_expiry_min": 600}')
    with pytest.raises(ValueError, match="relegated_expiry_min"):
        make_scheduler()
    monkeypatch.setenv("COSERVE_SCHEDULER_CONFIG", "relegated_expiry=600")
    with pytest.raises(ValueError, match="not JSON"):
        make_scheduler()


def test_the_cost_model_is_scaled_to_the_steps_as_they_ran(make_scheduler):
    """Each busy step's cost (schedule() to the next schedule()) against the profile's prediction: the policy
    plans with the median ratio. A pause longer than IDLE_GAP_S before the next step is idle time, not cost."""
    from gpu_runtime.costmodel.profile import conservative_cost_model
    from gpu_runtime.vllm.step_log import IDLE_GAP_S

    s = make_scheduler("qoserve", calibrate=True)
    cal = s.calibration
    assert cal is not None and s.coserve_policy.cost_model is cal.model and cal.model.scale == 1.0
    cal.min_steps = cal.every = 1
    s.add_request(vllm_request(16, max_tokens=64))
    run_step(s)  # the prompt
    predicted = []
    for _ in range(3):  # decode steps that take 0.15 s each in place (the model would run in the sleep)
        out = s.schedule()
        predicted.append(conservative_cost_model().predict(s.last_features))
        time.sleep(0.15)
        answer_step(s, out)
    assert cal.steps == 3  # the prompt's step and two decodes: each ended when the next one was scheduled
    assert cal.model.scale >= 0.15 / max(predicted) > 1.0  # the conservative model says ~41 ms a decode step
    time.sleep(IDLE_GAP_S + 0.1)  # the engine waited for work after the third decode: that one is not measured
    s.schedule()
    assert cal.steps == 3


def test_calibration_is_a_setting(make_scheduler, monkeypatch):
    assert make_scheduler("qoserve").calibration is None  # COSERVE_COST_CALIBRATION=off (the fixture's default)
    monkeypatch.setenv("COSERVE_SCHEDULER_POLICY", "qoserve")
    monkeypatch.setenv("COSERVE_COST_CALIBRATION", "maybe")
    from gpu_runtime.vllm.scheduler import calibrate_in_place

    with pytest.raises(ValueError, match="on or off"):
        calibrate_in_place()


def test_a_prompt_found_in_the_prefix_cache_is_planned_for_what_is_left(make_scheduler):
    """A prompt whose first 192 of 200 tokens vLLM's prefix cache holds (an earlier turn of the conversation) is,
    to the policy, a prompt of 8: it runs first (shortest remaining) and its chunk takes 8 tokens of the step, the
    rest going to the next prompt. Planned at its full length it took the whole step's budget and left it unused."""
    s = make_scheduler("qoserve", max_batched=64, prefix_caching=True)
    chat = {"ttft_ms": 30_000, "tbt_ms": 1000}
    earlier = vllm_request(200, chat, max_tokens=2, hashed=True)
    s.add_request(earlier)
    for _ in range(8):
        run_step(s)
    assert earlier.request_id not in s.requests  # done; its blocks stay in the cache
    again = vllm_request(200, chat, max_tokens=2, hashed=True)  # the same prompt
    other = vllm_request(100, chat, max_tokens=2, first_token=5000, hashed=True)
    s.add_request(other)
    s.add_request(again)
    assert s.mirrors[again.request_id].num_computed_tokens == 192  # 12 whole blocks; the last token is recomputed
    assert s.mirrors[other.request_id].num_computed_tokens == 0
    # its KV: the 8 tokens after the hit, and the hit's 12 blocks, which leave the free pool with it (none of them
    # is held by a running request)
    assert s.kv.blocks_needed(again.request_id, 8) == 13 and s.kv.blocks_needed(other.request_id, 56) == 4
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {again.request_id: 8, other.request_id: 56}, out.num_scheduled_tokens


def test_a_prompt_whose_cached_prefix_was_evicted_is_planned_for_what_vllm_finds(make_scheduler):
    """The policy counted 32 of a 33-token prompt cached (an earlier request's two blocks); before it started, the
    second block left the cache (vLLM evicts a freed request's blocks last first). vLLM finds 16 and computes 17;
    the policy, looking only for a hit that grew, planned 1, and the step's budget (its 1 and the next prompt's 20)
    gave the next prompt 4 of its 20 tokens. It plans the 17 now, and both run whole."""
    s = make_scheduler("qoserve", max_batched=64, prefix_caching=True)
    chat = {"ttft_ms": 30_000, "tbt_ms": 1000}
    earlier = vllm_request(33, chat, max_tokens=1, hashed=True)
    s.add_request(earlier)
    run_step(s)
    assert earlier.request_id not in s.requests  # done; its two blocks stay in the cache
    again = vllm_request(33, chat, max_tokens=1, hashed=True)
    s.add_request(again)
    mirror = s.mirrors[again.request_id]
    assert mirror.num_computed_tokens == 32
    pool = s.kv_cache_manager.block_pool
    pool.evict_blocks({pool.get_cached_block(again.block_hashes[1], [0])[0].block_id})
    other = vllm_request(20, chat, max_tokens=1, first_token=5000, hashed=True)
    s.add_request(other)
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {again.request_id: 17, other.request_id: 20}, out.num_scheduled_tokens


def test_a_prompts_cached_prefix_outlives_the_allocations_vllm_makes_before_it_in_the_step(make_scheduler):
    """The policy counted 32 of a 33-token prompt cached (an earlier request's blocks, the oldest free ones: a job
    ran and freed its blocks since). In the step, vLLM allocates for the prompt planned before it first (FCFS), and
    took the three blocks at the free queue's head, evicting the hit's second block: vLLM found 16 cached, computed 17
    where the policy planned 1, and took them from the prompt planned after it. The hit's blocks now leave the
    free queue's head for the step (the prompt takes them at its turn anyway), and every chunk runs as planned."""
    s = make_scheduler("sarathi-fcfs", max_batched=256, blocks=16, prefix_caching=True)
    lax = {"ttft_ms": 30_000, "tbt_ms": 1000}
    earlier = vllm_request(48, lax, max_tokens=1, hashed=True)
    s.add_request(earlier)
    run_step(s)  # its 3 blocks are cached; freed last first, its third block is evicted first
    job = vllm_request(190, lax, max_tokens=1, first_token=1000, hashed=True)
    s.add_request(job)
    run_step(s)  # the 12 other blocks: freed after the earlier request's, they are newer in vLLM's LRU order
    assert earlier.request_id not in s.requests and job.request_id not in s.requests
    # the free queue's head: the job's last block (part full, cached by no one), then the earlier request's blocks
    pool = s.kv_cache_manager.block_pool
    head = pool.free_block_queue.get_all_free_blocks()[:4]
    assert head[0].block_hash is None and head[1:] == [pool.get_cached_block(h, [0])[0]
                                                       for h in reversed(earlier.block_hashes)]
    now = time.time()  # in order of arrival: the first prompt's three blocks are allocated before the hit's turn
    first = vllm_request(40, lax, now - 2, max_tokens=1, first_token=3000, hashed=True)
    again = vllm_request(33, lax, now - 1, max_tokens=1, hashed=True)  # the earlier prompt's first 33 tokens
    after = vllm_request(40, lax, now, max_tokens=1, first_token=5000, hashed=True)
    for r in (first, again, after):
        s.add_request(r)
    assert s.mirrors[again.request_id].num_computed_tokens == 32
    plans = []
    plan_step = s.coserve_policy.schedule
    s.coserve_policy.schedule = lambda now: plans.append(plan_step(now)) or plans[-1]
    out, _ = run_step(s)
    planned = {p.request.request_id: p.num_tokens for p in plans[0].prefills}
    assert list(planned) == [first.request_id, again.request_id, after.request_id]
    assert out.num_scheduled_tokens == planned == {first.request_id: 40, again.request_id: 1, after.request_id: 40}
    assert all(pool.get_cached_block(h, [0]) is not None for h in again.block_hashes)  # the hit outlived the step


def test_a_prompt_left_with_one_token_by_the_cache_runs_while_speculating(make_scheduler):
    """With speculation vLLM pads a new prompt whose cache hit leaves it one token to a whole draft step, and
    waits rather than run it unpadded; the step's budget has room for that (it had none: the prompt never ran)."""
    s = make_scheduler("qoserve", max_batched=64, prefix_caching=True)
    s.num_spec_tokens = 4
    chat = {"ttft_ms": 30_000, "tbt_ms": 1000}
    earlier = vllm_request(33, chat, max_tokens=2, hashed=True)
    s.add_request(earlier)
    for _ in range(4):
        run_step(s)
    again = vllm_request(33, chat, max_tokens=2, hashed=True)
    s.add_request(again)
    assert s.mirrors[again.request_id].num_computed_tokens == 32
    out = s.schedule()
    assert out.num_scheduled_tokens.get(again.request_id, 0) >= 1, out.num_scheduled_tokens


def test_a_policy_at_no_drafts_verifies_none_on_a_cached_prompts_first_decode(make_scheduler, monkeypatch):
    """Nightjar chose no speculation; a prompt whose blocks vLLM's prefix cache holds but its last token runs as a
    decode of 1 token. vLLM had padded it with 4 placeholder drafts, verified at a cost and counted as drafts."""
    monkeypatch.setenv("COSERVE_SPEC_POLICY", "nightjar")
    s = make_scheduler("qoserve", prefix_caching=True, spec_tokens=4)
    s.drafts.policy.bandit.choose = lambda batch, switch_cost=0.0, mixed=False: 0  # the verdict under load
    chat = {"ttft_ms": 30_000, "tbt_ms": 1000}
    earlier = vllm_request(33, chat, max_tokens=32, hashed=True)
    s.add_request(earlier)
    run_step(s)
    run_step(s)
    again = vllm_request(33, chat, max_tokens=32, hashed=True)  # the same prompt: 2 blocks cached, 1 token left
    s.add_request(again)
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {earlier.request_id: 1, again.request_id: 1}
    assert out.scheduled_spec_decode_tokens == {}
    assert out.num_spec_tokens_to_schedule == 4  # the drafter still drafts vLLM's length for the policy to trim


def behind_one_system_prompt(s) -> list:  # noqa: ANN001 - a CoserveScheduler
    """Three chats added together: a 64-token system prompt, then 8 tokens of their own."""
    chat = {"ttft_ms": 30_000, "tbt_ms": 1000}
    system = list(range(100, 164))
    reqs = [vllm_request(0, chat, max_tokens=2, hashed=True, prompt=system + list(range(1000 * i, 1000 * i + 8)))
            for i in (1, 2, 3)]
    for r in reqs:
        s.add_request(r)
    return reqs


def test_prompts_that_arrived_together_are_planned_for_the_prefix_the_first_of_them_cached(make_scheduler):
    """Three prompts behind one 64-token system prompt arrive together, when none of it is cached. Once the first
    has run, the other two find the system prompt in vLLM's cache: each is planned for its 8-token tail, and both
    run in the next step. Planned at full length (the hit looked up on arrival only), the second took the whole
    step's budget, ran its 8 tokens, and the third waited a step."""
    s = make_scheduler("qoserve", max_batched=72, prefix_caching=True)
    reqs = behind_one_system_prompt(s)
    assert all(s.mirrors[r.request_id].num_computed_tokens == 0 for r in reqs)
    out, _ = run_step(s)
    ran = next(iter(out.num_scheduled_tokens))
    assert out.num_scheduled_tokens == {ran: 72}
    rest = [r.request_id for r in reqs if r.request_id != ran]
    out, _ = run_step(s)
    assert {rid: out.num_scheduled_tokens.get(rid) for rid in rest} == dict.fromkeys(rest, 8), out.num_scheduled_tokens


def test_a_preempted_request_is_planned_for_what_its_own_cached_blocks_leave(make_scheduler):
    """Preempted after its prompt and four tokens, a request's blocks stay in vLLM's prefix cache until reused: the
    policy counts them computed, so its recompute (it runs first: it is due first) takes a few tokens of the step
    and a waiting prompt the rest. Counted as nothing cached, the recompute took the step's whole budget, of which
    vLLM ran 4 tokens, and the prompt waited."""
    s = make_scheduler("qoserve", max_batched=64, prefix_caching=True)
    chat = {"ttft_ms": 30_000, "tbt_ms": 1000}
    victim = vllm_request(64, {"ttft_ms": 2000, "tbt_ms": 1000}, max_tokens=50, hashed=True)
    s.add_request(victim)
    for _ in range(4):  # its prompt, then three tokens
        run_step(s)
    mirror = s.mirrors[victim.request_id]
    assert mirror.num_output_tokens == 4
    s.kv.release_kv(victim.request_id)  # what the policy's recompute preemption does (least urgent first)
    s.coserve_policy.note_kv_released(mirror)
    waiting = vllm_request(64, chat, max_tokens=2, first_token=5000, hashed=True)
    s.add_request(waiting)
    out, _ = run_step(s)
    assert waiting.request_id in out.num_scheduled_tokens and victim.request_id in out.num_scheduled_tokens, \
        out.num_scheduled_tokens
    assert mirror.num_cached_tokens == 64  # its prompt's 4 blocks; the outputs fill no whole block


@pytest.mark.parametrize("plan_shared", [True, False])
def test_prompts_planned_in_one_step_share_the_prefix_the_first_of_them_caches(make_scheduler, monkeypatch,
                                                                                plan_shared):
    """Three prompts behind one 64-token system prompt arrive together, when none of it is cached. vLLM caches a
    block when it allocates it, so in one step the second and third prompts find the first one's system prompt.
    With ``plan_shared_prefixes`` the policy plans them for their 8-token tails and all three run in the first
    step (72 + 8 + 8 tokens of a 96-token budget); without it (coserve's default) the second takes the rest of the
    budget (vLLM runs 8 of its tokens) and the third waits a step."""
    monkeypatch.setenv("COSERVE_SCHEDULER_CONFIG", json.dumps({"plan_shared_prefixes": plan_shared}))
    s = make_scheduler("qoserve", max_batched=96, prefix_caching=True)
    behind_one_system_prompt(s)
    out, _ = run_step(s)
    assert sorted(out.num_scheduled_tokens.values()) == ([8, 8, 72] if plan_shared else [8, 72]), \
        out.num_scheduled_tokens


def _a_started_prompt_of_adapter_1(s):
    """A far batch job's 256-token prompt of LoRA adapter 1, its first chunk run (running, prompt unfinished): the
    time it was added after, and the request."""
    now = time.time()
    started = vllm_request(256, BATCH_FAR, arrival=now - 1, lora=1)
    s.add_request(started)
    out, _ = run_step(s)
    assert 0 < out.num_scheduled_tokens[started.request_id] < 256
    return now, started


def test_the_running_requests_never_hold_more_adapters_than_the_lora_slots(make_scheduler):
    """vLLM admits a prompt of another adapter only while the step's running requests leave a LoRA slot, and
    asserts that they never hold more. A started prompt the policy sets aside for a step is still running: a prompt
    of a second adapter admitted beside it would break that on the next step (one slot here). It waits instead,
    out of the policy's sight, so the steps go to what can run."""
    s = make_scheduler("qoserve", max_batched=32, max_loras=1)
    now, started = _a_started_prompt_of_adapter_1(s)
    urgent = vllm_request(32, {"ttft_ms": 200, "tbt_ms": 50}, arrival=now, lora=2, max_tokens=2)
    s.add_request(urgent)
    steps = []
    for _ in range(40):
        out, _ = run_step(s)
        running = {r.lora_request.lora_int_id for r in s.running if r.lora_request}
        assert len(running) <= 1, (out.num_scheduled_tokens, running)
        steps.append(dict(out.num_scheduled_tokens))
        if urgent.request_id in out.num_scheduled_tokens:
            break
    # the policy plans what can run: the started prompt and its decodes, no step empty; then the other adapter's
    assert all(steps[:-1]) and urgent.request_id in steps[-1], [sorted(st.items()) for st in steps]
    assert started.is_finished() and sum(st.get(started.request_id, 0) for st in steps) >= 256 - 32, steps


@pytest.mark.parametrize("policy", ["qoserve", "vllm-fcfs"])
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_request_in_flight_runs_again_only_with_async_scheduling(make_scheduler, policy, async_scheduling):
    """vLLM without async scheduling (so under pipeline parallelism, with several batches in flight) schedules a
    request again only once its last token is in; with async scheduling its next step goes out before, the worker
    filling the token in. The scheduler class is the same either way; it follows the engine's setting. (It had
    always scheduled as with async scheduling: under pipeline parallelism a later stage got no token to run.)"""
    s = make_scheduler(policy)
    s.scheduler_config.async_scheduling = async_scheduling
    r = vllm_request(16, max_tokens=4)
    s.add_request(r)
    first = s.schedule()  # the whole prompt: its first token comes with this step's output
    assert first.num_scheduled_tokens == {r.request_id: 16}
    second = s.schedule()  # the next batch, scheduled while the first is in flight
    assert (r.request_id in second.num_scheduled_tokens) is async_scheduling
    answer_step(s, first)
    if not async_scheduling:
        assert s.schedule().num_scheduled_tokens == {r.request_id: 1}  # its token is in: it decodes
    assert r.num_output_placeholders == (1 if async_scheduling else 0)


def test_requests_vllm_preempts_between_steps_are_recomputed_in_the_order_they_came(make_scheduler):
    """vLLM's reset of the prefix cache preempts every running request between two steps. The policy learned it only
    after it had planned the next step: it planned each as a decode (of a request that held no KV) and as a prompt to
    recompute, and its step budget lost the decodes' tokens. It also requeued them in the order of the set vLLM
    reports them in, which follows the process's string hashes (PYTHONHASHSEED): the order of the requeues breaks the
    ties of its queue, so of two equal requests, which one was recomputed first changed from process to process. Now
    they are requeued before the plan, in the order they came to the engine (here two ids whose set iterates the
    other way)."""
    names = (f"p{i}" for i in range(1_000))
    # vLLM preempts from the end of its running list: the second request's id goes into the set first
    first, second = next((a, b) for a, b in zip(names, names) if list(_set_of(b, a)) == [b, a])
    s = make_scheduler("qoserve", max_batched=32)
    now = time.time()
    reqs = [vllm_request(16, {"ttft_ms": 20_000, "tbt_ms": 1000}, arrival=now, max_tokens=20, request_id=rid)
            for rid in (first, second)]
    for r in reqs:
        s.add_request(r)
    for _ in range(3):  # both prompts, then two tokens each
        run_step(s)
    schedule, plans = s.coserve_policy.schedule, []
    s.coserve_policy.schedule = lambda now: plans.append(schedule(now)) or plans[-1]
    s.reset_prefix_cache(reset_running_requests=True)  # vLLM preempts every running request (recompute)
    out, _ = run_step(s)
    assert list(out.preempted_req_ids) == [second, first]  # the set's order
    assert not plans[-1].decodes  # nothing decodes: neither holds KV
    # the first to come is recomputed first, the second gets the rest of the step: all of it (no decode takes any)
    assert [p.request.request_id for p in plans[-1].prefills] == [first, second]
    assert list(out.num_scheduled_tokens) == [first, second] and out.total_num_scheduled_tokens == 32


def _set_of(*ids: str) -> set[str]:
    made = set()
    for rid in ids:  # as vLLM adds them (reset_preempted_req_ids)
        made.add(rid)
    return made


def test_a_recompute_is_planned_for_what_vllm_computes(make_scheduler):
    """vLLM recomputes a preempted request's prompt and every output it made, and its last token samples the next
    one. The policy planned the outputs but the last (its own engine feeds that one by the next decode): the
    recompute's chunk was a token short of vLLM's, which took it from the chunk after it."""
    s = make_scheduler("qoserve", max_batched=32)
    victim = vllm_request(16, {"ttft_ms": 2000, "tbt_ms": 1000}, max_tokens=20)
    s.add_request(victim)
    for _ in range(3):  # its prompt (its first token), then two tokens
        run_step(s)
    mirror = s.mirrors[victim.request_id]
    assert mirror.num_output_tokens == 3
    s.kv.release_kv(victim.request_id)  # what the policy's recompute preemption does
    s.coserve_policy.note_kv_released(mirror)
    s.add_request(vllm_request(64, {"ttft_ms": 30_000, "tbt_ms": 1000}, max_tokens=2))
    schedule, plans = s.coserve_policy.schedule, []
    s.coserve_policy.schedule = lambda now: plans.append(schedule(now)) or plans[-1]
    out, _ = run_step(s)
    planned = {p.request.request_id: p.num_tokens for p in plans[-1].prefills}
    assert planned[victim.request_id] == 19 and planned == out.num_scheduled_tokens, (planned, out.num_scheduled_tokens)
    assert mirror.num_output_tokens == 4  # the recompute's last token sampled the next


def test_new_prompts_of_two_adapters_take_no_more_lora_slots_than_a_set_aside_prompt_leaves(make_scheduler):
    """A started prompt of one adapter holds a LoRA slot of two; the policy puts two urgent prompts of two other
    adapters ahead of it, and it sits the step out, hidden from vLLM, which sees no slot taken and would start both
    (three adapters running: vLLM's assertion on the LoRAs of the running requests it schedules fails on the next
    step). Only one of them starts beside the set-aside prompt; the other waits, and every step's running requests
    hold at most two adapters. ``_without_lora_slot`` does not cover it: a slot was free when the step was planned."""
    s = make_scheduler("qoserve", max_batched=32, max_loras=2)
    now, started = _a_started_prompt_of_adapter_1(s)
    urgent = [vllm_request(16, {"ttft_ms": 200, "tbt_ms": 50}, arrival=now, lora=lora, max_tokens=2)
              for lora in (2, 3)]
    for r in urgent:
        s.add_request(r)
    steps = []
    for _ in range(40):
        out, _ = run_step(s)
        running = {r.lora_request.lora_int_id for r in s.running if r.lora_request}
        steps.append(dict(out.num_scheduled_tokens))
        assert len(running) <= 2, [sorted(st.items()) for st in steps]
        if started.is_finished() and all(r.is_finished() for r in urgent):
            break
    assert started.is_finished() and all(r.is_finished() for r in urgent), steps


@pytest.mark.parametrize("policy", ["qoserve", "sarathi-edf"])
def test_a_prompt_whose_grammar_is_compiling_leaves_the_step_to_the_prompts_that_can_run(make_scheduler, policy):
    """vLLM skips a structured request while its grammar compiles (WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR). The
    policy planned the structured prompt (the earlier deadline) for the whole 32-token step, vLLM skipped it, and
    the lax prompt was not shown to vLLM: steps ran nothing for as long as the grammar compiled. Set aside while it
    compiles, it leaves the step to the lax prompt, holds no KV and no decode slot, and starts once compiled."""
    from vllm.sampling_params import StructuredOutputsParams
    from vllm.v1.request import RequestStatus

    from tests.vllm.conftest import StubGrammar, compiling_grammar

    s = make_scheduler(policy, max_batched=32, blocks=16, max_seqs=2)
    now = time.time()
    structured = vllm_request(32, {"ttft_ms": 2_000, "tbt_ms": 100}, arrival=now - 0.01, max_tokens=1,
                              structured=StructuredOutputsParams(regex="[0-9]+"))
    lax = vllm_request(16, {"ttft_ms": 20_000, "tbt_ms": 500}, arrival=now, max_tokens=1)
    grammar = compiling_grammar(s, structured)
    s.add_request(structured)
    s.add_request(lax)
    for step in range(2):  # the grammar compiles for two steps
        out, _ = run_step(s)
        assert dict(out.num_scheduled_tokens) == ({lax.request_id: 16} if step == 0 else {})
        assert structured.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
        assert structured not in s.running and structured.request_id not in s.coserve_policy.running
        assert not any(s.kv_cache_manager.get_block_ids(structured.request_id))
    grammar.set_result(StubGrammar())
    out, outputs = run_step(s)
    assert dict(out.num_scheduled_tokens) == {structured.request_id: 32}
    ended = [o.request_id for eco in outputs.values() for o in eco.outputs if o.finish_reason]
    assert ended == [structured.request_id]


@pytest.mark.parametrize("policy", ["qoserve", "sarathi-edf"])
def test_a_prompt_whose_grammar_failed_ends_as_an_error_while_the_step_runs_the_others(make_scheduler, policy):
    """vLLM finishes a request whose grammar failed to compile as an error once it meets it in its waiting queue,
    and runs nothing of it. The policy planned it (the earlier deadline) for the whole 32-token step: the step ran
    nothing, and the lax prompt waited a step. Now it ends as an error in the step the lax prompt runs in."""
    from vllm.sampling_params import StructuredOutputsParams
    from vllm.v1.engine import FinishReason

    from tests.vllm.conftest import compiling_grammar

    s = make_scheduler(policy, max_batched=32, blocks=16, max_seqs=2)
    now = time.time()
    structured = vllm_request(32, {"ttft_ms": 2_000, "tbt_ms": 100}, arrival=now - 0.01, max_tokens=1,
                              structured=StructuredOutputsParams(regex="[0-9]+"))
    lax = vllm_request(16, {"ttft_ms": 20_000, "tbt_ms": 500}, arrival=now, max_tokens=1)
    compiling_grammar(s, structured).set_exception(ValueError("the grammar does not compile"))
    s.add_request(structured)
    s.add_request(lax)
    out, outputs = run_step(s)
    assert dict(out.num_scheduled_tokens) == {lax.request_id: 16}
    ended = {o.request_id: o.finish_reason for eco in outputs.values() for o in eco.outputs if o.finish_reason}
    assert ended == {lax.request_id: FinishReason.LENGTH, structured.request_id: FinishReason.ERROR}
    assert not s.requests and structured.request_id not in s.mirrors


@pytest.mark.parametrize("policy", ["qoserve", "vllm-fcfs"])
def test_a_grammar_that_failed_to_compile_is_the_requests_error_in_its_words(make_scheduler, policy):
    """vLLM ends a request whose grammar failed to compile as an error and says no more (its server answers a 500);
    the grammar is the client's to fix, so the scheduler keeps the compile error for the engine, which fails the job
    as a bad request with it. Under vLLM's own policy too (it meets the failed grammar in its queue)."""
    from vllm.sampling_params import StructuredOutputsParams

    from tests.vllm.conftest import compiling_grammar

    s = make_scheduler(policy, max_batched=32, blocks=16, max_seqs=2)
    structured = vllm_request(8, {"ttft_ms": 2_000, "tbt_ms": 100}, max_tokens=1,
                              structured=StructuredOutputsParams(regex="[0-9]+"))
    compiling_grammar(s, structured).set_exception(ValueError("unbalanced parenthesis at 3"))
    s.add_request(structured)
    run_step(s)
    assert not s.requests
    assert s.errors == {structured.request_id: "the structured output's grammar (schema, regex, choice or grammar) "
                                               "did not compile: unbalanced parenthesis at 3"}


def test_a_refused_qos_is_the_requests_error_in_its_words(make_scheduler):
    """A request whose QoS fields coserve's scheduler refuses ends as an error: the reason is kept for the engine
    (the job fails as a bad request naming it), not only logged."""
    s = make_scheduler("qoserve")
    bad = vllm_request(8, {"ttft_ms": -5})
    s.add_request(bad)
    run_step(s)
    assert not s.requests and bad.request_id in s.errors and "ttft" in s.errors[bad.request_id]


def test_a_request_vllm_ended_as_an_error_reaches_the_worker_with_the_schedulers_reason():
    """The engine's side of the two tests above: vLLM's output for a request it ended as an error ("error") becomes
    the request's rejection carrying the reason the scheduler kept (the worker fails the job as a bad request, a 400,
    with it: ``workers.engine_thread``); before, it carried none, and the job failed as the server's fault (a 500)."""
    from types import SimpleNamespace

    from gpu_runtime.qos import QoSClass, QoSSpec
    from gpu_runtime.request import Request
    from gpu_runtime.sampling import SamplingParams
    from gpu_runtime.vllm.engine import VLLMEngine

    engine = VLLMEngine.__new__(VLLMEngine)
    req = Request("job_a:1", [1, 2, 3], SamplingParams(max_tokens=4), QoSSpec(QoSClass.BATCH, ttlt_s=60.0),
                  arrival_time=0.0)
    engine.requests, engine.external, engine.internal = {req.request_id: req}, {req.request_id: "job_a:1-x"}, {}
    engine.internal["job_a:1-x"] = req.request_id
    engine.core_scheduler = SimpleNamespace(errors={"job_a:1-x": "the grammar did not compile: bad regex"})
    res = SimpleNamespace(request_id=req.request_id, finished=True, prompt_logprobs=None, num_cached_tokens=0,
                          num_cache_creation_tokens=0,
                          outputs=[SimpleNamespace(token_ids=[], text="", logprobs=None, finish_reason="error",
                                                   stop_reason=None)])
    out = engine._output(res, now=1.0)
    assert (out.event, out.error) == ("rejected", "the grammar did not compile: bad regex")
    assert not engine.core_scheduler.errors and not engine.requests


@pytest.mark.parametrize(("flags", "published"), [
    ("", "xgrammar"),  # auto: pinned to xgrammar from the engine's start
    ("--structured-outputs-config '{\"backend\": \"guidance\"}'", "guidance"),
    ("--structured-outputs-config '{\"backend\": \"outlines\"}'", "outlines"),
    ("--structured-outputs-config '{\"backend\": \"lm-format-enforcer\"}'", "lm-format-enforcer")],
    ids=["auto", "guidance", "outlines", "lm-format-enforcer"])
def test_the_engine_names_the_backend_it_compiles_structured_outputs_with(tiny_model_dir, flags, published):
    """What the worker publishes in its heartbeat (``grammar_backend``) for the API to check constraints with: the
    backend the engine compiles every constraint with, after ``pin_grammar_backend``, as the operator's flags
    (COSERVE_VLLM_ENGINE_ARGS) set it."""
    from vllm.config import ModelConfig, StructuredOutputsConfig, VllmConfig
    from vllm.v1.structured_output import StructuredOutputManager

    from gpu_runtime.vllm.cli_args import engine_cli_args
    from gpu_runtime.vllm.scheduler import grammar_backend, pin_grammar_backend

    named = engine_cli_args(flags).get("structured_outputs_config", StructuredOutputsConfig())  # vLLM's parser's
    config = VllmConfig(model_config=ModelConfig(model=str(tiny_model_dir), max_model_len=512),
                        structured_outputs_config=named)
    manager = StructuredOutputManager(config)
    why = pin_grammar_backend(manager, config)
    assert grammar_backend(manager, config) == published
    assert grammar_backend(None, config) is None  # an engine without a structured-output manager takes none
    # made at the engine's start, as vLLM would at its first constraint; else why not, for each constrained request
    # (lm-format-enforcer 0.11's vLLM integration does not import under vLLM 0.32)
    if published == "lm-format-enforcer":
        assert manager.backend is None and why.startswith(
            "the worker's structured-output backend lm-format-enforcer cannot run on this engine: vllm is not "
            "installed"), why
        assert "No module named 'vllm.transformers_utils.tokenizer'" in why, why
    else:
        assert manager.backend is not None and why is None, why
