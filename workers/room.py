"""Engine room by job kind: how many of a worker's ``max_inflight`` slots a job of each kind may fill (pure policy).

vLLM admits a request while it has KV room and fewer than ``max_num_seqs`` running, and with priority scheduling
puts a high-priority arrival ahead of what runs; coserve's worker instead stops taking jobs from the queue at
``max_inflight``. Left alone, a batch backlog fills every slot and an interactive job waits for a batch job to
finish. So batch jobs stop short of the cap by ``reserve`` slots, which only interactive jobs take: an interactive
job that arrives while batch jobs fill their share starts at once, and the engine's scheduler orders it first.
"""

from __future__ import annotations

RESERVE_SHARE = 8  # the default reserve: an eighth of the cap (rounded up), at most the cap less one


def default_reserve(max_inflight: int) -> int:
    """The slots kept for interactive jobs when the operator names none: an eighth of ``max_inflight``, rounded up,
    leaving batch jobs at least one slot (none kept at a cap of one)."""
    return min(max_inflight - 1, -(-max_inflight // RESERVE_SHARE))


def batch_room(max_inflight: int, reserve: int) -> int:
    """The most jobs in line at which a batch job still joins: the cap less the interactive reserve (at least 1)."""
    return max(1, max_inflight - reserve)


def has_room(in_line: int, batch: bool, max_inflight: int, reserve: int) -> bool:
    """Whether a job joins an engine that serves ``in_line`` jobs (relegated ones left out): an interactive job
    while fewer than ``max_inflight`` are in line, a batch job while fewer than ``batch_room`` are, so that
    ``reserve`` slots stay free for interactive jobs whenever a batch job joins."""
    return in_line < (batch_room(max_inflight, reserve) if batch else max_inflight)
