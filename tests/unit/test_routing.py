"""Prefix routing's pure rules (``app.services.routing``): the key a job's prompt gives, and the worker a key goes
to."""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime

from app.db.models import WorkerState
from app.services.routing import Candidate, _load, choose, routable, route_key

SYSTEM = {"role": "system", "content": "You are a terse assistant."}


def _turns(first: str) -> list[list[dict]]:
    """A conversation's three requests, each with the history before it."""
    history = [SYSTEM, {"role": "user", "content": first}]
    turns = [list(history)]
    for i in range(2):
        history += [{"role": "assistant", "content": f"answer {i}"}, {"role": "user", "content": f"more {i}"}]
        turns.append(list(history))
    return turns


def test_a_conversations_turns_share_a_key_and_conversations_do_not():
    keys = {route_key("t1", "m", messages=turn) for turn in _turns("Plan a trip to Oslo")}
    assert len(keys) == 1 and None not in keys
    other = route_key("t1", "m", messages=_turns("Summarize this report")[0])  # the same system prompt only
    assert other not in keys
    assert route_key("t2", "m", messages=_turns("Plan a trip to Oslo")[0]) not in keys  # another tenant's
    assert route_key("t1", "m2", messages=_turns("Plan a trip to Oslo")[0]) not in keys  # another model's


def test_prompt_cache_key_wins_and_raw_prompts_route_by_their_opening():
    a = route_key("t", "m", prompt_cache_key="user-42", messages=_turns("x")[0])
    assert a == route_key("t", "m", prompt_cache_key="user-42", prompt="anything else") != \
        route_key("t", "m", prompt_cache_key="user-43", prompt="anything else")
    shared = "Q: 2+2? A: 4.\n" * 100  # a few-shot prefix longer than the key reads
    assert route_key("t", "m", prompt=shared + "Q: 3+3?") == route_key("t", "m", prompt=shared + "Q: 5+5?")
    assert route_key("t", "m", prompt="short one") != route_key("t", "m", prompt="short two")
    assert route_key("t", "m", prompt_token_ids=[1, 2, 3]) != route_key("t", "m", prompt_token_ids=[1, 2, 4])
    assert route_key("t", "m") is None


def test_rendezvous_moves_only_the_keys_of_a_worker_that_comes_or_goes():
    keys = [f"{i:016x}" for i in range(2000)]
    three = [Candidate(w, 0, 100) for w in ("wa", "wb", "wc")]
    before = {k: choose(k, three, slack=16) for k in keys}
    assert all(n > 550 for n in Counter(before.values()).values())  # about a third each
    after = {k: choose(k, three[:2], slack=16) for k in keys}  # wc is gone
    assert all(after[k] == before[k] for k in keys if before[k] != "wc")
    grown = {k: choose(k, [*three, Candidate("wd", 0, 100)], slack=16) for k in keys}
    moved = [k for k in keys if grown[k] != before[k]]
    assert {grown[k] for k in moved} == {"wd"} and 350 < len(moved) < 650  # about a quarter, all to the newcomer


def test_a_busy_or_full_home_worker_gives_the_job_to_the_least_loaded():
    key = next(f"{i:x}" for i in range(100) if choose(f"{i:x}", [Candidate("wa", 0, 9), Candidate("wb", 0, 9)],
                                                      slack=4) == "wa")
    assert choose(key, [Candidate("wa", 6, 9), Candidate("wb", 2, 9)], slack=4) == "wa"  # 4 above: still home
    assert choose(key, [Candidate("wa", 7, 9), Candidate("wb", 2, 9)], slack=4) == "wb"  # 5 above: spread
    assert choose(key, [Candidate("wa", 9, 9), Candidate("wb", 8, 9)], slack=4) == "wb"  # home is full
    assert choose(key, [Candidate("wa", 9, 9), Candidate("wb", 9, 9)], slack=4) is None  # all full: shared queue
    assert choose(key, [], slack=4) is None


def test_a_batch_job_counts_a_worker_full_at_its_cap_less_its_interactive_reserve():
    assert _load({"in_line": 3, "max_inflight": 4, "batch_room": 3}) == (3, 4, 3)
    assert _load({"in_line": 3, "max_inflight": 4}) == (3, 4, 4)  # a worker without a reserve: its cap for both
    key = next(f"{i:x}" for i in range(100) if choose(f"{i:x}", [Candidate("wa", 0, 4), Candidate("wb", 0, 4)],
                                                       slack=16) == "wa")
    # wa holds 3 of 4: an interactive job still goes home, a batch job (room for 3) to the other worker
    assert choose(key, [Candidate("wa", 3, 4), Candidate("wb", 2, 4)], slack=16) == "wa"
    assert choose(key, [Candidate("wa", 3, 3), Candidate("wb", 2, 3)], slack=16) == "wb"


def test_jobs_routed_to_a_worker_and_not_taken_yet_count_as_in_line():
    # its engine holds 2 of 4 and its own queue 2 more: full, so a 5th job goes to the shared queue, not behind them
    held, capacity, _ = _load({"in_line": 2, "routed_waiting": 2, "max_inflight": 4})
    assert (held, capacity) == (4, 4)
    assert choose("00", [Candidate("wa", held, capacity)], slack=16) is None


def test_a_stopping_worker_is_routed_nothing_though_it_still_beats():
    """A worker in its warm shutdown's grace beats, and looks live, until its last jobs end: its state says it stops,
    and the router leaves it out, as it does a draining one."""
    now = datetime.now(UTC)
    rows = [WorkerState(id=w, model="m", queue="q", device="cpu", draining=False, heartbeat_at=now,
                        state={"served": ["m"], "in_line": 0, "max_inflight": 4, **state})
            for w, state in (("wa", {}), ("wb", {"stopping": True}), ("wc", {"stopping": False}))]
    assert [w.id for w in routable(rows)] == ["wa", "wc"]


def test_a_worker_that_reads_no_own_queue_is_routed_nothing():
    """A worker started with ``COSERVE_ROUTING=queue`` reads only its model's queue, and its state says so: an API that
    routes by prefix leaves it out, instead of sending it jobs on a queue it never reads. A worker that does not say
    (an older one) reads its own queue, as every prefix-routed worker did."""
    now = datetime.now(UTC)
    rows = [WorkerState(id=w, model="m", queue="q", device="cpu", draining=False, heartbeat_at=now,
                        state={"served": ["m"], "in_line": 0, "max_inflight": 4, **state})
            for w, state in (("wa", {}), ("wb", {"own_queue": False}), ("wc", {"own_queue": True}))]
    assert [w.id for w in routable(rows)] == ["wa", "wc"]
