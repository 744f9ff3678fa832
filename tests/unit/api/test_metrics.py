"""/metrics from the real migrated DB: gauges from job states, histograms/counters from finished jobs."""

from __future__ import annotations

import importlib.util
import re
from datetime import timedelta

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import select, update
from sqlalchemy.dialects import postgresql, sqlite

from app.auth import create_key, create_tenant
from app.db.models import Job, JobStatus, MetricTotals, Tenant, WorkerState
from app.db.session import session_scope
from app.observability.collector import TTFT_BUCKETS, SqlCollector, histogram_query, seconds_between, success_query
from app.observability.tally import SETTLE
from app.services.jobs import cancel_job
from app.services.transitions import as_utc, utcnow
from tests.conftest import ROOT
from workers.lease import Lease, keep_cancelled


@pytest.fixture
def client(client, db_url):
    """The app's client, scraping with an admin key (``GET /metrics`` needs one)."""
    with session_scope(db_url) as s:
        key = create_key(s, create_tenant(s, "scraper"), is_admin=True)[1]
    client.headers["Authorization"] = f"Bearer {key}"
    return client


def _job(tenant, status, tier, **kw):
    return Job(tenant_id=tenant, kind=kw.pop("kind", "interactive"), tier=tier, model=kw.pop("model", "tiny"),
               status=status, prompt="x", sampling={}, **kw)


def _seed(db_url) -> None:
    """Jobs in every state the metrics read, and a worker row."""
    now = utcnow()
    with session_scope(db_url) as s:
        t = Tenant(name="m")
        s.add(t)
        s.flush()
        s.add_all([_job(t.id, "running", "paid"), _job(t.id, "running", "paid"), _job(t.id, "queued", "free"),
                   _job(t.id, "relegated", "free"),
                   _job(t.id, "succeeded", "paid", ttft_s=0.03, tbt_p50_s=0.02, ttlt_s=0.5, slo_met=True,
                        created_at=now - timedelta(seconds=2), started_at=now - timedelta(seconds=1.5),
                        finished_at=now, finish_reason="length", prompt_tokens=10, completion_tokens=7,
                        cached_tokens=8),
                   _job(t.id, "succeeded", "free", queue_s=1.25, ttft_s=3.0, tbt_p50_s=0.3, ttlt_s=9.0, slo_met=False,
                        finished_at=now, finish_reason="stop", prompt_tokens=5, completion_tokens=3),
                   _job(t.id, "expired", "free", kind="batch", finished_at=now, slo_met=False),
                   # cancelled after 2 tokens: they count (as the Usage API bills them), the job is no success
                   _job(t.id, "cancelled", "paid", finished_at=now, finish_reason="cancelled", prompt_tokens=4,
                        completion_tokens=2),
                   _job(t.id, "cancelled", "paid", finished_at=now, finish_reason="cancelled", prompt_tokens=6)])
        s.add(WorkerState(id="w9", model="tiny", queue="q", device="cpu", state={"kv_usage": 0.25, "kv_recomputes": 3,
                                                                                   "routed_waiting": 4,
                                                                                   "set_aside_jobs": 1,
                                                                                   "draft_pool_short": 5}))


def test_metrics_endpoint_reflects_sql(client, db_url):
    _seed(db_url)
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = {}
    for fam in text_string_to_metric_families(r.text):
        for smp in fam.samples:
            samples[(smp.name, tuple(sorted(smp.labels.items())))] = smp.value

    def get(name, **labels):
        return samples[(name, tuple(sorted(labels.items())))]

    assert get("coserve:num_requests_running", model_name="tiny", tier="paid") == 2
    assert get("coserve:num_requests_waiting", model_name="tiny", tier="free") == 1
    assert get("coserve:num_requests_relegated", model_name="tiny", tier="free") == 1
    assert get("coserve:kv_cache_usage_perc", model_name="tiny", worker="w9") == 0.25
    assert get("coserve:num_preemptions_total", model_name="tiny", worker="w9") == 3
    assert get("coserve:spec_decode_num_draft_pool_short_total", model_name="tiny", worker="w9") == 5
    assert get("coserve:worker_routed_jobs_waiting", model_name="tiny", worker="w9") == 4
    assert get("coserve:worker_set_aside_jobs", model_name="tiny", worker="w9") == 1
    assert get("coserve:time_to_first_token_seconds_bucket", model_name="tiny", tier="paid", kind="interactive",
               le="0.04") == 1
    assert get("coserve:time_to_first_token_seconds_bucket", model_name="tiny", tier="free", kind="interactive",
               le="2.5") == 0
    assert abs(get("coserve:request_queue_time_seconds_sum", model_name="tiny", tier="paid",
                   kind="interactive") - 0.5) < 1e-3  # no queue time recorded: submission to the lease
    assert get("coserve:request_queue_time_seconds_sum", model_name="tiny", tier="free", kind="interactive") == 1.25
    assert get("coserve:slo_attainment_total", model_name="tiny", tier="paid", kind="interactive", outcome="met") == 1
    assert get("coserve:slo_attainment_total", model_name="tiny", tier="free", kind="interactive",
               outcome="violated") == 1
    assert get("coserve:slo_attainment_total", model_name="tiny", tier="free", kind="batch", outcome="violated") == 1
    assert get("coserve:request_success_total", model_name="tiny", finished_reason="length") == 1
    assert get("coserve:generation_tokens_total", model_name="tiny") == 10 + 2
    assert get("coserve:prompt_tokens_total", model_name="tiny") == 15 + 4  # the one cancelled before it ran: not
    assert get("coserve:prompt_tokens_cached_total", model_name="tiny") == 8  # the other job has no count
    assert get("vllm:prompt_tokens_cached_total", model_name="tiny") == 8  # under vLLM's name too


def _samples(families):
    return {(smp.name, tuple(sorted(smp.labels.items()))): smp.value for fam in families for smp in fam.samples}


def test_buckets_are_cumulative_across_edges(db_url):
    with session_scope(db_url) as s:
        t = Tenant(name="b")
        s.add(t)
        s.flush()
        s.add_all([_job(t.id, "succeeded", "paid", ttft_s=v, finished_at=utcnow()) for v in (0.003, 0.03, 0.3, 3.0)])
    samples = _samples(SqlCollector(db_url, "tiny", tiers=("free", "paid")).collect())

    def bucket(le):
        return samples[("coserve:time_to_first_token_seconds_bucket",
                        (("kind", "interactive"), ("le", le), ("model_name", "tiny"), ("tier", "paid")))]

    assert [bucket(le) for le in ("0.001", "0.005", "0.04", "0.5", "5.0", "+Inf")] == [0, 1, 2, 3, 4, 4]
    edges = [bucket(repr(float(e))) for e in TTFT_BUCKETS]
    assert edges == sorted(edges)  # never decreasing: each bucket counts everything at or below its edge
    assert samples[("coserve:time_to_first_token_seconds_count",
                    (("kind", "interactive"), ("model_name", "tiny"), ("tier", "paid")))] == 4


def _ended(db_url, *jobs: tuple[timedelta, int]) -> None:
    """Succeeded jobs, each (how long ago it finished and settled, its prompt tokens)."""
    now = utcnow()
    with session_scope(db_url) as s:
        tenant = s.query(Tenant).first() or Tenant(name="t")
        s.add(tenant)
        s.flush()
        s.add_all([_job(tenant.id, "succeeded", "paid", finished_at=now - ago, settled_at=now - ago, ttft_s=0.03,
                        prompt_tokens=tokens, completion_tokens=1) for ago, tokens in jobs])


def _scrape_sql(db_url, models=("tiny",)) -> tuple[float, float, float]:
    """Prompt tokens, TTFT count and cancelled jobs, as the SQL collector counts them."""
    samples = _samples(SqlCollector(db_url, "tiny", tiers=("paid",), models=models).collect())
    ttft = samples.get(("coserve:time_to_first_token_seconds_count",
                        (("kind", "interactive"), ("model_name", "tiny"), ("tier", "paid"))), 0)
    cancelled = samples.get(("coserve:request_outcome_total", (("model_name", "tiny"), ("status", "cancelled"))), 0)
    return samples[("coserve:prompt_tokens_total", (("model_name", "tiny"),))], ttft, cancelled


def _as_if_last_scraped(db_url, ago: timedelta) -> None:
    """The kept totals' horizon moved back (as if no scrape came for a while), every settled end with it."""
    with session_scope(db_url) as s:  # in Python: SQLite keeps datetimes as text
        for row in s.scalars(select(MetricTotals)):
            row.horizon = as_utc(row.horizon) - ago
        for job in s.scalars(select(Job).where(Job.settled_at.is_not(None))):
            job.settled_at = as_utc(job.settled_at) - ago


def test_the_first_scrape_starts_the_totals_and_each_settled_end_is_kept_once(db_url):
    """A deployment's first scrape reads the jobs settled since its horizon (an index range), not every job ended
    before; later scrapes keep each settled end once and read the recent ones afresh."""
    _ended(db_url, (timedelta(hours=1), 10), (timedelta(0), 5))
    assert _scrape_sql(db_url) == (5, 1, 0)  # the end of an hour ago is before the totals began
    with session_scope(db_url) as s:
        (row,) = s.query(MetricTotals).all()
        assert utcnow() - as_utc(row.horizon) >= SETTLE
    _ended(db_url, (timedelta(0), 1000))
    assert _scrape_sql(db_url) == (1005, 2, 0)
    assert _scrape_sql(db_url) == (1005, 2, 0)  # the recent jobs once, scrape after scrape
    _as_if_last_scraped(db_url, timedelta(hours=1))
    assert _scrape_sql(db_url) == (1005, 2, 0)  # kept now
    assert _scrape_sql(db_url) == (1005, 2, 0)
    # the deployment's totals go on where another model joins them (an adapter loaded): its jobs from here on
    assert _scrape_sql(db_url, ("tiny", "tiny-lora")) == (1005, 2, 0)


def test_an_end_its_worker_writes_late_is_counted_once(db_url):
    """A job the API cancelled while a worker ran it settles when the worker writes what it produced, however late
    behind the cancel's finished_at: counted as it stands until then, and its tokens once after."""
    _ended(db_url, (timedelta(0), 5))
    assert _scrape_sql(db_url) == (5, 1, 0)
    with session_scope(db_url) as s:
        tenant_id = s.scalars(select(Tenant.id)).first()
        held = _job(tenant_id, "running", "paid", worker_id="w1", attempt=1, prompt_tokens=100)
        s.add(held)
        s.flush()
        assert cancel_job(s, held) == JobStatus.RUNNING
        assert held.settled_at is None
        s.execute(update(Job).where(Job.id == held.id).values(finished_at=utcnow() - timedelta(hours=2)))
        s.commit()
        job_id = held.id
    assert _scrape_sql(db_url) == (5, 1, 1)  # cancelled; no tokens yet
    _as_if_last_scraped(db_url, timedelta(hours=1))
    assert _scrape_sql(db_url) == (5, 1, 1)  # not settled: read afresh, never kept
    assert _scrape_sql(db_url) == (5, 1, 1)
    lease = Lease(job_id, 1, "w1")
    with session_scope(db_url) as s:  # the worker writes two hours after the cancel
        assert keep_cancelled(s, lease, {"completion_tokens": 3, "ttft_s": 0.5})
    assert _scrape_sql(db_url) == (105, 2, 1)
    _as_if_last_scraped(db_url, timedelta(hours=1))
    assert _scrape_sql(db_url) == (105, 2, 1)  # kept once
    assert _scrape_sql(db_url) == (105, 2, 1)
    with session_scope(db_url) as s:  # a second write would change a kept end: refused
        assert not keep_cancelled(s, lease, {"completion_tokens": 30})
    assert _scrape_sql(db_url) == (105, 2, 1)


def _scrape_http(client) -> dict[tuple, float]:
    """The counters /metrics answers, by (name, labels)."""
    r = client.get("/metrics")
    assert r.status_code == 200
    return {(smp.name, tuple(sorted(smp.labels.items()))): smp.value
            for fam in text_string_to_metric_families(r.text) if fam.type == "counter" for smp in fam.samples}


def test_counters_never_go_back_when_an_adapter_is_loaded_or_unloaded(client, settings, db_url, tmp_path):
    """Prometheus counters count on for a label set: loading a runtime adapter (another set of counted models)
    neither restarts the model's counters nor, unloaded again, takes its jobs back out of them."""
    from tests.conftest import load_runtime_adapter

    from app.services import lora_adapters

    _ended(db_url, (timedelta(0), 5), (timedelta(0), 7))
    first = _scrape_http(client)
    _as_if_last_scraped(db_url, timedelta(hours=1))  # the ends are kept in the totals now
    assert _scrape_http(client) == first
    load_runtime_adapter(settings, tmp_path)
    with session_scope(db_url) as s:  # an adapter's job ends (counted under the model, as vLLM counts it)
        tenant_id = s.scalars(select(Tenant.id)).first()
        s.add(_job(tenant_id, "succeeded", "paid", model="rt-lora", finished_at=utcnow(), settled_at=utcnow(),
                   ttft_s=0.03, prompt_tokens=100, completion_tokens=1))
    loaded = _scrape_http(client)
    lora_adapters.unload(settings, "rt-lora")
    unloaded = _scrape_http(client)
    tokens = (("coserve:prompt_tokens_total", (("model_name", "tiny"),)))
    assert (first[tokens], loaded[tokens], unloaded[tokens]) == (12, 112, 112)
    for key, value in first.items():
        if key[0].startswith(("coserve:", "vllm:")):  # the SQL counters (the HTTP series count the scrapes)
            assert loaded.get(key, 0) >= value and unloaded.get(key, 0) >= loaded.get(key, 0), key


def test_every_configured_tier_has_gauges(db_url):
    samples = _samples(SqlCollector(db_url, "tiny", tiers=("free", "paid", "gold")).collect())
    for name in ("coserve:num_requests_running", "coserve:num_requests_waiting", "coserve:num_requests_relegated"):
        for tier in ("free", "paid", "gold"):
            assert samples[(name, (("model_name", "tiny"), ("tier", tier)))] == 0


def test_statements_compile_for_postgresql():
    # SELECT, GROUP BY and ORDER BY must be one expression (no per-clause bind parameters),
    # and durations use EXTRACT(epoch FROM ...) on PostgreSQL
    dialect = postgresql.dialect()
    sql = str(success_query().compile(dialect=dialect))
    reason = ("CASE WHEN (jobs.status = 'succeeded') THEN coalesce(jobs.finish_reason, 'stop') WHEN (jobs.status = "
              "'failed') THEN 'error' ELSE 'abort' END")
    assert sql.count(reason) == 2 and "%(" in sql  # the refused jobs' error code stays a parameter
    assert f"GROUP BY {reason} ORDER BY finish_reason" in sql
    queue_s = seconds_between("postgresql", Job.created_at, Job.started_at)
    sql = str(histogram_query(queue_s, (0.5, 1.0)).compile(dialect=dialect))
    assert "EXTRACT(epoch FROM jobs.started_at - jobs.created_at)" in sql
    assert sql.count("CASE WHEN") == 2 and "GROUP BY jobs.tier, jobs.kind" in sql
    assert "julianday" in str(seconds_between("sqlite", Job.created_at, Job.started_at).compile(
        dialect=sqlite.dialect()))


def test_vllm_names_carry_the_same_series(client, db_url):
    """Series that mean what vLLM's mean are exported under vLLM's names too, with equal values (a histogram at vLLM's
    bucket edges alone: test_vllms_names_carry_vllms_bucket_edges)."""
    from app.observability.collector import VLLM_ALIASES

    _seed(db_url)
    text = client.get("/metrics").text
    samples = {(smp.name, tuple(sorted(smp.labels.items()))): smp.value
               for fam in text_string_to_metric_families(text) for smp in fam.samples}
    for ours, theirs in VLLM_ALIASES.items():
        mine = {(n[len(ours):], lab): v for (n, lab), v in samples.items() if n.startswith(ours)}
        alias = {(n[len(theirs):], lab): v for (n, lab), v in samples.items() if n.startswith(theirs)}
        assert alias and {key: mine[key] for key in alias} == alias, ours
        assert all(suffix == "_bucket" for suffix, _labels in set(mine) - set(alias)), ours


def test_the_prefix_cache_hit_rate_reads_from_vllms_names(client, db_url):
    """vLLM's dashboards graph the prefix cache's hit rate as ``rate(vllm:prefix_cache_hits) /
    rate(vllm:prefix_cache_queries)`` (prompt tokens looked up, and found, in the prefix cache): the own engine's
    jobs' prompt and cached tokens are exported under those names too (they were missing: the panel was empty)."""
    _seed(db_url)
    scraped = _scrape(client)
    model = (("model_name", "tiny"),)
    assert scraped[("vllm:prefix_cache_queries_total", model)] == 10 + 5 + 4  # the jobs an engine ran
    assert scraped[("vllm:prefix_cache_hits_total", model)] == 8
    assert scraped[("vllm:prefix_cache_hits_total", model)] == scraped[("coserve:prompt_tokens_cached_total", model)]


def _scrape(client) -> dict:
    return {(smp.name, tuple(sorted(smp.labels.items()))): smp.value
            for fam in text_string_to_metric_families(client.get("/metrics").text) for smp in fam.samples}


def test_a_lost_workers_series_leave_the_scrape(client, db_url):
    """A worker killed without deregistering keeps its row; past the liveness cutoff its KV usage, preemptions,
    routed queue and heartbeat age are no longer exported (the heartbeat age grew for ever)."""
    with session_scope(db_url) as s:
        s.add_all([WorkerState(id=w, model="tiny", queue="q", device="cpu", heartbeat_at=at,
                               state={"kv_usage": 0.5, "kv_recomputes": 1, "routed_waiting": 2})
                   for w, at in (("live", utcnow()), ("killed", utcnow() - timedelta(hours=1)))])
    workers = {dict(labels).get("worker") for (name, labels) in _scrape(client)
               if name.startswith(("coserve:kv_cache_usage_perc", "coserve:num_preemptions",
                                   "coserve:worker_routed_jobs_waiting", "coserve:worker_heartbeat_age_seconds"))}
    assert workers == {"live"}


def test_vllm_names_come_from_the_engines_alone_on_the_vllm_backend(client, settings, db_url):
    """Where the workers run vLLM, the vllm: names are vLLM's own series: coserve's aliases stay out whether or not
    an engine's snapshot was read at this scrape (before, a scrape that found none exported the aliases instead,
    with other labels and buckets)."""
    _seed(db_url)
    settings.backend = "vllm"
    scraped = _scrape(client)
    assert not [name for name, _labels in scraped if name.startswith("vllm:")]
    assert scraped[("coserve:num_requests_running", (("model_name", "tiny"), ("tier", "paid")))] == 2
    settings.backend = "torch"
    assert ("vllm:request_success_total", (("finished_reason", "stop"), ("model_name", "tiny"))) in _scrape(client)


def test_a_vllm_workers_series_never_doubles_a_name_the_api_exports_itself(client, settings, db_url):
    """An API whose backend resolves to the own engine (``auto`` where vLLM is not installed, as in a slim API image)
    with workers that run vLLM: the scrape carried each of vLLM's names twice, the API's alias (by tier) and the
    engine's (by worker), so a dashboard's sum counted every token twice and a strict parser refused the
    second TYPE line. Each name is exported once: the API's, as its configuration says."""
    import redis
    from prometheus_client import CollectorRegistry, Counter, Gauge

    from app.observability.engine_metrics import publish

    _seed(db_url)
    engine = CollectorRegistry()
    Counter("vllm:generation_tokens", "tokens", ["model_name", "engine"], registry=engine).labels("tiny", "0").inc(50)
    Gauge("vllm:num_requests_waiting_by_reason", "waiting", ["model_name", "engine", "reason"],
          registry=engine).labels("tiny", "0", "capacity").set(1)
    with session_scope(db_url) as s:
        s.add(WorkerState(id="w-vllm", model="tiny", queue="q", device="cpu", state={}))
    publish(redis.Redis.from_url(settings.redis_url), "w-vllm", 60, engine, model_name="tiny")
    settings.backend = "torch"
    text = client.get("/metrics").text
    assert text.count("# TYPE vllm:generation_tokens_total ") == 1
    generated = [smp for fam in text_string_to_metric_families(text) if fam.name == "vllm:generation_tokens"
                 for smp in fam.samples if smp.name.endswith("_total")]
    assert sum(smp.value for smp in generated) == 7 + 3 + 2  # the jobs' (the API's), not also the engine's 50
    assert "vllm:num_requests_waiting_by_reason{" in text  # a name the API does not export still comes through


def test_the_series_count_the_deployments_own_model_and_its_adapters(client, settings, db_url):
    """Several models on one database: each API counts its model's jobs (an adapter's under the model's name, as
    vLLM counts them), never another model's under its own name."""
    settings.lora_modules = {"tiny-lora": "/adapters/tiny-lora"}
    with session_scope(db_url) as s:
        t = Tenant(name="multi")
        s.add(t)
        s.flush()
        done = {"finished_at": utcnow(), "prompt_tokens": 5, "completion_tokens": 3}
        s.add_all([_job(t.id, "running", "paid"), _job(t.id, "succeeded", "paid", **done),
                   _job(t.id, "succeeded", "paid", **{**done, "model": "tiny-lora"}),
                   _job(t.id, "running", "paid", model="other"), _job(t.id, "queued", "paid", model="other"),
                   _job(t.id, "succeeded", "paid", **{**done, "model": "other"})])
    scraped = _scrape(client)
    assert scraped[("coserve:num_requests_running", (("model_name", "tiny"), ("tier", "paid")))] == 1
    assert scraped[("coserve:num_requests_waiting", (("model_name", "tiny"), ("tier", "paid")))] == 0
    assert scraped[("coserve:generation_tokens_total", (("model_name", "tiny"),))] == 6
    assert scraped[("coserve:request_outcome_total", (("model_name", "tiny"), ("status", "succeeded")))] == 2
    assert not [labels for _name, labels in scraped if ("model_name", "other") in labels]


def test_http_requests_are_counted_per_route_template(client, keys):
    """As `vllm serve`'s http_ series: by route template, so a job's id is no label value, and every URL no route
    matches under one handler: the series stay bounded whatever clients ask for."""
    for n in range(3):
        client.get(f"/v1/jobs/no-such-job-{n}", headers={"Authorization": f"Bearer {keys.paid}"})
        client.get(f"/no/such/path/{n}")
    client.get("/healthz")
    handlers = {dict(labels)["handler"]: value for (name, labels), value in _scrape(client).items()
                if name == "http_requests_total"}
    assert handlers == {"/v1/jobs/{job_id}": 3, "none": 3}, handlers  # the probe is not traffic


def test_a_request_method_no_route_knows_counts_under_one_method_label(client):
    """The method label took whatever a client sent: with no key, each made-up method (``FOO1``, ``FOO2``...) added
    series to http_requests_total and http_request_duration_seconds for good. One outside HTTP's methods counts as
    ``other``, so the series stay bounded."""
    for n in range(3):
        client.request(f"FOO{n}", "/v1/models")
    client.request("PATCH", "/v1/models")
    methods = {dict(labels)["method"]: value for (name, labels), value in _scrape(client).items()
               if name in ("http_requests_total", "http_request_duration_seconds_count")}
    assert methods == {"other": 3, "PATCH": 1}, methods


def test_a_workers_heartbeat_age_says_whether_it_drains_or_stops(client, db_url):
    """A worker in a warm shutdown's grace takes no job, as a draining one: the heartbeat series says which of the
    two each worker is in, so an alert on live workers taking jobs can leave both out."""
    with session_scope(db_url) as s:
        s.add_all([WorkerState(id="serving", model="tiny", queue="q", device="cpu", heartbeat_at=utcnow(), state={}),
                   WorkerState(id="drained", model="tiny", queue="q", device="cpu", heartbeat_at=utcnow(),
                               draining=True, state={}),
                   WorkerState(id="leaving", model="tiny", queue="q", device="cpu", heartbeat_at=utcnow(),
                               state={"stopping": True})])
    ages = {dict(labels)["worker"]: (dict(labels)["draining"], dict(labels)["stopping"])
            for (name, labels) in _scrape(client) if name == "coserve:worker_heartbeat_age_seconds"}
    assert ages == {"serving": ("false", "false"), "drained": ("true", "false"), "leaving": ("false", "true")}


def _readme_metric_names() -> set[str]:
    """The series README.md lists for ``/metrics`` (coserve's, the vLLM names it exports too, the HTTP ones)."""
    readme = ROOT.joinpath("README.md").read_text()
    # a counter's family is named without its samples' ``_total``, as the exposition parser reads it
    return {n.removesuffix("_total") for n in re.findall(r"`((?:coserve|vllm):[a-z0-9_]+|http_[a-z0-9_]+)`", readme)}


def test_the_readme_lists_what_metrics_exports_and_nothing_else(client, db_url):
    """Every series README.md names is one a scrape exports, and every ``coserve:`` family a scrape exports is named
    there (as itself, or as the vLLM name it is also exported under), so the list cannot drift from the collector."""
    _seed(db_url)
    client.get("/v1/models")  # an HTTP series to export
    exported = {fam.name for fam in text_string_to_metric_families(client.get("/metrics").text)}
    named = _readme_metric_names()
    assert sorted(named - exported) == [], "README.md names series /metrics does not export"
    undocumented = sorted(n for n in exported if n.startswith("coserve:")
                          and n not in named and n.replace("coserve:", "vllm:", 1) not in named)
    assert undocumented == [], "/metrics exports series README.md does not name"


def test_the_workers_series_are_the_deployments_own_and_name_its_model(client, db_url):
    """Two models' deployments on one database: a scrape exports its own workers' KV usage and preemptions, labelled
    ``model_name`` as vLLM's (a vLLM dashboard selects ``vllm:kv_cache_usage_perc{model_name="$model_name"}``). They
    had no ``model_name``, so such a panel was empty, and every deployment exported the other's workers too."""
    with session_scope(db_url) as s:
        s.add_all([WorkerState(id=w, model=model, queue=model, device="cpu", heartbeat_at=utcnow(),
                               state={"kv_usage": 0.5, "kv_recomputes": 2})
                   for w, model in (("tiny-w", "tiny"), ("other-w", "other"))])
    scraped = _scrape(client)
    for name in ("vllm:kv_cache_usage_perc", "vllm:num_preemptions_total", "coserve:worker_heartbeat_age_seconds"):
        assert [dict(labels) for n, labels in scraped if n == name] == [
            {"model_name": "tiny", "worker": "tiny-w", **({"draining": "false", "stopping": "false"}
                                                          if "heartbeat" in name else {})}], name


def _relegations(db_url) -> dict[str, float]:
    samples = _samples(SqlCollector(db_url, "tiny", tiers=("free", "paid")).collect())
    return {dict(labels)["tier"]: v for (name, labels), v in samples.items() if name == "coserve:num_relegations_total"}


def test_relegations_are_a_counter_by_tier_that_never_goes_back(db_url):
    """``coserve:num_requests_relegated`` says how many jobs are relegated now: no rate to graph or alert on. The
    relegations counter sums every relegation (of the jobs not ended and of those ended since the totals began) and
    goes on as a relegated job ends and its end is kept in the totals."""
    with session_scope(db_url) as s:
        t = Tenant(name="r")
        s.add(t)
        s.flush()
        s.add_all([_job(t.id, "relegated", "free", relegation_count=2), _job(t.id, "running", "free",
                                                                              relegation_count=1),
                   _job(t.id, "succeeded", "free", relegation_count=1, finished_at=utcnow()),
                   _job(t.id, "running", "free", relegation_count=5, model="other")])  # another deployment's
    assert _relegations(db_url) == {"free": 4, "paid": 0}
    with session_scope(db_url) as s:  # the relegated job ends (expired), the running one is relegated again
        s.execute(update(Job).where(Job.status == "relegated").values(status="expired", finished_at=utcnow()))
        s.execute(update(Job).where(Job.status == "running", Job.model == "tiny")
                  .values(status="relegated", relegation_count=Job.relegation_count + 1))
    assert _relegations(db_url) == {"free": 5, "paid": 0}
    with session_scope(db_url) as s:
        s.execute(update(Job).where(Job.finished_at.is_not(None)).values(settled_at=utcnow()))
    _as_if_last_scraped(db_url, timedelta(hours=1))  # the ended jobs' relegations are kept in the totals now
    assert _relegations(db_url) == {"free": 5, "paid": 0}
    assert _relegations(db_url) == {"free": 5, "paid": 0}


def test_request_success_counts_every_finished_job_by_vllms_finished_reason(db_url):
    """vLLM's ``request_success`` counts every finished request by its finished_reason (stop, length, abort,
    error...), not the succeeded ones alone: a cancelled or expired job is vLLM's ``abort`` (its engine ends one
    coserve's scheduler gives up on as an abort), a failed one ``error``; one the engine refused for its parameters
    is not counted (vLLM refuses such a request before its engine, with a 400). Each job once."""
    _seed(db_url)  # succeeded: length, stop; cancelled: two; expired: one
    with session_scope(db_url) as s:
        tenant_id = s.scalars(select(Tenant.id)).first()
        s.add_all([_job(tenant_id, "failed", "paid", finished_at=utcnow(), error="engine error"),
                   _job(tenant_id, "failed", "paid", finished_at=utcnow(), error="bad", error_code="invalid_request")])
    samples = _samples(SqlCollector(db_url, "tiny", tiers=("free", "paid")).collect())
    reasons = {dict(labels)["finished_reason"]: v for (name, labels), v in samples.items()
               if name == "vllm:request_success_total"}
    assert reasons == {"stop": 1, "length": 1, "abort": 3, "error": 1}


def test_the_per_job_mean_time_per_output_token_is_vllms_request_time_per_output_token(db_url):
    """vLLM's ``request_time_per_output_token_seconds`` observes each finished request's mean gap (its first token
    to its last, over its tokens after the first; 0 for a one-token answer). coserve's per-job median
    (``coserve:time_per_output_token_seconds``) is neither that nor vLLM's per-gap ``inter_token_latency``: the mean
    is exported under vLLM's name, from each job's first and last token times."""
    with session_scope(db_url) as s:
        t = Tenant(name="tpot")
        s.add(t)
        s.flush()
        s.add_all([_job(t.id, "succeeded", "paid", finished_at=utcnow(), ttft_s=0.5, ttlt_s=2.5, completion_tokens=5,
                        tbt_p50_s=0.1),
                   _job(t.id, "succeeded", "paid", finished_at=utcnow(), ttft_s=0.3, ttlt_s=0.3, completion_tokens=1)])
    samples = _samples(SqlCollector(db_url, "tiny", tiers=("paid",)).collect())
    labels = (("kind", "interactive"), ("model_name", "tiny"), ("tier", "paid"))
    for name in ("coserve:request_time_per_output_token_seconds", "vllm:request_time_per_output_token_seconds"):
        assert (samples[(name + "_count", labels)], samples[(name + "_sum", labels)]) == (2, 0.5), name
        assert samples[(name + "_bucket", (("kind", "interactive"), ("le", "0.5"), ("model_name", "tiny"),
                                            ("tier", "paid")))] == 2, name
    assert samples[("coserve:time_per_output_token_seconds_sum", labels)] == 0.1  # the median, as before


MALFORMED_SNAPSHOTS = {  # what a worker of another version, or a bug in one, could store as its snapshot
    "a family without samples": [{"name": "vllm:num_requests_running", "type": "gauge", "doc": "running"}],
    "an unknown type": [{"name": "vllm:x", "type": "weird", "doc": "x", "samples": [["vllm:x", {}, 1.0]]}],
    "a value not a number": [{"name": "vllm:num_requests_running", "type": "gauge", "doc": "running",
                              "samples": [["vllm:num_requests_running", {"model_name": "tiny"}, "many"]]}],
    "a null value": [{"name": "vllm:num_requests_running", "type": "gauge", "doc": "running",
                      "samples": [["vllm:num_requests_running", {"model_name": "tiny"}, None]]}],
    "labels not a mapping": [{"name": "vllm:num_requests_running", "type": "gauge", "doc": "running",
                              "samples": [["vllm:num_requests_running", ["tiny"], 1.0]]}],
    "a label value not text": [{"name": "vllm:num_requests_running", "type": "gauge", "doc": "running",
                                "samples": [["vllm:num_requests_running", {"engine": 0}, 1.0]]}],
    "a sample of two fields": [{"name": "vllm:num_requests_running", "type": "gauge", "doc": "running",
                                "samples": [["vllm:num_requests_running", {}]]}],
    "families not a list": {"vllm:num_requests_running": 1},
    "a family not an object": ["vllm:num_requests_running"],
    "a name Prometheus cannot parse": [{"name": "vllm:bad name", "type": "gauge", "doc": "x",
                                        "samples": [["vllm:bad name", {}, 1.0]]}],
}


@pytest.mark.parametrize("case", sorted(MALFORMED_SNAPSHOTS))
def test_one_workers_malformed_snapshot_leaves_the_others_series(client, settings, db_url, case):
    """A worker that stored a snapshot with a missing or odd field in Redis failed the whole scrape (500): no
    series of any worker, nor the API's own, while it kept beating. Its families that cannot be read are left out;
    every other worker's series, and the API's, still answer."""
    import json

    import redis
    from prometheus_client import CollectorRegistry, Gauge

    from app.observability.engine_metrics import engine_metrics_key, publish

    _seed(db_url)
    with session_scope(db_url) as s:
        s.add_all([WorkerState(id=w, model="tiny", queue="q", device="cpu", state={}) for w in ("w-good", "w-bad")])
    engine = CollectorRegistry()
    Gauge("vllm:num_requests_running", "running", ["model_name", "engine"], registry=engine).labels("tiny", "0").set(3)
    client_redis = redis.Redis.from_url(settings.redis_url)
    publish(client_redis, "w-good", 60, engine, model_name="tiny")
    bad = {"model_name": "tiny", "families": MALFORMED_SNAPSHOTS[case]}
    client_redis.set(engine_metrics_key("w-bad"), json.dumps(bad), ex=60)
    response = client.get("/metrics")
    assert response.status_code == 200, case
    scraped = {(smp.name, tuple(sorted(smp.labels.items()))): smp.value
               for fam in text_string_to_metric_families(response.text) for smp in fam.samples}
    good = (("engine", "0"), ("model_name", "tiny"), ("worker_id", "w-good"))
    assert scraped[("vllm:num_requests_running", good)] == 3
    assert scraped[("coserve:num_requests_running", (("model_name", "tiny"), ("tier", "paid")))] == 2
    assert not [labels for _name, labels in scraped if ("worker_id", "w-bad") in labels]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="compares with vLLM's own bucket edges")
def test_vllms_names_carry_vllms_bucket_edges(client, db_url):
    """A dashboard built for vLLM reads the vllm: histograms by their ``le`` edges (a heatmap's rows, a quantile's
    interpolation): vllm:e2e_request_latency_seconds and vllm:request_queue_time_seconds carried edges of 28800 s and
    86400 s vLLM's have not. Each vllm: histogram has vLLM's edges, and the counts at those edges coserve's."""
    from vllm.v1.metrics import buckets

    _seed(db_url)
    scraped = _scrape(client)
    theirs = {"vllm:time_to_first_token_seconds": buckets.TIME_TO_FIRST_TOKEN_BUCKETS,
              "vllm:request_time_per_output_token_seconds": buckets.INTER_TOKEN_LATENCY_BUCKETS,
              "vllm:e2e_request_latency_seconds": buckets.REQUEST_LATENCY_BUCKETS,
              "vllm:request_queue_time_seconds": buckets.REQUEST_LATENCY_BUCKETS}
    for name, edges in theirs.items():
        ours = name.replace("vllm:", "coserve:")
        series = {labels: (dict(labels)["le"], value) for (n, labels), value in scraped.items()
                  if n == name + "_bucket" and ("tier", "paid") in labels}
        assert series, name
        les = sorted({le for le, _value in series.values()}, key=float)
        assert les == [*(repr(float(e)) for e in edges), "+Inf"], name
        for labels, (_le, value) in series.items():
            assert scraped[(ours + "_bucket", labels)] == value, (name, labels)
