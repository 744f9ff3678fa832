"""ops/distill_draft.py on tiny random Llama models: distillation lowers the held-out KL, and a
saved draft loads as a DraftModelRunner whose speculation leaves the greedy output unchanged."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from gpu_runtime.engine import Engine
from gpu_runtime.executor.drafters.model_runner import DraftModelRunner
from gpu_runtime.executor.torch import TorchExecutor
from gpu_runtime.speculation.registry import create_policy
from tests.engine.conftest import make_request, run_engine, tiny_llama
from tests.engine.fcfs import FCFSTestScheduler

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "ops"))
import distill_draft  # noqa: E402


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 97, (int(torch.randint(6, 20, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0, layers=4).requires_grad_(False)


def test_teacher_samples_hold_the_targets_top_k_on_the_loss_positions(target):
    prompts = _prompts(3, seed=5)
    samples = distill_draft.teacher_samples(target, prompts, gen_tokens=6, topk=5, prompt_loss_tokens=4,
                                            batch_size=3, eos_id=None)
    for p, s in zip(prompts, samples):
        assert s.ids[:len(p)].tolist() == p and len(s.ids) == len(p) + 6
        with torch.no_grad():  # one unpadded forward pass: the same as generate's left-padded batch
            logp = target(s.ids[None].to(target.device)).logits[0, s.start:-1].log_softmax(-1).cpu()
        assert s.start == len(p) - 4
        assert torch.equal(logp.topk(5, -1).indices, s.topk_idx)
        assert torch.allclose(logp.topk(5, -1).values, s.topk_logp, atol=1e-4)
        assert s.ids[len(p):].tolist() == logp.argmax(-1)[3:].tolist()  # the greedy continuation


def test_distillation_lowers_held_out_kl(target):
    train = distill_draft.teacher_samples(target, _prompts(24, seed=1), gen_tokens=12, topk=16,
                                          prompt_loss_tokens=8, eos_id=None)
    val = distill_draft.teacher_samples(target, _prompts(6, seed=2), gen_tokens=12, topk=16,
                                        prompt_loss_tokens=8, eos_id=None)
    draft = distill_draft.build_draft(target, distill_draft.init_layers("spread", 4, 2))
    assert draft.config.num_hidden_layers == 2
    frozen = draft.model.embed_tokens.weight.clone()
    history = distill_draft.train(draft, train, val, steps=40, lr=3e-3, batch_tokens=256, warmup=4,
                                  eval_every=20, seed=0)
    assert [h["step"] for h in history] == [0, 20, 40]
    assert history[-1]["kl"] < 0.7 * history[0]["kl"]
    assert history[-1]["top1"] >= history[0]["top1"]
    assert torch.equal(draft.model.embed_tokens.weight, frozen)  # embeddings / lm_head stay frozen


def test_saved_draft_loads_and_speculation_keeps_the_greedy_output(target, tmp_path):
    draft = distill_draft.build_draft(target, distill_draft.init_layers("first", 4, 2))
    out = distill_draft.save_draft(draft, tmp_path / "draft", meta={"steps": 0})
    assert (out / "config.json").exists() and (out / "distill.json").exists()
    runner = DraftModelRunner.from_pretrained(str(out), device=str(target.device), dtype=target.dtype, block_size=4)
    assert runner.hf_model.config.num_hidden_layers == 2
    assert torch.equal(runner.hf_model.lm_head.weight, target.lm_head.weight)  # tied, copied from the target
    prompts = _prompts(3, seed=3)
    plain = TorchExecutor.from_model(target, kv_blocks=64, block_size=4)
    reference = run_engine(plain, [make_request(p, max_tokens=20) for p in prompts])
    ex = TorchExecutor.from_model(target, kv_blocks=64, block_size=4, drafter=runner)
    reqs = [make_request(p, max_tokens=20) for p in prompts]
    engine = Engine(ex, FCFSTestScheduler(ex, chunk=16), create_policy("chain-4"))
    for r in reqs:
        engine.add_request(r)
    drafted = 0
    while engine.has_work:
        engine.step()
        drafted += engine.last_stats.num_tree_tokens
    assert [list(r.output_token_ids) for r in reqs] == list(reference.values())
    assert drafted > 0  # the draft did propose (and the target verified) chains
