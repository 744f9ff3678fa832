"""Per-request SLO requirement A(r) for one speculative iteration (AdaServe section 3).

A(r) = (l_r + t_spec) / TPOT_r - o_r: the tokens request r must accept now (its pending
token included) so that its mean TPOT stays within target after this iteration.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpu_runtime.qos import QoSClass

if TYPE_CHECKING:
    from gpu_runtime.request import Request


def slo_requirement(req: Request, now: float, t_spec: float) -> float:
    """A(r) in tokens; 0 when the request has no per-token target."""
    tpot = req.tpot_target(now)
    if tpot is None or tpot <= 0:
        return 0.0
    if req.qos.qos_class is QoSClass.INTERACTIVE:
        first = req.first_token_time
        if first is None:
            return t_spec / tpot
        latency = max(0.0, now - first)  # l_r: time since the first decoding step
        decoded = max(0, req.num_output_tokens - 1)  # o_r: tokens decoded after the first
        return (latency + t_spec) / tpot - decoded  # eq. 2 rewritten as A(r)
    # Batch jobs: tpot_target is already "seconds per token from now to the deadline".
    return t_spec / tpot
