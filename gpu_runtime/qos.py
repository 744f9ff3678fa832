"""QoS classes, tiers and deadlines (QoServe section 3.1, eq. 1-3).

Times are seconds on the engine's clock (monotonic or simulated).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class QoSClass(StrEnum):
    INTERACTIVE = "interactive"  # TTFT + TBT targets
    BATCH = "batch"  # time-to-last-token deadline


class TbtAnchor(StrEnum):
    """Where an interactive job's per-token deadlines start (eq. 2 and its stream-pace variant)."""

    ARRIVAL = "arrival"  # QoServe eq. 2: D_n = t_arr + TTFT + (n-1)*TBT; early first tokens bank slack
    FIRST_TOKEN = "first-token"  # stream pace: D_n = min(t_arr + TTFT, t_first) + (n-1)*TBT


class Tier(StrEnum):
    FREE = "free"  # relegated first under overload (QoServe 3.4)
    PAID = "paid"  # relegated only once violated and no free job remains


@dataclass(frozen=True)
class QoSSpec:
    qos_class: QoSClass
    tier: Tier = Tier.PAID
    ttft_s: float | None = None  # interactive: time-to-first-token target
    tbt_s: float | None = None  # interactive: time-between-tokens target
    ttlt_s: float | None = None  # batch: time-to-last-token target, relative to arrival
    tbt_anchor: TbtAnchor = TbtAnchor.ARRIVAL  # interactive: where the TBT deadlines of tokens 2.. start
    # A rerun that goes on from an earlier attempt's streamed tokens (workers/resume.py): how many output tokens the
    # client already has, and when the first of them went out (seconds after arrival). Its engine request's prompt
    # ends with those tokens, so its own outputs are the answer's tokens delivered+1...; the policy judges it on the
    # pace of what is left (eq. 2 counted over the whole answer), not on a TTFT it settled long ago.
    delivered: int = 0
    first_token_s: float | None = None

    def __post_init__(self) -> None:
        if self.delivered < 0 or (self.first_token_s is not None and self.first_token_s < 0):
            raise ValueError("delivered and first_token_s must be >= 0")
        if self.qos_class is QoSClass.INTERACTIVE and (self.ttft_s is None or self.tbt_s is None):
            raise ValueError("interactive QoS needs ttft_s and tbt_s")
        if self.qos_class is QoSClass.BATCH and self.ttlt_s is None:
            raise ValueError("batch QoS needs ttlt_s")


def first_token_deadline(arrival: float, qos: QoSSpec) -> float:
    """Eq. 1: D_first = t_arr + TTFT (batch jobs have only the eq. 3 deadline)."""
    if qos.qos_class is QoSClass.INTERACTIVE:
        return arrival + qos.ttft_s  # type: ignore[operator]
    return arrival + qos.ttlt_s  # type: ignore[operator]


def token_deadline(arrival: float, qos: QoSSpec, n: int, first_token_time: float | None = None) -> float:
    """Eq. 2: D_n = t_arr + TTFT + (n-1)*TBT for the n-th output token (n >= 1).

    With ``TbtAnchor.FIRST_TOKEN`` the deadlines of tokens 2.. start at the first token when it
    came before its deadline, so TTFT slack is not spent mid-stream: the stream keeps its TBT
    pace (what a TPOT measured from the first token asks). Never later than eq. 2."""
    if qos.qos_class is QoSClass.INTERACTIVE:
        start = arrival + qos.ttft_s  # type: ignore[operator]
        if first_token_time is not None and qos.tbt_anchor is TbtAnchor.FIRST_TOKEN:
            start = min(start, first_token_time)
        return start + (n - 1) * qos.tbt_s  # type: ignore[operator]
    return arrival + qos.ttlt_s  # type: ignore[operator]


def completion_deadline(arrival: float, qos: QoSSpec) -> float | None:
    """Eq. 3: D_total = t_arr + TTLT (interactive jobs have none)."""
    if qos.qos_class is QoSClass.BATCH:
        return arrival + qos.ttlt_s  # type: ignore[operator]
    return None


# Deployment tier names -> scheduling tier (DESIGN.md: tier names are configurable).
DEFAULT_TIER_NAMES: dict[str, Tier] = {
    "free": Tier.FREE, "low": Tier.FREE, "best-effort": Tier.FREE,
    "paid": Tier.PAID, "premium": Tier.PAID, "important": Tier.PAID, "high": Tier.PAID,
}


def resolve_tier(name: str | Tier | None, names: dict[str, Tier] | None = None, default: Tier = Tier.PAID) -> Tier:
    """Map a tenant/application tier label to the tier relegation uses (QoServe 3.4: free first)."""
    if isinstance(name, Tier):
        return name
    if not name:
        return default
    table = DEFAULT_TIER_NAMES if names is None else names
    try:
        return table[name.strip().lower()]
    except KeyError:
        raise ValueError(f"unknown tier {name!r}; known: {', '.join(sorted(table))}") from None


def relegation_rank(tier: Tier) -> int:
    """Order in which tiers are relegated under overload: lower first (free before paid)."""
    return 0 if tier is Tier.FREE else 1
