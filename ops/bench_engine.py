"""Engine vs transformers ``generate``, measured in the same run (CPU by default).

(a) decode tokens/s at batch 1 on the default model (goal: not slower than generate);
(b) 16 SpecBench prompts (chat template) with their own output lengths: total wall
    time of the engine (continuous batching, all at once) vs ``generate`` on the
    left-padded batch (goal: >= 2x faster).
``--gpu``: Llama-3.1-8B- and 3.2-1B-shaped random bf16 models, decode step time at
batch 1/32 vs the memory-bandwidth limit (unverified unless run on a GPU machine).

    python ops/bench_engine.py [--prompts 16] [--decode-tokens 64] [--threads 2]
    python ops/bench_engine.py --gpu [--bandwidth-gbs 3350]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gpu_runtime.engine import Engine  # noqa: E402
from gpu_runtime.executor.torch import TorchExecutor  # noqa: E402
from gpu_runtime.qos import QoSClass, QoSSpec  # noqa: E402
from gpu_runtime.request import Request  # noqa: E402
from gpu_runtime.sampling import SamplingParams  # noqa: E402
from gpu_runtime.scheduler.registry import create_scheduler  # noqa: E402

log = logging.getLogger("bench_engine")


def shared_dir() -> Path:
    return Path(os.environ.get("COSERVE_SHARED_DIR", REPO.parent / "shared"))


def specbench_prompts(n: int, seed: int) -> list[str]:
    rows = [json.loads(line) for line in (shared_dir() / "datasets" / "spec_bench_questions.jsonl").open()]
    rng = random.Random(seed)
    return [r["turns"][0] for r in rng.sample(rows, n)]


def make_engine(ex: TorchExecutor, chunk: int) -> Engine:
    return Engine(ex, create_scheduler("sarathi-fcfs", executor=ex, chunk_size=chunk))


def request(i: int, prompt: list[int], max_tokens: int) -> Request:
    return Request(f"b{i}-{time.monotonic_ns()}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   QoSSpec(QoSClass.BATCH, ttlt_s=1e6), arrival_time=time.monotonic())


def no_eos(n: int) -> dict:
    """generate() kwargs for exactly n greedy tokens (the model's generation_config eos is cleared in main)."""
    return {"max_new_tokens": n, "do_sample": False, "pad_token_id": 0}


# ---- (a) batch-1 decode ----
def bench_decode(ex: TorchExecutor, prompt: list[int], n: int) -> tuple[float, float, bool]:
    hf = ex.hf_model
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        hf.generate(ids, attention_mask=torch.ones_like(ids), **no_eos(4))  # warm-up
        t0 = time.perf_counter()
        hf.generate(ids, attention_mask=torch.ones_like(ids), **no_eos(1))
        t1 = time.perf_counter()
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), **no_eos(n))
        t2 = time.perf_counter()
    hf_tps = (n - 1) / max(1e-9, (t2 - t1) - (t1 - t0))  # generate's decode rate: total minus prefill
    engine = make_engine(ex, chunk=512)
    warm = request(-1, prompt, 4)
    engine.add_request(warm)
    engine.run_until_idle()
    req = request(0, prompt, n)
    engine.add_request(req)
    engine.run_until_idle()
    eng_tps = (n - 1) / (req.token_times[-1] - req.token_times[0])
    same = req.output_token_ids == ref[0, len(prompt):].tolist()
    return eng_tps, hf_tps, same


# ---- (b) 16 prompts, own lengths ----
def bench_batch(ex: TorchExecutor, prompts: list[list[int]], lengths: list[int], chunk: int,
                layouts: list[str]) -> dict:
    tok = ex.tokenizer
    hf = ex.hf_model
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=mask, **no_eos(max(lengths)))
    hf_s = time.perf_counter() - t0
    hf_out = [out[i, width:width + n].tolist() for i, n in enumerate(lengths)]
    print(f"(b) generate on the padded batch: {hf_s:.1f}s", flush=True)

    result = {"hf_s": hf_s, "tokens": sum(lengths)}
    for layout in layouts:
        ex.attention_layout = layout
        engine = make_engine(ex, chunk=chunk)
        reqs = [request(i, p, n) for i, (p, n) in enumerate(zip(prompts, lengths))]
        t0 = time.perf_counter()
        for r in reqs:
            engine.add_request(r)
        engine.run_until_idle()
        eng_s = time.perf_counter() - t0
        # padded-batch numerics differ slightly from unpadded: count exact and first-16-token matches
        exact = sum(r.output_token_ids == h for r, h in zip(reqs, hf_out))
        prefix = sum(r.output_token_ids[:16] == h[:16] for r, h in zip(reqs, hf_out))
        result[layout] = {"engine_s": eng_s, "exact": exact, "prefix16": prefix}
        print(f"(b) engine [{layout}]: {eng_s:.1f}s", flush=True)
    ex.attention_layout = layouts[0]
    return result


def run_cpu(args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    ex = TorchExecutor.from_pretrained("smollm2-135m", device="cpu", kv_blocks=args.kv_blocks)
    print(f"loaded SmolLM2-135M-Instruct in {time.perf_counter() - t0:.1f}s; torch threads={args.threads}")
    ex.hf_model.generation_config.eos_token_id = None  # both sides ignore EOS: fixed output lengths
    texts = specbench_prompts(args.prompts, args.seed)
    prompts = [ex.chat_prompt_ids([{"role": "user", "content": t}]) for t in texts]
    rng = random.Random(args.seed)
    lengths = [rng.randint(args.min_len, args.max_len) for _ in prompts]

    layouts = args.layouts.split(",")
    ex.attention_layout = layouts[0]
    eng_tps, hf_tps, same = bench_decode(ex, prompts[0], args.decode_tokens)
    print(f"(a) engine {eng_tps:.1f} tok/s, generate {hf_tps:.1f} tok/s, outputs identical: {same}", flush=True)
    batch = bench_batch(ex, prompts, lengths, args.chunk, layouts)

    table = Table(title="coserve TorchExecutor vs transformers generate (same run, CPU)")
    for col in ("benchmark", "engine", "transformers", "ratio", "goal", "outputs"):
        table.add_column(col)
    table.add_row(f"(a) decode tok/s, batch 1, {args.decode_tokens} tokens [{layouts[0]}]", f"{eng_tps:.1f}",
                  f"{hf_tps:.1f}", f"{eng_tps / hf_tps:.2f}x", ">= 1.0x", "identical" if same else "DIFFER")
    for layout in layouts:
        b = batch[layout]
        table.add_row(f"(b) {len(prompts)} SpecBench prompts, {batch['tokens']} output tokens, wall s [{layout}]",
                      f"{b['engine_s']:.1f}", f"{batch['hf_s']:.1f}", f"{batch['hf_s'] / b['engine_s']:.2f}x",
                      ">= 2.0x", f"{b['exact']}/{len(prompts)} exact, {b['prefix16']} first-16")
    Console().print(table)
    print(f"prompt lengths {sorted(len(p) for p in prompts)}; output lengths {lengths}")


# ---- --gpu: Llama-shaped random models ----
SHAPES = {
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
}


def run_gpu(args: argparse.Namespace) -> None:
    """Unverified on this project's CPU box; decode step time vs (weights + KV read) / bandwidth."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from gpu_runtime.executor.base import BatchPlan, DecodeEntry, PrefillChunk

    assert torch.cuda.is_available(), "--gpu needs CUDA"
    print(f"{'shape':14} {'batch':>5} {'ctx':>5} {'step ms':>8} {'bound ms':>8} {'% of BW':>7}")
    for name, shape in SHAPES.items():
        cfg = LlamaConfig(max_position_embeddings=8192, rope_theta=500000.0, **shape)
        torch.set_default_dtype(torch.bfloat16)
        with torch.device("cuda"):
            hf = LlamaForCausalLM(cfg).eval()
        torch.set_default_dtype(torch.float32)
        ex = TorchExecutor.from_model(hf, kv_blocks=(args.ctx // 16 + 2) * 33, block_size=16)
        weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
        for batch in (1, 32):
            rids = [f"{name}-{batch}-{i}" for i in range(batch)]
            for rid in rids:
                ex.add_request(rid, SamplingParams(ignore_eos=True))
                ex.step(BatchPlan(prefills=[PrefillChunk(rid, 0, [5] * args.ctx, True)]))
            pos = args.ctx
            times = []
            for it in range(args.gpu_steps + 3):
                res = ex.step(BatchPlan(decodes=[DecodeEntry(r, pos, 7) for r in rids]))
                pos += 1
                if it >= 3:
                    times.append(res.latency_s)
            kv_bytes = batch * pos * ex.model.bytes_per_block() // ex.blocks.block_size
            bound = (weight_bytes + kv_bytes) / (args.bandwidth_gbs * 1e9)
            step = sorted(times)[len(times) // 2]
            print(f"{name:14} {batch:>5} {pos:>5} {step * 1e3:8.2f} {bound * 1e3:8.2f} {100 * bound / step:6.0f}%")
            for rid in rids:
                ex.free(rid)
        del ex, hf
        torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--decode-tokens", type=int, default=48)
    p.add_argument("--min-len", type=int, default=8, help="shortest per-prompt output (tokens)")
    p.add_argument("--max-len", type=int, default=96, help="longest per-prompt output (tokens)")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk (Sarathi chunk_size)")
    p.add_argument("--kv-blocks", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layouts", default="padded,per-request", help="attention layouts to time in (b), first used in (a)")
    p.add_argument("--gpu", action="store_true")
    p.add_argument("--ctx", type=int, default=512, help="--gpu: context length per request")
    p.add_argument("--gpu-steps", type=int, default=20)
    p.add_argument("--bandwidth-gbs", type=float, default=3350.0, help="--gpu: peak HBM GB/s (H100 SXM 3350)")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    run_gpu(args) if args.gpu else run_cpu(args)


if __name__ == "__main__":
    main()
