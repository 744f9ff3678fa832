"""Hand-built requests and a linear cost model for scheduler rule tests."""

from __future__ import annotations

from gpu_runtime.costmodel.linear import PiecewiseLinearCostModel
from gpu_runtime.qos import QoSClass, QoSSpec, TbtAnchor, Tier
from gpu_runtime.request import Request, RequestStatus
from gpu_runtime.sampling import SamplingParams

# 10 ms per pass + 0.1 ms per token: a 256-token chunk with no decodes takes 35.6 ms.
COST = PiecewiseLinearCostModel([0.010, 0.0, 1e-4, 0.0, 0.0, 0.0], 0.0)


def interactive(rid: str, arrival: float = 0.0, prompt: int = 100, ttft: float = 1.0, tbt: float = 0.05,
                tier: Tier = Tier.PAID, max_tokens: int = 10, anchor: TbtAnchor = TbtAnchor.ARRIVAL) -> Request:
    return Request(rid, [1] * prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   QoSSpec(QoSClass.INTERACTIVE, tier, ttft_s=ttft, tbt_s=tbt, tbt_anchor=anchor), arrival)


def batch(rid: str, arrival: float = 0.0, prompt: int = 100, ttlt: float = 100.0, tier: Tier = Tier.PAID,
          max_tokens: int = 10, app: str | None = None) -> Request:
    return Request(rid, [1] * prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   QoSSpec(QoSClass.BATCH, tier, ttlt_s=ttlt), arrival, app_id=app)


def decoding(req: Request, outputs: int, times: list[float]) -> Request:
    """Put ``req`` in its decode phase with ``outputs`` tokens produced at ``times``."""
    req.num_computed_tokens = req.prompt_len + outputs - 1
    req.output_token_ids = [7] * outputs
    req.token_times = list(times)
    req.status = RequestStatus.DECODING
    return req
