"""A rerun that goes on from an earlier attempt's streamed tokens (workers/resume.py) on hand-built situations: its
QoS says the client has ``delivered`` tokens since ``first_token_s``, so the policy judges it on the pace of what is
left (eq. 2 over the whole answer), not on a TTFT it settled long ago."""

from dataclasses import replace

from gpu_runtime.qos import TbtAnchor, Tier
from gpu_runtime.request import RequestStatus
from gpu_runtime.scheduler.decode_length import DecodeLengthHistory
from gpu_runtime.scheduler.priority import first_deadline
from gpu_runtime.scheduler.registry import create_scheduler
from gpu_runtime.scheduler.relegation import WorkEstimate, expires_at, is_violated, should_relegate

from tests.unit.scheduler.helpers import COST, batch, interactive

EST = WorkEstimate(iteration_s=0.1, budget=1000, decode_step_s=0.02)


def rerun(rid: str = "r", delivered: int = 40, first_token_s: float | None = 0.5, tier: Tier = Tier.FREE,
          anchor: TbtAnchor = TbtAnchor.ARRIVAL):
    """TTFT 2 s, TBT 0.2 s, arrived at 0; the prompt ends with the ``delivered`` tokens of its earlier attempt."""
    req = interactive(rid, arrival=0.0, prompt=100 + delivered, ttft=2.0, tbt=0.2, tier=tier, max_tokens=60,
                      anchor=anchor)
    req.qos = replace(req.qos, delivered=delivered, first_token_s=first_token_s)
    return req


def test_rerun_is_ordered_by_its_next_tokens_deadline_over_the_whole_answer():
    # eq. 2: token 41 of the answer is due at 0 + 2 + 40 x 0.2 = 10 s, not at the 2 s TTFT deadline
    assert first_deadline(rerun()) == 10.0
    # stream pace: anchored at the delivered first token (0.5 s): 0.5 + 40 x 0.2 = 8.5 s
    assert first_deadline(rerun(anchor=TbtAnchor.FIRST_TOKEN)) == 8.5
    # a fresh job (nothing delivered) keeps eq. 1
    assert first_deadline(interactive("f", ttft=2.0)) == 2.0


def test_rerun_on_pace_is_not_relegated_though_its_ttft_deadline_is_long_past():
    req = rerun()
    assert not is_violated(req, now=5.0)  # its TTFT was settled by the earlier attempt
    assert not should_relegate(req, 5.0, EST, free_jobs_waiting=1)
    # behind the pace of what is left (token 41 due at 10 s): relegated as a stream recomputing its KV would be
    assert should_relegate(req, 10.5, EST, free_jobs_waiting=1)


def test_a_relegated_rerun_expires_later_than_a_fresh_job():
    # mid-answer: twice the grace (2 x max(2 x 2 s, 60 s)) after its next token's deadline (10 s, eq. 2)
    assert expires_at(rerun(), 2.0, 60.0) == 10.0 + 120.0
    assert expires_at(interactive("fresh", ttft=2.0), 2.0, 60.0) == 2.0 + 60.0


def test_rerun_predicts_what_is_left_of_the_answer():
    h = DecodeLengthHistory(min_samples=3)
    for n in (100, 100, 100):
        h.record("app", n)
    assert h.predict("app", 500) == 100
    assert h.predict_rest("app", 40, 460) == 60  # an answer of 100 tokens, 40 of them already out
    assert h.predict_rest("app", 0, 500) == 100
    # a batch rerun's remaining decode (eq. 5, eq. 3's check) is what is left, not the whole answer again
    s = create_scheduler("qoserve", cost_model=COST)
    s.history = h
    b = batch("b", prompt=140, ttlt=100.0, max_tokens=460, app="app")
    b.qos = replace(b.qos, delivered=40)
    s.add_request(b)
    assert b.predicted_output_len == 60


def test_finished_rerun_records_the_whole_answers_length():
    s = create_scheduler("qoserve", cost_model=COST)
    req = rerun(delivered=40)
    req.app_id = "app"
    s.add_request(req)
    req.output_token_ids = [7] * 20
    req.status = RequestStatus.FINISHED_STOPPED
    s._forget(req)
    assert list(s.history.recent["app"]) == [60]


def test_schedule_runs_a_rerun_on_pace_and_relegates_a_fresh_job_past_its_ttft():
    s = create_scheduler("qoserve", cost_model=COST)
    resumed = rerun("resumed")
    late = interactive("late", arrival=0.0, prompt=140, ttft=2.0, tbt=0.2, tier=Tier.FREE)
    s.add_request(resumed)
    s.add_request(late)
    out = s.schedule(now=5.0)
    assert [r.request_id for r in out.relegated] == ["late"]
    assert resumed.status is not RequestStatus.RELEGATED
    assert out.prefills[0].request.request_id == "resumed"
