"""The simulation loop: a heap of events over one or more replicas (Engine + SimExecutor).

Replicas run the same Engine and scheduler objects as the real server; only the
executor is simulated. A router picks the replica of each arrival (one replica, or one
per tier for siloed deployments).
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from gpu_runtime.costmodel.base import CostModel
from gpu_runtime.engine import Engine, RequestOutput
from gpu_runtime.executor.sim import SimExecutor
from gpu_runtime.request import Request
from gpu_runtime.scheduler.registry import create_scheduler
from gpu_runtime.sim.events import ArrivalEvent, Event

log = logging.getLogger(__name__)


@dataclass
class Replica:
    name: str
    engine: Engine
    executor: SimExecutor
    idle: bool = True


def make_replica(name: str, policy: str, cost_model: CostModel, kv_blocks: int, block_size: int = 16,
                 noise: float = 0.0, seed: int = 0, **sched_config) -> Replica:
    ex = SimExecutor(cost_model, kv_blocks=kv_blocks, block_size=block_size, noise=noise, seed=seed)
    sched = create_scheduler(policy, cost_model=cost_model, executor=ex, **sched_config)
    return Replica(name, Engine(ex, sched), ex)


@dataclass
class Simulator:
    replicas: list[Replica]
    router: Callable[[Request], int] = lambda req: 0
    finished: list[RequestOutput] = field(default_factory=list)
    requests: dict[str, Request] = field(default_factory=dict)
    max_time: float | None = None  # stop (leaving work unfinished) past this simulated time

    def run(self, arrivals: list[Request]) -> list[Request]:
        seq = itertools.count()
        heap: list[tuple[float, int, Event]] = []  # (time, tie-break, event)
        for req in arrivals:
            self.requests[req.request_id] = req
            ev = ArrivalEvent(req.arrival_time, 0, req, self.replicas[self.router(req)])
            heapq.heappush(heap, (ev.time, next(seq), ev))
        while heap:
            _, _, ev = heapq.heappop(heap)
            if self.max_time is not None and ev.time > self.max_time:
                break
            for new in ev.handle(self):
                heapq.heappush(heap, (new.time, next(seq), new))
        return list(self.requests.values())
