"""Engine vs transformers ``generate``, measured in the same run (CPU by default).

(a) decode tokens/s at batch 1 on the default model (goal: not slower than generate);
(b) 16 SpecBench prompts (chat template) with their OWN output lengths: ``generate`` runs
    the left-padded batch with EOS on, capped at --max-len, so each prompt ends where the
    model ends it; the engine then produces exactly that many tokens per prompt (its EOS
    would end it at the same place when its greedy tokens agree). Total wall time of the
    engine (continuous batching, all at once) vs ``generate`` (goal: >= 2x faster).
Each timing is the median of --repeats runs.
``--gpu``: Llama-3.1-8B- and 3.2-1B-shaped random bf16 models, decode step time at
batch 1/32 vs the weight-read limit (weight bytes / device copy bandwidth, measured by
timing a multi-GB bf16 copy unless --bandwidth-gbs is given).

    python ops/bench_engine.py [--prompts 16] [--decode-tokens 64] [--threads 2] [--repeats 3]
    python ops/bench_engine.py --gpu [--bandwidth-gbs GBS] [--profile]
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gpu_runtime.data import specbench_path  # noqa: E402
from gpu_runtime.engine import Engine  # noqa: E402
from gpu_runtime.executor.torch import TorchExecutor  # noqa: E402
from gpu_runtime.qos import QoSClass, QoSSpec  # noqa: E402
from gpu_runtime.request import Request  # noqa: E402
from gpu_runtime.sampling import SamplingParams  # noqa: E402
from gpu_runtime.scheduler.registry import create_scheduler  # noqa: E402

log = logging.getLogger("bench_engine")


def specbench_prompts(n: int, seed: int) -> list[str]:
    rows = [json.loads(line) for line in specbench_path().open()]
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


def median_of(repeats: int, run):  # noqa: ANN001, ANN201 (any callable returning (seconds, payload))
    """Runs ``run()`` ``repeats`` times; the median seconds and the last payload (shared CPU: one run is noise)."""
    times, payload = [], None
    for _ in range(max(1, repeats)):
        seconds, payload = run()
        times.append(seconds)
    return statistics.median(times), payload


def own_lengths(rows: torch.Tensor, eos: int | None, cap: int) -> list[int]:
    """Per row of generate's new tokens: up to and including the first EOS, else the cap."""
    return [row.index(eos) + 1 if eos is not None and eos in row[:cap] else cap for row in rows.tolist()]


# ---- (a) batch-1 decode ----
def bench_decode(ex: TorchExecutor, prompt: list[int], n: int, repeats: int) -> tuple[float, float, bool]:
    hf = ex.hf_model
    ids = torch.tensor([prompt])

    def gen(k: int):  # noqa: ANN202
        t0 = time.perf_counter()
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), **no_eos(k))
        return time.perf_counter() - t0, out

    with torch.inference_mode():
        gen(4)  # warm-up
        prefill_s, _ = median_of(repeats, lambda: gen(1))
        total_s, ref = median_of(repeats, lambda: gen(n))
    hf_tps = (n - 1) / max(1e-9, total_s - prefill_s)  # generate's decode rate: total minus prefill
    engine = make_engine(ex, chunk=512)
    warm = request(-1, prompt, 4)
    engine.add_request(warm)
    engine.run_until_idle()

    def run_engine():  # noqa: ANN202
        req = request(0, prompt, n)
        engine.add_request(req)
        engine.run_until_idle()
        return req.token_times[-1] - req.token_times[0], req

    decode_s, req = median_of(repeats, run_engine)
    eng_tps = (n - 1) / decode_s
    same = req.output_token_ids == ref[0, len(prompt):].tolist()
    return eng_tps, hf_tps, same


# ---- (b) 16 prompts, own lengths ----
def bench_batch(ex: TorchExecutor, prompts: list[list[int]], cap: int, chunk: int, layouts: list[str],
                repeats: int) -> dict:
    tok = ex.tokenizer
    hf = ex.hf_model
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    eos = ex.eos_token_id

    def gen():  # noqa: ANN202
        t0 = time.perf_counter()
        with torch.inference_mode():  # EOS on: each row ends where the model ends it (or at the cap)
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=cap, do_sample=False, pad_token_id=pad,
                              eos_token_id=eos)
        return time.perf_counter() - t0, out

    hf_s, out = median_of(repeats, gen)
    lengths = own_lengths(out[:, width:], eos, cap)
    hf_out = [out[i, width:width + n].tolist() for i, n in enumerate(lengths)]
    print(f"(b) generate on the padded batch: {hf_s:.1f}s (median of {repeats})", flush=True)

    result: dict = {"hf_s": hf_s, "tokens": sum(lengths), "lengths": lengths}
    for layout in layouts:
        ex.attention_layout = layout

        def run_engine():  # noqa: ANN202
            engine = make_engine(ex, chunk=chunk)
            # exactly generate's count per prompt: EOS ignored so a near-tie that flips one token
            # cannot make the engine's run shorter (or longer) than generate's
            reqs = [request(i, p, n) for i, (p, n) in enumerate(zip(prompts, lengths))]
            t0 = time.perf_counter()
            for r in reqs:
                engine.add_request(r)
            engine.run_until_idle()
            return time.perf_counter() - t0, reqs

        eng_s, reqs = median_of(repeats, run_engine)
        assert [r.num_output_tokens for r in reqs] == lengths
        # padded-batch numerics differ slightly from unpadded: count exact and first-16-token matches
        exact = sum(r.output_token_ids == h for r, h in zip(reqs, hf_out))
        prefix = sum(r.output_token_ids[:16] == h[:16] for r, h in zip(reqs, hf_out))
        result[layout] = {"engine_s": eng_s, "exact": exact, "prefix16": prefix}
        print(f"(b) engine [{layout}]: {eng_s:.1f}s (median of {repeats})", flush=True)
    ex.attention_layout = layouts[0]
    return result


def run_cpu(args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    ex = TorchExecutor.from_pretrained("smollm2-135m", device="cpu", kv_blocks=args.kv_blocks)
    print(f"loaded SmolLM2-135M-Instruct in {time.perf_counter() - t0:.1f}s; torch threads={args.threads}")
    ex.hf_model.generation_config.eos_token_id = None  # (a) ignores EOS; (b) passes eos_token_id itself
    texts = specbench_prompts(args.prompts, args.seed)
    prompts = [ex.chat_prompt_ids([{"role": "user", "content": t}]) for t in texts]

    layouts = args.layouts.split(",")
    ex.attention_layout = layouts[0]
    eng_tps, hf_tps, same = bench_decode(ex, prompts[0], args.decode_tokens, args.repeats)
    print(f"(a) engine {eng_tps:.1f} tok/s, generate {hf_tps:.1f} tok/s, outputs identical: {same}", flush=True)
    batch = bench_batch(ex, prompts, args.max_len, args.chunk, layouts, args.repeats)
    lengths = batch["lengths"]

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
    print(f"prompt lengths {sorted(len(p) for p in prompts)}; own output lengths (EOS, cap {args.max_len}) "
          f"{lengths}; medians of {args.repeats} runs")


# ---- --gpu: Llama-shaped random models ----
SHAPES = {
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
}


def copy_bandwidth_gbs(gib: float = 4.0, reps: int = 10) -> float:
    """Device memory bandwidth as this GPU really copies: a ``gib`` GiB bf16 buffer copied ``reps``
    times; each copy reads and writes every byte (bytes * 2 / time). The datasheet peak (3350 GB/s
    on H100 SXM) is not reached by any kernel, so a limit built on it overstates the gap."""
    n = int(gib * 2**30) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / reps
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n * 2 / seconds / 1e9


def run_gpu(args: argparse.Namespace) -> None:
    """Decode step time vs the weight-read limit: weight bytes / measured copy bandwidth."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from gpu_runtime.executor.base import BatchPlan, DecodeEntry, PrefillChunk

    assert torch.cuda.is_available(), "--gpu needs CUDA"
    bandwidth = args.bandwidth_gbs or copy_bandwidth_gbs()
    print(f"device copy bandwidth {bandwidth:.0f} GB/s ({'given' if args.bandwidth_gbs else 'measured'})")
    print(f"{'shape':14} {'batch':>5} {'ctx':>5} {'step ms':>8} {'limit ms':>8} {'% of BW':>7} {'KV MB':>7}")
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
            bound = weight_bytes / (bandwidth * 1e9)  # every step reads every weight once
            step = statistics.median(times)
            print(f"{name:14} {batch:>5} {pos:>5} {step * 1e3:8.2f} {bound * 1e3:8.2f} {100 * bound / step:6.0f}% "
                  f"{kv_bytes / 1e6:7.0f}")
            if args.profile and batch == 1:
                profile_decode(ex, rids, pos, name)
            for rid in rids:
                ex.free(rid)
        del ex, hf
        torch.cuda.empty_cache()


def profile_decode(ex: TorchExecutor, rids: list[str], pos: int, name: str, steps: int = 5) -> None:
    """Where a decode step's time goes: Python (cProfile, by cumulative time) and the ops torch's profiler
    sees (by self CPU time and by self device time)."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile

    from gpu_runtime.executor.base import BatchPlan, DecodeEntry

    def run(n: int, at: int) -> int:
        for _ in range(n):
            ex.step(BatchPlan(decodes=[DecodeEntry(r, at, 7) for r in rids]))
            at += 1
        return at

    print(f"\n--- {name}, batch {len(rids)}: cProfile of {steps} steps (top 20 by cumulative time) ---")
    prof = cProfile.Profile()
    prof.enable()
    pos = run(steps, pos)
    prof.disable()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(20)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
        pos = run(steps, pos)
    table = tp.key_averages()
    print(f"--- {name}: torch profiler, {steps} steps, by self CPU time ---")
    print(table.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60))
    print(f"--- {name}: torch profiler, {steps} steps, by self device time ---")
    print(table.table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=60))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--decode-tokens", type=int, default=48)
    p.add_argument("--max-len", type=int, default=128, help="(b) cap on each prompt's own output (tokens)")
    p.add_argument("--repeats", type=int, default=3, help="runs per timing; the median is reported")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk (Sarathi chunk_size)")
    p.add_argument("--kv-blocks", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layouts", default="auto,padded,per-request",
                   help="attention layouts to time in (b), first used in (a)")
    p.add_argument("--gpu", action="store_true")
    p.add_argument("--ctx", type=int, default=512, help="--gpu: context length per request")
    p.add_argument("--gpu-steps", type=int, default=20)
    p.add_argument("--profile", action="store_true",
                   help="--gpu: also profile batch-1 decode steps (cProfile and torch's profiler)")
    p.add_argument("--bandwidth-gbs", type=float, default=None,
                   help="--gpu: device GB/s for the limit (default: measured with a 4 GiB bf16 copy)")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    run_gpu(args) if args.gpu else run_cpu(args)


if __name__ == "__main__":
    main()
