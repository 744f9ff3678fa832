"""The scheduler's two-call interface: ``schedule()`` and ``update_from_output()``.

The scheduler decides every iteration which decodes run, which prefill chunks run and
how many prefill tokens go into the batch; it never runs the model.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from gpu_runtime.qos import Tier
from gpu_runtime.request import Request


@dataclass
class ScheduledPrefill:
    request: Request
    num_tokens: int  # prompt tokens of this request computed in this iteration


@dataclass
class SchedulerOutput:
    prefills: list[ScheduledPrefill] = field(default_factory=list)  # chunks, in priority order
    decodes: list[Request] = field(default_factory=list)  # requests that decode one step (or a tree)
    relegated: list[Request] = field(default_factory=list)  # newly relegated this iteration
    resumed: list[Request] = field(default_factory=list)  # relegated jobs brought back this iteration
    preempted: list[Request] = field(default_factory=list)  # prefills paused for a more urgent one
    recomputed: list[Request] = field(default_factory=list)  # KV released under memory pressure (recompute later)
    # Relegated jobs given up on (past their expiry, relegation.expires_at): they left every queue with the
    # status finished_expired; the engine frees their KV and reports them finished
    expired: list[Request] = field(default_factory=list)
    prefill_budget: int = 0  # the chunk budget C chosen for this iteration (tokens)
    predicted_latency_s: float | None = None  # cost-model prediction of the batch time
    # Time the pass may take before the tightest decode misses its next deadline (slack / safety), when
    # the scheduler sized the chunk by one; speculation may add tree tokens into what is left of it.
    pass_time_budget_s: float | None = None

    @property
    def pass_spare_s(self) -> float | None:
        """Seconds the predicted pass may still grow within ``pass_time_budget_s`` (None without one)."""
        if self.pass_time_budget_s is None or self.predicted_latency_s is None:
            return None
        return max(0.0, self.pass_time_budget_s - self.predicted_latency_s)

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler(ABC):
    """Base of every scheduling policy (QoServe, Sarathi-FCFS/EDF/SRPF, vLLM FCFS)."""

    @abstractmethod
    def add_request(self, request: Request) -> None:
        """Admit a new request (its prompt not yet computed)."""

    @abstractmethod
    def abort_request(self, request_id: str) -> Request | None:
        """Drop a request from every queue; returns it if it was known."""

    @abstractmethod
    def schedule(self, now: float) -> SchedulerOutput:
        """Form this iteration's batch."""

    @abstractmethod
    def update_from_output(self, output: SchedulerOutput, now: float) -> None:
        """Move requests between queues after the engine committed the step's tokens.

        Finished requests (``request.status.finished``) leave every queue here."""

    @abstractmethod
    def resume(self, request_id: str) -> bool:
        """Operator action: put a relegated request back into normal scheduling."""

    def change_tier(self, request_id: str, tier: Tier) -> Request | None:
        """Operator action (promote): the request's tier changes; returns it if it was known."""
        raise NotImplementedError(f"{type(self).__name__} does not change tiers")

    def note_kv_released(self, request: Request) -> None:
        """The engine freed the request's KV (its own preemption): it recomputes its prefill later."""
        raise NotImplementedError(f"{type(self).__name__} does not track released KV")

    def note_cached_prefix(self, request: Request, tokens: int) -> None:
        """The engine's prefix cache holds the first ``tokens`` of a prompt not (re)started: they count as
        computed."""
        raise NotImplementedError(f"{type(self).__name__} does not track cached prefixes")

    @property
    @abstractmethod
    def num_unfinished(self) -> int:
        """Requests admitted and not finished (any queue)."""

    @abstractmethod
    def queue_depths(self) -> dict[str, int]:
        """Sizes of the scheduler's queues by name (prefill, decode, relegated, ...)."""
