"""The lateness capacity forces: a fluid EDF server that drops a job once it cannot make its deadline."""

from __future__ import annotations

import pytest

from gpu_runtime.sim.capacity import late_floor


def test_no_job_is_late_below_capacity():
    jobs = [(float(i), i + 1.5) for i in range(10)]  # one a second, each 1 s of work, 1.5 s to spare
    assert late_floor(jobs, goodput=1.0) == 0.0


def test_a_burst_beyond_capacity_drops_what_cannot_make_it():
    # three at once, due at 1.5 s, 1 s each: only the first can be on time
    assert late_floor([(0.0, 1.5)] * 3, goodput=1.0) == pytest.approx(2 / 3)


def test_earliest_deadline_first_saves_the_urgent_job():
    # the later-due job waits, so both make it; served in arrival order the urgent one would be late
    assert late_floor([(0.0, 10.0), (0.0, 1.0)], goodput=1.0) == 0.0


def test_sustained_overload_tends_to_one_minus_capacity_over_load():
    jobs = [(i / 2.0, i / 2.0 + 5.0) for i in range(2000)]  # 2 QPS against 1.5 of capacity
    assert late_floor(jobs, goodput=1.5) == pytest.approx(0.25, abs=0.01)


def test_no_jobs_no_floor():
    assert late_floor([], goodput=1.0) == 0.0
