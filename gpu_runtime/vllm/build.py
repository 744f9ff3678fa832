"""Builds the worker's vLLM engine: coserve's scheduler loaded through ``scheduler_cls``."""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

from gpu_runtime.vllm.lora import lora_engine_args
from gpu_runtime.vllm.scheduler import SCHEDULER_CLS, SCHEDULER_CONFIG_ENV, VLLM_NATIVE

log = logging.getLogger(__name__)

# coserve's adaptive speculation policies: the most draft tokens a step may verify, unless set (``draft_tokens``).
# n-gram drafts are prompt lookups of a few tokens; suffix trees draft longer, and the policies trim what does not
# pay (on the CPU, AdaSpec with 32 suffix tokens: 2.37x none at batch 1, no loss at 8-32; BENCHMARKS stops 40, 45).
SPEC_MAX_TOKENS = 8
SUFFIX_MAX_TOKENS = 32
# a draft model runs a pass for every token it drafts, whatever share the policy keeps: fewer by default
DRAFT_MODEL_MAX_TOKENS = 4


def draft_tokens(spec_policy: str, requested: int | None = None, drafter: str = "ngram") -> int:
    """vLLM's ``num_speculative_tokens``: the draft tokens its drafter proposes per request and step, of which
    the speculation policy verifies a share. ``requested`` when given; else N for a static ``chain-N`` (it
    verifies all N), else ``SPEC_MAX_TOKENS`` (``SUFFIX_MAX_TOKENS`` for suffix decoding)."""
    from gpu_runtime.speculation.registry import chain_length

    if requested is not None:
        if requested < 1:
            raise ValueError(f"draft tokens per step must be >= 1 (got {requested})")
        return requested
    longest = {"suffix": SUFFIX_MAX_TOKENS, "draft_model": DRAFT_MODEL_MAX_TOKENS}.get(drafter, SPEC_MAX_TOKENS)
    return chain_length(spec_policy) or longest


DRAFTERS = ("ngram", "suffix")


def speculative_config(drafter: str, num_tokens: int, trimmed: bool = False) -> dict[str, Any]:
    """vLLM's ``speculative_config`` for one of its model-free drafters: ``ngram`` (prompt lookup of the last
    2-4 tokens) or ``suffix`` (suffix decoding: suffix trees of the prompt and of earlier outputs, drafts as long
    as the tree's path probability allows; needs the ``arctic-inference`` package). ``trimmed``: an adaptive policy
    keeps a share of each draft, so suffix decoding may draft up to twice its match's length (vLLM's default: once)
    within a tree twice the draft's depth."""
    if drafter == "ngram":
        return {"method": "ngram", "prompt_lookup_max": 4, "prompt_lookup_min": 2, "num_speculative_tokens": num_tokens}
    if drafter == "suffix":
        import importlib.util

        if importlib.util.find_spec("arctic_inference") is None:
            raise ValueError("the suffix drafter needs the arctic-inference package (scripts/setup.sh installs it)")
        # the tree depth bounds match + draft; vLLM's default cap on a draft is the depth
        room = {"suffix_decoding_max_spec_factor": 2.0} if trimmed else {}
        return {"method": "suffix", "num_speculative_tokens": num_tokens,
                "suffix_decoding_max_tree_depth": max((2 if trimmed else 1) * num_tokens, 24), **room}
    raise ValueError(f"unknown drafter {drafter!r}; choose from {', '.join(DRAFTERS)}")


def draft_model_config(checkpoint: str, num_tokens: int, drafter: str = "ngram") -> dict[str, Any]:
    """vLLM's ``speculative_config`` drafting with the model ``checkpoint`` (``COSERVE_DRAFT``: a directory, a GGUF
    or a bundled name, sharing the target's tokenizer), whose ``num_tokens`` draft tokens the policy trims as it does
    n-gram ones. ``drafter``: the model-free one asked for besides, which cannot run with it."""
    from gpu_runtime.vllm.checkpoint import vllm_checkpoint

    if drafter != "ngram":
        raise ValueError(f"COSERVE_DRAFT names a draft model ({checkpoint}) and COSERVE_VLLM_DRAFTER is {drafter!r}: "
                         "vLLM drafts with one of them; unset COSERVE_DRAFT, or COSERVE_VLLM_DRAFTER")
    return {"method": "draft_model", "model": str(vllm_checkpoint(checkpoint)), "num_speculative_tokens": num_tokens}


# EngineArgs fields the worker sets itself, and the setting that decides each instead
OWNED_ENGINE_ARGS = {
    "model": "COSERVE_MODEL names the model",
    "scheduler_cls": "coserve's scheduler is the one the worker serves with; COSERVE_SCHEDULER_POLICY picks its policy",
    "scheduling_policy": "COSERVE_SCHEDULER_POLICY picks it (vllm-fcfs or vllm-priority)",
    "served_model_name": "COSERVE_MODEL_NAME names the model in the API and in vLLM's metrics",
}


def checked_overrides(overrides: dict[str, Any], spec_policy: str = "none") -> dict[str, Any]:
    """``overrides`` (the operator's: ``cli_args.operator_engine_args``) if each names an ``EngineArgs`` field the
    worker leaves to the operator, for the worker's speculation policy; else a ValueError that names the key and
    what to do instead."""
    import dataclasses
    import difflib

    from vllm import EngineArgs

    names = {f.name for f in dataclasses.fields(EngineArgs)}
    for key in overrides:
        if key in OWNED_ENGINE_ARGS:
            raise ValueError(f"vLLM engine arguments (COSERVE_VLLM_ENGINE_ARGS, COSERVE_VLLM_ARGS, a worker's flags) "
                             f"may not set {key!r}: {OWNED_ENGINE_ARGS[key]}")
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else " (see vLLM's EngineArgs / `vllm serve --help`)"
            raise ValueError(f"COSERVE_VLLM_ENGINE_ARGS: {key!r} is not a vLLM engine argument{hint}")
    if isinstance(dp := overrides.get("data_parallel_size"), int) and dp > 1:
        # vLLM's in-process engine core waits for the other data-parallel ranks' engines, which nothing starts
        raise ValueError(f"data_parallel_size {dp}: a coserve worker runs one engine replica; run a worker per replica "
                         "instead (e.g. one `coserve worker` per GPU with CUDA_VISIBLE_DEVICES): they share the "
                         "queue, and jobs are routed across them")
    if overrides.get("speculative_config") and spec_policy == "none":
        raise ValueError("the vLLM engine arguments set a speculative_config but COSERVE_SPEC_POLICY is 'none': "
                         "set the policy that decides how many draft tokens are verified (e.g. chain-4, adaspec)")
    return overrides


def reasoning_outputs_config(checkpoint: str, reasoning_parser: str | None) -> dict[str, Any]:
    """What ``vllm serve --reasoning-parser`` sets, where the tokenizer has the ``<think>`` and ``</think>`` tokens
    that vLLM's parser looks for: the ``structured_outputs_config`` under which vLLM applies a request's grammar after
    the model's thinking, and the ``reasoning_config`` under which it keeps a request's ``thinking_token_budget``
    (forcing the end of thinking once the budget is spent). Else nothing, with a warning: the grammar then covers
    the whole answer, and vLLM refuses a thinking budget (a 400)."""
    if reasoning_parser is None:
        return {}
    from transformers import AutoTokenizer
    from vllm.config import ReasoningConfig

    from app.reasoning import CLOSE, OPEN, has_think_tokens

    if has_think_tokens(AutoTokenizer.from_pretrained(checkpoint)):
        return {"structured_outputs_config": {"reasoning_parser": reasoning_parser},
                "reasoning_config": ReasoningConfig(reasoning_parser=reasoning_parser)}
    log.warning("reasoning parser %s: the tokenizer of %s has no %s and %s tokens, so a structured output's grammar "
                "covers the model's thinking too and a thinking budget is refused", reasoning_parser, checkpoint,
                OPEN, CLOSE)
    return {}


def vllm_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def engine_args(model: str, device: str = "auto", scheduler_policy: str = "qoserve", spec_policy: str = "none",
                max_model_len: int | None = None, kv_cache_gib: int = 2, enforce_eager: bool | None = None,
                max_num_seqs: int | None = None, seed: int = 0, dtype: str | None = None,
                enable_prefix_caching: bool | None = None, spec_tokens: int | None = None,
                drafter: str = "ngram", draft_model: str | None = None, lora_modules: dict[str, str] | None = None,
                runtime_loras: int = 0, runtime_lora_rank: int = 16, reasoning_parser: str | None = None,
                served_model_name: str | None = None, overrides: dict[str, Any] | None = None) -> Any:
    """``EngineArgs`` for ``model`` with coserve's scheduler (policy chosen by ``scheduler_policy``); ``overrides``
    (any other engine argument: ``tensor_parallel_size``, ``gpu_memory_utilization``, ``quantization``, a
    ``speculative_config`` with another drafter, ...) win over what the other parameters set; ``runtime_loras``:
    LoRA slots for adapters loaded while it runs, up to ``runtime_lora_rank``; ``reasoning_parser``: a grammar
    applies after the thinking and a thinking budget is kept (``reasoning_outputs_config``); ``served_model_name``:
    the model's name in vLLM's metrics (their ``model_name`` label, as ``vllm serve --served-model-name`` sets it;
    else the checkpoint's path);
    ``draft_model``: a draft checkpoint that drafts instead of ``drafter`` (``draft_model_config``)."""
    from vllm import EngineArgs
    from vllm.platforms import current_platform

    from gpu_runtime.speculation.registry import chain_length
    from gpu_runtime.vllm.checkpoint import vllm_checkpoint

    cpu = current_platform.is_cpu() or device == "cpu"
    if cpu:
        # vLLM-CPU sizes its KV pool from this (GiB); without it start-up fails when other processes hold memory.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
        # vLLM-CPU compiles with Inductor's own backend, whose saved AOT artifact vLLM 0.32 cannot load (its loader
        # calls finalize_loading, which only the artifact of vLLM's GPU backend has): each start compiled again.
        # Without AOT, torch's Inductor caches serve the next start. On GPUs vLLM's AOT default stands: it loads.
        os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
    kwargs: dict[str, Any] = dict(
        model=str(vllm_checkpoint(model)), scheduler_cls=SCHEDULER_CLS, seed=seed,
        # compiled graphs load in 130-170 s on this CPU and 19 s eager; on GPUs CUDA graphs are worth it
        enforce_eager=cpu if enforce_eager is None else enforce_eager,
        scheduling_policy="priority" if scheduler_policy == "vllm-priority" else "fcfs",
    )
    if dtype is not None or cpu:
        kwargs["dtype"] = dtype or "bfloat16"
    if enable_prefix_caching is not None:
        kwargs["enable_prefix_caching"] = enable_prefix_caching
    if max_model_len is not None:
        kwargs["max_model_len"] = max_model_len
    if max_num_seqs is not None:
        kwargs["max_num_seqs"] = max_num_seqs
    if served_model_name:
        kwargs["served_model_name"] = served_model_name
    if spec_policy != "none" and draft_model:
        tokens = draft_tokens(spec_policy, spec_tokens, "draft_model")
        kwargs["speculative_config"] = draft_model_config(draft_model, tokens, drafter)
    elif spec_policy != "none":
        kwargs["speculative_config"] = speculative_config(drafter, draft_tokens(spec_policy, spec_tokens, drafter),
                                                          trimmed=not chain_length(spec_policy))
    kwargs.update(synchronous_for_drafts(scheduler_policy, spec_policy, overrides or {}))
    # LoRA adapters served beside the model
    kwargs.update(lora_engine_args(lora_modules or {}, runtime_loras, runtime_lora_rank))
    kwargs.update(reasoning_outputs_config(kwargs["model"], reasoning_parser))
    kwargs.update(checked_overrides(overrides or {}, spec_policy))
    if cpu and isinstance(stages := kwargs.get("pipeline_parallel_size"), int) and stages > 1:
        kwargs["enforce_eager"] = cpu_pipeline_eager(kwargs["enforce_eager"], explicit=enforce_eager is not None
                                                     or "enforce_eager" in (overrides or {}))
    return EngineArgs(**kwargs)


def synchronous_for_drafts(scheduler_policy: str, spec_policy: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """``async_scheduling`` off where coserve's speculation policy chooses the draft lengths: under async scheduling
    a step is scheduled before its drafts exist, so vLLM's own lengths would run, and vLLM turns it on by default for
    a GPU drafter (EAGLE, a draft model). The operator's explicit ``async_scheduling`` stands, with a warning."""
    if spec_policy == "none" or scheduler_policy in VLLM_NATIVE:
        return {}
    if overrides.get("async_scheduling"):
        log.warning("the vLLM engine arguments turn async_scheduling on: COSERVE_SPEC_POLICY=%s does not run, vLLM "
                    "verifies every draft token; leave async_scheduling out for the policy to choose", spec_policy)
        return {}
    return {"async_scheduling": False}


def cpu_pipeline_eager(eager: bool, explicit: bool) -> bool:
    """enforce_eager for pipeline parallelism on vLLM-CPU: its eager mode skips the warm-up run that allocates a later
    stage's buffer for the hidden states it receives, so that stage fails on its first step (vllm-cpu 0.32). The
    stages are compiled instead (a slower start); eager asked for explicitly is refused."""
    if eager and explicit:
        raise ValueError("enforce_eager with pipeline_parallel_size > 1 fails on vLLM's CPU backend (its eager mode "
                         "never allocates the later stages' input buffers): leave enforce_eager out")
    if eager:
        log.info("pipeline parallelism on the CPU: the model is compiled (vLLM-CPU's eager mode fails with it)")
    return False


def build_vllm_engine(model: str, device: str = "auto", scheduler_policy: str = "qoserve", spec_policy: str = "none",
                      cost_profile: str | None = "auto", kv_reserve: str = "predicted",
                      step_log: str | os.PathLike | None = None, scheduler_config: dict[str, Any] | None = None,
                      cost_calibration: bool = True, lora_modules: dict[str, str] | None = None,
                      **engine_kw: Any) -> Any:
    """A ``VLLMEngine`` (the worker's engine) running ``scheduler_policy`` inside vLLM's scheduler;
    ``scheduler_config`` overrides fields of the policy's config (unknown ones are errors); with
    ``cost_calibration`` the policy's cost model is scaled to the engine's measured steps."""
    from gpu_runtime.scheduler.registry import available

    known = sorted({*available(), *VLLM_NATIVE})
    if scheduler_policy not in known:
        raise ValueError(f"unknown scheduler {scheduler_policy!r}; choose from {', '.join(known)}")
    # The policy reads its settings in the engine core; the engine core runs in this process, so the
    # worker's engine thread reaches the scheduler (events, resumes, the decode-length history).
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["COSERVE_SCHEDULER_POLICY"] = scheduler_policy
    os.environ["COSERVE_COST_PROFILE"] = cost_profile or "none"
    os.environ["COSERVE_COST_CALIBRATION"] = "on" if cost_calibration else "off"
    os.environ["COSERVE_KV_RESERVE"] = kv_reserve
    os.environ["COSERVE_SPEC_POLICY"] = spec_policy
    if scheduler_config is not None:  # else the policy reads COSERVE_SCHEDULER_CONFIG as the environment has it
        os.environ[SCHEDULER_CONFIG_ENV] = json.dumps(scheduler_config)
    from vllm.v1.engine.llm_engine import LLMEngine

    from gpu_runtime.vllm.engine import VLLMEngine

    t0 = time.monotonic()
    args = engine_args(model, device, scheduler_policy, spec_policy, lora_modules=lora_modules, **engine_kw)
    llm = LLMEngine.from_engine_args(args)
    log.info("vLLM engine ready in %.1fs: model=%s scheduler=%s speculation=%s", time.monotonic() - t0, model,
             scheduler_policy, spec_policy)
    return VLLMEngine(llm, spec_policy, step_log=step_log, lora_modules=lora_modules,
                      runtime_lora=engine_kw.get("runtime_loras", 0) > 0 and args.enable_lora)
