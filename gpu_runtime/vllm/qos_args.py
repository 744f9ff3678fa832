"""Per-request QoS carried in vLLM's ``SamplingParams.extra_args``.

The coserve worker puts these keys there itself; a plain ``vllm serve --scheduler-cls``
user sends them in the request body as ``vllm_xargs`` (vLLM's OpenAI server copies that
object into ``extra_args``). Keys, all optional:

* ``qos_class``: ``interactive`` (default) or ``batch``;
* ``ttft_ms``, ``tbt_ms``: interactive targets (defaults: ``COSERVE_DEFAULT_TTFT_MS`` /
  ``COSERVE_DEFAULT_TBT_MS``, else 2000 / 200);
* ``deadline_s``: a batch job's time-to-last-token target, seconds after arrival
  (default ``COSERVE_DEFAULT_BATCH_WINDOW_S``, else 24 h);
* ``tier``: ``free`` / ``paid`` or an alias (``low``, ``premium``, ...; default paid);
* ``app_id``: key of the decode-length history (output-length prediction);
* ``tbt_anchor``: ``arrival`` (QoServe eq. 2) or ``first-token`` (stream pace);
* ``tokens_delivered``, ``first_token_s``: a rerun whose prompt ends with the output tokens an earlier attempt already
  streamed: how many, and when the first went out (seconds after arrival). The policy then judges it on the pace of
  what is left instead of on its first token (``QoSSpec.delivered``).

Anything else in ``extra_args`` is left alone (other plugins may read it).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpu_runtime.qos import QoSClass, QoSSpec, TbtAnchor, resolve_tier

KEYS = ("qos_class", "ttft_ms", "tbt_ms", "deadline_s", "tier", "app_id", "tbt_anchor", "tokens_delivered",
        "first_token_s")


class QoSArgsError(ValueError):
    """A QoS key in ``extra_args`` has a value coserve cannot use; the message says which and why."""


@dataclass(frozen=True)
class RequestQoS:
    qos: QoSSpec
    app_id: str | None


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


def _positive(args: Mapping[str, Any], key: str, default: float, scale: float) -> float:
    value = args.get(key)
    if value is None:
        return default * scale
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise QoSArgsError(f"extra_args.{key} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise QoSArgsError(f"extra_args.{key} must be a finite number > 0, got {value!r}")
    return float(value) * scale


def _resumed_from(args: Mapping[str, Any]) -> tuple[int, float | None]:
    """``tokens_delivered`` and ``first_token_s``: where a rerun's answer stands (0, None: a fresh request)."""
    n = args.get("tokens_delivered", 0)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise QoSArgsError(f"extra_args.tokens_delivered must be an integer >= 0, got {n!r}")
    first = args.get("first_token_s")
    if first is not None:
        if isinstance(first, bool) or not isinstance(first, (int, float)) or not math.isfinite(first) or first < 0:
            raise QoSArgsError(f"extra_args.first_token_s must be a finite number >= 0, got {first!r}")
        first = float(first)
    return n, first


def parse_qos(extra_args: Mapping[str, Any] | None) -> RequestQoS:
    """The request's QoS from ``extra_args`` (defaults where a key is absent); ``QoSArgsError`` if invalid."""
    args = extra_args or {}
    if not isinstance(args, Mapping):
        raise QoSArgsError("extra_args must be an object")
    kind = args.get("qos_class", "interactive")
    try:
        qos_class = QoSClass(kind)
    except ValueError:
        raise QoSArgsError(f"extra_args.qos_class must be 'interactive' or 'batch', got {kind!r}") from None
    tier_name = args.get("tier")
    if tier_name is not None and not isinstance(tier_name, str):
        raise QoSArgsError("extra_args.tier must be a string")
    try:
        tier = resolve_tier(tier_name)
    except ValueError as exc:
        raise QoSArgsError(f"extra_args.tier: {exc}") from None
    app_id = args.get("app_id")
    if app_id is not None and not isinstance(app_id, str):
        raise QoSArgsError("extra_args.app_id must be a string")
    delivered, first = _resumed_from(args)
    if qos_class is QoSClass.BATCH:
        for key in ("ttft_ms", "tbt_ms", "tbt_anchor"):
            if args.get(key) is not None:
                raise QoSArgsError(f"extra_args.{key} applies to interactive requests; a batch job takes deadline_s")
        ttlt = _positive(args, "deadline_s", _env_float("COSERVE_DEFAULT_BATCH_WINDOW_S", 24 * 3600.0), 1.0)
        return RequestQoS(QoSSpec(QoSClass.BATCH, tier, ttlt_s=ttlt, delivered=delivered, first_token_s=first), app_id)
    if args.get("deadline_s") is not None:
        raise QoSArgsError("extra_args.deadline_s applies to batch requests (set qos_class: 'batch')")
    anchor = args.get("tbt_anchor", os.environ.get("COSERVE_TBT_ANCHOR", TbtAnchor.ARRIVAL.value))
    try:
        tbt_anchor = TbtAnchor(anchor)
    except ValueError:
        raise QoSArgsError(f"extra_args.tbt_anchor must be 'arrival' or 'first-token', got {anchor!r}") from None
    ttft = _positive(args, "ttft_ms", _env_float("COSERVE_DEFAULT_TTFT_MS", 2000.0), 1e-3)
    tbt = _positive(args, "tbt_ms", _env_float("COSERVE_DEFAULT_TBT_MS", 200.0), 1e-3)
    return RequestQoS(QoSSpec(QoSClass.INTERACTIVE, tier, ttft_s=ttft, tbt_s=tbt, tbt_anchor=tbt_anchor,
                              delivered=delivered, first_token_s=first), app_id)


def to_extra_args(qos: QoSSpec, app_id: str | None = None) -> dict[str, Any]:
    """The ``extra_args`` that ``parse_qos`` reads back as ``qos`` (what the worker sends)."""
    args: dict[str, Any] = {"qos_class": qos.qos_class.value, "tier": qos.tier.value}
    if qos.qos_class is QoSClass.BATCH:
        args["deadline_s"] = qos.ttlt_s
    else:
        args.update(ttft_ms=qos.ttft_s * 1e3, tbt_ms=qos.tbt_s * 1e3,  # type: ignore[operator]
                    tbt_anchor=qos.tbt_anchor.value)
    if app_id is not None:
        args["app_id"] = app_id
    if qos.delivered:
        args["tokens_delivered"] = qos.delivered
    if qos.first_token_s is not None:
        args["first_token_s"] = qos.first_token_s
    return args
