"""Full collections held off while a burst of long-lived objects is made (app/gc_pause.py), shared by threads that
overlap, and the collector's thresholds given back by the last of them."""

from __future__ import annotations

import gc
import threading

from app.gc_pause import NEVER, full_collections_paused


def test_full_collections_are_held_off_inside_and_given_back_after():
    before = gc.get_threshold()
    with full_collections_paused():
        assert gc.get_threshold() == (before[0], before[1], NEVER)
        gc.collect(0)  # young collections still run
    assert gc.get_threshold() == before


def test_overlapping_pauses_end_when_the_last_one_leaves():
    before = gc.get_threshold()
    entered, release = threading.Event(), threading.Event()

    def other():
        with full_collections_paused():
            entered.set()
            release.wait(10)

    t = threading.Thread(target=other)
    t.start()
    assert entered.wait(10)
    with full_collections_paused():
        pass
    assert gc.get_threshold()[2] == NEVER  # the other thread's pause still holds
    release.set()
    t.join(10)
    assert gc.get_threshold() == before


def test_a_pause_given_back_after_an_error():
    before = gc.get_threshold()
    try:
        with full_collections_paused():
            raise ValueError("the fan-out failed")
    except ValueError:
        pass
    assert gc.get_threshold() == before
