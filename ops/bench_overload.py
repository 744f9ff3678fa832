"""Sustained overload in simulation (issue 18 item 3): paid lateness against the capacity floor.

Poisson arrivals at a multiple of QoServe's goodput (default 9.45 QPS: conv, synthetic A100
8B profile, 120-minute capacity search with the backlog check in docs/BENCHMARKS.md, stop 21) for --minutes of
(SLO-scaled) time, QoServe's three tiers with --free-share of each tier free. Per policy:

- paid late / free late: share of the tier's jobs that missed their SLO or never finished
  (a relegated job that still finished within its SLO counts as on time, one that expired as late);
- paid late, not relegated: paid jobs the scheduler kept in normal service and still let slip
  (what a paid customer was promised; relegation is the scheduler saying "shed" up front);
- floor: about the least paid lateness capacity allows if it served paid work only. Steady:
  1 - goodput / (paid share x QPS) (0 when the paid load fits). Run: this run's paid jobs, the
  drain after the arrivals included, each worth 1/goodput seconds of the replica, served
  earliest deadline first by a server that drops a job the moment it cannot finish by its
  first deadline (eq. 1 / eq. 3), so every second it works makes a job on time. Both price
  every job as the mix's average one, so a policy that sheds long prompts first can beat them;
- relegated (paid/free), how many of them finished, how many expired (relegated jobs the
  scheduler gave up on: ``SchedulerOutput.expired``), how many were left unfinished;
- served QPS: jobs served (finished, not expired) per second over the last three quarters of the
  arrivals: what the replica really carried under this load (compare it with the goodput);
- free on time while paid late (the issue's "no free job finishing on time while a paid job
  that was waiting is late"): free jobs that met their SLO although a paid job that ended late
  was waiting (arrived, not finished) while the free job's prompt was computed (first chunk to
  first token): "prefill". "service" also counts the free job's decode: a decode that began
  before the paid job arrived (neither QoServe nor vLLM preempts a running decode for a later
  arrival).

Arrivals stop after --minutes; the queue then drains (relegated jobs run out of spare
capacity or expire), so "finished" counts jobs finished after the overload too.

    nice -n 10 .venv/bin/python ops/bench_overload.py --minutes 60 --loads 1.5,2.0 --policies qoserve,sarathi-edf
"""

from __future__ import annotations

import argparse
import logging
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from gpu_runtime.costmodel.profile import A100_PROFILE, resolve_profile, scheduling_cost_model, slo_scale
from gpu_runtime.metrics import slo_met
from gpu_runtime.qos import Tier
from gpu_runtime.request import Request
from gpu_runtime.scheduler.priority import first_deadline
from gpu_runtime.sim.capacity import late_floor
from gpu_runtime.sim.metrics import free_on_time_while_paid_late
from gpu_runtime.sim.runner import Experiment, simulate
from gpu_runtime.sim.workload import paper_tiers

log = logging.getLogger(__name__)

# docs/BENCHMARKS.md, stop 21: QoServe on conv, synthetic A100, 120-min runs whose backlog did not grow (stop 12's
# 10.54 kept the replica 100% busy serving ~9.8 jobs a second: its backlog grew, hidden by the 30-min deadlines)
CONV_GOODPUT_QPS = 9.45


@dataclass(frozen=True)
class OverloadRow:
    policy: str
    load: float  # x goodput
    qps: float
    n_paid: int
    n_free: int
    paid_late: int
    free_late: int
    paid_late_kept: int  # paid late and never relegated
    floor: float  # least paid late share capacity allows (steady state)
    run_floor: float  # the same for this run, drain included
    relegated_paid: int
    relegated_free: int
    relegated_finished: int
    relegated_on_time: int
    expired: int
    unfinished: int
    free_ok_while_paid_late: int  # ... while the free job's prompt was computed
    free_ok_while_paid_late_any: int  # ... while it was served at all (its decode included)
    served_qps: float  # jobs served (finished, not expired) per second over the last 3/4 of the arrivals
    wall_s: float


def _expired(req: Request) -> bool:
    # by value: the script also runs against code from before the expired status (docs/BENCHMARKS.md's "before")
    return req.status.value == "finished_expired"


def run_floor(reqs: list[Request], goodput: float) -> float:
    """Share of the paid jobs late even for the fluid server of the docstring (EDF, drop when infeasible)."""
    return late_floor([(r.arrival_time, first_deadline(r)) for r in reqs if r.qos.tier is Tier.PAID], goodput)


def run(policy: str, load: float, goodput: float, minutes: float, free_share: float, profile: str,
        seed: int, sched: dict) -> OverloadRow:
    t0 = time.time()
    cm = scheduling_cost_model(profile)
    scale = slo_scale(cm)
    qps = load * goodput
    exp = Experiment(trace="conv", num_requests=int(qps * minutes * 60 * scale), seed=seed)
    reqs = simulate(policy, cm, exp, paper_tiers(scale, free_share=free_share), qps=qps, **sched)
    paid = [r for r in reqs if r.qos.tier is Tier.PAID]
    free = [r for r in reqs if r.qos.tier is Tier.FREE]

    def late(r: Request) -> bool:
        return not (r.status.finished and not _expired(r) and slo_met(r))

    rel = [r for r in reqs if r.relegation_count]
    first, end = min(r.arrival_time for r in reqs), max(r.arrival_time for r in reqs)
    start = first + (end - first) / 4  # served QPS: over the last three quarters of the arrivals
    served = sum(1 for r in reqs if r.finish_time is not None and start <= r.finish_time <= end and not _expired(r))
    done = [r for r in rel if r.status.finished and not _expired(r)]
    paid_rate = qps * (1 - free_share)
    return OverloadRow(
        policy=policy, load=load, qps=qps, n_paid=len(paid), n_free=len(free),
        paid_late=sum(map(late, paid)), free_late=sum(map(late, free)),
        paid_late_kept=sum(1 for r in paid if late(r) and not r.relegation_count),
        floor=max(0.0, 1 - goodput / paid_rate) if paid_rate else 0.0, run_floor=run_floor(reqs, goodput),
        relegated_paid=sum(1 for r in rel if r.qos.tier is Tier.PAID),
        relegated_free=sum(1 for r in rel if r.qos.tier is Tier.FREE),
        relegated_finished=len(done), relegated_on_time=sum(1 for r in done if slo_met(r)),
        expired=sum(1 for r in reqs if _expired(r)),
        unfinished=sum(1 for r in reqs if not r.status.finished),
        free_ok_while_paid_late=free_on_time_while_paid_late(reqs),
        free_ok_while_paid_late_any=free_on_time_while_paid_late(reqs, whole_service=True),
        served_qps=served / max(1e-9, end - start), wall_s=time.time() - t0)


def _pct(k: int, n: int) -> str:
    return f"{k / n:.1%}" if n else "n/a"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", default="qoserve,sarathi-edf,sarathi-fcfs")
    ap.add_argument("--loads", default="1.5,2.0", help="multiples of --goodput")
    ap.add_argument("--goodput", type=float, default=CONV_GOODPUT_QPS, help="QoServe's goodput (QPS) on conv")
    ap.add_argument("--minutes", type=float, default=60.0, help="arrival span (x SLO scale)")
    ap.add_argument("--free-share", type=float, default=0.2)
    ap.add_argument("--profile", default=str(A100_PROFILE))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="scheduler config override for every policy that has the field (repeatable)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    profile = str(resolve_profile(args.profile))
    sched = {}
    for kv in args.set:
        k, v = kv.split("=", 1)
        sched[k] = {"true": True, "false": False}.get(v.lower(), v)
        if isinstance(sched[k], str):
            try:
                sched[k] = float(v) if "." in v else int(v)
            except ValueError:
                pass
    from gpu_runtime.scheduler.registry import config_fields

    jobs = []
    with ProcessPoolExecutor(args.workers) as pool:
        for load in (float(x) for x in args.loads.split(",")):
            for pol in args.policies.split(","):
                own = {k: v for k, v in sched.items() if k in config_fields(pol)}
                jobs.append(pool.submit(run, pol, load, args.goodput, args.minutes, args.free_share, profile,
                                        args.seed, own))
        rows = [j.result() for j in jobs]
    print(f"conv, {args.profile}, {args.minutes:g} min of Poisson arrivals (x SLO scale), "
          f"{args.free_share:.0%} free, goodput {args.goodput} QPS, seed {args.seed}")
    print("| load (QPS) | policy | paid late | floor: steady / run | paid late, not relegated | free late | "
          "relegated paid / free | relegated finished (on time) | expired | unfinished | "
          "free on time while paid late: prefill / service | served QPS | wall s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.load:g}x ({r.qps:.2f}) | {r.policy} | {_pct(r.paid_late, r.n_paid)} ({r.paid_late}/{r.n_paid}) "
              f"| {r.floor:.1%} / {r.run_floor:.1%} | {_pct(r.paid_late_kept, r.n_paid)} ({r.paid_late_kept}) "
              f"| {_pct(r.free_late, r.n_free)} ({r.free_late}/{r.n_free}) | {r.relegated_paid} / {r.relegated_free} "
              f"| {r.relegated_finished} ({r.relegated_on_time}) | {r.expired} | {r.unfinished} "
              f"| {r.free_ok_while_paid_late} / {r.free_ok_while_paid_late_any} | {r.served_qps:.2f} "
              f"| {r.wall_s:.0f} |")


if __name__ == "__main__":
    main()
