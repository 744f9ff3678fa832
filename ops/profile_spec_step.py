"""Where the time of a speculative step goes on the real engine (default model, CPU, batch 1).

After prefilling one SpecBench prompt, it times the pieces of one decode step with a chain
of k draft tokens (k = 0 is a plain decode step), in interleaved rounds so that load from
other processes hits every k alike (min and median over rounds):

* build: segment + ForwardBatch (slots, positions, tree mask)
* forward: PagedDecoder.forward + argmax, for each query count 1 + k
* draft: the prompt-lookup drafter on the request's tokens (incremental index vs a scan)
* verify: greedy tree verification on the argmax rows

``--compare-prepack`` also times the forward with the dense (MKL) projections, the path
before the oneDNN prepacking, in the same rounds.

    python ops/profile_spec_step.py [--threads 2] [--rounds 7] [--ks 0 1 2 3 4 6 8 12 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gpu_runtime.data import specbench_path  # noqa: E402


def first_prompt(category: str) -> str:
    for line in specbench_path().read_text().splitlines():
        q = json.loads(line)
        if q["category"] == category:
            return q["turns"][0]
    raise SystemExit(f"no {category} prompt")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2, 3, 4, 6, 8, 12, 16])
    ap.add_argument("--category", default="summarization")
    ap.add_argument("--compare-prepack", action="store_true", help="also time the dense (MKL) projections")
    args = ap.parse_args()
    import torch

    from gpu_runtime.executor.base import BatchPlan, DraftEntry, PrefillChunk
    from gpu_runtime.executor.drafters.prompt_lookup import scan_matches
    from gpu_runtime.executor.torch import TorchExecutor
    from gpu_runtime.executor.torch.batch import build_forward_batch
    from gpu_runtime.executor.torch.sampler import verify_greedy
    from gpu_runtime.sampling import SamplingParams
    from gpu_runtime.speculation.token_tree import TokenTree

    torch.set_num_threads(args.threads)
    ex = TorchExecutor.from_pretrained("smollm2-135m", device="cpu", draft="prompt-lookup", kv_blocks=1024)
    ids = ex.chat_prompt_ids([{"role": "user", "content": first_prompt(args.category)}])[-1024:]
    ex.add_request("r", SamplingParams(max_tokens=256, ignore_eos=True))
    pos = len(ids)
    tok = ex.step(BatchPlan(prefills=[PrefillChunk("r", 0, ids, True)])).tokens["r"][0]
    print(f"context {pos} tokens, {args.threads} threads, {args.rounds} interleaved rounds")
    model = ex.model
    packed = [(w.packed, model.lm_head_packed) for w in model.layers]

    def set_prepack(on: bool) -> None:
        for w, (p, lm) in zip(model.layers, packed):
            w.packed = p if on else None
            model.lm_head_packed = lm if on else None

    variants = ["prepacked", "dense"] if args.compare_prepack and packed[0][0] else ["current"]
    times: dict[tuple[str, int], list[float]] = {(v, k): [] for v in variants for k in args.ks}
    build: dict[int, list[float]] = {k: [] for k in args.ks}
    for _ in range(args.rounds):
        for k in args.ks:
            tree = TokenTree.chain(list(range(100, 100 + k))) if k else None
            for v in variants:
                if v != "current":
                    set_prepack(v == "prepacked")
                t0 = time.perf_counter()
                seg = ex._decode_segment("r", pos, tok, tree)
                fb, _ = build_forward_batch([seg], ex.device, ex.attention_layout)
                t1 = time.perf_counter()
                argmax = model.forward(fb).argmax(-1).tolist()
                t2 = time.perf_counter()
                times[(v, k)].append(t2 - t1)
                build[k].append(t1 - t0)
    set_prepack(True)
    base = {v: min(times[(v, 0)]) for v in variants}
    print(f"\n{'query tokens':>12s} {'build ms':>9s} " + " ".join(
        f"{v + ' min ms':>16s} {'med ms':>7s} {'x q=1':>6s}" for v in variants))
    for k in args.ks:
        row = f"{1 + k:12d} {statistics.median(build[k]) * 1e3:9.2f} "
        for v in variants:
            ts = times[(v, k)]
            row += f"{min(ts) * 1e3:16.1f} {statistics.median(ts) * 1e3:7.1f} {min(ts) / base[v]:6.2f}"
        print(row)

    # drafter and verification costs on a sequence of realistic length
    seq = ex.token_ids("r")
    t0 = time.perf_counter()
    for _ in range(200):
        ex.drafter.draft([DraftEntry("r", 8, 1)])
    t_index = (time.perf_counter() - t0) / 200
    t0 = time.perf_counter()
    for _ in range(200):
        scan_matches(seq, 8, 3, 1, 16)
    t_scan = (time.perf_counter() - t0) / 200
    chain = TokenTree.chain(list(range(100, 108)))
    t0 = time.perf_counter()
    for _ in range(2000):
        verify_greedy(chain, list(range(100, 109)))
    t_verify = (time.perf_counter() - t0) / 2000
    print(f"\nprompt lookup (context {len(seq)}): incremental index {t_index * 1e3:.3f} ms/step, "
          f"full scan {t_scan * 1e3:.3f} ms/step; greedy verification of an 8-chain {t_verify * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
