"""Common base of speculation policies (AdaServe, AdaSpec, Nightjar, static baselines).

Per iteration the engine asks the policy what to draft, lets the executor draft it,
asks the policy which nodes to verify, runs the batch, then reports what was accepted.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpu_runtime.executor.base import DraftEntry, Executor, KeepDrafting, StepResult
    from gpu_runtime.request import Request
    from gpu_runtime.speculation.token_tree import TokenTree


class SpeculationPolicy(ABC):
    name: str = "base"
    # Prompt tokens already in this iteration's pass (set by the engine before draft_plan):
    # a token budget for the pass (AdaServe's B) is shared with them.
    prefill_tokens_in_pass: int = 0
    # Seconds the pass may still grow before the tightest decode misses its deadline (set by the engine
    # from ``SchedulerOutput.pass_spare_s``); None when the scheduler sets no time budget.
    pass_spare_s: float | None = None
    # Handed to the executor's drafter: asked after each drafted depth whether to draft one more
    # (AdaSpec's adaptive drafter); None drafts every entry to its depth.
    keep_drafting: KeepDrafting | None = None

    @classmethod
    def drafting_up_to(cls, longest: int, chains_only: bool = False) -> dict[str, int]:
        """Config fields that make the policy's longest draft ``longest`` tokens: what the engine's drafter
        proposes per request and step (vLLM's ``num_speculative_tokens``). {} for a policy without a length.
        ``chains_only``: the drafter proposes one chain per request (vLLM), no beam of several."""
        return {}

    def most_kept(self, decodes: int) -> int | None:
        """The most draft tokens (one chain) any request verifies in the pass about to be planned, which carries at
        most ``decodes`` decodes: read from the policy's state before the pass is planned (the policy chooses after
        it), so the step's token budget leaves each decode's drafts no more than that. Never below what the policy
        then keeps; None: as many as the drafter proposed."""
        return None

    def bind(self, executor: Executor) -> None:
        """Called once by the engine; policies may read the executor's profile/capacity."""
        self.executor = executor

    @abstractmethod
    def draft_plan(self, decodes: list[Request], now: float) -> list[DraftEntry]:
        """Which requests to draft for and how deep/wide; [] means no speculation this step."""

    @abstractmethod
    def select(self, decodes: list[Request], candidates: dict[str, TokenTree], now: float) -> dict[str, TokenTree]:
        """The sub-trees to verify, keyed by request id (missing = plain decode)."""

    def observe(self, decodes: list[Request], selected: dict[str, TokenTree], result: StepResult,
                draft_latency_s: float, now: float) -> None:
        """Feedback after the step: accepted nodes and measured latencies."""

    def free_spare_s(self, prefill_tokens: int, free_beside_prefill: bool) -> float | None:
        """``pass_spare_s`` as the time tree tokens may take for free (AdaServe's slack rule): none in a pass that
        carries ``prefill_tokens`` of prompts unless ``free_beside_prefill``, since the prompts queued behind the
        chunk wait for the whole pass too. None: the scheduler sets no time budget."""
        if self.pass_spare_s is None:
            return None
        return self.pass_spare_s if prefill_tokens == 0 or free_beside_prefill else 0.0

    def maintain(self, executor: Executor, num_waiting: int) -> None:
        """Once per iteration, outside the forward pass: e.g. Nightjar's draft offload/reload."""

    def state(self) -> dict[str, object]:
        """Small JSON-able summary for dashboards (current arm, draft on/off, ...)."""
        return {"policy": self.name}


class NoSpeculation(SpeculationPolicy):
    """Plain autoregressive decoding."""

    name = "none"

    def most_kept(self, decodes: int) -> int | None:
        return 0

    def draft_plan(self, decodes, now):
        return []

    def select(self, decodes, candidates, now):
        return {}
