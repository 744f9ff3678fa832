"""LoRA adapters served beside the model (vLLM's multi-LoRA): what vLLM's engine needs to load them.

Each adapter is a PEFT directory (``adapter_config.json`` and its weights), named as a request names it; vLLM
loads an adapter when a request first asks for it and batches requests of different adapters together.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

# vLLM's allowed max_lora_rank values (vllm.config.lora.MaxLoRARanks)
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def is_lora(config: Any) -> bool:
    """Whether an ``adapter_config.json`` (read) is a LoRA adapter's, the only PEFT kind vLLM loads: its
    ``peft_type`` is LORA, or it gives none."""
    return isinstance(config, dict) and str(config.get("peft_type", "LORA")).upper() == "LORA"


def adapter_rank(name: str, path: str | Path) -> int:
    """The rank ``r`` of the adapter at ``path``; a ValueError naming the adapter where it is not a LoRA one."""
    config = Path(path) / "adapter_config.json"
    try:
        read = json.loads(config.read_text())
    except FileNotFoundError:
        raise ValueError(f"LoRA adapter {name!r}: no adapter_config.json in {path} (a PEFT adapter directory)") \
            from None
    except ValueError as exc:
        raise ValueError(f"LoRA adapter {name!r}: {config} cannot be read ({exc})") from None
    if isinstance(read, dict) and not is_lora(read):  # vLLM would take its weights for LoRA's and fail each request
        raise ValueError(f"LoRA adapter {name!r}: {config} has peft_type {read['peft_type']!r}; vLLM serves LoRA "
                         "adapters only (peft_type 'LORA')")
    try:
        rank = read["r"]
    except (KeyError, TypeError) as exc:
        raise ValueError(f"LoRA adapter {name!r}: {config} has no rank 'r' ({exc})") from None
    if not isinstance(rank, int) or not 1 <= rank <= LORA_RANKS[-1]:
        raise ValueError(f"LoRA adapter {name!r}: rank {rank!r} is not one vLLM serves (1-{LORA_RANKS[-1]})")
    return rank


def lora_rank_for(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM allows that holds adapters of ``rank``."""
    return next(r for r in LORA_RANKS if r >= rank)


def runtime_rank_limit(runtime_rank: int, overrides: dict[str, Any]) -> int:
    """The largest rank of an adapter loaded at runtime that the engine serves: the ``max_lora_rank`` of the
    operator's engine arguments (``overrides``, ``cli_args.operator_engine_args``) where they set it, as they win
    in ``build.engine_args``, else ``runtime_rank`` (COSERVE_MAX_LORA_RANK) as ``lora_engine_args`` rounds it up.
    The API holds loads to it, so no adapter it accepts fails in the engine for its rank."""
    rank = overrides.get("max_lora_rank")
    return rank if isinstance(rank, int) else lora_rank_for(runtime_rank)


def lora_engine_args(modules: dict[str, str], runtime_slots: int = 0, runtime_rank: int = 16) -> dict[str, Any]:
    """Engine arguments that serve ``modules`` (name -> directory): LoRA on, slots for every adapter in one batch
    (so the policy's batches never wait on vLLM's max_loras), the smallest rank vLLM allows that holds them.

    ``runtime_slots`` more for adapters loaded while the engine runs, up to ``runtime_rank``: those beyond the
    slots wait for one (vLLM's scheduler admits a batch's adapters up to max_loras) and are kept on the CPU."""
    if not modules and not runtime_slots:
        return {}
    ranks = [adapter_rank(name, path) for name, path in modules.items()] + ([runtime_rank] if runtime_slots else [])
    slots = len(modules) + runtime_slots
    return {"enable_lora": True, "max_lora_rank": lora_rank_for(max(ranks)),
            "max_loras": slots, "max_cpu_loras": slots}


NO_LORA: dict[str, Any] = {"runtime": False, "max_lora_rank": None, "max_loras": None}  # an engine without LoRA


def lora_limits(lora_config: Any, runtime: bool) -> dict[str, Any]:
    """What an engine serves of the adapters loaded at runtime, as its worker's heartbeat publishes it (``lora``) for
    the API to hold loads to: whether it loads them (``runtime``: COSERVE_RUNTIME_LORA, and LoRA on in its engine),
    the largest rank and the adapters in one batch of its ``lora_config`` (vLLM's ``LoRAConfig``; None: LoRA off,
    vLLM's ``enable_lora``), which the worker's own engine arguments may set apart from the API's."""
    if lora_config is None:
        return dict(NO_LORA)
    return {"runtime": runtime, "max_lora_rank": lora_config.max_lora_rank, "max_loras": lora_config.max_loras}


def lora_requests(modules: dict[str, str]) -> dict[str, Any]:
    """Adapter name -> vLLM's ``LoRARequest`` (ids 1..n, stable for the engine's life)."""
    if not modules:
        return {}
    from vllm.lora.request import LoRARequest

    return {name: LoRARequest(name, i, str(Path(path).resolve())) for i, (name, path) in enumerate(modules.items(), 1)}


class LoraRegistry:
    """The adapters an engine serves: those it started with, and those loaded at runtime as requests name them.

    A runtime adapter gets the next id the first time a request names a version of it (its path and when it was
    loaded): an adapter replaced, from another path or from the same one with new weights there, is a new adapter
    to vLLM, which loads it from disk and does not serve the old weights.

    An adapter unloaded (or replaced) leaves the engine once no request uses it (``retired``, which the engine hands
    to vLLM's ``remove_lora``; vLLM's own unload leaves it in its LoRA cache, where it held a slot until evicted as
    the least recently used): removing it at once could pull it from under a request that began before the unload
    (vLLM would load it from disk again mid-run, from a directory the admin may have deleted). Once vLLM's cache
    has let an adapter go (evicted) and no request uses it, ``prune`` drops its entry: ``loaded`` stays as small as
    that cache, not one entry for every version ever served."""

    def __init__(self, modules: dict[str, str], runtime: bool) -> None:
        self.fixed = lora_requests(modules)
        self.runtime = runtime
        self.loaded: dict[tuple[str, str, float], Any] = {}  # (name, path, version) -> LoRARequest
        self.current: dict[str, tuple[str, float]] = {}  # runtime adapter -> (path, version) loaded now (``retired``)
        self.unloaded: dict[str, float] = {}  # runtime adapter unloaded -> the last version heard of (``retired``)
        self._next_id = len(self.fixed) + 1

    def refusal(self, name: str | None, path: str | None) -> str | None:
        """Why a request naming adapter ``name`` (at ``path`` when loaded at runtime) cannot run here."""
        if name is None or name in self.fixed or (path is not None and self.runtime):
            return None
        if path is not None:
            return f"LoRA adapter {name!r} was loaded at runtime, but this engine serves none (COSERVE_RUNTIME_LORA)"
        return f"LoRA adapter {name!r} is not served here (adapters: {', '.join(self.fixed) or 'none'})"

    def source(self, name: str | None, path: str | None, version: float = 0.0) -> tuple[str | None, float]:
        """Where a request for runtime adapter ``name`` (``path`` and ``version`` as its job read them) loads it from:
        the version loaded now where a newer one replaced its own since it was read (its own may be removed from
        vLLM already, ``retired``, and its directory gone), else its own. A version newer than the last one
        ``retired`` heard of is kept: that one is stale, not the request."""
        now = self.current.get(name) if name is not None and path is not None else None
        return now if now is not None and now[1] > version else (path, version)

    def unloaded_refusal(self, name: str | None, path: str | None, version: float = 0.0) -> str | None:
        """Why a request for runtime adapter ``name`` (``path`` and ``version`` as its job read them) may not run: the
        adapter was unloaded since that version, as ``retired`` heard. vLLM's server answers a request naming an
        adapter its /v1/unload_lora_adapter removed with a 404; run anyway, it was loaded again from disk. A version
        newer than the last one heard of was loaded again since: that one runs."""
        if name is None or path is None or name not in self.unloaded or version > self.unloaded[name]:
            return None
        return (f"LoRA adapter {name!r} was unloaded before the engine took this job; load it again "
                "(POST /v1/load_lora_adapter) and resubmit")

    def request(self, name: str | None, path: str | None, version: float = 0.0) -> tuple[Any, bool]:
        """vLLM's ``LoRARequest`` for the adapter, and whether it is new to the engine (load it first)."""
        if name is None:
            return None, False
        if name in self.fixed:
            return self.fixed[name], False
        key = (name, path or "", version)  # the path as SQL holds it, resolved when it was loaded
        if key in self.loaded:
            return self.loaded[key], False
        from vllm.lora.request import LoRARequest

        self.loaded[key] = LoRARequest(name, self._next_id, key[1])
        self._next_id += 1
        return self.loaded[key], True

    def prune(self, cached: set[int], live: Iterable[tuple[str | None, str | None, float]]) -> None:
        """Drops the runtime adapters that vLLM's LoRA cache no longer holds (``cached``: its adapter ids, as
        ``LLMEngine.list_loras`` lists them) and that none of the ``live`` requests (name, path, version) uses. A
        request that names a dropped one again gets a new id, and vLLM loads it from disk, as it would have for the
        old id, which its cache had evicted."""
        used = _in_use(live)
        self.loaded = {key: lora for key, lora in self.loaded.items() if lora.lora_int_id in cached or key in used}

    def retired(self, current: dict[str, tuple[str, float]],
                live: Iterable[tuple[str | None, str | None, float]]) -> list[Any]:
        """The runtime adapters unloaded or replaced since the engine loaded them (``current``: each runtime adapter
        loaded now, name -> (path, version) as SQL holds them) that none of the ``live`` requests uses, dropped here:
        the engine removes them from vLLM (``remove_lora``). Those no longer loaded at all are ``unloaded``."""
        heard = [*self.current.items(), *((key[0], key[1:]) for key in self.loaded)]
        for name, (_path, version) in heard:
            if name not in current:
                self.unloaded[name] = max(version, self.unloaded.get(name, version))
        for name in current:  # loaded again
            self.unloaded.pop(name, None)
        self.current = dict(current)
        used = _in_use(live)
        gone = [key for key in self.loaded if current.get(key[0]) != (key[1], key[2]) and key not in used]
        return [self.loaded.pop(key) for key in gone]

    def forget(self, name: str, path: str | None, version: float = 0.0) -> None:
        """Drops an adapter whose load failed, so a later request tries again."""
        self.loaded.pop((name, path or "", version), None)


def _in_use(live: Iterable[tuple[str | None, str | None, float]]) -> set[tuple[str, str, float]]:
    """The ``loaded`` keys of the adapters the ``live`` requests (name, path, version) use."""
    return {(name, path or "", version) for name, path, version in live if name is not None}
