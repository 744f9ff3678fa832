"""Speculation policies by config name (STYLE.md item 8).

Names: ``none``, ``chain-<n>`` (vLLM-Spec(n)), ``static-tree`` (SpecInfer-like, 23
nodes), ``adaserve``, ``adaspec``, ``nightjar``. Keyword config goes to the policy's
config dataclass (unknown keys raise).
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING

from gpu_runtime.speculation.adaserve import AdaServe
from gpu_runtime.speculation.adaspec import AdaSpec
from gpu_runtime.speculation.base import NoSpeculation, SpeculationPolicy
from gpu_runtime.speculation.nightjar import Nightjar
from gpu_runtime.speculation.static import StaticChain, StaticTree

if TYPE_CHECKING:
    from gpu_runtime.executor.base import Executor

log = logging.getLogger(__name__)

POLICIES: dict[str, type[SpeculationPolicy]] = {
    "none": NoSpeculation,
    "static-tree": StaticTree,
    "adaserve": AdaServe,
    "adaspec": AdaSpec,
    "nightjar": Nightjar,
}

_CHAIN = re.compile(r"^chain-(\d+)$")


def policy_names() -> list[str]:
    return ["none", "chain-<n>", *[n for n in POLICIES if n != "none"]]


def chain_length(name: str) -> int | None:
    """N of a static ``chain-N`` policy (None for the others)."""
    m = _CHAIN.match(name)
    return int(m.group(1)) if m else None


def create_policy(name: str, executor: Executor | None = None, longest_draft: int | None = None,
                  chains_only: bool = False, **config) -> SpeculationPolicy:
    """Build a fresh policy; ``chain-4`` etc. are static chains of that length.

    ``executor`` (optional) is bound right away so the policy can read its profile; the
    Engine binds it again, which is harmless. ``longest_draft``: the most tokens the engine's
    drafter proposes per request and step; the adaptive policies' longest length becomes it
    (``config`` still wins); ``chains_only``: it proposes one chain per request, no beams."""
    n = chain_length(name)
    if n is not None:
        policy: SpeculationPolicy = StaticChain(n, **config)
    else:
        try:
            cls = POLICIES[name]
        except KeyError:
            raise ValueError(f"unknown speculation policy {name!r}; known: {', '.join(policy_names())}") from None
        if longest_draft is not None:
            config = {**cls.drafting_up_to(longest_draft, chains_only), **config}
        policy = cls(**config)
    if executor is not None:
        policy.bind(executor)
    return policy
