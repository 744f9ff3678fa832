"""The submit path counts prompt tokens with the Rust tokenizer directly; the ids must be
those of the transformers call the worker's engine would see."""

from __future__ import annotations

import json

from app.services.model_info import encode_input, get_tokenizer
from gpu_runtime.data import specbench_path

SPEC_BENCH = specbench_path()


def _prompts() -> list[str]:
    prompts = ["", " ", "héllo\n\n  wörld \U0001f916", "<|im_start|>user hi<|im_end|>", "a" * 3000, "x\ty\r\nz"]
    with SPEC_BENCH.open() as f:
        prompts += [json.loads(line)["turns"][0] for _, line in zip(range(120), f)]
    return prompts


def test_fast_prompt_ids_equal_the_transformers_call(tiny_model_dir):
    tok = get_tokenizer(str(tiny_model_dir))
    for prompt in _prompts():
        assert encode_input(str(tiny_model_dir), prompt, None) == list(tok(prompt, add_special_tokens=True)["input_ids"])
