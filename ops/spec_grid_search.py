"""Grid search of AdaServe's adaptive-control constants (eq. 8-9) in simulation.

Searches c1, c2, D_max, W_max, the knee tolerance, n_max (the per-request cap of the
SLO-customized phase) and whether the budget is shared with the pass's prefill chunk, on
the AdaServe SLO mix through the same stack and drafter as ops/bench_spec_sim.py
(Engine + QoServe + SimExecutor; ``--drafter`` as there) at a few arrival rates, scores
each setting by mean goodput (tokens/s of SLO-attaining requests) and
writes the ranking to gpu_runtime/speculation/data/adaserve_grid.json (``--out``). Run it
for both drafters (prompt lookup at 6/8 RPS; the draft model at 10/14 RPS, written to
adaserve_grid_draft_model.json): AdaServeConfig's defaults are the setting whose worse
score relative to each grid's best is highest.

    python ops/spec_grid_search.py
    python ops/spec_grid_search.py --drafter draft-model --rps 10 14 \
        --out gpu_runtime/speculation/data/adaserve_grid_draft_model.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_spec_harness import DRAFTERS, acceptance_for, poisson_arrivals  # noqa: E402
from bench_spec_sim import engine_setup, simulate_engine  # noqa: E402

from gpu_runtime.speculation.adaserve import AdaServe, AdaServeConfig  # noqa: E402

OUT = Path(__file__).resolve().parent.parent / "gpu_runtime" / "speculation" / "data" / "adaserve_grid.json"

GRID = {
    "c1": [0.0, 4.0],
    "c2": [0, 1],
    "d_min": [1],
    "d_max": [4, 8],
    "w_max": [1, 3],
    "budget_tolerance": [0.5, 1.0],
    "n_max": [2, 8],
    "budget_shares_prefill": [True, False],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=12.0)
    ap.add_argument("--rps", type=float, nargs="+", default=[6.0, 8.0])
    ap.add_argument("--draft-cost-ms", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--drafter", choices=sorted(DRAFTERS), default="prompt-lookup")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    drafter = DRAFTERS[args.drafter]
    acceptance = acceptance_for(drafter)
    cost_model, slos = engine_setup()
    workloads = [poisson_arrivals(r, args.duration, slos, seed=args.seed) for r in args.rps]
    keys = list(GRID)
    rows = []
    t0 = time.perf_counter()
    for values in itertools.product(*GRID.values()):
        cfg = dict(zip(keys, values))
        if cfg["d_min"] > cfg["d_max"]:
            continue
        res = [simulate_engine(AdaServe(AdaServeConfig(**cfg)), w, cost_model, acceptance, args.draft_cost_ms / 1e3,
                               seed=args.seed, drafter=drafter) for w in workloads]
        rows.append({"config": cfg, "goodput": [round(m.goodput, 1) for m in res],
                     "attainment": [round(m.attainment, 4) for m in res],
                     "score": round(sum(m.goodput for m in res) / len(res), 2)})
    rows.sort(key=lambda r: -r["score"])
    print(f"{len(rows)} settings x {len(workloads)} rates in {time.perf_counter() - t0:.0f} s; top 10:")
    print(f"{'score':>8s}  {'goodput by RPS':28s} {'attainment':24s} config")
    for r in rows[:10]:
        print(f"{r['score']:8.1f}  {str(r['goodput']):28s} {str(r['attainment']):24s} {r['config']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rps": args.rps, "duration_s": args.duration, "seed": args.seed,
                                    "stack": "engine+qoserve+sim (synthetic A100 8B)",
                                    "draft_cost_ms": args.draft_cost_ms, "drafter": args.drafter, "rows": rows},
                                   indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
