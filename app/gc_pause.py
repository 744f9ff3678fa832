"""Full (oldest-generation) garbage collections held off while a burst of long-lived objects is made.

A batch fan-out makes hundreds of thousands of objects that live until its rows are written (parsed lines, specs,
row dicts). Each one that survives a young collection counts toward the next full collection, which walks every
object not frozen (``app.main`` freezes start-up's): a few of those walks were ~15% of a 10,000-line fan-out's CPU
and grow with the batch. The young generations are still collected (short-lived cycles go as before); what the
full collections would have found waits until the burst ends, when its objects are mostly freed by reference
counts anyway.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

# gen-2 collections start once this many gen-1 collections have run (C int): never, while paused
NEVER = 2**31 - 1

_lock = threading.Lock()
_holders = 0
_saved: tuple[int, int, int] | None = None


@contextmanager
def full_collections_paused() -> Iterator[None]:
    """Holds off full collections while the block runs; threads that overlap share one pause, and the collector's
    own thresholds come back when the last of them leaves."""
    global _holders, _saved
    with _lock:
        if _holders == 0:
            _saved = gc.get_threshold()
            gc.set_threshold(_saved[0], _saved[1], NEVER)
        _holders += 1
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0 and _saved is not None:
                now = gc.get_threshold()  # a threshold set meanwhile by someone else stays, but for gen 2's
                gc.set_threshold(now[0], now[1], _saved[2])
                _saved = None
