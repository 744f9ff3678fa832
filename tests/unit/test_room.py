"""Engine room by job kind (``workers.room``): batch jobs leave the interactive reserve free."""

from __future__ import annotations

import pytest

from workers.room import batch_room, default_reserve, has_room


@pytest.mark.parametrize(("cap", "reserve"), [(1, 0), (2, 1), (8, 1), (9, 2), (16, 2), (1024, 128)])
def test_the_default_reserve_is_an_eighth_rounded_up_and_leaves_batch_jobs_a_slot(cap, reserve):
    assert default_reserve(cap) == reserve


def test_a_batch_job_stops_short_of_the_cap_by_the_reserve():
    assert [has_room(n, True, 4, 1) for n in range(5)] == [True, True, True, False, False]
    assert batch_room(4, 1) == 3


def test_an_interactive_job_takes_the_reserve_up_to_the_cap():
    assert [has_room(n, False, 4, 1) for n in range(5)] == [True, True, True, True, False]


def test_without_a_reserve_both_kinds_fill_the_cap():
    assert [has_room(n, True, 4, 0) for n in range(5)] == [has_room(n, False, 4, 0) for n in range(5)]


def test_a_batch_job_keeps_one_slot_whatever_the_reserve():
    assert batch_room(2, 5) == 1
    assert has_room(0, True, 2, 5) and not has_room(1, True, 2, 5)


def test_a_free_reserve_is_there_whenever_a_batch_job_joins():
    cap, reserve = 10, 3
    for in_line in range(cap + 1):
        if has_room(in_line, True, cap, reserve):
            assert cap - (in_line + 1) >= reserve  # after it joins, `reserve` interactive jobs still start at once
