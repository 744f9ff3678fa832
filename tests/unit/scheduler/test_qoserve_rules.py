"""QoServe rules on hand-built situations: relegation, resumption, preemption, order."""

from gpu_runtime.qos import Tier
from gpu_runtime.request import RequestStatus
from gpu_runtime.scheduler.registry import available, create_scheduler
from gpu_runtime.scheduler.relegation import PaidRelegation, WorkEstimate, should_relegate

from tests.unit.scheduler.helpers import COST, batch, decoding, interactive

EST = WorkEstimate(iteration_s=0.1, budget=100, decode_step_s=0.02)


def test_free_job_is_relegated_when_it_will_violate_paid_only_when_violated():
    # needs 10 iterations of 0.1 s = 1 s, only 0.5 s left: will violate, not yet violated
    free = interactive("f", prompt=1000, ttft=0.5, tier=Tier.FREE)
    paid = interactive("p", prompt=1000, ttft=0.5, tier=Tier.PAID)
    late = PaidRelegation.VIOLATED  # QoServe 3.4 as printed
    assert should_relegate(free, 0.0, EST, free_jobs_waiting=0, paid=late)
    assert not should_relegate(paid, 0.0, EST, free_jobs_waiting=0, paid=late)
    # once violated, a paid job goes only if no free job is left
    assert should_relegate(paid, 0.6, EST, free_jobs_waiting=0, paid=late)
    assert not should_relegate(paid, 0.6, EST, free_jobs_waiting=1, paid=late)
    # the default: a paid job that cannot make it even at the head of the queue goes at once, free jobs or not
    assert should_relegate(paid, 0.0, EST, free_jobs_waiting=1)
    assert not should_relegate(interactive("ok", prompt=400, ttft=0.5), 0.0, EST, free_jobs_waiting=1)


def test_batch_job_relegation_counts_predicted_decode_time():
    r = batch("b", prompt=100, ttlt=1.0, max_tokens=100, tier=Tier.FREE)
    r.predicted_output_len = 100
    # 1 prefill iteration (0.1 s) + 99 decode steps x 0.02 s = 2.08 s > 1 s
    assert should_relegate(r, 0.0, EST, 0)
    r.predicted_output_len = 10
    assert not should_relegate(r, 0.0, EST, 0)


def test_interactive_relegation_counts_a_stream_slower_than_tbt():
    # first token at 0.1 s of a 1 s TTFT; 20 tokens at TBT 0.1 s
    r = interactive("i", prompt=100, ttft=1.0, tbt=0.1, max_tokens=20, tier=Tier.FREE)
    r.predicted_output_len = 20
    assert not should_relegate(r, 0.0, EST, 0)  # decode passes within TBT: no pace lost
    # passes of 0.15 s lose 0.05 s a token: 19 x 0.05 = 0.95 s behind, more than the 0.9 s the first token saved
    slow = WorkEstimate(iteration_s=0.1, budget=100, decode_step_s=0.02, interactive_step_s=0.15)
    assert should_relegate(r, 0.0, slow, 0)
    r.predicted_output_len = 10  # 9 x 0.05 = 0.45 s: it still makes every deadline
    assert not should_relegate(r, 0.0, slow, 0)


def test_schedule_relegates_hopeless_free_job_and_serves_others_first():
    s = create_scheduler("qoserve", cost_model=COST)
    hopeless = interactive("free-late", arrival=0.0, prompt=200, ttft=0.5, tier=Tier.FREE)
    ok = interactive("paid", arrival=0.9, prompt=200, ttft=6.0)
    s.add_request(hopeless)
    s.add_request(ok)
    out = s.schedule(now=1.0)
    assert [r.request_id for r in out.relegated] == ["free-late"]
    assert hopeless.status is RequestStatus.RELEGATED and hopeless.relegation_count == 1
    ids = [p.request.request_id for p in out.prefills]
    assert ids[0] == "paid"
    # spare budget still runs the relegated job after everyone else
    assert ids[-1] == "free-late"
    for p in out.prefills:  # the engine computes the whole prompts
        p.request.num_computed_tokens += p.num_tokens
        p.request.output_token_ids.append(7)
        p.request.token_times.append(1.1)
    s.update_from_output(out, 1.1)
    assert s.queue_depths() == {"prefill": 0, "decode": 2, "relegated": 0}
    assert s.schedule(now=1.2).resumed == [hopeless]  # back in normal service once decoding


def test_relegated_job_is_not_rechecked_and_resume_brings_it_back():
    s = create_scheduler("qoserve", cost_model=COST, chunk_ceiling=16, chunk_floor=16, relegated_expiry=None)
    late = interactive("late", prompt=500, ttft=0.1, tier=Tier.FREE)
    other = interactive("other", arrival=0.0, prompt=500, ttft=100.0)
    s.add_request(late)
    s.add_request(other)
    out = s.schedule(now=1.0)
    assert out.relegated == [late]
    assert all(p.request is other for p in out.prefills)  # budget 16 all used by 'other'
    s.update_from_output(out, 1.1)
    out2 = s.schedule(now=1.2)
    assert out2.relegated == []  # stays relegated; not relegated twice
    s.update_from_output(out2, 1.3)
    assert s.resume("late")
    assert not s.resume("late")
    out3 = s.schedule(now=1.4)
    assert out3.resumed == [late] and late.status is RequestStatus.WAITING
    assert late.request_id not in s.relegated and out3.relegated == []  # pinned by the operator


def test_decodes_always_run_and_slack_limits_the_chunk():
    s = create_scheduler("qoserve", cost_model=COST, chunk_floor=16, chunk_ceiling=4096)
    d = decoding(interactive("d", ttft=1.0, tbt=0.05), outputs=1, times=[0.9])
    s.running[d.request_id] = d
    s.add_request(batch("big", prompt=4000, ttlt=1000.0))
    out = s.schedule(now=1.0)  # slack 0.05 s
    assert out.decodes == [d]
    assert 0 < out.prefill_budget <= 315 and out.prefills[0].num_tokens == out.prefill_budget
    assert out.predicted_latency_s * 1.2 <= 0.05 + 1e-9


def test_selective_preemption_pauses_started_prefill_only_if_it_keeps_its_deadline():
    s = create_scheduler("qoserve", cost_model=COST, chunk_floor=64, chunk_ceiling=64, relegation=False)
    started = batch("started", arrival=0.0, prompt=1000, ttlt=1000.0)
    s.add_request(started)
    out = s.schedule(now=0.0)
    s.update_from_output(out, 0.05)
    started.num_computed_tokens = 64
    urgent = interactive("urgent", arrival=0.1, prompt=64, ttft=0.5)
    s.add_request(urgent)
    out = s.schedule(now=0.1)
    assert [p.request.request_id for p in out.prefills] == ["urgent"]
    assert out.preempted == [started] and started.was_preempted
    assert started.num_computed_tokens == 64  # KV kept: progress not lost


def test_started_prefill_that_would_miss_its_deadline_is_not_preempted():
    s = create_scheduler("qoserve", cost_model=COST, chunk_floor=64, chunk_ceiling=64, relegation=False)
    tight = interactive("tight", arrival=0.0, prompt=128, ttft=0.2)
    s.add_request(tight)
    out = s.schedule(now=0.0)
    s.update_from_output(out, 0.02)
    tight.num_computed_tokens = 64
    newcomer = interactive("new", arrival=0.02, prompt=64, ttft=0.05)  # higher priority
    s.add_request(newcomer)
    out = s.schedule(now=0.18)  # one chunk (16.4 ms) ends at 0.196; skipping it would miss 0.2
    assert out.prefills[0].request is tight and out.preempted == []


def test_finished_requests_leave_and_all_policies_complete_a_workload():
    for name in available():
        s = create_scheduler(name, cost_model=COST)
        reqs = [interactive(f"i{k}", prompt=300, max_tokens=3) for k in range(3)] + \
               [batch(f"b{k}", prompt=300, max_tokens=3) for k in range(3)]
        for r in reqs:
            s.add_request(r)
        now, steps = 0.0, 0
        while s.num_unfinished and steps < 200:
            out = s.schedule(now)
            for p in out.prefills:
                p.request.num_computed_tokens += p.num_tokens
                if not p.request.in_prefill:
                    p.request.output_token_ids.append(7)
                    p.request.token_times.append(now)
            for d in out.decodes:
                d.num_computed_tokens += 1
                d.output_token_ids.append(7)
                d.token_times.append(now)
            for r in [p.request for p in out.prefills] + out.decodes:
                if r.num_output_tokens >= r.sampling.max_tokens:
                    r.status = RequestStatus.FINISHED_LENGTH
            now += 0.05
            s.update_from_output(out, now)
            steps += 1
        assert s.num_unfinished == 0, name
        assert all(r.num_output_tokens == 3 for r in reqs), name


def test_registry_rejects_unknown_names_and_keys():
    import pytest

    with pytest.raises(ValueError):
        create_scheduler("nope")
    with pytest.raises(ValueError):
        create_scheduler("sarathi-fcfs", bogus=1)
    assert create_scheduler("sarathi-fcfs", chunk_size=128).config.chunk_size == 128


def test_kv_admission_reserves_whole_footprints_and_never_starves_decodes():
    from gpu_runtime.executor.sim import SimExecutor

    ex = SimExecutor(COST, kv_blocks=20, block_size=16)  # 320 tokens
    s = create_scheduler("sarathi-fcfs", cost_model=COST, executor=ex, kv_watermark=0.0)
    a, b = batch("a", prompt=100, max_tokens=100), batch("b", prompt=100, max_tokens=100)
    for r in (a, b):
        ex.add_request(r.request_id, r.sampling)
        s.add_request(r)
    out = s.schedule(0.0)
    # a's footprint (200 tokens = 13+1 blocks) is reserved; b's would not fit beside it
    assert [p.request.request_id for p in out.prefills] == ["a"]


def test_a_request_larger_than_the_cache_still_runs_when_alone():
    from gpu_runtime.executor.sim import SimExecutor

    ex = SimExecutor(COST, kv_blocks=4, block_size=16)
    s = create_scheduler("qoserve", cost_model=COST, executor=ex)
    r = batch("big", prompt=20, max_tokens=500)
    ex.add_request("big", r.sampling)
    s.add_request(r)
    assert s.schedule(0.0).prefills[0].num_tokens == 20


def test_per_request_state_is_dropped_when_a_request_leaves():
    s = create_scheduler("qoserve", cost_model=COST)
    tight = interactive("tight", prompt=50, ttft=0.5)
    loose = batch("loose", prompt=50, ttlt=600.0)
    s.add_request(tight)
    s.add_request(loose)
    assert s._min_first_target == 0.5
    s.pinned.add("tight")
    s.abort_request("tight")
    assert "tight" not in s.pinned
    assert s._min_first_target == 600.0  # the load horizon widens once the tight job is gone
    loose.status = RequestStatus.FINISHED_LENGTH
    s._forget(loose)
    assert s._min_first_target == float("inf") and not s._target_of


def test_sarathi_chunk_size_is_a_token_budget_that_decodes_take_first():
    s = create_scheduler("sarathi-fcfs", cost_model=COST, chunk_size=256)
    for k in range(100):
        r = decoding(interactive(f"d{k}", arrival=0.0), outputs=2, times=[0.1, 0.2])
        s.running[r.request_id] = r
    s.add_request(interactive("new", arrival=0.0, prompt=1000))
    out = s.schedule(now=0.3)
    assert len(out.decodes) == 100
    assert [p.num_tokens for p in out.prefills] == [156] and out.prefill_budget == 156
    for k in range(100, 300):
        r = decoding(interactive(f"d{k}", arrival=0.0), outputs=2, times=[0.1, 0.2])
        s.running[r.request_id] = r
    assert s.schedule(now=0.4).prefills == []  # 300 decodes fill the 256-token budget


def test_sarathi_srpf_orders_by_remaining_prefill_only():
    from gpu_runtime.scheduler.priority import remaining_work

    short_prompt_long_answer = batch("a", prompt=50, max_tokens=5000)
    long_prompt_short_answer = batch("b", prompt=400, max_tokens=5)
    assert remaining_work(short_prompt_long_answer) == 50.0
    s = create_scheduler("sarathi-srpf", cost_model=COST, chunk_size=1000)
    s.add_request(long_prompt_short_answer)
    s.add_request(short_prompt_long_answer)
    out = s.schedule(now=0.0)
    assert [p.request.request_id for p in out.prefills] == ["a", "b"]


def test_qoserve_budget_is_not_pinned_to_the_floor_by_late_decodes():
    """Bursty-overload cascade (QoServe 3.2): late decodes must not shrink the chunk to the floor."""
    s = create_scheduler("qoserve", cost_model=COST, chunk_floor=16, chunk_ceiling=512)
    for k in range(6):
        r = decoding(interactive(f"late{k}", arrival=0.0, ttft=1.0, tbt=0.05), outputs=2, times=[3.0, 3.5])
        s.running[r.request_id] = r
    s.add_request(interactive("new", arrival=9.0, prompt=2000, ttft=6.0))
    out = s.schedule(now=10.0)
    assert len(out.decodes) == 6
    assert out.prefill_budget > 16 and sum(p.num_tokens for p in out.prefills) == out.prefill_budget


def _first_prefill(jobs):
    s = create_scheduler("qoserve", cost_model=COST, chunk_ceiling=256, chunk_floor=256)
    for r in jobs:
        s.add_request(r)
    return s.schedule(now=0.0).prefills[0].request.request_id


def test_paid_guard_sums_the_paid_work_queued_ahead():
    # One 256-token chunk per 35.6 ms iteration. The free job's TTFT is earliest, so it leads the
    # priority order; a paid job due at 0.13 s could wait one iteration alone (x1.5 margin: 53 ms
    # of prefill from 36 ms), so the free job still goes first ...
    free = interactive("free", prompt=256, ttft=0.10, tier=Tier.FREE)
    assert _first_prefill([free, interactive("p1", prompt=256, ttft=0.13)]) == "free"
    # ... but two such paid jobs cannot both wait: the second needs the first's prefill before its own.
    free = interactive("free", prompt=256, ttft=0.10, tier=Tier.FREE)
    first = _first_prefill([free, interactive("p1", prompt=256, ttft=0.13), interactive("p2", prompt=256, ttft=0.13)])
    assert first in {"p1", "p2"}


def test_paid_guard_counts_a_batch_jobs_predicted_decode_at_a_decode_step_alone():
    # A 256-token prompt (one 35.6 ms chunk) due at 0.13 s. The guard prices its decode at a decode step alone
    # (10.1 ms, the fastest it can go): with 3 predicted tokens it needs 66 ms, x1.5 margin 99 ms, so it cannot
    # wait one more chunk; the prefill alone (53 ms with the margin) could. With 1 predicted token it can wait.
    free = interactive("free", prompt=256, ttft=0.10, tier=Tier.FREE)
    late = batch("b", prompt=256, ttlt=0.13, max_tokens=30)
    late.predicted_output_len = 3
    assert _first_prefill([free, late]) == "b"
    free = interactive("free", prompt=256, ttft=0.10, tier=Tier.FREE)
    short = batch("b", prompt=256, ttlt=0.13, max_tokens=30)
    short.predicted_output_len = 1
    assert _first_prefill([free, short]) == "free"


def test_paid_guard_leaves_a_job_a_loaded_engine_cannot_finish_in_time_to_relegation():
    # 30 predicted tokens due at 0.3 s: at a decode step alone (10.1 ms) it would be due now, but relegation prices
    # the decode at a pass beside a full 512-token chunk (61 ms a token): hopeless, so it is relegated, not moved
    # ahead of the free job (which takes half the budget; the paid one is looked at next)
    s = create_scheduler("qoserve", cost_model=COST, chunk_ceiling=512, chunk_floor=512)
    s.add_request(interactive("free", prompt=256, ttft=0.10, tier=Tier.FREE))
    hopeless = batch("b", prompt=256, ttlt=0.3, max_tokens=30)
    hopeless.predicted_output_len = 30
    s.add_request(hopeless)
    out = s.schedule(now=0.0)
    assert out.prefills[0].request.request_id == "free"
    assert [r.request_id for r in out.relegated] == ["b"]


def test_a_free_job_gives_way_when_its_whole_prefill_would_make_a_paid_job_late():
    # EDF order (alpha 0); 256-token chunks of 35.6 ms. The free job is due first and would finish in time
    # (2 chunks, 71 ms of its 120 ms); the paid job (due at 150 ms) could wait one chunk but not two.
    def first(free_prompt: int) -> tuple[str, list[str]]:
        s = create_scheduler("qoserve", cost_model=COST, chunk_ceiling=256, chunk_floor=256, adaptive_alpha=False,
                             alpha_high_ms=0.0)
        s.add_request(interactive("free", prompt=free_prompt, ttft=0.12, tier=Tier.FREE))
        s.add_request(interactive("paid", prompt=256, ttft=0.15))
        out = s.schedule(now=0.0)
        return out.prefills[0].request.request_id, [r.request_id for r in out.relegated]

    assert first(512) == ("paid", ["free"])  # relegated before it is overdue; it runs with spare budget later
    assert first(256) == ("free", [])  # one chunk: the paid job can wait that long
    s = create_scheduler("qoserve", cost_model=COST, chunk_ceiling=256, chunk_floor=256, adaptive_alpha=False,
                         alpha_high_ms=0.0, free_yields=False)
    s.add_request(interactive("free", prompt=512, ttft=0.12, tier=Tier.FREE))
    s.add_request(interactive("paid", prompt=256, ttft=0.15))
    assert s.schedule(now=0.0).prefills[0].request.request_id == "free"


def test_a_short_prompt_is_not_relegated_for_a_budget_larger_than_the_queue():
    # The pass of the whole budget (8192 tokens, 0.83 s) would miss a 0.5 s TTFT; the 100 tokens queued take 20 ms.
    # Before, the job was predicted at the whole budget and relegated on arriving at an idle engine.
    s = create_scheduler("qoserve", cost_model=COST, chunk_ceiling=8192)
    short = interactive("short", prompt=100, ttft=0.5)
    s.add_request(short)
    out = s.schedule(now=0.0)
    assert out.relegated == [] and short.relegation_count == 0
    assert [p.request.request_id for p in out.prefills] == ["short"]
    # one that cannot make it even alone still goes: 6000 tokens take 0.61 s
    s = create_scheduler("qoserve", cost_model=COST, chunk_ceiling=8192)
    s.add_request(interactive("long", prompt=6000, ttft=0.5, tier=Tier.FREE))
    assert [r.request_id for r in s.schedule(now=0.0).relegated] == ["long"]
    # a relegated prompt's tokens count in the pass too: with 2000 of them waiting, a 0.3 s TTFT is out of reach
    s = create_scheduler("qoserve", cost_model=COST, chunk_ceiling=8192)
    s.add_request(interactive("shed", prompt=2000, ttft=0.05, tier=Tier.FREE))
    assert [r.request_id for r in s.schedule(now=0.0).relegated] == ["shed"]


def test_a_batch_job_is_paced_beside_the_prompts_queued_other_than_its_own():
    # 500 tokens due in 20 s. Beside a saturating chunk (2048 tokens, 0.215 s a pass) they would take 107 s; with
    # nothing else queued its decode runs alone (10 ms a token, 5 s). Before, it was relegated at an idle engine.
    def relegated(*others: int) -> list[str]:
        s = create_scheduler("qoserve", cost_model=COST, chunk_ceiling=2048)
        job = batch("job", prompt=100, ttlt=20.0, max_tokens=500)
        job.predicted_output_len = 500
        s.add_request(job)
        for i, prompt in enumerate(others):  # due later: they queue behind the job
            s.add_request(batch(f"other{i}", prompt=prompt, ttlt=1000.0))
        return [r.request_id for r in s.schedule(now=0.0).relegated]

    assert relegated() == []
    assert relegated(200) == []  # beside 200 prompt tokens: 30 ms a token, 15 s
    assert relegated(3000) == ["job"]  # under a backlog the saturating chunk's pace holds


def test_a_chunk_cut_by_the_step_cap_is_predicted_as_cut():
    """A decode with 10 s of slack lets the chunk take the 4000 tokens queued (0.41 s predicted); the engine's step
    cap of 100 tokens leaves it 99 beside the decode. The pass predicted is that one: 100 tokens, 20 ms on COST."""
    s = create_scheduler("qoserve", cost_model=COST, chunk_floor=16, chunk_ceiling=4096, step_tokens=100)
    d = decoding(interactive("d", ttft=1.0, tbt=10.0), outputs=1, times=[0.9])
    s.running[d.request_id] = d
    s.add_request(batch("big", prompt=4000, ttlt=1000.0))
    out = s.schedule(now=1.0)
    assert out.prefill_budget == 99 and out.prefills[0].num_tokens == 99
    assert abs(out.predicted_latency_s - (0.010 + 1e-4 * 100)) < 1e-9, out.predicted_latency_s
