"""Benchmark (b): AdaServe vs static speculation in simulation, RPS sweep.

AdaServe's SLO categories (section 6.1): coding 1.2x baseline TPOT, chat 50 ms,
summarization 150 ms (the latter two scaled to this profile's baseline step latency),
mixed 60/20/20 with Poisson arrivals. Acceptance comes from the per-category rates
measured on the real default model (ops/measure_acceptance.py). Every policy runs the
same arrivals; the table prints SLO attainment and goodput (tokens/s of requests that
met their TPOT SLO), with AdaServe's ratio to the best of vLLM-Spec(n) and the static
tree at each rate.

    python ops/bench_spec_sim.py [--duration 60] [--rps 2 4 6 8]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_spec_harness import (RooflineProfile, adaserve_slos, fmt_ratio, load_acceptance,  # noqa: E402
                                poisson_arrivals, simulate)

from gpu_runtime.speculation.registry import create_policy  # noqa: E402

BASELINES = ["none", "chain-1", "chain-2", "chain-4", "chain-6", "static-tree"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per run")
    ap.add_argument("--rps", type=float, nargs="+", default=[2.0, 4.0, 6.0, 8.0])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    profile = RooflineProfile()
    acceptance = load_acceptance()
    slos = adaserve_slos(profile)
    print("TPOT SLOs (ms): " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in slos.items()))
    t0 = time.perf_counter()
    rows = []
    for rps in args.rps:
        arrivals = poisson_arrivals(rps, args.duration, slos, seed=args.seed)
        res = {name: simulate(create_policy(name), arrivals, profile, acceptance, seed=args.seed)
               for name in [*BASELINES, "adaserve"]}
        rows.append((rps, len(arrivals), res))
    print(f"\n{'RPS':>5s} {'reqs':>5s} " + " ".join(f"{n:>16s}" for n in [*BASELINES, "adaserve"])
          + f" {'attain vs best':>15s} {'goodput vs best':>16s}")
    for rps, n, res in rows:
        best_att = max(res[b].attainment for b in BASELINES if b != "none")
        best_good = max(res[b].goodput for b in BASELINES if b != "none")
        cells = " ".join(f"{res[k].attainment * 100:6.1f}% {res[k].goodput:7.0f}t/s" for k in [*BASELINES, "adaserve"])
        print(f"{rps:5.1f} {n:5d} {cells} {fmt_ratio(res['adaserve'].attainment, best_att):>15s} "
              f"{fmt_ratio(res['adaserve'].goodput, best_good):>16s}")
    print("\nper category attainment at the highest RPS (attained/total):")
    _, _, res = rows[-1]
    for k, m in res.items():
        print(f"  {k:12s} " + "  ".join(f"{c}: {a}/{t}" for c, (a, t) in sorted(m.by_category.items()))
              + f"   tokens/step {m.tokens_per_step:.2f}")
    print(f"\n(simulated {len(rows) * (len(BASELINES) + 1)} runs in {time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
