"""QoServe vs Sarathi baselines in simulation (QoServe section 4.1.2 and 4.3).

Policies: QoServe, Sarathi FCFS/EDF/SRPF (chunk 256), vLLM-style FCFS without chunking,
and siloed replicas per tier class (goodput per machine). For each profile (the measured
CPU default-model profile, and the SYNTHETIC 8B/A100 profile) and each Azure trace, with the paper's three tiers (Q1 TTFT 6 s / TBT
50 ms, Q2 TTLT 600 s, Q3 TTLT 1800 s, equal thirds) and every SLO multiplied by
(profile batch-1 decode step / 12.5 ms):

1. goodput = highest Poisson QPS with <= 1% violations (binary search), per policy;
2. bursty load alternating every --bursty-period-min (paper: 15 min; x SLO scale) between two rates 2.5x apart
   (peak = 1.4x QoServe's goodput), 20% free-tier jobs: violations per tier.

Runs are subsampled (--minutes of arrivals per goodput run, --bursty-minutes of bursty
load; the paper ran 4 hours) to finish in minutes; such short runs rarely build up the
backlog that breaks TTLT deadlines of 600 s / 1800 s, so goodput here is mostly decided
by the interactive tier.

    python ops/bench_qoserve.py [--minutes 5] [--traces conv,code] [--profiles ...]
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ProcessPoolExecutor
from functools import partial

from rich.console import Console
from rich.table import Table

from gpu_runtime.costmodel.profile import A100_PROFILE, CPU_PROFILE, load_cost_model, slo_scale
from gpu_runtime.sim.capacity import capacity_search
from gpu_runtime.sim.runner import Experiment, run_policy
from gpu_runtime.sim.workload import paper_tiers

POLICIES = ("qoserve", "sarathi-fcfs", "sarathi-edf", "sarathi-srpf", "vllm-fcfs", "silo")
MACHINES = {"silo": 2}  # a siloed deployment runs one replica per tier class: goodput is per machine


def _violations(qps: float, policy: str, profile: str, trace: str, minutes: float, seed: int) -> float:
    cm = load_cost_model(profile, ("piecewise-linear",))
    scale = slo_scale(cm)
    n = max(50, int(qps * minutes * 60.0 * scale))  # a fixed span of (scaled) time at every rate
    exp = Experiment(trace=trace, num_requests=n, seed=seed)
    return run_policy(policy, cm, exp, paper_tiers(scale), qps=qps).violation_rate


def goodput(policy: str, profile: str, trace: str, minutes: float, lo: float, hi: float, iters: int,
            seed: int) -> float:
    machines = MACHINES.get(policy, 1)
    f = partial(_violations, policy=policy, profile=profile, trace=trace, minutes=minutes, seed=seed)
    return capacity_search(f, lo * machines, hi * machines, target=0.01, iters=iters) / machines


def bursty(policy: str, profile: str, trace: str, low: float, high: float, minutes: float, period_min: float,
           seed: int) -> dict:
    cm = load_cost_model(profile, ("piecewise-linear",))
    scale = slo_scale(cm)
    exp = Experiment(trace=trace, seed=seed)
    period = period_min * 60.0 * scale
    s = run_policy(policy, cm, exp, paper_tiers(scale, free_share=0.2),
                   bursty=(low, high, period, minutes * 60.0 * scale))
    return {"n": s.n, "all": s.violation_rate, **{k: v.violation_rate for k, v in s.tiers.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profiles", default=",".join(str(p) for p in (CPU_PROFILE, A100_PROFILE) if p.exists()))
    ap.add_argument("--traces", default="conv,code")
    ap.add_argument("--minutes", type=float, default=5.0,
                    help="arrival span of each goodput run (x SLO scale); requests = qps x span")
    ap.add_argument("--iters", type=int, default=5, help="binary-search steps")
    ap.add_argument("--bursty-minutes", type=float, default=60.0, help="bursty run length (x SLO scale)")
    ap.add_argument("--bursty-period-min", type=float, default=15.0, help="minutes per rate (paper: 15)")
    ap.add_argument("--bursty-trace", default="code")
    ap.add_argument("--bursty-qps", default=None, help="low:high rates (default: peak = 1.4x QoServe's goodput, "
                                                        "low = peak / 2.5)")
    ap.add_argument("--skip-goodput", action="store_true", help="only the bursty experiment (needs --bursty-qps)")
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help="qoserve first; the goodput table compares it with each of the others")
    ap.add_argument("--bursty-policies", default="qoserve,sarathi-fcfs,sarathi-edf")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    policies = tuple(args.policies.split(","))
    bursty_policies = tuple(args.bursty_policies.split(","))
    console = Console(width=140)
    t0 = time.time()
    pool = ProcessPoolExecutor(args.workers)
    for profile in args.profiles.split(","):
        cm = load_cost_model(profile, ("piecewise-linear",))
        scale = slo_scale(cm)
        name = profile.rsplit("/", 1)[-1]
        console.print(f"\n[bold]{name}[/]: batch-1 decode step {scale * 12.5:.1f} ms -> every SLO multiplied by "
                      f"{scale:.2f} (Q1 TTFT {6 * scale:.1f} s / TBT {50 * scale:.0f} ms, Q2 {600 * scale:.0f} s, "
                      f"Q3 {1800 * scale:.0f} s)")
        # Search range from the profile: up to the rate at which the replica could only run prompts.
        hi = 24.0 / scale
        traces = [] if args.skip_goodput else args.traces.split(",")
        jobs = {(trace, pol): pool.submit(goodput, pol, profile, trace, args.minutes, hi / 24, hi, args.iters,
                                          args.seed)
                for trace in traces for pol in policies}
        table = Table(title=f"goodput per machine (QPS at <= 1% violations, {args.minutes * scale:.0f} min of "
                            f"arrivals per run) - {name}")
        others = [p for p in policies if p != "qoserve"]
        goals = {"sarathi-fcfs": " (goal >= 1.5x)", "sarathi-edf": " (goal >= 1.2x)"}
        for col in ("trace", *policies, *(f"vs {p}{goals.get(p, '')}" for p in others)):
            table.add_column(col, justify="right")
        good: dict[str, float] = {}
        for trace in traces:
            g = {pol: jobs[(trace, pol)].result() for pol in policies}
            good[trace] = g["qoserve"]
            ratios = [f"{g['qoserve'] / g[p]:.2f}x" if g[p] else "inf" for p in others]
            table.add_row(trace, *(f"{g[p]:.3f}" for p in policies), *ratios)
        if traces:
            console.print(table)
        trace = args.bursty_trace
        if args.bursty_qps:
            low, high = (float(x) for x in args.bursty_qps.split(":"))
        elif trace in good:
            high = 1.4 * good[trace]
            low = high / 2.5
        else:
            continue
        bj = {pol: pool.submit(bursty, pol, profile, trace, low, high, args.bursty_minutes, args.bursty_period_min,
                               args.seed)
              for pol in bursty_policies}
        bt = Table(title=f"bursty {low:.2f} <-> {high:.2f} QPS every {args.bursty_period_min * scale:.0f} min, "
                         f"20% free tier, "
                         f"{args.bursty_minutes * scale:.0f} min, {trace} - {name}")
        for col in ("policy", "requests", "violations", "paid", "free", "goal"):
            bt.add_column(col, justify="right")
        res = {pol: bj[pol].result() for pol in bursty_policies}
        for pol in bursty_policies:
            r = res[pol]
            goal = ("paid == 0" + (" ok" if r.get("paid", 0) == 0 else " MISSED")) if pol == "qoserve" else \
                ("> 50%" + (" ok" if r["all"] > 0.5 else " not reached"))
            bt.add_row(pol, str(r["n"]), f"{r['all']:.1%}", f"{r.get('paid', 0):.1%}", f"{r.get('free', 0):.1%}", goal)
        console.print(bt)
    pool.shutdown()
    console.print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
