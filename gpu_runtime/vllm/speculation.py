"""coserve's speculation policies on vLLM's drafters: each request's number of draft tokens per step.

vLLM proposes up to ``num_speculative_tokens`` draft tokens per request (n-gram / prompt lookup
and suffix decoding on CPU; a draft model or EAGLE on GPUs) and verifies them as one chain.
Before each step the policy named by ``COSERVE_SPEC_POLICY`` decides how many of them each
request verifies, with the same code the own engine runs: ``draft_plan`` gives the depth, and
``select`` picks the chain prefix (AdaServe's SLO-customized budget, AdaSpec's adaptive length,
Nightjar's bandit down to 0 under load, static ``chain-N``). The rest is trimmed off the
request's ``spec_token_ids``, so vLLM schedules and verifies only what the policy kept.
Verification is vLLM's: the tokens are those it would produce without speculation (greedy).

What vLLM cannot express stays on the own engine: token trees (vLLM verifies chains, so
``static-tree`` and AdaServe select chains here), and Nightjar's draft offload (vLLM does not
resize its KV pool at run time).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gpu_runtime.executor.base import StepResult
from gpu_runtime.speculation.draft_acceptance import ProposalAcceptance
from gpu_runtime.speculation.registry import create_policy
from gpu_runtime.speculation.token_tree import TokenTree

if TYPE_CHECKING:
    from vllm.v1.request import Request as VLLMRequest

    from gpu_runtime.request import Request
    from gpu_runtime.scheduler.interface import SchedulerOutput as PolicyOutput

log = logging.getLogger(__name__)


class _DraftExecutor:
    """The executor facts speculation policies read when bound: the latency profile, an on-device draft."""

    draft_on_device = True
    draft_offloadable = False  # vLLM's KV pool is fixed once the engine starts
    latency_curve = None
    draft_switch_cost = None

    def __init__(self, cost_model: Any) -> None:
        self.cost_model = cost_model


class DraftLengths:
    """Trims vLLM's per-request draft tokens to what a coserve speculation policy keeps, and feeds it back."""

    def __init__(self, name: str, cost_model: Any, longest_draft: int,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.name = name
        # seconds, read when a step is planned and when its output is in: the step's time the policies learn from
        # (a test gives one that steps on its own, so that a run chooses as every other run of it does)
        self.clock = clock
        # the policy's lengths go up to what vLLM drafts (num_speculative_tokens), no further
        self.policy = create_policy(name, executor=_DraftExecutor(cost_model), longest_draft=longest_draft,
                                    chains_only=True)
        # of vLLM's drafts, by position and size of proposal: the path probabilities the policies rank with
        self.acceptance = ProposalAcceptance(longest_draft)
        self.kept: dict[str, int] = {}  # request -> draft tokens verified in the step in flight
        self.proposed: dict[str, int] = {}  # request -> draft tokens vLLM proposed for the step in flight
        self._decodes: list[Request] = []
        self._selected: dict[str, TokenTree] = {}
        self._t0 = 0.0

    def trim(self, decodes: list[tuple[Request, VLLMRequest]], plan: PolicyOutput, now: float) -> None:
        """Before vLLM schedules the step: keep the policy's share of each decode's draft tokens."""
        self.kept, self._t0 = {}, self.clock()
        drafted = [(m, v) for m, v in decodes if v.spec_token_ids]
        self.proposed = {m.request_id: len(v.spec_token_ids) for m, v in drafted}
        self._decodes = [m for m, _ in decodes]
        self._selected = {}
        policy = self.policy  # what the pass carries besides its decodes, drafts or not (observe reads it too)
        policy.prefill_tokens_in_pass = sum(p.num_tokens for p in plan.prefills)
        policy.pass_spare_s = plan.pass_spare_s
        if not drafted:
            return
        depth = {e.request_id: e.depth for e in policy.draft_plan(self._decodes, now)}
        candidates = {}
        for m, v in drafted:
            d = depth.get(m.request_id, 0)
            if d > 0:
                tokens = list(v.spec_token_ids[:d])
                rates = self.acceptance.conditionals(len(tokens), proposed=len(v.spec_token_ids))
                candidates[m.request_id] = TokenTree.chain(tokens, rates)
        self._selected = policy.select(self._decodes, candidates, now) if candidates else {}
        for m, v in drafted:
            tree = self._selected.get(m.request_id)
            k = _chain_prefix(tree) if tree is not None else 0
            v.spec_token_ids = list(v.spec_token_ids[:k])
            if k:
                self.kept[m.request_id] = k

    def observe(self, accepted: dict[str, int], now: float) -> None:
        """After vLLM's step: the draft tokens each request that verified drafts had accepted, and the step's time.
        A request kept drafts for but missing from ``accepted`` did not run them (vLLM preempted it): no miss."""
        if not self._decodes:
            return
        latency = self.clock() - self._t0
        result = StepResult(accepted_nodes={rid: list(range(n)) for rid, n in accepted.items() if n > 0},
                            latency_s=latency)
        verified = {rid: tree for rid, tree in self._selected.items() if rid in accepted}
        self.policy.observe(self._decodes, verified, result, 0.0, now)
        for rid, k in self.kept.items():
            if rid in accepted:
                self.acceptance.observe(self.proposed[rid], k, min(accepted[rid], k))
        self._decodes = []

    def state(self) -> dict[str, object]:
        rates = self.acceptance.rates
        return {**self.policy.state(), "engine": "vllm", "acceptance": [round(q, 3) for q in rates]}


def _chain_prefix(tree: TokenTree) -> int:
    """Length of the chain the selection kept (nodes 0..k-1 of the drafted chain)."""
    k = 0
    for i, p in enumerate(tree.parents):
        if p != i - 1:
            break
        k += 1
    return k
