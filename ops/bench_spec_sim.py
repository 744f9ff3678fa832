"""Benchmark (b): AdaServe vs static speculation in simulation, RPS sweep.

AdaServe's SLO categories (section 6.1): coding 1.2x baseline TPOT, chat 50 ms,
summarization 150 ms (the latter two scaled to this profile's baseline step latency),
mixed 60/20/20 with Poisson arrivals.

``--stack engine`` (default) runs the full co-serving stack: Engine + QoServe scheduler
+ SimExecutor on the (SYNTHETIC) A100 Llama3-8B roofline cost model. ``--stack harness``
runs the decode-level harness (ops/bench_spec_harness.py, 70B-class roofline) instead.

``--drafter prompt-lookup`` (default) is the drafter whose acceptance is measured: the
per-category rates of the engine's PromptLookupDrafter on the real default model
(ops/measure_acceptance.py), charged its measured host CPU propose time per request
(``--measure-drafter`` re-times it here). ``--drafter draft-model`` charges
``--draft-cost-ms`` per tree level with an ASSUMED acceptance (no draft model's acceptance
is measured; the output says so). Every policy runs the same arrivals; the tables print
SLO attainment (TPOT target met and first token within the TTFT target: see ``_metrics``)
and goodput (tokens of the requests that attained, per second of the arrivals' span: the same time for every policy,
so a policy's longer drain after the last arrival costs it only the requests it made late).

Two comparisons, both printed: the paper's, of systems (coserve with AdaServe against
vLLM-Spec(n) and the static tree on vLLM-style scheduling: FCFS, decodes first, a 2048-token
budget per step that the decodes take first), and the speculation policy alone (every policy on coserve's scheduler).
The engine stack schedules each stream's TBT deadlines from its first token by default
(``--tbt-anchor``), the pace the scored mean TPOT measures; the vLLM-style scheduler has no
deadlines.

``--slo-scale`` multiplies every TPOT target (the paper's SLO scale; TTFT stays 10 s) and may
list several scales: each gets its own tables, and a last table sets AdaServe against the best
static policy (chain-n or static tree, on coserve's scheduler) at every scale and RPS.

    python ops/bench_spec_sim.py [--duration 60] [--rps 2 4 6 8] [--slo-scale 0.6 1.0 1.6]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_spec_harness import (DRAFTERS, Arrival, DrafterSpec, RooflineProfile, RunMetrics,  # noqa: E402
                                _metrics, acceptance_for, adaserve_slos, arrival_span, fmt_ratio,
                                measure_prompt_lookup_cost, poisson_arrivals, simulate)

from gpu_runtime.qos import TbtAnchor  # noqa: E402
from gpu_runtime.speculation.registry import create_policy  # noqa: E402

BASELINES = ["none", "chain-1", "chain-2", "chain-4", "chain-6", "static-tree"]


def simulate_engine(policy_name, arrivals: list[Arrival], cost_model, acceptance, draft_cost_s: float,
                    seed: int = 0, drafter: DrafterSpec | None = None,
                    score_until: float | None = None, scheduler: tuple[str, dict] = ("qoserve", {})) -> RunMetrics:
    """Engine + QoServe + SimExecutor: arrivals join at their time on the simulated clock."""
    from gpu_runtime.engine import Engine
    from gpu_runtime.executor.sim import SimExecutor
    from gpu_runtime.request import Request
    from gpu_runtime.sampling import SamplingParams
    from gpu_runtime.scheduler.registry import create_scheduler

    # The engine hands each request's app_id (its acceptance category) to the simulator.
    drafter = drafter or DrafterSpec("draft-model", model=True)  # callers that pass only draft_cost_s
    if drafter.model:
        ex = SimExecutor(cost_model, kv_blocks=30000, acceptance=acceptance, draft_cost_s=draft_cost_s, seed=seed)
    else:  # prompt lookup: host time per request, no device draft passes, nothing to catch up
        ex = SimExecutor(cost_model, kv_blocks=30000, acceptance=acceptance, seed=seed,
                         draft_cpu_s_per_request=drafter.cpu_s_per_request,
                         draft_cpu_s_per_context_token=drafter.cpu_s_per_context_token)
    policy = create_policy(policy_name) if isinstance(policy_name, str) else policy_name
    engine = Engine(ex, create_scheduler(scheduler[0], cost_model=cost_model, executor=ex, **scheduler[1]), policy)
    pending = sorted(arrivals, key=lambda a: a.time)
    reqs, info, busy, steps = [], {}, 0.0, 0
    i = 0
    while i < len(pending) or engine.has_work:
        while i < len(pending) and pending[i].time <= ex.now():
            a = pending[i]
            rid = f"q{i}"
            req = Request(rid, [1] * a.prompt_len, SamplingParams(max_tokens=a.output_len, ignore_eos=True),
                          a.qos, a.time, app_id=a.category)
            engine.add_request(req)
            reqs.append(req)
            info[rid] = a
            i += 1
        if not engine.has_work:
            ex.advance_to(pending[i].time)
            continue
        before = ex.now()
        engine.step()
        busy += ex.now() - before
        steps += 1
    # Every request counts: one that never produced output (rejected, aborted) is a violation.
    if score_until is not None:  # later arrivals are load only (see --tail)
        reqs = [r for r in reqs if info[r.request_id].time <= score_until]
    served = [r for r in reqs if r.num_output_tokens > 0]
    return _metrics(policy.name, reqs, info, arrival_span(arrivals, score_until), busy, steps,
                    sum(r.num_output_tokens for r in served))


SPEC_BASELINES = [b for b in BASELINES if b != "none"]  # vLLM-Spec(n) and the static tree
GOALS = (("SLO attainment", "attainment", 2.0), ("goodput", "goodput", 1.5))  # AdaServe vs best baseline


def print_goals(rows, versus: str = "", label: str = "") -> bool:
    """AdaServe's targets at the highest RPS: attainment >= 2x and goodput >= 1.5x the best
    of vLLM-Spec(n) and the static tree (paper: up to 4.3x fewer violations, 1.9x goodput).
    ``versus`` prefixes the baselines' result keys (``VLLM`` for the vLLM-style stack)."""
    rps, _, res = rows[-1]
    ok_all = True
    print(f"\ngoals at the highest RPS ({rps:g}), {label}:")
    for name, attr, need in GOALS:
        best = max(SPEC_BASELINES, key=lambda b: getattr(res[versus + b], attr))
        have, ref = getattr(res["adaserve"], attr), getattr(res[versus + best], attr)
        ok = have >= need * ref if ref > 0 else have > 0
        ok_all &= ok
        print(f"  {name:15s} >= {need:.1f}x: {fmt_ratio(have, ref):>6s} (best {best})  {'PASS' if ok else 'FAIL'}")
    return ok_all


# vLLM-Spec(n) and SpecInfer as systems: vLLM V1's scheduling on this A100 profile (FCFS, decodes
# first, chunked prefill with the API server's 2048-token budget, which the decodes and, as in vLLM, their
# speculative tokens take first: the engine hands the scheduler what each decode verified in the last pass).
VLLM = "vllm:"
VLLM_SCHEDULER = ("sarathi-fcfs", {"chunk_size": 2048})


def print_table(rows, names: list[str], prefix: str = "") -> None:
    print(f"{'RPS':>5s} {'reqs':>5s} " + " ".join(f"{n:>16s}" for n in names))
    for rps, n, res in rows:
        print(f"{rps:5.1f} {n:5d} " + " ".join(f"{res[prefix + k].attainment * 100:6.1f}% "
                                             f"{res[prefix + k].goodput:7.0f}t/s" for k in names))


def engine_setup():
    """The A100 8B cost model and AdaServe's SLOs scaled to its baseline decode step."""
    from gpu_runtime.costmodel.base import decode_step_time
    from gpu_runtime.costmodel.profile import A100_PROFILE, load_cost_model

    cost_model = load_cost_model(A100_PROFILE, ("piecewise-linear",))
    base = decode_step_time(cost_model, 16, 1500)
    scale = base / 0.040
    return cost_model, {"coding": 1.2 * base, "chat": 0.050 * scale, "summarization": 0.150 * scale}


def describe_drafter(drafter: DrafterSpec, draft_cost_ms: float | None) -> str:
    if drafter.model:
        cost = f"{draft_cost_ms:g} ms per tree level" if draft_cost_ms is not None else "the profile's draft steps"
        return (f"drafter: draft model, {cost}; acceptance ASSUMED "
                f"(geometric, {drafter.assumed_alpha:g} per depth; not measured)")
    return (f"drafter: prompt lookup, measured acceptance (acceptance.json), host cost "
            f"{drafter.cpu_s_per_request * 1e6:.1f} us/request + "
            f"{drafter.cpu_s_per_context_token * 1e9:.0f} ns/context token")


def report(rows, names: list[str], stack: str, vllm_stack: bool) -> None:
    """The tables of one SLO scale: every policy by RPS, the goals, attainment per category."""
    print(f"\nSLO attainment and goodput, every policy on {stack}:")
    print_table(rows, names)
    if vllm_stack:
        print("\nthe baselines as systems: vLLM-style scheduling (FCFS, decodes first, 2048 tokens per step):")
        print_table(rows, BASELINES, VLLM)
    print("\nTPOT-only attainment (the paper's definition; counts requests deferred past their TTFT target):")
    for rps, n, res in rows:
        print(f"{rps:5.1f} " + " ".join(f"{k} {res[k].attainment_tpot * 100:5.1f}%" for k in names))
    if vllm_stack:
        print_goals(rows, VLLM, "coserve + AdaServe vs vLLM-Spec(n) and the static tree as systems "
                                "(the paper's comparison)")
    print_goals(rows, "", f"AdaServe vs the static policies on the same {stack} (speculation policy alone)")
    print("\nper category attainment at the highest RPS (attained/total):")
    _, _, res = rows[-1]
    for k, m in res.items():
        print(f"  {k:17s} " + "  ".join(f"{c}: {a}/{t}" for c, (a, t) in sorted(m.by_category.items()))
              + f"   tokens/step {m.tokens_per_step:.2f}")


def pool_runs(runs: list[RunMetrics]) -> RunMetrics:
    """One policy's runs over several seeds as one: counts summed, goodput over the summed spans."""
    if len(runs) == 1:
        return runs[0]
    out = RunMetrics(runs[0].policy)
    for m in runs:
        for f in ("requests", "attained", "attained_tpot", "output_tokens", "goodput_tokens", "makespan_s",
                  "busy_s", "steps"):
            setattr(out, f, getattr(out, f) + getattr(m, f))
        for cat, (a, t) in m.by_category.items():
            got, tot = out.by_category.get(cat, (0, 0))
            out.by_category[cat] = (got + a, tot + t)
    out.tokens_per_step = sum(m.tokens_per_step * m.steps for m in runs) / max(1, out.steps)
    out.mean_tpot_s = sum(m.mean_tpot_s * m.requests for m in runs) / max(1, out.requests)
    return out


def best_static(res: dict[str, RunMetrics]) -> str:
    """The static policy (chain-n or static tree) with the highest attainment, goodput breaking ties."""
    return max(SPEC_BASELINES, key=lambda b: (res[b].attainment, res[b].goodput))


def print_scale_table(by_scale, duration_s: float, seeds: int = 1) -> None:
    """AdaServe against the best static shape at each SLO scale (goal: never below it)."""
    print(f"\nAdaServe vs the best static shape by SLO scale ({duration_s:g} s of arrivals per run, "
          f"{seeds} seed{'s' if seeds > 1 else ''} pooled; attainment, goodput):")
    print(f"{'scale':>5s} {'RPS':>5s} {'none':>16s} {'best static':>28s} {'adaserve':>16s} {'vs best':>8s}  goal")
    ok_all = True
    for scale, rows in by_scale:
        for rps, _, res in rows:
            best = best_static(res)
            a, b = res["adaserve"], res[best]
            ok = a.attainment >= b.attainment
            ok_all &= ok
            cell = f"{b.attainment * 100:5.1f}% {b.goodput:5.0f}t/s ({best})"
            ratio = fmt_ratio(a.attainment, b.attainment)
            print(f"{scale:5.2f} {rps:5.1f} {res['none'].attainment * 100:6.1f}% {res['none'].goodput:5.0f}t/s "
                  f"{cell:>28s} {a.attainment * 100:6.1f}% {a.goodput:5.0f}t/s {ratio:>8s}  {'PASS' if ok else 'FAIL'}")
    print(f"AdaServe >= the best static shape at every scale: {'PASS' if ok_all else 'FAIL'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per run")
    ap.add_argument("--rps", type=float, nargs="+", default=[4.0, 6.0, 8.0, 10.0])
    ap.add_argument("--slo-scale", type=float, nargs="+", default=[1.0],
                    help="multiply every TPOT target by this (AdaServe's SLO scale; TTFT unchanged); several values "
                         "run a sweep and end with AdaServe vs the best static shape per scale")
    ap.add_argument("--seed", type=int, nargs="+", default=[0],
                    help="arrival and acceptance seeds; with several, each policy's runs are pooled (attainment over "
                         "all their requests, goodput over their summed spans)")
    ap.add_argument("--stack", choices=["engine", "harness"], default="engine")
    ap.add_argument("--drafter", choices=sorted(DRAFTERS), default="prompt-lookup",
                    help="prompt-lookup: measured acceptance and CPU cost; draft-model: assumed acceptance")
    ap.add_argument("--draft-cost-ms", type=float, default=0.2,
                    help="engine stack, --drafter draft-model: draft time per tree level")
    ap.add_argument("--tail", type=float, default=0.0,
                    help="seconds of further arrivals after --duration that load the system but are not "
                         "scored (removes the drain at the end of a run; engine stack)")
    ap.add_argument("--tbt-anchor", choices=[a.value for a in TbtAnchor], default=TbtAnchor.FIRST_TOKEN.value,
                    help="engine stack: where the scheduler starts each request's TBT deadlines. first-token "
                         "(default) paces every stream from its first token, which is what the mean TPOT scored "
                         "here measures; arrival is QoServe's eq. 2 (t_arr + TTFT), which lets the scheduler "
                         "spend the loose 10-s TTFT target mid-stream")
    ap.add_argument("--vllm-stack", action=argparse.BooleanOptionalAction, default=True,
                    help="engine stack: also run the static baselines on vLLM-style scheduling, the systems the "
                         "paper compares against")
    ap.add_argument("--also", nargs="*", default=[], metavar="POLICY",
                    help="more speculation policies to run on coserve's stack (e.g. adaspec nightjar)")
    ap.add_argument("--config", nargs="*", default=[], metavar="POLICY=JSON",
                    help="config fields of a speculation policy on coserve's stack, e.g. "
                         "adaspec='{\"spare_free_beside_prefill\": true}'")
    ap.add_argument("--measure-drafter", action="store_true",
                    help="time PromptLookupDrafter.propose on this host and use that cost")
    args = ap.parse_args()
    configs = {name: json.loads(fields) for name, fields in (c.split("=", 1) for c in args.config)}
    profile = RooflineProfile()
    drafter = DRAFTERS[args.drafter]
    if args.measure_drafter and not drafter.model:
        per_req, per_tok = measure_prompt_lookup_cost()
        drafter = DrafterSpec(drafter.name, model=False, cpu_s_per_request=per_req, cpu_s_per_context_token=per_tok)
    acceptance = acceptance_for(drafter)
    vllm_stack = args.stack == "engine" and args.vllm_stack
    if args.stack == "engine":
        cost_model, slos = engine_setup()

        def run(name, arrivals, seed, scheduler=("qoserve", {})):
            policy = create_policy(name, **configs[name]) if name in configs else name
            return simulate_engine(policy, arrivals, cost_model, acceptance, args.draft_cost_ms / 1e3, seed,
                                   drafter=drafter, score_until=args.duration if args.tail > 0 else None,
                                   scheduler=scheduler)
    else:
        slos = adaserve_slos(profile)

        def run(name, arrivals, seed, scheduler=None):
            return simulate(create_policy(name), arrivals, profile, acceptance, seed=seed, drafter=drafter)
    print(describe_drafter(drafter, args.draft_cost_ms if args.stack == "engine" else None))
    print("TPOT SLOs (ms): " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in slos.items())
          + (f"; TTFT 10 s; TBT deadlines from {args.tbt_anchor}" if args.stack == "engine" else ""))
    t0 = time.perf_counter()
    names = [*BASELINES, "adaserve", *args.also]
    stack = "coserve (QoServe scheduler)" if args.stack == "engine" else "decode-level harness"
    by_scale = []
    for scale in args.slo_scale:
        scaled = {k: v * scale for k, v in slos.items()}
        rows = []
        for rps in args.rps:
            runs: dict[str, list[RunMetrics]] = {}
            for seed in args.seed:
                arrivals = poisson_arrivals(rps, args.duration + (args.tail if args.stack == "engine" else 0.0),
                                            scaled, seed=seed, tbt_anchor=TbtAnchor(args.tbt_anchor))
                for name in names:
                    runs.setdefault(name, []).append(run(name, arrivals, seed))
                if vllm_stack:
                    for name in BASELINES:
                        runs.setdefault(VLLM + name, []).append(run(name, arrivals, seed, VLLM_SCHEDULER))
            res = {name: pool_runs(ms) for name, ms in runs.items()}
            rows.append((rps, res["none"].requests, res))
        if len(args.slo_scale) > 1 or scale != 1.0:
            print(f"\n===== SLO scale x{scale:g}: TPOT SLOs (ms) "
                  + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in scaled.items()) + " =====")
        report(rows, names, stack, vllm_stack)
        by_scale.append((scale, rows))
    if len(by_scale) > 1:
        print_scale_table(by_scale, args.duration, len(args.seed))
    runs = sum(len(rows) * len(rows[0][2]) for _, rows in by_scale) * len(args.seed)
    print(f"\n(simulated {runs} runs in {time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
