"""A Prometheus collector that reads the jobs and workers tables at scrape time.

Workers are separate processes (and machines); rather than prometheus multiprocess mode,
the API derives every metric from SQL, the source of truth: gauges from the current job
states and worker heartbeats, histograms and counters from the finished jobs' metrics.
Names follow vLLM's (``vllm:`` -> ``coserve:``) where one exists.
"""

from __future__ import annotations

import bisect
import logging
from collections import defaultdict
from collections.abc import Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import func, select

from app.db.models import Job, JobStatus, WorkerState
from app.db.session import session_scope
from app.services.transitions import as_utc, utcnow

log = logging.getLogger(__name__)

# bucket edges as vLLM uses for the same quantities
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0, 28800.0, 86400.0)
WAITING = (JobStatus.QUEUED.value, JobStatus.DISPATCHED.value)


def histogram_buckets(values: Sequence[float], edges: Sequence[float]) -> list[tuple[str, float]]:
    """Cumulative (le, count) pairs, ending with +Inf."""
    ordered = sorted(values)
    out = [(repr(float(e)), float(bisect.bisect_right(ordered, e))) for e in edges]
    out.append(("+Inf", float(len(ordered))))
    return out


class SqlCollector(Collector):
    def __init__(self, url: str, model_name: str) -> None:
        self.url, self.model_name = url, model_name

    def collect(self) -> Iterator:
        with session_scope(self.url) as s:
            by_state = s.execute(select(Job.status, Job.tier, func.count()).group_by(Job.status, Job.tier)).all()
            finished = s.execute(select(
                Job.tier, Job.kind, Job.ttft_s, Job.tbt_p50_s, Job.ttlt_s, Job.created_at, Job.started_at,
                Job.slo_met, Job.finish_reason, Job.prompt_tokens, Job.completion_tokens, Job.status,
            ).where(Job.finished_at.is_not(None))).all()
            workers = list(s.scalars(select(WorkerState)))
        yield from self._gauges(by_state, workers)
        yield from self._histograms(finished)
        yield from self._counters(finished)

    def _gauges(self, by_state, workers) -> Iterator:
        labels = ["model_name", "tier"]
        running = GaugeMetricFamily("coserve:num_requests_running", "Jobs running on a worker.", labels=labels)
        waiting = GaugeMetricFamily("coserve:num_requests_waiting", "Jobs queued or dispatched, not yet running.",
                                    labels=labels)
        relegated = GaugeMetricFamily("coserve:num_requests_relegated",
                                      "Jobs relegated by the scheduler (QoServe eager relegation).", labels=labels)
        acc: dict[tuple[str, str], float] = defaultdict(float)
        for status, tier, n in by_state:
            kind = ("running" if status == JobStatus.RUNNING else "relegated" if status == JobStatus.RELEGATED
                    else "waiting" if status in WAITING else None)
            if kind:
                acc[(kind, tier)] += n
        tiers = sorted({t for _s, t, _n in by_state})
        for fam, kind in ((running, "running"), (waiting, "waiting"), (relegated, "relegated")):
            for tier in tiers:
                fam.add_metric([self.model_name, tier], acc.get((kind, tier), 0.0))
            yield fam
        kv = GaugeMetricFamily("coserve:kv_cache_usage_perc", "KV-cache usage per worker (1 = full).",
                               labels=["worker"])
        up = GaugeMetricFamily("coserve:worker_heartbeat_age_seconds", "Seconds since the worker's last heartbeat.",
                               labels=["worker", "draining"])
        now = utcnow()
        for w in workers:
            state = w.state or {}
            if state.get("kv_usage") is not None:
                kv.add_metric([w.id], float(state["kv_usage"]))
            up.add_metric([w.id, str(bool(w.draining)).lower()], (now - as_utc(w.heartbeat_at)).total_seconds())
        yield kv
        yield up

    def _histograms(self, finished) -> Iterator:
        series = {
            "ttft": ("coserve:time_to_first_token_seconds", "Time to first token, per finished job.", TTFT_BUCKETS,
                     lambda r: r.ttft_s),
            "tpot": ("coserve:time_per_output_token_seconds",
                     "Median time between output tokens, per finished job.", TPOT_BUCKETS, lambda r: r.tbt_p50_s),
            "e2e": ("coserve:e2e_request_latency_seconds", "Submission to last token, per finished job.",
                    E2E_BUCKETS, lambda r: r.ttlt_s),
            "queue": ("coserve:request_queue_time_seconds", "Submission to the worker's lease, per finished job.",
                      E2E_BUCKETS, lambda r: (as_utc(r.started_at) - as_utc(r.created_at)).total_seconds()
                      if r.started_at and r.created_at else None),
        }
        for name, doc, edges, get in series.values():
            fam = HistogramMetricFamily(name, doc, labels=["model_name", "tier", "kind"])
            groups: dict[tuple[str, str], list[float]] = defaultdict(list)
            for r in finished:
                v = get(r)
                if v is not None:
                    groups[(r.tier, r.kind)].append(float(v))
            for (tier, kind), values in sorted(groups.items()):
                fam.add_metric([self.model_name, tier, kind], histogram_buckets(values, edges), sum(values))
            yield fam

    def _counters(self, finished) -> Iterator:
        slo = CounterMetricFamily("coserve:slo_attainment", "Finished jobs that met or violated their SLO, by tier.",
                                  labels=["model_name", "tier", "kind", "outcome"])
        success = CounterMetricFamily("coserve:request_success", "Finished jobs by finish reason.",
                                      labels=["model_name", "finished_reason"])
        outcome = CounterMetricFamily("coserve:request_outcome", "Terminal jobs by status.",
                                      labels=["model_name", "status"])
        prompt = CounterMetricFamily("coserve:prompt_tokens", "Prompt tokens of finished jobs.", labels=["model_name"])
        gen = CounterMetricFamily("coserve:generation_tokens", "Generated tokens of finished jobs.",
                                  labels=["model_name"])
        slo_acc: dict[tuple[str, str, str], int] = defaultdict(int)
        reasons: dict[str, int] = defaultdict(int)
        statuses: dict[str, int] = defaultdict(int)
        p = g = 0
        for r in finished:
            statuses[r.status] += 1
            if r.status == JobStatus.SUCCEEDED:
                reasons[r.finish_reason or "stop"] += 1
                p += r.prompt_tokens or 0
                g += r.completion_tokens or 0
            if r.slo_met is not None:
                slo_acc[(r.tier, r.kind, "met" if r.slo_met else "violated")] += 1
            elif r.status == JobStatus.EXPIRED:
                slo_acc[(r.tier, r.kind, "violated")] += 1
        for (tier, kind, out), n in sorted(slo_acc.items()):
            slo.add_metric([self.model_name, tier, kind, out], n)
        for reason, n in sorted(reasons.items()):
            success.add_metric([self.model_name, reason], n)
        for status, n in sorted(statuses.items()):
            outcome.add_metric([self.model_name, status], n)
        prompt.add_metric([self.model_name], p)
        gen.add_metric([self.model_name], g)
        yield from (slo, success, outcome, prompt, gen)
