"""Simulator events: one class per event; ``handle`` returns the events it causes (vidur-style)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpu_runtime.request import Request
    from gpu_runtime.sim.simulator import Replica

log = logging.getLogger(__name__)


@dataclass(order=True)
class Event:
    time: float
    seq: int = field(compare=True, default=0)

    def handle(self, sim) -> list[Event]:  # noqa: ANN001 - the Simulator
        raise NotImplementedError


@dataclass(order=True)
class ArrivalEvent(Event):
    request: Request | None = field(compare=False, default=None)
    replica: Replica | None = field(compare=False, default=None)

    def handle(self, sim) -> list[Event]:  # noqa: ANN001
        rep = self.replica
        stop = getattr(self.request, "stop_after", None)  # trace length: the simulated model's EOS
        if stop is not None and hasattr(rep.executor, "stop_after"):
            rep.executor.stop_after[self.request.request_id] = stop
        try:
            rep.engine.add_request(self.request)
        except ValueError as exc:  # e.g. longer than the replica's KV cache holds: refused, as vLLM refuses it
            return self._refuse(sim, str(exc))
        if rep.idle:
            rep.idle = False
            rep.executor.advance_to(self.time)
            # The step starts at the replica's clock, which a step that ran past this arrival left ahead of it:
            # the arrivals up to then must reach the scheduler before it (the heap puts them first), or each
            # would get a step of its own, one request at a time.
            return [StepEvent(rep.executor.now(), 0, rep)]
        return []

    def _refuse(self, sim, error: str) -> list[Event]:  # noqa: ANN001
        """The request ends unserved (an SLO violation, as one left unfinished) and holds nothing."""
        from gpu_runtime.engine import RequestOutput
        from gpu_runtime.request import RequestStatus

        log.warning("request %s refused at arrival: %s", self.request.request_id, error)
        self.request.status = RequestStatus.FINISHED_ABORTED
        sim.finished.append(RequestOutput(self.request.request_id, status=self.request.status, event="rejected",
                                          error=error))
        return []


@dataclass(order=True)
class StepEvent(Event):
    replica: Replica | None = field(compare=False, default=None)

    def handle(self, sim) -> list[Event]:  # noqa: ANN001
        rep = self.replica
        rep.executor.advance_to(self.time)
        for out in rep.engine.step():
            if out.finished:
                sim.finished.append(out)
        if rep.engine.has_work:
            t = rep.executor.now()
            if t <= self.time:  # nothing ran (everything waits for KV or arrivals): idle until the next event
                rep.idle = True
                return []
            return [StepEvent(t, 0, rep)]
        rep.idle = True
        return []
