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
from gpu_runtime.costmodel.calibration import InPlaceCalibration, ScaledCostModel
from gpu_runtime.engine import Engine, RequestOutput
from gpu_runtime.executor.base import BatchPlan, StepResult
from gpu_runtime.executor.sim import SimExecutor
from gpu_runtime.request import Request
from gpu_runtime.scheduler.registry import create_scheduler
from gpu_runtime.sim.events import ArrivalEvent, Event

log = logging.getLogger(__name__)


SIM_EOS = 2  # the id TraceSimExecutor says EOS with (SimExecutor's placeholder tokens are 7)


class TraceSimExecutor(SimExecutor):
    """SimExecutor whose model ends each trace request with EOS after its trace output length.

    The length stays inside the executor (``stop_after``, filled on arrival), as a real
    model's answer length does: schedulers only see ``max_tokens`` and what history predicts."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003 - SimExecutor's
        super().__init__(*args, **kwargs)
        self.eos_token_id = SIM_EOS
        self.stop_after: dict[str, int] = {}  # request -> output tokens, the last one EOS
        self._emitted: dict[str, int] = {}

    def step(self, plan: BatchPlan) -> StepResult:
        result = super().step(plan)
        for rid, toks in result.tokens.items():
            done = self._emitted.get(rid, 0)
            self._emitted[rid] = done + len(toks)
            stop = self.stop_after.get(rid)
            if stop is not None and done < stop <= done + len(toks):
                toks[stop - done - 1] = SIM_EOS
        return result

    def free(self, request_id: str) -> None:
        super().free(request_id)
        self.stop_after.pop(request_id, None)
        self._emitted.pop(request_id, None)


@dataclass
class Replica:
    name: str
    engine: Engine
    executor: TraceSimExecutor
    idle: bool = True


def make_replica(name: str, policy: str, cost_model: CostModel, kv_blocks: int, block_size: int = 16,
                 noise: float = 0.0, seed: int = 0, plan_cost_model: CostModel | None = None,
                 calibrate: bool = False, prefix_caching: bool = False, **sched_config) -> Replica:
    """A simulated engine whose passes take ``cost_model``'s time; its scheduler plans with
    ``plan_cost_model`` (default: the same model; a real engine's policy may plan with another), scaled to
    the simulated steps' cost with ``calibrate`` as the vLLM worker scales it (COSERVE_COST_CALIBRATION);
    ``prefix_caching``: vLLM's prefix cache (for requests whose prompts are real token ids)."""
    ex = TraceSimExecutor(cost_model, kv_blocks=kv_blocks, block_size=block_size, noise=noise, seed=seed,
                          prefix_caching=prefix_caching)
    plan = plan_cost_model or cost_model
    if calibrate:
        plan = ScaledCostModel(plan)
        ex.calibration = InPlaceCalibration(plan)
    sched = create_scheduler(policy, cost_model=plan, executor=ex, **sched_config)
    return Replica(name, Engine(ex, sched), ex)


@dataclass
class Simulator:
    replicas: list[Replica]
    router: Callable[[Request], int] = lambda req: 0
    finished: list[RequestOutput] = field(default_factory=list)
    requests: dict[str, Request] = field(default_factory=dict)
    max_time: float | None = None  # stop (leaving work unfinished) past this simulated time
    # Stop once more than this many requests have finished late (capacity search: the run has already
    # failed its target, and an overloaded run is the slowest to simulate). Unfinished requests count
    # as violations in ``summarize``, so the reported rate is a lower bound above the limit.
    max_violations: int | None = None
    stopped_early: bool = False

    def _late(self, start: int) -> int:
        return sum(1 for out in self.finished[start:] if out.metrics is not None and out.metrics.slo_met is False)

    def run(self, arrivals: list[Request], reaches_engine: dict[str, float] | None = None) -> list[Request]:
        """``reaches_engine``: when a request reaches its replica's scheduler, where that is later than its
        arrival (a replayed service's dispatch hop); its deadlines still count from ``arrival_time``."""
        seq = itertools.count()
        late, seen = 0, 0
        heap: list[tuple[float, int, Event]] = []  # (time, tie-break, event)
        for req in arrivals:
            self.requests[req.request_id] = req
            t = max(req.arrival_time, (reaches_engine or {}).get(req.request_id, req.arrival_time))
            ev = ArrivalEvent(t, 0, req, self.replicas[self.router(req)])
            heapq.heappush(heap, (ev.time, next(seq), ev))
        while heap:
            _, _, ev = heapq.heappop(heap)
            if self.max_time is not None and ev.time > self.max_time:
                break
            for new in ev.handle(self):
                heapq.heappush(heap, (new.time, next(seq), new))
            if self.max_violations is not None and seen < len(self.finished):
                late, seen = late + self._late(seen), len(self.finished)
                if late > self.max_violations:
                    self.stopped_early = True
                    break
        return list(self.requests.values())
