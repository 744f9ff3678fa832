"""A capacity search's backlog check: a rate whose queue grew is past capacity, however few jobs were late."""

from __future__ import annotations

import pytest

from gpu_runtime.sim.capacity import backlog_growth, keeps_up, sustained_violation_rate


def _served(n: int, rate: float, service_rate: float) -> list[tuple[float, float]]:
    """n jobs arriving at ``rate`` per second through one FIFO server doing ``service_rate`` jobs a second."""
    jobs, free_at = [], 0.0
    for i in range(n):
        arrival = i / rate
        free_at = max(free_at, arrival) + 1.0 / service_rate
        jobs.append((arrival, free_at))
    return jobs


def test_a_server_faster_than_its_arrivals_keeps_up():
    jobs = _served(4000, rate=1.0, service_rate=1.25)
    assert backlog_growth(jobs) == pytest.approx(0.0, abs=0.001)
    assert keeps_up(jobs)


def test_a_server_slower_than_its_arrivals_falls_behind_by_the_rate_gap():
    jobs = _served(4000, rate=1.0, service_rate=0.9)  # 10% short: the backlog grows by ~10% of the arrivals
    assert backlog_growth(jobs) == pytest.approx(0.1, abs=0.01)
    assert not keeps_up(jobs)


def test_a_run_whose_deadlines_hid_the_backlog_counts_as_past_capacity():
    jobs = _served(4000, rate=1.0, service_rate=0.9)
    assert sustained_violation_rate(0.002, jobs) == 1.0  # few late yet, but the queue grew
    assert sustained_violation_rate(0.002, _served(4000, 1.0, 1.25)) == 0.002


def test_unfinished_jobs_stay_in_the_system():
    jobs = [(float(i), None) for i in range(100)]  # nothing finished: every arrival is backlog
    assert backlog_growth(jobs) == pytest.approx(1.0, abs=0.03)
    assert not keeps_up(jobs)


def test_a_short_run_is_judged_within_its_poisson_noise():
    # 200 arrivals, 6% short: inside two standard deviations of a count of ~100 (20%), so not called behind
    assert keeps_up(_served(200, rate=1.0, service_rate=0.94))
    assert not keeps_up(_served(200, rate=1.0, service_rate=0.6))


def test_too_few_jobs_to_tell():
    assert backlog_growth([]) == 0.0
    assert backlog_growth([(0.0, None)]) == 0.0
