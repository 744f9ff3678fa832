"""LoRA adapters served beside the model (vLLM's multi-LoRA): what vLLM's engine needs to load them.

Each adapter is a PEFT directory (``adapter_config.json`` and its weights), named as a request names it; vLLM
loads an adapter when a request first asks for it and batches requests of different adapters together.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# vLLM's allowed max_lora_rank values (vllm.config.lora.MaxLoRARanks)
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def adapter_rank(name: str, path: str | Path) -> int:
    """The rank ``r`` of the adapter at ``path``; a ValueError naming the adapter where it is not one."""
    config = Path(path) / "adapter_config.json"
    try:
        rank = json.loads(config.read_text())["r"]
    except FileNotFoundError:
        raise ValueError(f"LoRA adapter {name!r}: no adapter_config.json in {path} (a PEFT adapter directory)") \
            from None
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"LoRA adapter {name!r}: {config} has no rank 'r' ({exc})") from None
    if not isinstance(rank, int) or not 1 <= rank <= LORA_RANKS[-1]:
        raise ValueError(f"LoRA adapter {name!r}: rank {rank!r} is not one vLLM serves (1-{LORA_RANKS[-1]})")
    return rank


def lora_engine_args(modules: dict[str, str]) -> dict[str, Any]:
    """Engine arguments that serve ``modules`` (name -> directory): LoRA on, slots for every adapter in one batch
    (so the policy's batches never wait on vLLM's max_loras), the smallest rank vLLM allows that holds them."""
    if not modules:
        return {}
    rank = max(adapter_rank(name, path) for name, path in modules.items())
    return {"enable_lora": True, "max_lora_rank": next(r for r in LORA_RANKS if r >= rank),
            "max_loras": len(modules), "max_cpu_loras": len(modules)}


def lora_requests(modules: dict[str, str]) -> dict[str, Any]:
    """Adapter name -> vLLM's ``LoRARequest`` (ids 1..n, stable for the engine's life)."""
    if not modules:
        return {}
    from vllm.lora.request import LoRARequest

    return {name: LoRARequest(name, i, str(Path(path).resolve())) for i, (name, path) in enumerate(modules.items(), 1)}
