""""SLO met" has one definition (gpu_runtime.metrics: every token by its eq. 1/2 deadline, a batch job's
last token by its deadline) and `coserve status` says why a job missed: the first deadline missed,
with the token, when it was due and came (seconds after arrival) and how late."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import numpy as np
import pytest
from typer.testing import CliRunner

from app.cli import cli, service_cmds
from app.cli.service_cmds import slo_explanation
from app.db.models import Job
from app.schemas import JobPublic
from gpu_runtime.metrics import DeadlineMiss, first_missed_deadline, request_metrics, slo_met
from gpu_runtime.qos import TbtAnchor
from gpu_runtime.request import RequestStatus
from tests.unit.scheduler.helpers import batch, interactive

JOB_ID = "job_5a0c9e1d2b3f4a6e8c7d9b10"


def _finished(req, times: list[float]):
    req.token_times = list(times)
    req.output_token_ids = [7] * len(times)
    req.status = RequestStatus.FINISHED_LENGTH
    req.finish_time = times[-1] if times else 0.0
    return req


def _job(req, kind: str = "interactive", **extra: Any) -> dict[str, Any]:
    """The job resource the API would return for ``req`` once the worker recorded it."""
    m = request_metrics(req)
    d = m.as_dict()
    job = {"id": JOB_ID, "kind": kind, "status": "succeeded", "tier": "paid", "model": "m", "attempt": 1,
           "worker_id": "w1", "prompt_tokens": 3, "completion_tokens": m.num_output_tokens,
           "metrics": {k: d[k] for k in ("ttft_s", "tbt_p50_s", "tbt_p99_s", "ttlt_s", "slo_met", "slo_miss")}}
    if kind == "interactive":
        job.update(ttft_ms=req.qos.ttft_s * 1e3, tbt_ms=req.qos.tbt_s * 1e3, tbt_anchor=req.qos.tbt_anchor.value)
    job.update(extra)
    return job


def test_a_tbt_p99_over_target_can_meet_the_slo_slack_banked_early_absorbs_a_slow_gap():
    # TTFT 1 s, TBT 200 ms from arrival: token n is due 1 + 0.2 (n-1); the first came at 0.1 s
    req = _finished(interactive("r", ttft=1.0, tbt=0.2, max_tokens=4), [0.1, 0.2, 0.3, 0.51])
    m = request_metrics(req)
    assert m.tbt_p99_s > 0.2 and m.slo_met is True and m.slo_miss is None
    assert slo_explanation(_job(req)) is None


def test_a_tbt_p99_under_target_can_miss_the_slo_and_the_explanation_says_which_token():
    # first-token anchor: token n is due 0.205 + 0.1 (n-1) s; token 2 came 0.3 s after the first, the next
    # hundred gaps 90 ms each: p99 90 ms < 100 ms, yet token 2 was 200 ms late
    times = [0.205, 0.505] + [0.505 + 0.09 * i for i in range(1, 100)]
    req = _finished(interactive("r", ttft=1.0, tbt=0.1, max_tokens=101, anchor=TbtAnchor.FIRST_TOKEN), times)
    m = request_metrics(req)
    assert m.tbt_p99_s < 0.1 and m.slo_met is False and not slo_met(req)
    assert m.slo_miss.token == 2
    assert m.slo_miss.due_s == pytest.approx(0.305) and m.slo_miss.at_s == pytest.approx(0.505)
    assert m.slo_miss.as_dict()["late_ms"] == pytest.approx(200.0)
    why = slo_explanation(_job(req))
    assert why == ("token 2 was due 0.305 s after arrival (first token at 0.205 s + 1 x TBT 100 ms, "
                   "tbt_anchor first-token) and came at 0.505 s: 200.0 ms late")


def test_the_first_miss_is_reported_not_the_worst_and_eq2_counts_from_ttft():
    # arrival anchor, TTFT 0.5 s, TBT 0.1 s: token 3 (due 0.7) is the first late one, token 4 the latest
    req = _finished(interactive("r", ttft=0.5, tbt=0.1, max_tokens=4), [0.4, 0.6, 0.75, 1.2])
    miss = first_missed_deadline(req)
    assert (miss.token, round(miss.due_s, 6), miss.at_s) == (3, 0.7, 0.75)
    assert slo_explanation(_job(req)) == ("token 3 was due 0.700 s after arrival (TTFT 500 ms + 2 x TBT 100 ms) "
                                          "and came at 0.750 s: 50.0 ms late")


def test_a_late_first_token_and_a_late_batch_job():
    req = _finished(interactive("r", arrival=10.0, ttft=0.2, tbt=0.1, max_tokens=2), [10.35, 10.4])
    assert slo_explanation(_job(req)) == ("token 1 (the first) was due 0.200 s after arrival (TTFT 200 ms) and "
                                          "came at 0.350 s: 150.0 ms late")
    job = _finished(batch("b", ttlt=60.0, max_tokens=3), [20.0, 40.0, 61.5])
    m = request_metrics(job)
    assert m.slo_met is False and m.slo_miss == DeadlineMiss(3, 60.0, 61.5)
    assert slo_explanation(_job(job, "batch")) == ("the last token (3) was due 60.000 s after arrival (the batch "
                                                   "deadline) and came at 61.500 s: 1500.0 ms late")
    on_time = _finished(batch("b", ttlt=60.0, max_tokens=3), [20.0, 40.0, 59.0])
    assert slo_met(on_time) and slo_explanation(_job(on_time, "batch")) is None


def test_no_token_at_all_missed_the_first_deadline():
    req = _finished(interactive("r", ttft=0.2, tbt=0.1), [])
    assert first_missed_deadline(req) == DeadlineMiss(1, 0.2, None) and not slo_met(req)
    assert slo_explanation(_job(req)) == ("token 1 (the first) was due 0.200 s after arrival (TTFT 200 ms) "
                                          "and never came")


def test_slo_met_agrees_with_every_token_by_its_deadline_on_random_streams():
    rng = np.random.default_rng(7)
    for anchor in TbtAnchor:
        for _ in range(200):
            times = list(np.cumsum(rng.uniform(0.0, 0.15, size=int(rng.integers(1, 30)))) + rng.uniform(0, 0.5))
            req = _finished(interactive("r", ttft=0.3, tbt=0.1, anchor=anchor), times)
            start = 0.3 if anchor is TbtAnchor.ARRIVAL else min(0.3, times[0])
            late = [n for n, t in enumerate(times, 1) if t > start + (n - 1) * 0.1 + 1e-9]
            miss = first_missed_deadline(req)
            assert slo_met(req) is (not late) and (miss is None if not late else miss.token == late[0])


def test_jobs_recorded_without_details_explain_what_ttft_and_ttlt_show():
    base = {"id": JOB_ID, "kind": "interactive", "ttft_ms": 200.0, "tbt_ms": 50.0, "tbt_anchor": "arrival"}
    assert slo_explanation({**base, "metrics": {"slo_met": False, "ttft_s": 0.25}}) == (
        "token 1 (the first) was due 0.200 s after arrival (TTFT 200 ms) and came at 0.250 s: 50.0 ms late")
    assert "no per-token details" in slo_explanation({**base, "metrics": {"slo_met": False, "ttft_s": 0.1}})
    created = datetime(2026, 1, 1, tzinfo=UTC)
    old_batch = {"id": JOB_ID, "kind": "batch", "completion_tokens": 9, "created_at": created.isoformat(),
                 "deadline_at": (created + timedelta(seconds=30)).isoformat().replace("+00:00", "Z"),
                 "metrics": {"slo_met": False, "ttlt_s": 31.0}}
    assert slo_explanation(old_batch) == ("the last token (9) was due 30.000 s after arrival (the batch deadline) "
                                          "and came at 31.000 s: 1000.0 ms late")
    assert slo_explanation({**base, "metrics": {"slo_met": None}}) is None
    assert slo_explanation({**base, "metrics": {"slo_met": True}}) is None


def test_the_job_resource_carries_the_miss_the_worker_stored():
    now = datetime.now(UTC)
    row = Job(id=JOB_ID, tenant_id="ten_1", kind="interactive", tier="paid", model="m", status="succeeded",
              created_at=now, sampling={}, endpoint="/v1/jobs", stream=False, attempt=1, relegation_count=0,
              ttft_ms=1000.0, tbt_ms=100.0, slo_met=False,
              slo_miss=DeadlineMiss(2, 0.305, 0.505).as_dict())
    body = JobPublic.of(row).model_dump(mode="json")
    assert body["metrics"]["slo_miss"] == {"token": 2, "due_s": 0.305, "at_s": 0.505, "late_ms": 200.0}
    row.slo_met = True  # a stale miss from an earlier attempt is never shown beside a met SLO
    assert JobPublic.of(row).metrics.slo_miss is None


def test_coserve_status_prints_the_first_missed_deadline(monkeypatch):
    req = _finished(interactive("r", ttft=0.5, tbt=0.1, max_tokens=4), [0.4, 0.6, 0.75, 1.2])
    job = _job(req, output_text="hi", relegation_count=0)

    def request(method: str, url: str, **kw: Any) -> httpx.Response:
        assert (method, url) == ("GET", f"http://coserve.test/v1/jobs/{JOB_ID}")
        return httpx.Response(200, json=job, request=httpx.Request(method, url))

    monkeypatch.setattr(service_cmds.httpx, "request", request)
    # off a terminal the table keeps its natural width, whatever width the console took at import (COLUMNS=80 here
    # wrapped the explanation inside its cell)
    res = CliRunner().invoke(cli, ["status", JOB_ID, "--url", "http://coserve.test", "--key", "k"])
    assert res.exit_code == 0, res.output
    assert "SLO met" in res.output and "False" in res.output
    assert "first missed deadline" in res.output
    assert "token 3 was due 0.700 s after arrival (TTFT 500 ms + 2 x TBT 100 ms) and came at 0.750 s: 50.0 ms late" in (
        " ".join(res.output.split()))


def test_coserve_status_says_why_a_job_has_no_slo_verdict(monkeypatch):
    """A cancelled or running job's "SLO met" read "None"; it says the job is not judged, or not yet."""
    req = _finished(interactive("r", ttft=0.5, tbt=0.1, max_tokens=4), [0.4, 0.6, 0.75, 1.2])
    for status, shown in (("cancelled", "not judged (cancelled)"), ("running", "not yet (running)")):
        job = _job(req, output_text="hi", relegation_count=0)
        job["status"], job["metrics"]["slo_met"], job["metrics"]["slo_miss"] = status, None, None

        def request(method: str, url: str, job=job, **kw: Any) -> httpx.Response:
            return httpx.Response(200, json=job, request=httpx.Request(method, url))

        monkeypatch.setattr(service_cmds.httpx, "request", request)
        res = CliRunner().invoke(cli, ["status", JOB_ID, "--url", "http://coserve.test", "--key", "k"])
        assert res.exit_code == 0 and shown in res.output and "None" not in res.output, res.output
