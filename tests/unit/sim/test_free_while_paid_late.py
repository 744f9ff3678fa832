"""The tier-order check of sustained overload: free jobs on time while a paid job that ended late was waiting."""

from __future__ import annotations

from gpu_runtime.qos import QoSClass, QoSSpec, Tier
from gpu_runtime.request import Request, RequestStatus
from gpu_runtime.sampling import SamplingParams
from gpu_runtime.sim.metrics import free_on_time_while_paid_late


def job(rid: str, tier: Tier, arrival: float, ttlt: float, scheduled: float | None, tokens: list[float],
        status: RequestStatus = RequestStatus.FINISHED_STOPPED) -> Request:
    """A batch job that ran its first prefill chunk at ``scheduled`` and produced tokens at ``tokens``."""
    r = Request(rid, [1] * 10, SamplingParams(max_tokens=len(tokens) or 1), QoSSpec(QoSClass.BATCH, tier, ttlt_s=ttlt),
                arrival, status=status, scheduled_time=scheduled)
    r.output_token_ids, r.token_times = [7] * len(tokens), list(tokens)
    r.finish_time = tokens[-1] if tokens else None
    return r


def test_free_prefill_while_a_late_paid_job_waits_counts():
    paid = job("p", Tier.PAID, arrival=0.0, ttlt=5.0, scheduled=8.0, tokens=[9.0])  # late: done at 9, due at 5
    free = job("f", Tier.FREE, arrival=1.0, ttlt=20.0, scheduled=2.0, tokens=[3.0, 4.0])  # its prompt ran at 2-3
    assert free_on_time_while_paid_late([paid, free]) == 1
    assert free_on_time_while_paid_late([paid, free], whole_service=True) == 1


def test_a_late_paid_job_that_left_before_the_free_job_ran_does_not_count():
    # the paid job expired at 6 (relegated, never ran); the free job started at 7: it took nothing from it
    paid = job("p", Tier.PAID, 0.0, 5.0, None, [], status=RequestStatus.FINISHED_EXPIRED)
    paid.finish_time = 6.0
    free = job("f", Tier.FREE, 1.0, 20.0, 7.0, [8.0])
    assert free_on_time_while_paid_late([paid, free], whole_service=True) == 0


def test_a_paid_job_arriving_during_the_free_decode_counts_only_for_the_whole_service():
    free = job("f", Tier.FREE, 0.0, 20.0, 0.0, [1.0, 2.0, 3.0])  # prompt at 0-1, decode to 3
    paid = job("p", Tier.PAID, 2.0, 1.0, 2.5, [4.0])  # arrives mid-decode, late
    assert free_on_time_while_paid_late([free, paid]) == 0
    assert free_on_time_while_paid_late([free, paid], whole_service=True) == 1


def test_on_time_paid_jobs_and_late_free_jobs_do_not_count():
    paid_ok = job("p", Tier.PAID, 0.0, 50.0, 3.0, [4.0])
    free_late = job("f", Tier.FREE, 0.0, 1.0, 0.5, [2.0])  # due at 1, done at 2
    paid_late = job("q", Tier.PAID, 0.0, 1.0, 0.0, [5.0])
    assert free_on_time_while_paid_late([paid_ok, free_late, paid_late], whole_service=True) == 0
    free_ok = job("g", Tier.FREE, 0.0, 50.0, 1.0, [2.0])
    assert free_on_time_while_paid_late([paid_ok, free_ok]) == 0
    assert free_on_time_while_paid_late([paid_late, free_ok]) == 1


def test_spans_against_waiting_windows():
    from gpu_runtime.sim.metrics import spans_while_waiting

    windows = [(0.0, 2.0), (5.0, float("inf"))]
    # (1, 3) overlaps the first window, (3, 4) none, (4, 6) the second, (10, 11) the open second
    assert spans_while_waiting([(1.0, 3.0), (3.0, 4.0), (4.0, 6.0), (10.0, 11.0)], windows) == 3
    assert spans_while_waiting([(2.0, 4.9)], windows) == 0  # the first closed at 2, the second opens at 5
    assert spans_while_waiting([(1.0, 2.0)], []) == 0
