"""Fixtures: tiny random Llama/Qwen2 models, an engine driver, and the real default model (session).

``COSERVE_TEST_DEVICE=cuda`` puts the tiny models (and with them the executors, drafts and reference passes) on
the GPU: the same tests then check the engine there (``ops/gpu_check.sh``)."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from gpu_runtime.engine import Engine
from gpu_runtime.executor.torch import TorchExecutor
from gpu_runtime.qos import QoSClass, QoSSpec
from gpu_runtime.request import Request
from gpu_runtime.sampling import SamplingParams
from tests.engine.fcfs import FCFSTestScheduler

_ids = itertools.count()
DEVICE = os.environ.get("COSERVE_TEST_DEVICE", "cpu")  # where the tiny models live


def tiny_llama(seed: int = 0, vocab: int = 97, layers: int = 2, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
               rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    cfg.update(overrides)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    with torch.no_grad():  # sharper logits than the default init: fewer argmax near-ties
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    return model.to(DEVICE)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Tiny matmuls on a shared 2-core box: OpenMP thread spinning costs more than it gains."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def tiny_model():
    return tiny_llama()


def make_request(prompt: list[int], **sampling) -> Request:
    sampling.setdefault("ignore_eos", True)
    return Request(f"r{next(_ids)}", list(prompt), SamplingParams(**sampling),
                   QoSSpec(QoSClass.BATCH, ttlt_s=1e6), arrival_time=0.0)


def run_engine(executor, requests, scheduler=None, speculation=None, chunk: int = 16) -> dict[str, list[int]]:
    engine = Engine(executor, scheduler or FCFSTestScheduler(executor, chunk=chunk), speculation)
    for r in requests:
        engine.add_request(r)
    engine.run_until_idle(max_steps=10_000)
    return {r.request_id: list(r.output_token_ids) for r in requests}


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None  # like ignore_eos: a generation_config argument does not override it
    try:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    finally:
        model.generation_config.eos_token_id = saved
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="session")
def default_executor():
    from app.services.model_info import load_tokenizer

    load_tokenizer("smollm2-135m")  # the API's converted copy on disk, as a worker finds it once the API has counted
    return TorchExecutor.from_pretrained("smollm2-135m", device="cpu", kv_blocks=256)
