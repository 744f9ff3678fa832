"""Conversations on vLLM's prefix cache: scheduling policies on the same engine, in wall-clock time.

Multi-turn conversations (the Responses and Conversations APIs' traffic) send each turn with the
whole conversation before it, which vLLM's prefix cache mostly holds. This replays such a load
against the worker's vLLM engine in this process (``build_vllm_engine``, prefix caching on, as
the worker runs it), one policy per process:

* ``--conversations`` conversations, each ``--turns`` turns, all behind one system prompt of
  ``--system`` tokens; a turn adds ``--user`` new tokens to the conversation so far (its earlier
  prompts and answers) and answers ``--answer`` tokens; the next turn comes ``--think-s`` after
  the answer (closed loop per conversation, conversations started ``--stagger-s`` apart);
* beside them, fresh prompts of ``--fresh-len`` random tokens arrive Poisson at ``--fresh-qps``
  (nothing of them is cached), answering ``--answer`` tokens;
* every request is interactive, TTFT ``--ttft-s`` and TBT ``--tbt-s`` (paid), EOS ignored.

Printed per policy: TTFT p50/p99 of the conversations' first turns (with ``--stagger-s 0`` they
arrive together, behind a system prompt none of them finds cached), of the turns after the first
(the ones the cache holds) and of the fresh prompts, the share of requests whose every token met its deadline, the
prompt tokens found in the cache, output tok/s and the run's length.

    python ops/bench_prefix_reuse.py --policies qoserve vllm-fcfs
    python ops/bench_prefix_reuse.py --policies qoserve --fresh-qps 2 --out run.json
    python ops/bench_prefix_reuse.py --conversations 48 --turns 2 --stagger-s 0   # a burst behind one system prompt
    python ops/bench_prefix_reuse.py --simulate --out run.json   # beside the simulator, with and without its
                                                                 # model of the prefix cache
    python ops/bench_prefix_reuse.py --simulate --from-json run.json   # simulate saved runs again
    python ops/bench_prefix_reuse.py --tenants 4 --cache-scope shared   # what the per-tenant cache costs
    python ops/bench_prefix_reuse.py --system 96 --vllm-args='--block-size 32'   # a short system prompt, cached
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VOCAB = 49152


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


class WallClock:
    """The real engine's time."""

    now = staticmethod(time.time)

    @staticmethod
    def wait_until(t: float) -> None:
        time.sleep(max(0.0, min(0.05, t - time.time())))


class SimClock:
    """The simulated engine's time: waiting moves it on."""

    def __init__(self, executor) -> None:  # noqa: ANN001 - a SimExecutor
        self.executor = executor

    def now(self) -> float:
        return self.executor.now()

    def wait_until(self, t: float) -> None:
        self.executor.advance_to(t)


def run_one(args: argparse.Namespace) -> dict:
    """One policy's run on vLLM in this process: the load above, the per-request results, and the engine's KV
    pool and step limits (what a simulation of the run needs)."""
    from gpu_runtime.vllm.build import build_vllm_engine
    from gpu_runtime.vllm.cli_args import engine_cli_args

    step_log = Path(args.step_log) / f"{args.one}.jsonl" if args.step_log else None
    engine = build_vllm_engine(args.model, scheduler_policy=args.one, max_model_len=4096, cost_profile="auto",
                               enable_prefix_caching=True, step_log=step_log,
                               overrides=engine_cli_args(args.vllm_args))
    config = engine.llm.vllm_config
    run = drive(engine, WallClock(), args, args.one)
    run["engine"] = {"block_size": config.cache_config.block_size, "kv_blocks": config.cache_config.num_gpu_blocks,
                     "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
                     "max_num_seqs": config.scheduler_config.max_num_seqs}
    return run


def simulate_one(args: argparse.Namespace, measured: dict, profile: str, prefix_cache: bool) -> dict | None:
    """The same load through the simulator (the policy's code on a cost model of this CPU's vLLM, the measured
    run's KV pool and step limits, coserve's policies calibrating as the worker does); ``prefix_cache``: with the
    simulator's model of vLLM's prefix cache, else every prompt priced whole."""
    from gpu_runtime.costmodel.profile import scheduling_cost_model
    from gpu_runtime.sim.replay import SIMULATED, vllm_limits
    from gpu_runtime.sim.simulator import make_replica

    policy = SIMULATED.get(measured["policy"])
    if policy is None:
        return None
    eng = measured["engine"]
    extra = vllm_limits(policy, eng["max_num_batched_tokens"], eng["max_num_seqs"])
    model = scheduling_cost_model(profile)
    replica = make_replica(policy, policy, model, eng["kv_blocks"], eng["block_size"], prefix_caching=prefix_cache,
                           calibrate=not measured["policy"].startswith("vllm-"), **extra)
    return drive(replica.engine, SimClock(replica.executor), args, measured["policy"])


def drive(engine, clock, args: argparse.Namespace, policy: str) -> dict:  # noqa: ANN001 - either engine
    """The load above on ``engine`` (the worker's vLLM engine or a simulated one), in ``clock``'s time."""
    from gpu_runtime.qos import QoSClass, QoSSpec, Tier
    from gpu_runtime.request import Request
    from gpu_runtime.sampling import SamplingParams

    qos = QoSSpec(QoSClass.INTERACTIVE, Tier.PAID, ttft_s=args.ttft_s, tbt_s=args.tbt_s)
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, VOCAB) for _ in range(n)]

    # warm-up: one short request, untimed (the first steps of a fresh engine are slow)
    engine.add_request(Request("warm", tokens(32), SamplingParams(max_tokens=4, ignore_eos=True), qos,
                               arrival_time=clock.now()))
    while engine.has_work:
        engine.step()

    system = tokens(args.system)
    history = {c: list(system) for c in range(args.conversations)}
    turn = dict.fromkeys(range(args.conversations), 0)
    t0 = clock.now()
    due: list[tuple[float, str]] = []  # (arrival, request key)
    for c in range(args.conversations):
        heapq.heappush(due, (t0 + c * args.stagger_s, f"c{c}"))
    t = t0
    fresh = 0
    while True:
        t += rng.expovariate(args.fresh_qps) if args.fresh_qps > 0 else float("inf")
        if t > t0 + args.fresh_minutes * 60:
            break
        heapq.heappush(due, (t, f"f{fresh}"))
        fresh += 1
    prompts: dict[str, list[int]] = {}
    answers: dict[str, list[int]] = {}
    results: list[dict] = []
    kind: dict[str, str] = {}
    while due or engine.has_work:
        now = clock.now()
        while due and due[0][0] <= now:
            arrival, key = heapq.heappop(due)
            if key.startswith("c"):
                c = int(key[1:])
                history[c] += tokens(args.user)
                rid = f"{key}t{turn[c]}"
                kind[rid] = "first turn" if turn[c] == 0 else "later turn"
                ids = list(history[c])
            else:
                rid, ids = key, tokens(args.fresh_len)
                kind[rid] = "fresh"
            prompts[rid] = ids
            engine.add_request(Request(rid, ids, SamplingParams(max_tokens=args.answer, ignore_eos=True), qos,
                                       arrival_time=arrival, cache_salt=cache_salt(args, int(key[1:]))))
        if not engine.has_work:
            if due:
                clock.wait_until(due[0][0])
            continue
        for out in engine.step():
            answers.setdefault(out.request_id, []).extend(out.new_token_ids)
            m = out.metrics
            if m is None or out.request_id == "warm":
                continue
            rid = out.request_id
            results.append({"id": rid, "kind": kind[rid], "prompt": len(prompts[rid]), "ttft_s": m.ttft_s,
                            "slo_met": m.slo_met, "cached": getattr(m, "num_cached_tokens", 0),
                            "tokens": m.num_output_tokens, "finished": clock.now() - t0})
            if rid.startswith("c"):  # the conversation goes on after the answer
                c = int(rid[1:].split("t")[0])
                history[c] += answers[rid]
                turn[c] += 1
                if turn[c] < args.turns:
                    heapq.heappush(due, (clock.now() + args.think_s, f"c{c}"))
        if engine.idle and isinstance(clock, SimClock):  # nothing schedulable: simulated time waits for arrivals
            if not due:
                raise RuntimeError(f"{policy}: the simulated engine holds work it never schedules")
            clock.wait_until(due[0][0])
    return {"policy": policy, "elapsed_s": clock.now() - t0, "requests": results}


def cache_salt(args: argparse.Namespace, index: int) -> str | None:
    """The prefix-cache scope of conversation or fresh prompt ``index``: its tenant's (the worker's default,
    COSERVE_PREFIX_CACHE_SCOPE=tenant; tenants take the conversations in turn) or none (``--cache-scope shared``)."""
    tenants = getattr(args, "tenants", 1)
    return f"tenant-{index % tenants}" if getattr(args, "cache_scope", "shared") == "tenant" else None


def summary(run: dict) -> dict:
    reqs = run["requests"]
    out = {"policy": run["policy"], "elapsed_s": run["elapsed_s"], "n": len(reqs)}
    for k in ("first turn", "later turn", "fresh"):
        ttfts = [r["ttft_s"] for r in reqs if r["kind"] == k and r["ttft_s"] is not None]
        out[k] = (_pct(ttfts, 50), _pct(ttfts, 99), len(ttfts))
    out["met"] = sum(bool(r["slo_met"]) for r in reqs) / max(1, len(reqs))
    out["cached"] = sum(r["cached"] for r in reqs) / max(1, sum(r["prompt"] for r in reqs))
    out["tok_s"] = sum(r["tokens"] for r in reqs) / max(1e-9, run["elapsed_s"])
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", nargs="+", default=["qoserve", "vllm-fcfs"])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system", type=int, default=384, help="tokens of the system prompt all conversations share")
    ap.add_argument("--user", type=int, default=96, help="new tokens a turn adds")
    ap.add_argument("--answer", type=int, default=32, help="tokens each request generates")
    ap.add_argument("--think-s", type=float, default=1.0)
    ap.add_argument("--stagger-s", type=float, default=2.0)
    ap.add_argument("--fresh-qps", type=float, default=1.0)
    ap.add_argument("--fresh-len", type=int, default=768)
    ap.add_argument("--fresh-minutes", type=float, default=2.0, help="how long fresh prompts keep arriving")
    ap.add_argument("--ttft-s", type=float, default=2.0)
    ap.add_argument("--tbt-s", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tenants", type=int, default=1, help="tenants the conversations (and fresh prompts) belong "
                                                          "to, in turn")
    ap.add_argument("--cache-scope", choices=["tenant", "shared"], default="tenant",
                    help="whose prompts a prompt may reuse from the prefix cache (COSERVE_PREFIX_CACHE_SCOPE): its "
                         "tenant's (vLLM's cache_salt, the worker's default) or every tenant's")
    ap.add_argument("--out", default=None, help="every request's result, as JSON")
    ap.add_argument("--simulate", nargs="?", const="auto", default=None, metavar="PROFILE",
                    help="also run the load through the simulator on PROFILE (default: the vLLM profile of this CPU "
                         "the engine planned with), with and without its prefix-cache model, beside the measured")
    ap.add_argument("--from-json", default=None, metavar="FILE",
                    help="take the measured runs from FILE (an earlier --out, run with the same load options) "
                         "instead of running vLLM: with --simulate, simulates them again")
    ap.add_argument("--step-log", default=None, metavar="DIR",
                    help="write each policy's engine steps to DIR/POLICY.jsonl (coserve profile --from-steps reads it)")
    ap.add_argument("--vllm-args", default="", help="vLLM engine flags, as `coserve worker` takes them after its own "
                                                    "(e.g. '--block-size 32')")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run one policy here
    args = ap.parse_args(argv)
    if args.one:
        Path(args.out).write_text(json.dumps(run_one(args)))
        return
    runs = []
    if args.from_json:  # measured runs saved with --out (the same load options): simulate them again
        saved = json.loads(Path(args.from_json).read_text())
        runs = [r for r in saved if r.get("source", "measured") == "measured" and r["policy"] in args.policies]
    with tempfile.TemporaryDirectory() as tmp:
        for policy in [] if args.from_json else args.policies:  # one process per engine (vLLM's engine core
            out = Path(tmp) / f"{policy}.json"  # runs in the process, one per process)
            proc = subprocess.run([sys.executable, __file__, "--one", policy, "--out", str(out), *_passed(args)],
                                  cwd=ROOT, capture_output=True, text=True, timeout=3600)
            if proc.returncode != 0:
                raise SystemExit(f"{policy} failed:\n{proc.stderr[-3000:]}")
            runs.append(json.loads(out.read_text()))
    rows = [("measured", run) for run in runs]
    if args.simulate:
        from gpu_runtime.vllm.profiling import default_profile

        profile = default_profile() if args.simulate == "auto" else args.simulate  # the engine's "auto" choice
        if profile is None:
            raise SystemExit("no shipped vLLM profile fits this machine: pass --simulate PROFILE")
        for run in runs:
            for label, model in (("simulated", True), ("simulated, no prefix cache", False)):
                sim = simulate_one(args, run, profile, model)
                if sim is not None:
                    rows.append((f"{label} ({Path(profile).stem})", sim))
    if args.out:
        Path(args.out).write_text(json.dumps([{"source": source, **run} for source, run in rows]))
    table = Table(title=f"{args.conversations} conversations x {args.turns} turns beside fresh prompts at "
                        f"{args.fresh_qps}/s for {args.fresh_minutes} min; TTFT {args.ttft_s} s, TBT {args.tbt_s} s; "
                        f"{args.tenants} tenant(s), prefix cache scope {args.cache_scope}; KV block "
                        f"{'/'.join(sorted({str(r['engine']['block_size']) for r in runs if 'engine' in r})) or '-'}")
    for col in ("policy", "run", "first turns TTFT p50 / p99 s", "later turns TTFT p50 / p99 s",
                "fresh TTFT p50 / p99 s", "SLO met", "prompt cached", "output tok/s", "run s", "requests",
                "TTFT error vs measured"):
        table.add_column(col)
    measured = {run["policy"]: summary(run) for run in runs}
    for source, run in sorted(rows, key=lambda r: r[1]["policy"]):
        s = summary(run)

        def pair(k: str) -> str:
            p50, p99, n = s[k]
            return "-" if p50 is None else f"{p50:.2f} / {p99:.2f} ({n})"
        error = "-" if source == "measured" else f"{ttft_error(s, measured[s['policy']]):.1%}"
        table.add_row(s["policy"], source, pair("first turn"), pair("later turn"), pair("fresh"), f"{s['met']:.1%}",
                      f"{s['cached']:.1%}", f"{s['tok_s']:.1f}", f"{s['elapsed_s']:.0f}", str(s["n"]), error)
    Console(width=200).print(table)
    if args.simulate:
        print("TTFT error: mean absolute percentage error of the TTFT p50 and p99 of each kind of request, "
              "simulated against measured")


def ttft_error(sim: dict, measured: dict) -> float:
    """MAPE of the TTFT p50 and p99 per kind of request (first turns, later turns, fresh), where both have them."""
    errors = [abs(s - m) / m for k in ("first turn", "later turn", "fresh")
              for s, m in zip(sim[k][:2], measured[k][:2], strict=True) if s is not None and m]
    return sum(errors) / len(errors) if errors else float("nan")


def _passed(args: argparse.Namespace) -> list[str]:
    """The workload's options for a policy's own process."""
    out = []
    for name in ("model", "conversations", "turns", "system", "user", "answer", "think_s", "stagger_s", "fresh_qps",
                 "fresh_len", "fresh_minutes", "ttft_s", "tbt_s", "seed", "tenants", "cache_scope", "vllm_args"):
        out += [f"--{name.replace('_', '-')}={getattr(args, name)}"]
    if args.step_log:
        Path(args.step_log).mkdir(parents=True, exist_ok=True)
        out += ["--step-log", str(Path(args.step_log).resolve())]
    return out


if __name__ == "__main__":
    main()
