"""Offline runs on the worker's vLLM engine: a list of prompts in, tokens and timings out.

Used by the vLLM tests (greedy parity, lossless speculation) and the benchmarks; each run is
one process with one engine (``python -m gpu_runtime.vllm.offline ... --out F`` writes JSON), since
vLLM's in-process engine core sets process-wide state.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from gpu_runtime.qos import QoSClass, QoSSpec, Tier
from gpu_runtime.request import Request
from gpu_runtime.sampling import SamplingParams


_INTERACTIVE = QoSSpec(QoSClass.INTERACTIVE, Tier.PAID, ttft_s=10.0, tbt_s=1.0)
_BATCH = QoSSpec(QoSClass.BATCH, Tier.PAID, ttlt_s=3600.0)
OFFLINE_QOS = {  # the QoS of prompt i is the name's i-th, cycled
    "interactive": (_INTERACTIVE,),
    "batch": (_BATCH,),
    "mixed": (_INTERACTIVE, _BATCH),
}


@dataclass
class OfflineRun:
    tokens: dict[str, list[int]] = field(default_factory=dict)  # request id -> output token ids
    elapsed_s: float = 0.0  # wall time of the generation (engine already loaded and warm)
    steps: int = 0  # engine steps it took
    policy_s: float = 0.0  # of which in coserve's scheduling code (0 with vLLM's own scheduler)
    speculation: dict[str, Any] = field(default_factory=dict)  # the speculation policy's last state

    @property
    def output_tokens(self) -> int:
        return sum(len(t) for t in self.tokens.values())


def summarization_prompts(model: str, n: int, chat: bool = True) -> list[list[int]]:
    """The first ``n`` SpecBench summarization questions, through the model's chat template (or as raw text)."""
    from app.services.model_info import encode_input
    from gpu_runtime.data import specbench_path

    rows = [json.loads(line) for line in specbench_path().read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r["category"] == "summarization"][:n]
    if not chat:
        return [encode_input(model, r["turns"][0], None) for r in rows]
    return [encode_input(model, None, [{"role": "user", "content": r["turns"][0]}]) for r in rows]


def random_prompts(n: int, length: int, seed: int = 0, vocab: int = 49152) -> list[list[int]]:
    """``n`` prompts of ``length`` random token ids (vLLM's random dataset does the same)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def generate(engine: Any, prompts: list[list[int]], max_tokens: int, batch: int,
             qos: tuple[QoSSpec, ...] = OFFLINE_QOS["interactive"], ignore_eos: bool = True) -> OfflineRun:
    """Runs ``prompts`` ``batch`` at a time (each group to completion) and collects their tokens; prompt i runs
    with ``qos[i % len(qos)]``."""
    run = OfflineRun()
    policy_before = engine.core_scheduler.policy_s
    t0 = time.perf_counter()
    for start in range(0, len(prompts), batch):
        for i, ids in enumerate(prompts[start:start + batch], start):
            engine.add_request(Request(f"p{i}", ids, SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos),
                                       qos[i % len(qos)], arrival_time=engine.executor.now()))
        while engine.has_work:
            run.steps += 1
            for out in engine.step():
                run.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    run.elapsed_s = time.perf_counter() - t0
    run.policy_s = engine.core_scheduler.policy_s - policy_before
    run.speculation = engine.speculation.state()
    return run


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--policy", default="qoserve", help="coserve scheduling policy or vllm-fcfs / vllm-priority")
    ap.add_argument("--spec", default="none", help="speculation policy (none, chain-N, nightjar, adaspec, adaserve)")
    ap.add_argument("--dtype", default=None, help="model dtype (default bfloat16 on CPU)")
    ap.add_argument("--prompts", type=int, default=4, help="SpecBench summarization prompts (at least the batch)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--workload", choices=("summarization", "random"), default="summarization")
    ap.add_argument("--raw", action="store_true", help="summarization prompts as raw text, without the chat template")
    ap.add_argument("--stop-at-eos", action="store_true", help="end at EOS (default: ignore it, --max-tokens each)")
    ap.add_argument("--input-len", type=int, default=128, help="random workload: prompt tokens")
    ap.add_argument("--shared-prefix", type=int, default=0,
                    help="random workload: tokens of a system prompt every prompt starts with (before --input-len)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1], help="batch sizes to run, one after the other")
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs first (the n-gram drafter compiles)")
    ap.add_argument("--qos", choices=tuple(OFFLINE_QOS), default="interactive",
                    help="the prompts' QoS: interactive (TTFT 10 s, TBT 1 s), batch (TTLT 1 h: offline work) or "
                         "mixed (one of each, in turn)")
    ap.add_argument("--spec-tokens", type=int, default=None,
                    help="draft tokens vLLM proposes per request and step (default: N for chain-N, else 8; 32 with "
                         "the suffix drafter)")
    ap.add_argument("--drafter", default="ngram", help="vLLM's drafter when speculating: ngram or suffix")
    ap.add_argument("--draft", default=None, help="a draft checkpoint that drafts instead (as COSERVE_DRAFT)")
    ap.add_argument("--engine-args", type=json.loads, default=None, metavar="JSON",
                    help="more vLLM EngineArgs, as COSERVE_VLLM_ENGINE_ARGS takes them (e.g. a speculative_config)")
    ap.add_argument("--out", default="-", help="where the JSON goes (vLLM logs to stdout: give a file)")
    args = ap.parse_args(argv)
    from gpu_runtime.vllm.build import build_vllm_engine

    engine = build_vllm_engine(args.model, scheduler_policy=args.policy, spec_policy=args.spec, dtype=args.dtype,
                               max_model_len=4096, cost_profile="auto", spec_tokens=args.spec_tokens,
                               drafter=args.drafter, draft_model=args.draft, overrides=args.engine_args)
    n = max(args.prompts, *args.batch)
    prompts = (summarization_prompts(args.model, n, chat=not args.raw) if args.workload == "summarization"
               else random_prompts(n, args.input_len))
    if args.shared_prefix:
        system = random_prompts(1, args.shared_prefix, seed=1)[0]
        prompts = [system + p for p in prompts]
    for _ in range(args.warmup):  # without the shared prefix: the timed prompts find none of it cached
        generate(engine, [prompts[0][args.shared_prefix:]], 16, 1)
    results = {}
    for b in args.batch:  # one batch of b prompts, or --prompts of them b at a time
        run = generate(engine, prompts[:max(b, args.prompts)], args.max_tokens, b, qos=OFFLINE_QOS[args.qos],
                       ignore_eos=not args.stop_at_eos)
        results[str(b)] = {"tokens": run.tokens, "elapsed_s": run.elapsed_s, "output_tokens": run.output_tokens,
                           "policy_s": run.policy_s, "steps": run.steps, "speculation": run.speculation}
    if args.out == "-":
        json.dump(results, sys.stdout)
    else:
        with open(args.out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
