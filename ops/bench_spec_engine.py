"""Benchmark (a): speculation on the real engine, default model, CPU, low load.

Runs SpecBench summarization prompts (default) one request at a time through Engine +
TorchExecutor (SmolLM2-135M-Instruct, prompt-lookup drafter or ``--draft`` model) + the sarathi-fcfs
scheduler, once per speculation policy, greedy, same prompts. Prints decode tokens/s
(output tokens after the first / time from first to last token) and end-to-end
tokens/s, with each policy's ratio to no speculation measured in the same run, and
checks that every policy produced the same tokens.

    python ops/bench_spec_engine.py [--prompts 4] [--max-tokens 96] [--category summarization]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gpu_runtime.costmodel.profile import CPU_PROFILE, load_cost_model  # noqa: E402
from gpu_runtime.data import specbench_path  # noqa: E402
from gpu_runtime.engine import Engine  # noqa: E402
from gpu_runtime.qos import QoSClass, QoSSpec  # noqa: E402
from gpu_runtime.request import Request  # noqa: E402
from gpu_runtime.sampling import SamplingParams  # noqa: E402
from gpu_runtime.speculation.registry import create_policy  # noqa: E402

POLICIES = ["none", "chain-2", "chain-4", "chain-8", "static-tree", "adaserve", "adaspec", "nightjar"]


def load_prompts(category: str, n: int) -> list[str]:
    out = []
    for line in specbench_path().read_text().splitlines():
        q = json.loads(line)
        if q["category"] == category:
            out.append(q["turns"][0])
            if len(out) == n:
                break
    return out


def run(executor, policy_name: str, prompts: list[list[int]], max_tokens: int, tbt_s: float) -> dict:
    from gpu_runtime.scheduler.registry import create_scheduler

    policy = create_policy(policy_name)
    engine = Engine(executor, create_scheduler("sarathi-fcfs", executor=executor), policy)
    outputs, decode_tokens, decode_time, total_tokens = [], 0, 0.0, 0
    accepted = steps = 0
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):  # low load: one request in flight
        req = Request(f"{policy_name}-{i}", ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                      QoSSpec(QoSClass.INTERACTIVE, ttft_s=60.0, tbt_s=tbt_s), arrival_time=executor.now())
        engine.add_request(req)
        while engine.has_work:
            engine.step()
            accepted += engine.last_stats.num_accepted
            steps += 1
        outputs.append(list(req.output_token_ids))
        total_tokens += req.num_output_tokens
        decode_tokens += req.num_output_tokens - 1
        decode_time += req.token_times[-1] - req.token_times[0]
    wall = time.perf_counter() - t0
    return {"outputs": outputs, "decode_tps": decode_tokens / decode_time, "e2e_tps": total_tokens / wall,
            "accepted": accepted, "steps": steps, "state": policy.state()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--category", default="summarization")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--max-prompt", type=int, default=1024, help="keep the last N prompt tokens")
    ap.add_argument("--tbt", type=float, default=0.2, help="interactive TBT target (s) given to every request")
    ap.add_argument("--policies", nargs="+", default=POLICIES)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--draft", default="prompt-lookup",
                    help="drafter: prompt-lookup, or a draft model directory (e.g. ops/out/smollm2-draft from "
                         "ops/distill_draft.py)")
    ap.add_argument("--no-profile", action="store_true",
                    help="do not load the shipped CPU profile (AdaServe then fits B online)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    import torch

    from gpu_runtime.executor.torch import TorchExecutor

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    ex = TorchExecutor.from_pretrained("smollm2-135m", device="cpu", draft=args.draft, kv_blocks=1024)
    print(f"model loaded in {time.perf_counter() - t0:.1f} s")
    if not args.no_profile and CPU_PROFILE.exists():
        # AdaServe's B = knee of this machine's measured latency-vs-tokens curve (not the online fit).
        ex.cost_model = load_cost_model(CPU_PROFILE, ("piecewise-linear",))
        print(f"cost model: {CPU_PROFILE.name} ({ex.cost_model.name})")
    texts = load_prompts(args.category, args.prompts)
    prompts = [ex.chat_prompt_ids([{"role": "user", "content": t}])[-args.max_prompt:] for t in texts]
    print(f"{len(prompts)} {args.category} prompts, {sum(map(len, prompts)) / len(prompts):.0f} tokens on average, "
          f"{args.max_tokens} output tokens each, greedy, one request at a time")
    res = {}
    for name in args.policies:
        res[name] = run(ex, name, prompts, args.max_tokens, args.tbt)
        print(f"  {name}: {res[name]['decode_tps']:.1f} tok/s", flush=True)
    base = res.get("none")
    print(f"\n{'policy':12s} {'decode tok/s':>12s} {'vs none':>8s} {'e2e tok/s':>10s} {'vs none':>8s} "
          f"{'accepted/step':>13s} {'same tokens':>11s}")
    for name, r in res.items():
        same = base is None or r["outputs"] == base["outputs"]
        ratio = f"{r['decode_tps'] / base['decode_tps']:.2f}x" if base else "-"
        ratio2 = f"{r['e2e_tps'] / base['e2e_tps']:.2f}x" if base else "-"
        print(f"{name:12s} {r['decode_tps']:12.1f} {ratio:>8s} {r['e2e_tps']:10.1f} {ratio2:>8s} "
              f"{r['accepted'] / max(1, r['steps']):13.2f} {str(same):>11s}")
    if base:
        best = max((n for n in res if n != "none"), key=lambda n: res[n]["decode_tps"])
        print(f"\nbest policy: {best}, decode speed-up over no speculation "
              f"{res[best]['decode_tps'] / base['decode_tps']:.2f}x")
        for name in ("adaserve", "adaspec", "nightjar"):
            if name in res:
                print(f"{name} state: {res[name]['state']}")


if __name__ == "__main__":
    main()
