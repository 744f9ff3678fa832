"""Engine greedy output equals transformers ``generate`` token for token."""

from __future__ import annotations

import random

import pytest

from gpu_runtime.executor.torch import TorchExecutor
from tests.engine.conftest import DEVICE, hf_greedy, make_request, run_engine, tiny_llama


def test_single_request_matches_generate(tiny_model):
    ex = TorchExecutor.from_model(tiny_model, kv_blocks=64, block_size=4)
    prompt = [5, 17, 33, 8, 91, 40, 12]
    req = make_request(prompt, max_tokens=20)
    out = run_engine(ex, [req])
    assert out[req.request_id] == hf_greedy(tiny_model, prompt, 20)


@pytest.mark.parametrize("layout", ["padded", "per-request", "auto"])
def test_batched_requests_of_different_lengths_match_generate(tiny_model, layout):
    rng = random.Random(1)
    ex = TorchExecutor.from_model(tiny_model, kv_blocks=128, block_size=4, attention_layout=layout)
    prompts = [[rng.randrange(3, 97) for _ in range(n)] for n in (3, 11, 26, 40, 7)]
    lengths = [9, 17, 5, 12, 21]
    reqs = [make_request(p, max_tokens=n) for p, n in zip(prompts, lengths)]
    out = run_engine(ex, reqs, chunk=10)  # chunked prefill interleaved with decodes
    for r, p, n in zip(reqs, prompts, lengths):
        assert out[r.request_id] == hf_greedy(tiny_model, p, n)
    assert ex.capacity().free_blocks == 128


def test_qwen2_bias_and_untied_head_match_generate():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    import torch

    torch.manual_seed(3)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=89, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=256,
                                         tie_word_embeddings=False)).eval().to(DEVICE)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.mul_(4.0) if p.dim() == 2 else p.add_(0.1 * torch.randn_like(p)) if name.endswith("bias") else None
    ex = TorchExecutor.from_model(model, kv_blocks=32, block_size=8)
    prompt = [4, 9, 60, 22, 3, 71]
    req = make_request(prompt, max_tokens=15)
    assert run_engine(ex, [req])[req.request_id] == hf_greedy(model, prompt, 15)


def test_llama3_rope_scaling_matches_generate():
    model = tiny_llama(seed=5, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    ex = TorchExecutor.from_model(model, kv_blocks=64, block_size=16)
    prompt = list(range(3, 90))  # longer than the original context: scaled frequencies matter
    req = make_request(prompt, max_tokens=10)
    assert run_engine(ex, [req], chunk=32)[req.request_id] == hf_greedy(model, prompt, 10)


def test_real_sarathi_scheduler_drives_the_executor(tiny_model):
    from gpu_runtime.scheduler.registry import create_scheduler

    rng = random.Random(7)
    ex = TorchExecutor.from_model(tiny_model, kv_blocks=128, block_size=8)
    prompts = [[rng.randrange(3, 97) for _ in range(n)] for n in (50, 4, 23)]
    reqs = [make_request(p, max_tokens=m) for p, m in zip(prompts, (6, 14, 9))]
    out = run_engine(ex, reqs, scheduler=create_scheduler("sarathi-fcfs", executor=ex, chunk_size=16))
    for r, p in zip(reqs, prompts):
        assert out[r.request_id] == hf_greedy(tiny_model, p, r.sampling.max_tokens)
    assert ex.capacity().free_blocks == 128


def test_from_pretrained_checkpoint_directory_with_draft(tmp_path, tiny_model):
    target_dir, draft_dir = tmp_path / "target", tmp_path / "draft"
    tiny_model.save_pretrained(target_dir)  # config + safetensors
    tiny_llama(seed=4).save_pretrained(draft_dir)
    ex = TorchExecutor.from_pretrained(str(target_dir), device=DEVICE, kv_blocks=32, block_size=8,
                                      draft=str(draft_dir))
    assert ex.has_draft and ex.draft_on_device and ex.capacity().total_blocks == 32
    prompt = [9, 8, 7, 6, 5, 4]
    req = make_request(prompt, max_tokens=10)
    from tests.engine.spec_helpers import VerifyAll

    assert run_engine(ex, [req], speculation=VerifyAll(2, 2))[req.request_id] == hf_greedy(tiny_model, prompt, 10)


def test_auto_layout_pads_uniform_decodes_and_splits_mixed_batches():
    import torch

    from gpu_runtime.executor.torch.batch import Segment, choose_layout

    def seg(n: int, keys: int) -> Segment:
        return Segment([5] * n, torch.arange(n), torch.arange(n), torch.arange(keys))

    decodes = [seg(1, k) for k in (300, 500, 700, 900)]
    assert choose_layout(decodes) == "padded"  # one SDPA call: waste = longest / mean context < 2
    assert choose_layout([seg(256, 256), *decodes]) == "per-request"  # decodes would pad to 256 queries
    assert choose_layout([seg(1, 1000), seg(1, 10), seg(1, 10)]) == "per-request"  # one long context, many short
    # CPU: work, not calls, is the cost; padded only without waste
    assert choose_layout(decodes, max_waste=1.0) == "per-request"
    assert choose_layout([seg(1, 500)] * 4, max_waste=1.0) == "padded"
