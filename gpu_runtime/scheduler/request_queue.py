"""Request queues: ordering kept apart from batch building (FCFS, deadline, priority).

All three are binary heaps with lazy deletion: ``push``/``pop`` are O(log n) and
``remove`` only marks the entry. A request's key is computed when it is pushed; callers
re-push after anything the key depends on changed (pop before re-push).
"""

from __future__ import annotations

import heapq
import itertools
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from typing import TypeAlias

from gpu_runtime.request import Request
from gpu_runtime.scheduler.priority import first_deadline

log = logging.getLogger(__name__)

QueueKey: TypeAlias = float | tuple[bool, float]  # lower runs first


class RequestQueue(ABC):
    def __init__(self) -> None:
        self._heap: list[list] = []  # [key, seq, request or None (removed)]
        self._entries: dict[str, list] = {}
        self._seq = itertools.count()

    @abstractmethod
    def key(self, request: Request) -> QueueKey:
        """Lower runs first."""

    def push(self, request: Request) -> None:
        if request.request_id in self._entries:
            self.remove(request.request_id)
        entry = [self.key(request), next(self._seq), request]
        self._entries[request.request_id] = entry
        heapq.heappush(self._heap, entry)

    def remove(self, request_id: str) -> Request | None:
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return None
        req, entry[2] = entry[2], None
        return req

    def get(self, request_id: str) -> Request | None:
        entry = self._entries.get(request_id)
        return entry[2] if entry else None

    def _drop_dead(self) -> None:
        while self._heap and self._heap[0][2] is None:
            heapq.heappop(self._heap)

    def peek(self) -> Request | None:
        self._drop_dead()
        return self._heap[0][2] if self._heap else None

    def pop(self) -> Request | None:
        self._drop_dead()
        if not self._heap:
            return None
        req = heapq.heappop(self._heap)[2]
        del self._entries[req.request_id]
        return req

    def rekey(self) -> None:
        """Recompute every key (after a parameter such as alpha changed); O(n log n)."""
        reqs = list(self)
        self._heap, self._entries = [], {}
        for r in reqs:
            self.push(r)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Request]:
        """Members in no particular order (use ``ordered`` for priority order)."""
        return (e[2] for e in self._entries.values())

    def ordered(self) -> list[Request]:
        return [e[2] for e in sorted(self._entries.values())]

    def in_order(self, request_ids: Iterable[str]) -> list[Request]:
        """The members among ``request_ids`` in the order ``pop`` would give them: by key, equal keys by when they
        were pushed (never by the order ``request_ids`` iterates in)."""
        entries = [self._entries[rid] for rid in request_ids if rid in self._entries]
        return [e[2] for e in sorted(entries)]


class FCFSQueue(RequestQueue):
    def key(self, request: Request) -> float:
        return request.arrival_time


class DeadlineQueue(RequestQueue):
    """Earliest first deadline (TTFT for interactive, TTLT for batch) first."""

    def key(self, request: Request) -> float:
        return first_deadline(request)


class PriorityQueue(RequestQueue):
    """Ordered by any key function, e.g. QoServe's hybrid priority or SRPF's remaining work."""

    def __init__(self, key_fn: Callable[[Request], QueueKey]) -> None:
        super().__init__()
        self.key_fn = key_fn

    def key(self, request: Request) -> QueueKey:
        return self.key_fn(request)


def create_queue(kind: str, key_fn: Callable[[Request], float] | None = None) -> RequestQueue:
    """Factory: ``fcfs``, ``deadline`` or ``priority`` (needs ``key_fn``)."""
    if kind == "fcfs":
        return FCFSQueue()
    if kind == "deadline":
        return DeadlineQueue()
    if kind == "priority":
        if key_fn is None:
            raise ValueError("a priority queue needs key_fn")
        return PriorityQueue(key_fn)
    raise ValueError(f"unknown queue kind {kind!r} (fcfs, deadline, priority)")
