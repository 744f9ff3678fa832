"""Speculation on vLLM: coserve's policies trimming vLLM's n-gram drafts, against no speculation.

Summarization prompts (SpecBench, the model's chat template), greedy, ``--max-tokens`` each, run
b at a time for each batch size b. Every policy runs in its own process with its own engine
(``gpu_runtime.vllm.offline``), one after the other; the table gives output tok/s, the speed-up
over ``none`` at the same batch size, and whether the tokens equal ``none``'s. In bfloat16 (what
the CPU serves) vLLM's own verification pass can part from plain decoding at near-ties; run with
``--dtype float32`` for the lossless check.

    python ops/bench_spec_vllm.py                              # none, nightjar, adaspec, adaserve, chain-4
    python ops/bench_spec_vllm.py --policies none nightjar --batch 1 8 --dtype float32
    python ops/bench_spec_vllm.py --policies none nightjar --batch 8 32 --repeats 3   # paired rounds, medians
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]


def run(policy: str, args: argparse.Namespace, out: Path) -> dict:
    cmd = [sys.executable, "-m", "gpu_runtime.vllm.offline", "--spec", policy, "--prompts", str(args.prompts),
           "--max-tokens", str(args.max_tokens), "--batch", *map(str, args.batch), "--out", str(out)]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    if args.raw:
        cmd += ["--raw"]
    if args.spec_tokens:
        cmd += ["--spec-tokens", str(args.spec_tokens)]
    cmd += ["--drafter", args.drafter]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{policy} failed:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def _tput(r: dict) -> float:
    return r["output_tokens"] / r["elapsed_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", nargs="+", default=["none", "nightjar", "adaspec", "adaserve", "chain-4"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 16, 32])
    ap.add_argument("--prompts", type=int, default=4, help="prompts at batch 1 (a batch of b runs b prompts)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--raw", action="store_true", help="the prompts as raw text, without the chat template")
    ap.add_argument("--spec-tokens", type=int, default=None,
                    help="draft tokens vLLM proposes per request and step (default: N for chain-N, else 8; 32 with "
                         "the suffix drafter)")
    ap.add_argument("--drafter", default="ngram",
                    help="vLLM's drafter: ngram (prompt lookup) or suffix (suffix decoding, arctic-inference)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="rounds of every policy, interleaved (round r runs each policy once): the table gives the "
                         "median speed-up over none's run of the same round, and the range")
    args = ap.parse_args()
    if args.policies[0] != "none":
        args.policies.insert(0, "none")
    console = Console(width=160)
    results: dict[str, list[dict]] = {p: [] for p in args.policies}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.repeats):
            for policy in args.policies:
                results[policy].append(run(policy, args, Path(tmp) / f"{policy}-{rnd}.json"))
                console.print(f"round {rnd + 1}", policy,
                              {b: round(_tput(r), 1) for b, r in results[policy][-1].items()})
    console.print(speedup_table(results, args))


def speedup_table(results: dict[str, list[dict]], args: argparse.Namespace) -> Table:
    """Per batch size and policy: median tok/s over the rounds, and the speed-up over none's run of each round."""
    table = Table(title=f"vLLM speculation, SpecBench summarization, {args.drafter} drafts"
                        f"{' (raw text)' if args.raw else ''}, "
                        f"{args.max_tokens} tokens each, dtype {args.dtype or 'bfloat16'}, {args.repeats} round(s)")
    for col in ("batch", "policy", "tok/s (median)", "x none (median)", "x none (range)", "same tokens as none",
                "speculation state (last round)"):
        table.add_column(col)
    for b in map(str, args.batch):
        for policy in args.policies:
            runs, bases = [r[b] for r in results[policy]], [r[b] for r in results["none"]]
            ratios = [_tput(r) / _tput(base) for r, base in zip(runs, bases)]
            state = {k: v for k, v in runs[-1]["speculation"].items()
                     if k in ("gamma", "length", "acceptance", "budget")}
            same = all(r["tokens"] == base["tokens"] for r, base in zip(runs, bases))
            table.add_row(b, policy, f"{statistics.median(map(_tput, runs)):.1f}", f"{statistics.median(ratios):.3f}",
                          f"{min(ratios):.3f}-{max(ratios):.3f}", str(same), json.dumps(state))
    return table


if __name__ == "__main__":
    main()
