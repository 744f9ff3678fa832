"""The real default model (SmolLM2-135M-Instruct GGUF): engine greedy == transformers generate."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engine.conftest import hf_greedy, make_request, run_engine

pytestmark = pytest.mark.model


def test_eos_is_the_chat_end_token(default_executor):
    tok = default_executor.tokenizer
    assert default_executor.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>") == 2


def test_the_engine_tokenizes_with_the_apis_converted_copy_of_the_gguf_tokenizer(default_executor):
    """The engine's tokenizer is the GGUF's as the API converted it once and cached it on disk (``load_tokenizer``;
    the fixture made sure the copy is there, as a worker finds it once the API has counted), an instance of its own:
    converting the GGUF's again took 12-35 s of every engine start on the CPU."""
    from app.services.model_info import get_tokenizer, resolve_model, tokenizer_cache_dir

    tok, api = default_executor.tokenizer, get_tokenizer("smollm2-135m")
    cached = tokenizer_cache_dir(resolve_model("smollm2-135m"))
    assert Path(tok.name_or_path) == cached, tok.name_or_path  # not the GGUF's directory
    assert tok is not api and tok.get_vocab() == api.get_vocab() and tok.chat_template == api.chat_template


def test_chat_prompt_and_batched_greedy_match_generate(default_executor):
    ex = default_executor
    torch.set_num_threads(2)  # the real model's matmuls are big enough to use both cores
    prompts = [ex.chat_prompt_ids([{"role": "user", "content": "What is the capital of France?"}]),
               ex.chat_prompt_ids([{"role": "user", "content": "Write a haiku about the sea."}])]
    text = ex.tokenizer.decode(prompts[0])
    assert "<|im_start|>assistant" in text and text.rstrip().endswith("assistant")
    reqs = [make_request(p, max_tokens=12) for p in prompts]
    out = run_engine(ex, reqs, chunk=32)
    for r, p in zip(reqs, prompts):
        assert out[r.request_id] == hf_greedy(ex.hf_model, p, 12)
    assert ex.capacity().free_blocks == ex.capacity().total_blocks


def test_eos_stops_a_request(default_executor):
    ex = default_executor
    prompt = ex.chat_prompt_ids([{"role": "user", "content": "Say only the word yes."}])
    req = make_request(prompt, max_tokens=40, ignore_eos=False)
    run_engine(ex, [req], chunk=64)
    assert req.output_token_ids[-1] == 2 and req.status.value == "finished_stopped"
