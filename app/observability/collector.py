"""A Prometheus collector that reads the jobs and workers tables at scrape time.

Workers are separate processes (and machines); rather than prometheus multiprocess mode,
the API derives every metric from SQL, the source of truth: gauges from the current job
states and worker heartbeats, histograms and counters from the finished jobs' metrics.
Names follow vLLM's (``vllm:`` -> ``coserve:``) where one exists, and where the workers do not run vLLM (which
exports those itself) the series are exported under vLLM's own ``vllm:`` name too (``VLLM_ALIASES``).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import case, func, literal_column, select
from sqlalchemy.orm import Session

from app.db.models import INVALID_REQUEST, Job, JobStatus, WorkerState
from app.db.session import DATABASE_ERRORS, database_unavailable, session_scope, unavailable_reason
from app.observability import tally
from app.observability.engine_metrics import INTER_TOKEN_LATENCY_BUCKETS
from app.observability.tally import Groups, Summed
from app.services import routing
from app.services.transitions import NOT_TERMINAL, as_utc, utcnow

log = logging.getLogger(__name__)

# bucket edges as vLLM uses for the same quantities
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = INTER_TOKEN_LATENCY_BUCKETS
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
# coserve's own names add edges for the batch jobs, whose window is up to a day; under vLLM's names the series has
# vLLM's edges alone (VLLM_BUCKETS), as a dashboard built for vLLM reads them
E2E_BUCKETS = (*REQUEST_LATENCY_BUCKETS, 28800.0, 86400.0)
# (name, help, bucket edges) of the histograms of finished jobs (their values: SqlCollector._summed)
HISTOGRAMS = (
    ("coserve:time_to_first_token_seconds", "Time to first token, per finished job (one cancelled after its first "
     "token too).", TTFT_BUCKETS),
    ("coserve:time_per_output_token_seconds", "Median time between output tokens, per finished job.", TPOT_BUCKETS),
    ("coserve:request_time_per_output_token_seconds", "Mean time per output token after the first (first token to "
     "last, over the tokens after the first; 0 for one token), per finished job.", TPOT_BUCKETS),
    ("coserve:e2e_request_latency_seconds", "Submission to last token, per finished job.", E2E_BUCKETS),
    ("coserve:request_queue_time_seconds", "Submission to the engine running the first chunk of the prompt, per "
     "finished job (one cancelled after that too).", E2E_BUCKETS),
)
WAITING = (JobStatus.QUEUED.value, JobStatus.DISPATCHED.value)


def _literal(text: str):
    return literal_column(f"'{text}'")


# a finished job's vLLM finished_reason (vllm.v1.engine.FinishReason: stop, length, abort, error, repetition):
# a succeeded one's own (one without a recorded reason stopped on EOS/stop), abort for a cancelled or expired one
# (vLLM ends a request its scheduler gives up on as an abort), error for a failed one. One expression object of
# literals, not bind parameters, so SELECT, GROUP BY and ORDER BY render identically: with server-side binding
# (PostgreSQL) three separate "stop" parameters are three different expressions and GROUP BY rejects the SELECT list
FINISH_REASON = case((Job.status == _literal(JobStatus.SUCCEEDED.value), func.coalesce(Job.finish_reason,
                                                                                        _literal("stop"))),
                     (Job.status == _literal(JobStatus.FAILED.value), _literal("error")),
                     else_=_literal("abort")).label("finish_reason")


# coserve's metrics that mean what vLLM's of the same name mean are also exported under vLLM's name, so a
# dashboard built for vLLM reads them (coserve's carry extra tier/kind labels). Not aliased:
# time_per_output_token (each job's median gap: not vLLM's request_time_per_output_token, each request's mean,
# exported as request_time_per_output_token; nor its inter_token_latency, each gap, which the jobs' rows do not keep:
# the own engine's workers observe it, engine_metrics.OwnEngineSeries)
# and coserve's own relegation, SLO and heartbeat series, which vLLM has no name for.
# Nor the jobs' states (running: leased by a worker, up to COSERVE_MAX_INFLIGHT of them, most waiting in its engine):
# vLLM's num_requests_running and num_requests_waiting are each engine's batch and queue, which the own engine's
# workers export (engine_metrics.OwnEngineSeries) as vLLM's do.
VLLM_ALIASES = {f"coserve:{n}": f"vllm:{n}" for n in (
    "kv_cache_usage_perc", "num_preemptions",
    "time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
    "request_time_per_output_token_seconds", "request_success", "prompt_tokens", "prompt_tokens_cached",
    "generation_tokens")}
# vLLM's prefix cache counters (its dashboards' hit rate is their ratio) count the prompt tokens of each request once
# (not again after a preemption), looked up and found in the cache: the jobs' prompt and cached tokens, under
# another name of coserve's
VLLM_PREFIX_CACHE = {"coserve:prompt_tokens": "vllm:prefix_cache_queries",
                     "coserve:prompt_tokens_cached": "vllm:prefix_cache_hits"}


def vllm_names(name: str) -> list[str]:
    """The vLLM names coserve's series ``name`` is exported under too (none: coserve's own)."""
    return [n for n in (VLLM_ALIASES.get(name), VLLM_PREFIX_CACHE.get(name)) if n is not None]


# the bucket edges of vLLM's histograms coserve's are aliased to (vllm/v1/metrics/buckets.py)
VLLM_BUCKETS = {"vllm:time_to_first_token_seconds": TTFT_BUCKETS,
                "vllm:request_time_per_output_token_seconds": TPOT_BUCKETS,
                "vllm:e2e_request_latency_seconds": REQUEST_LATENCY_BUCKETS,
                "vllm:request_queue_time_seconds": REQUEST_LATENCY_BUCKETS}


def vllm_alias(family: Metric, name: str) -> Metric:
    """The same series under vLLM's ``name``; a histogram's at vLLM's edges alone (the counts are cumulative, so
    leaving an edge out leaves the others' counts as they are)."""
    alias = Metric(name, family.documentation + " (vLLM's name)", family.type)
    edges = {repr(float(e)) for e in VLLM_BUCKETS.get(name, ())} | {"+Inf"}
    for smp in family.samples:
        if name in VLLM_BUCKETS and smp.name.endswith("_bucket") and smp.labels.get("le") not in edges:
            continue
        alias.add_sample(name + smp.name[len(family.name):], smp.labels, smp.value, smp.timestamp, smp.exemplar)
    return alias


def database_up(up: bool) -> GaugeMetricFamily:
    family = GaugeMetricFamily("coserve:database_up", "1 where this scrape read the database; 0: it could not be "
                               "reached, and the series derived from it are missing.")
    family.add_metric([], 1.0 if up else 0.0)
    return family


@dataclass
class Tables:
    """What one scrape read from the database."""

    by_state: list  # (status, tier, jobs) of the model's jobs not yet ended
    workers: list[WorkerState]  # the live ones of the deployment's model
    totals: dict[str, Groups]  # the finished jobs' sums (SqlCollector._summed)


class SqlCollector(Collector):
    def __init__(self, url: str, model_name: str, tiers: Sequence[str] | None = None, *,
                 models: Sequence[str] | None = None, vllm_aliases: bool = True,
                 live_since: datetime | None = None) -> None:
        """``tiers``: the configured tiers, each gets its gauge series (zero when it has no jobs).
        ``models``: the jobs' models counted, under ``model_name`` (the model's and its adapters', as vLLM counts an
        adapter's requests under its model; default: ``model_name``'s alone): other models on the same database are
        their own deployments'. ``vllm_aliases``: the series under vLLM's names too (off where the workers run vLLM,
        which exports them itself). ``live_since``: workers whose last heartbeat is older are lost, left out."""
        if tiers is None:
            from app.settings import get_settings

            tiers = get_settings().tiers
        self.url, self.model_name, self.tiers = url, model_name, tuple(tiers)
        self.models = tuple(models) if models is not None else (model_name,)
        self.vllm_aliases, self.live_since = vllm_aliases, live_since

    @cached_property
    def tables(self) -> Tables | None:
        """The scrape's reads (made once); None where the database could not serve them (``database_unavailable``)."""
        try:
            return self._query()
        except DATABASE_ERRORS as exc:
            if not database_unavailable(exc):
                raise  # a statement's own failure: a defect
            log.warning("/metrics: the database is unavailable (%s)", unavailable_reason(exc))
            return None

    @property
    def vllm_names(self) -> frozenset[str]:
        """The vLLM names this collector exports its series under (none where ``vllm_aliases`` is off, or where the
        database could not be read: the series are missing then)."""
        if not self.vllm_aliases or self.tables is None:
            return frozenset()
        return frozenset(VLLM_ALIASES.values()) | frozenset(VLLM_PREFIX_CACHE.values())

    def live_workers(self) -> list[str] | None:
        """The deployment's live workers' ids; None where the database could not be reached."""
        tables = self.tables
        return None if tables is None else [w.id for w in tables.workers]

    def _query(self) -> Tables:
        # every aggregate is computed by the database, over the jobs not yet ended and those finished since the
        # horizon of the totals kept (app.observability.tally): a scrape costs a few grouped index scans, not a pass
        # over every job
        workers = select(WorkerState)
        if self.live_since is not None:
            workers = workers.where(WorkerState.heartbeat_at >= self.live_since)
        with session_scope(self.url) as s:
            # by status alone, the models picked here: the planner then takes the status index (SQLite, without
            # statistics, took the model's, a pass over every job the model ever had)
            live = s.execute(select(Job.status, Job.tier, Job.model, func.count(), func.sum(Job.relegation_count))
                             .where(Job.status.in_([st.value for st in NOT_TERMINAL]))
                             .group_by(Job.status, Job.tier, Job.model)).all()
            by_state = [(status, tier, n) for status, tier, model, n, _relegations in live if model in self.models]
            scope = tally.scope_of(self.model_name)
            start = tally.kept(s, scope)
            models = tally.counted(start, self.models)  # those counted before too: no counter goes back
            totals, after = tally.totals(s, start, self._summed(s, models), models)
            # the relegations counter: the ended jobs' (kept) and those of the jobs not ended yet, read afresh; a
            # job's count only grows, and moves from the one to the other as it ends, so the sum never goes back
            for _status, tier, model, _n, relegations in live:
                if model in models:
                    tally.add(totals["relegations"], (tier,), (relegations,))
            # the deployment's own workers: another model's deployment on the same database exports its own
            own = [w for w in s.scalars(workers.order_by(WorkerState.id)) if self.model_name in w.served]
            tables = Tables(by_state, own, totals)
        tally.keep(self.url, scope, start, after)
        return tables

    def collect(self) -> Iterator:
        tables = self.tables
        yield database_up(tables is not None)
        if tables is None:
            return
        for family in (*self._gauges(tables.by_state, tables.workers), *self._histograms(tables.totals),
                       *self._counters(tables.totals)):
            yield family
            if self.vllm_aliases:
                yield from (vllm_alias(family, name) for name in vllm_names(family.name))

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
        # every configured tier, so dashboards see 0 rather than a missing series
        tiers = sorted(set(self.tiers) | {t for _s, t, _n in by_state})
        for fam, kind in ((running, "running"), (waiting, "waiting"), (relegated, "relegated")):
            for tier in tiers:
                fam.add_metric([self.model_name, tier], acc.get((kind, tier), 0.0))
            yield fam
        # model_name as on vLLM's series (its dashboards select by it), then the worker
        per_worker = ["model_name", "worker"]
        kv = GaugeMetricFamily("coserve:kv_cache_usage_perc", "KV-cache usage per worker (1 = full).",
                               labels=per_worker)
        up = GaugeMetricFamily("coserve:worker_heartbeat_age_seconds", "Seconds since the worker's last heartbeat "
                               "(draining: an operator's drain; stopping: a warm shutdown's grace).",
                               labels=[*per_worker, "draining", "stopping"])
        preempt = CounterMetricFamily("coserve:num_preemptions", "Requests whose KV the worker's engine released "
                                      "under memory pressure, to recompute later (since the worker started).",
                                      labels=per_worker)
        pool_short = CounterMetricFamily("coserve:spec_decode_num_draft_pool_short", "Requests the worker's draft "
                                         "model drafted a shallower token tree for, or none, because its KV pool "
                                         "was short (since the worker started).", labels=per_worker)
        routed = GaugeMetricFamily("coserve:worker_routed_jobs_waiting", "Jobs prefix routing sent the worker that "
                                   "wait on its own queue (at its last heartbeat).", labels=per_worker)
        set_aside = GaugeMetricFamily("coserve:worker_set_aside_jobs", "Job attempts the worker set aside: their "
                                      "abort its engine has not confirmed (at its last heartbeat).",
                                      labels=per_worker)
        now = utcnow()
        for w in workers:
            state = w.state or {}
            if state.get("set_aside_jobs") is not None:
                set_aside.add_metric([self.model_name, w.id], float(state["set_aside_jobs"]))
            if state.get("routed_waiting") is not None:
                routed.add_metric([self.model_name, w.id], float(state["routed_waiting"]))
            if state.get("kv_usage") is not None:
                kv.add_metric([self.model_name, w.id], float(state["kv_usage"]))
            if state.get("kv_recomputes") is not None:
                preempt.add_metric([self.model_name, w.id], float(state["kv_recomputes"]))
            if state.get("draft_pool_short") is not None:
                pool_short.add_metric([self.model_name, w.id], float(state["draft_pool_short"]))
            up.add_metric([self.model_name, w.id, str(bool(w.draining)).lower(),
                           str(routing.stopping(w.state)).lower()], (now - as_utc(w.heartbeat_at)).total_seconds())
        yield kv
        yield up
        yield preempt
        yield pool_short
        yield routed
        yield set_aside

    def _summed(self, s: Session, models: Sequence[str]) -> dict[str, Summed]:
        """The additive reads of ``models``' finished jobs, by name: each histogram's and each counter's."""
        # the engine's queue time (submission to the first prompt chunk); rows written before workers recorded it
        # fall back to submission to the worker's lease
        queue_s = func.coalesce(Job.queue_s, seconds_between(s.get_bind().dialect.name, Job.created_at,
                                                             Job.started_at))
        served, finished = Job.model.in_(models), Job.finished_at.is_not(None)
        values = {"coserve:time_to_first_token_seconds": Job.ttft_s,
                  "coserve:time_per_output_token_seconds": Job.tbt_p50_s,
                  "coserve:request_time_per_output_token_seconds": mean_time_per_output_token(),
                  "coserve:e2e_request_latency_seconds": Job.ttlt_s, "coserve:request_queue_time_seconds": queue_s}
        histograms = {name: Summed(histogram_query(values[name], edges, served), keys=2)
                      for name, _doc, edges in HISTOGRAMS}
        return {**histograms,
                "slo": Summed(select(Job.tier, Job.kind, Job.slo_met, func.count())
                              .where(finished, served, Job.slo_met.is_not(None))
                              .group_by(Job.tier, Job.kind, Job.slo_met), keys=3),
                "relegations": Summed(select(Job.tier, func.sum(Job.relegation_count)).where(finished, served)
                                      .group_by(Job.tier), keys=1),
                "success": Summed(success_query(served), keys=1),
                "tokens": Summed(tokens_query(served), keys=0),
                "outcome": Summed(select(Job.status, func.count()).where(finished, served).group_by(Job.status),
                                  keys=1)}

    def _histograms(self, totals: dict[str, Groups]) -> Iterator:
        for name, doc, edges in HISTOGRAMS:
            fam = HistogramMetricFamily(name, doc, labels=["model_name", "tier", "kind"])
            for (tier, kind), (count, total, *cumulative) in sorted(totals[name].items()):
                buckets = [(repr(float(e)), c) for e, c in zip(edges, cumulative)]
                fam.add_metric([self.model_name, tier, kind], [*buckets, ("+Inf", count)], total)
            yield fam

    def _counters(self, totals: dict[str, Groups]) -> Iterator:
        slo = CounterMetricFamily("coserve:slo_attainment", "Finished jobs that met or violated their SLO, by tier.",
                                  labels=["model_name", "tier", "kind", "outcome"])
        success = CounterMetricFamily("coserve:request_success", "Finished jobs by vLLM's finished_reason: stop, "
                                      "length (succeeded), abort (cancelled or expired), error (failed).",
                                      labels=["model_name", "finished_reason"])
        outcome = CounterMetricFamily("coserve:request_outcome", "Terminal jobs by status.",
                                      labels=["model_name", "status"])
        prompt = CounterMetricFamily("coserve:prompt_tokens", "Prompt tokens of the jobs an engine ran (finished, "
                                     "or cancelled after their first token).", labels=["model_name"])
        cached = CounterMetricFamily("coserve:prompt_tokens_cached",
                                     "Prompt tokens of those jobs found in the engine's prefix cache.",
                                     labels=["model_name"])
        gen = CounterMetricFamily("coserve:generation_tokens", "Generated tokens of those jobs (a cancelled one's "
                                  "before the cancel).", labels=["model_name"])
        relegations = CounterMetricFamily("coserve:num_relegations", "Relegations by the scheduler (QoServe eager "
                                          "relegation; a job relegated twice counts twice), by tier.",
                                          labels=["model_name", "tier"])
        for tier in sorted(set(self.tiers) | {t for (t,) in totals["relegations"]}):
            relegations.add_metric([self.model_name, tier], totals["relegations"].get((tier,), (0.0,))[0])
        for (tier, kind, met), (n,) in sorted(totals["slo"].items()):
            slo.add_metric([self.model_name, tier, kind, "met" if met else "violated"], n)
        for (reason,), (n,) in sorted(totals["success"].items()):
            success.add_metric([self.model_name, reason], n)
        for (status,), (n,) in sorted(totals["outcome"].items()):
            outcome.add_metric([self.model_name, status], n)
        p, c, g = totals["tokens"].get((), (0.0, 0.0, 0.0))
        prompt.add_metric([self.model_name], p)
        cached.add_metric([self.model_name], c)
        gen.add_metric([self.model_name], g)
        yield from (relegations, slo, success, outcome, prompt, cached, gen)


def histogram_query(value, edges: Sequence[float], *where):
    """Per (tier, kind): count, sum and one cumulative bucket count per edge (``value <= edge``), of the finished
    jobs ``where`` holds."""
    return (select(Job.tier, Job.kind, func.count(value), func.sum(value),
                   *(func.sum(case((value <= e, 1), else_=0)) for e in edges))
            .where(Job.finished_at.is_not(None), value.is_not(None), *where)
            .group_by(Job.tier, Job.kind).order_by(Job.tier, Job.kind))


def mean_time_per_output_token():
    """SQL for a job's mean time per output token as vLLM's request_time_per_output_token observes it: first token to
    last (its TTLT less its TTFT, both from its submission) over the tokens after the first, 0 for one token; NULL
    where either time is missing (0 times the span keeps a NULL span NULL)."""
    span = Job.ttlt_s - Job.ttft_s
    return case((Job.completion_tokens > 1, span / (Job.completion_tokens - 1)), else_=span * 0)


def success_query(*where):
    """Finished jobs (those ``where`` holds) per vLLM finished_reason (``FINISH_REASON``), as vLLM's request_success
    counts every finished request; not one the engine refused for its parameters (vLLM refuses such a request before
    its engine, with a 400, and counts nothing)."""
    # the error code in an expression: a NULL one is no refusal
    not_refused = func.coalesce(Job.error_code, literal_column("''")) != INVALID_REQUEST
    return (select(FINISH_REASON, func.count())
            .where(Job.finished_at.is_not(None), not_refused, *where)
            .group_by(FINISH_REASON).order_by(FINISH_REASON))


def tokens_query(*where):
    """Prompt, cached prompt and generated token sums of the jobs an engine ran (those ``where`` holds): the ones
    with an output count (succeeded, or cancelled after their first token: what they ran before the cancel, as the
    Usage API bills)."""
    return select(func.sum(Job.prompt_tokens), func.sum(Job.cached_tokens), func.sum(Job.completion_tokens)).where(
        Job.finished_at.is_not(None), Job.completion_tokens.is_not(None), *where)


def seconds_between(dialect: str, start, end):
    """SQL for ``end - start`` in seconds (SQLite keeps datetimes as text; PostgreSQL has intervals)."""
    if dialect == "sqlite":
        return (func.julianday(end) - func.julianday(start)) * 86400.0
    return func.extract("epoch", end - start)
