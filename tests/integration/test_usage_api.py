"""OpenAI's Usage API (``GET /v1/organization/usage/completions``) over jobs in a real SQLite database migrated
by Alembic, through the real app: buckets, grouping, filters, pages, who sees what, and bad input."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from sqlalchemy import select

from app.db.models import Batch, File, Job, Tenant
from app.db.session import session_scope

pytestmark = pytest.mark.integration

DAY = 86400
T0 = int(datetime(2026, 11, 1, tzinfo=UTC).timestamp())  # the first bucket's start
URL = "/v1/organization/usage/completions"


def at(seconds: int) -> datetime:
    return datetime.fromtimestamp(T0 + seconds, UTC)


@pytest.fixture
def jobs(db_url, keys):
    """acme: a paid chat job and a relegated free batch job on day 0; globex: one job on day 1; a batch job its
    window expired in the queue (a missed SLO, no request); and jobs that do not count (one that never ran, one
    before the range)."""
    with session_scope(db_url) as s:
        acme = keys.tenant_id
        globex = s.scalars(select(Tenant.id).where(Tenant.name == "globex")).one()
        s.add(File(id="file_in", tenant_id=acme, filename="in.jsonl", purpose="batch", bytes=1, path="/dev/null"))
        s.flush()
        s.add(Batch(id="batch_1", tenant_id=acme, endpoint="/v1/chat/completions", input_file_id="file_in",
                    completion_window="24h", status="completed", tier="free"))
        common = {"kind": "interactive", "sampling": {}, "status": "succeeded"}
        s.add_all([
            Job(tenant_id=acme, tier="paid", model="tiny", created_at=at(3600), prompt_tokens=100,
                completion_tokens=10, cached_tokens=64, slo_met=True, user_id="user_ada", **common),
            Job(tenant_id=acme, tier="free", model="tiny", created_at=at(7200), prompt_tokens=50,
                completion_tokens=5, cached_tokens=0, slo_met=False, relegation_count=1, batch_id="batch_1",
                **common),
            Job(tenant_id=globex, tier="paid", model="other", created_at=at(DAY + 300), prompt_tokens=30,
                completion_tokens=3, cached_tokens=None, slo_met=True, **common),
            Job(tenant_id=acme, tier="paid", model="tiny", created_at=at(3600), **{**common, "status": "cancelled"}),
            Job(tenant_id=acme, tier="free", model="tiny", created_at=at(7200), prompt_tokens=40, slo_met=False,
                batch_id="batch_1", **{**common, "status": "expired"}),
            Job(tenant_id=acme, tier="paid", model="tiny", created_at=at(-60), prompt_tokens=999,
                completion_tokens=9, slo_met=True, **common),
        ])
        s.commit()
        return acme, globex


def get(client, key, **params):
    return client.get(URL, params={"start_time": T0, "end_time": T0 + 3 * DAY, **params},
                      headers={"Authorization": f"Bearer {key}"})


def test_day_buckets_sum_the_jobs_an_engine_ran(client, keys, jobs):
    r = get(client, keys.admin)
    assert r.status_code == 200, r.text
    page = r.json()
    assert page["object"] == "page" and not page["has_more"] and page["next_page"] is None
    assert [(b["start_time"] - T0, b["end_time"] - T0) for b in page["data"]] == [(0, DAY), (DAY, 2 * DAY),
                                                                                 (2 * DAY, 3 * DAY)]
    (day0,), (day1,), empty = (b["results"] for b in page["data"])
    assert empty == []
    assert {k: day0[k] for k in ("input_tokens", "output_tokens", "input_cached_tokens", "num_model_requests",
                                 "num_slo_met", "num_slo_missed", "num_relegated")} == {
        "input_tokens": 150, "output_tokens": 15, "input_cached_tokens": 64, "num_model_requests": 2,
        "num_slo_met": 1, "num_slo_missed": 2, "num_relegated": 1}
    assert day0["object"] == "organization.usage.completions.result" and day0["project_id"] is None
    assert (day1["input_tokens"], day1["input_cached_tokens"], day1["num_model_requests"]) == (30, 0, 1)


def test_grouped_and_filtered(client, keys, jobs):
    acme, globex = jobs
    r = get(client, keys.admin, group_by=["project_id", "service_tier", "batch"])
    day0 = r.json()["data"][0]["results"]
    assert sorted((x["project_id"], x["service_tier"], x["batch"], x["input_tokens"]) for x in day0) == [
        (acme, "flex", True, 50), (acme, "priority", False, 100)]
    r = get(client, keys.admin, group_by=["model"], models=["other"])
    assert [[(x["model"], x["input_tokens"]) for x in b["results"]] for b in r.json()["data"]] == [
        [], [("other", 30)], []]
    r = get(client, keys.admin, batch="true")
    assert [[x["input_tokens"] for x in b["results"]] for b in r.json()["data"]] == [[50], [], []]
    r = get(client, keys.admin, project_ids=[globex])
    assert [[x["input_tokens"] for x in b["results"]] for b in r.json()["data"]] == [[], [30], []]


def test_grouped_and_filtered_by_user(client, keys, jobs):
    """OpenAI's group_by=user_id and user_ids: the requests' end users, null for the jobs that named none."""
    r = get(client, keys.admin, group_by=["user_id"])
    assert r.status_code == 200, r.text
    assert [sorted(((x["user_id"] or ""), x["input_tokens"]) for x in b["results"]) for b in r.json()["data"]] == [
        [("", 50), ("user_ada", 100)], [("", 30)], []]
    r = get(client, keys.admin, user_ids=["user_ada", "user_nobody"])
    assert r.status_code == 200, r.text
    assert [[(x["user_id"], x["input_tokens"]) for x in b["results"]] for b in r.json()["data"]] == [
        [(None, 100)], [], []]  # filtered, not grouped: user_id stays null, as OpenAI's
    r = get(client, keys.other, user_ids=["user_ada"])  # globex's key: acme's user is not its usage
    assert [b["results"] for b in r.json()["data"]] == [[], [], []]


def test_a_request_records_its_end_user(client, keys, settings):
    """The end user a request names (Responses' safety_identifier or user, chat's user, Anthropic's
    metadata.user_id) is its job's, and the Usage API groups by it once the job ran."""
    H = {"Authorization": f"Bearer {keys.paid}"}
    body = {"model": settings.model_name, "input": "hi", "background": True, "max_output_tokens": 2}
    for extra in ({"safety_identifier": "user_sid", "user": "user_old"}, {"user": "user_old"}, {}):
        r = client.post("/v1/responses", json={**body, **extra}, headers=H)
        assert r.status_code == 200, r.text
        assert r.json()["safety_identifier"] == extra.get("safety_identifier")
    r = client.post("/v1/responses", json={**body, "safety_identifier": "u" * 257}, headers=H)
    assert r.status_code == 400 and r.json()["error"]["param"] == "safety_identifier", r.text
    with session_scope(settings.sqlalchemy_url) as s:
        ran = s.scalars(select(Job)).all()
        assert sorted(j.user_id or "" for j in ran) == ["", "user_old", "user_sid"]
        for j in ran:
            j.prompt_tokens, j.completion_tokens = 7, 2
        start = int(min(j.created_at for j in ran).timestamp())
    r = client.get(URL, params={"start_time": start, "group_by": "user_id"}, headers=H)
    assert r.status_code == 200, r.text
    assert sorted((x["user_id"] or "", x["num_model_requests"]) for b in r.json()["data"] for x in b["results"]) == [
        ("", 1), ("user_old", 1), ("user_sid", 1)]


def test_a_tenant_key_sees_its_own_usage_only(client, keys, jobs):
    acme, globex = jobs
    r = get(client, keys.paid, group_by=["project_id"])
    assert r.status_code == 200, r.text
    assert [[(x["project_id"], x["input_tokens"]) for x in b["results"]] for b in r.json()["data"]] == [
        [(acme, 150)], [], []]
    r = get(client, keys.other)  # globex's own key
    assert [[x["input_tokens"] for x in b["results"]] for b in r.json()["data"]] == [[], [30], []]
    r = get(client, keys.paid, project_ids=[globex])
    assert r.status_code == 403 and r.json()["error"]["param"] == "project_ids", r.text
    assert client.get(URL, params={"start_time": T0}).status_code == 401


def test_hour_buckets_come_in_pages(client, keys, jobs):
    r = get(client, keys.admin, bucket_width="1h")
    page = r.json()
    assert len(page["data"]) == 24 and page["has_more"] and page["next_page"]
    assert [b["results"][0]["input_tokens"] if b["results"] else 0 for b in page["data"][:4]] == [0, 100, 50, 0]
    seen = 24
    while page["has_more"]:
        page = get(client, keys.admin, bucket_width="1h", page=page["next_page"]).json()
        assert page["data"][0]["start_time"] == T0 + seen * 3600
        seen += len(page["data"])
    assert seen == 72
    assert get(client, keys.admin, bucket_width="1h", limit=100).json()["data"][24]["results"][0]["input_tokens"] == 30


@pytest.mark.parametrize("params, param", [
    ({"end_time": T0}, "end_time"),
    ({"group_by": ["user"]}, "group_by"),
    ({"limit": 32}, "limit"),
    ({"bucket_width": "1w"}, "bucket_width"),
    ({"page": "elsewhere"}, "page"),
])
def test_bad_input_is_a_400_naming_the_parameter(client, keys, params, param):
    r = get(client, keys.admin, **params)
    assert r.status_code == 400 and param in (r.json()["error"]["param"] or ""), r.text


@pytest.mark.parametrize("params, param", [
    ({"start_time": 10 ** 12}, "start_time"),
    ({"end_time": 10 ** 12}, "end_time"),
    ({"page": "page_999999"}, "page"),
    ({"page": "page_" + "9" * 30}, "page"),
    # the page just past the range's last bucket, where that range ends in year 9999: a 500 before
    ({"start_time": 253402300700, "end_time": 253402300799, "bucket_width": "1d", "page": "page_1"}, "page"),
])
def test_times_and_pages_out_of_range_are_400s(client, keys, params, param):
    r = get(client, keys.admin, **params)
    assert r.status_code == 400 and param in (r.json()["error"]["param"] or ""), r.text


def test_a_start_time_in_the_future_without_end_time_is_blamed_not_the_end_time_never_sent(client, keys):
    """The 400 said 'end_time (now) must come after start_time' with param end_time, a parameter the client never
    sent: it now names start_time and says that the default end_time is now."""
    future = int(datetime.now(UTC).timestamp()) + DAY
    r = client.get(URL, params={"start_time": future}, headers={"Authorization": f"Bearer {keys.admin}"})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "start_time", r.text
    assert "in the future" in error["message"] and "end_time" in error["message"], r.text


def test_usage_by_the_key_that_submitted_the_jobs(client, keys, db_url):
    """Jobs submitted over HTTP record their key; only the ones an engine finished count (the worker's write is
    done here in SQL)."""
    from sqlalchemy import update

    from app.auth import hash_key
    from app.db.models import ApiKey

    body = {"kind": "interactive", "prompt": "hello there", "max_tokens": 4}
    ids = {}
    for name, key in (("paid", keys.paid), ("paid", keys.paid), ("free", keys.free), ("queued", keys.paid)):
        r = client.post("/v1/jobs", json=body, headers=keys.header(key))
        assert r.status_code in (200, 201, 202), r.text
        ids.setdefault(name, []).append(r.json()["id"])
    with session_scope(db_url) as s:
        key_of = {k: s.scalar(select(ApiKey.id).where(ApiKey.key_hash == hash_key(v)))
                  for k, v in (("paid", keys.paid), ("free", keys.free))}
        assert {s.get(Job, i).api_key_id for i in ids["paid"] + ids["queued"]} == {key_of["paid"]}
        done = ids["paid"] + ids["free"]
        s.execute(update(Job).where(Job.id.in_(done)).values(completion_tokens=4, status="succeeded"))
        s.commit()
    now = int(datetime.now(UTC).timestamp())
    r = client.get(URL, params={"start_time": now - 3600, "end_time": now + 60, "group_by": ["api_key_id"]},
                   headers=keys.header(keys.paid))
    assert r.status_code == 200, r.text
    results = [x for b in r.json()["data"] for x in b["results"]]
    assert sorted((x["api_key_id"], x["num_model_requests"], x["output_tokens"]) for x in results) == sorted(
        [(key_of["paid"], 2, 8), (key_of["free"], 1, 4)])
    r = client.get(URL, params={"start_time": now - 3600, "end_time": now + 60, "api_key_ids": [key_of["free"]]},
                   headers=keys.header(keys.admin))
    assert [x["num_model_requests"] for b in r.json()["data"] for x in b["results"]] == [1]

    # the admin dashboard's tenant table reads the same sums, for the last day
    assert client.get("/admin/api/tenants", headers=keys.header(keys.paid)).status_code == 403
    rows = {t["name"]: t for t in client.get("/admin/api/tenants", headers=keys.header(keys.admin)).json()["tenants"]}
    assert sorted(rows) == ["acme", "globex", "ops"]
    assert rows["acme"]["day"] == {"num_model_requests": 3, "input_tokens": rows["acme"]["day"]["input_tokens"],
                                   "output_tokens": 12, "num_slo_met": 0, "num_slo_missed": 0, "num_relegated": 0}
    assert rows["acme"]["day"]["input_tokens"] > 0 and rows["globex"]["day"]["num_model_requests"] == 0
    assert (rows["acme"]["batch_queued_tokens"], rows["acme"]["batch_queue_tokens"]) == (0, None)


def test_the_default_range_ends_after_the_current_second(client, keys, db_url, monkeypatch):
    """Without end_time the range ends after the current second (end is exclusive): a job that ran in this very
    second counts, and a range that starts in it is not empty (the API's clock is held inside one second)."""
    import types

    from app.api import usage as usage_api

    now = T0 + 5 * DAY
    with session_scope(db_url) as s:
        s.add(Job(tenant_id=keys.tenant_id, tier="paid", model="tiny", created_at=at(5 * DAY).replace(microsecond=25),
                  prompt_tokens=7, completion_tokens=2, kind="interactive", sampling={}, status="succeeded"))
        s.commit()
    monkeypatch.setattr(usage_api, "time", types.SimpleNamespace(time=lambda: now + 0.75))  # the API's clock only

    def counted(start: int) -> tuple[list[list[int]], int]:
        """Each bucket's output tokens, and when the last bucket ends."""
        r = client.get(URL, params={"start_time": start}, headers={"Authorization": f"Bearer {keys.admin}"})
        assert r.status_code == 200, r.text
        data = r.json()["data"]
        return [[x["output_tokens"] for x in b["results"]] for b in data], data[-1]["end_time"]

    assert counted(now - DAY) == ([[], [2]], now + DAY)  # the last bucket holds the current second
    assert counted(now) == ([[2]], now + DAY)


def test_a_request_of_n_choices_and_two_prompts_counts_once_with_each_prompt_once(client, keys, db_url, settings):
    """As OpenAI bills it and the answer's own usage says: one request, each prompt's tokens once, every choice's
    output (through the route's submission of a request's choices; the worker's write done here in SQL)."""
    from sqlalchemy import update

    from app.api.openai_compat import _submit_choices
    from app.auth import authenticate
    from app.schemas import JobCreate

    prompts = [JobCreate(prompt="hello there", max_tokens=4), JobCreate(prompt="and a longer one again", max_tokens=4)]
    with session_scope(db_url) as s:
        jobs, _ = _submit_choices(s, authenticate(s, keys.paid), settings, [p for p in prompts for _ in range(3)],
                                  "/v1/completions", n=3)
        ids = [j.id for j in jobs]
    with session_scope(db_url) as s:
        s.execute(update(Job).where(Job.id.in_(ids)).values(completion_tokens=4, status="succeeded"))
        prompt_tokens = [s.get(Job, i).prompt_tokens for i in ids]
    now = int(datetime.now(UTC).timestamp())
    r = client.get(URL, params={"start_time": now - 3600, "end_time": now + 60}, headers=keys.header(keys.paid))
    (result,) = [x for b in r.json()["data"] for x in b["results"]]
    assert (result["num_model_requests"], result["input_tokens"], result["output_tokens"]) == (
        1, prompt_tokens[0] + prompt_tokens[3], 24)


def _choices_of(db_url, keys, settings, prompts: list[str], n: int) -> list[str]:
    """The jobs of one request of ``n`` choices of each prompt, as the completions route submits them."""
    from app.api.openai_compat import _submit_choices
    from app.auth import authenticate
    from app.schemas import JobCreate

    specs = [JobCreate(prompt=p, max_tokens=4) for p in prompts for _ in range(n)]
    with session_scope(db_url) as s:
        jobs, _ = _submit_choices(s, authenticate(s, keys.paid), settings, specs, "/v1/completions", n=n)
        return [j.id for j in jobs]


def _ran(db_url, job_id: str, cached: int = 0) -> int:
    """A worker's write of a choice it ran (4 tokens out); the job's prompt tokens."""
    from sqlalchemy import update

    with session_scope(db_url) as s:
        s.execute(update(Job).where(Job.id == job_id).values(completion_tokens=4, cached_tokens=cached,
                                                            status="succeeded"))
        return s.get(Job, job_id).prompt_tokens


def _one_result(client, keys) -> dict:
    now = int(datetime.now(UTC).timestamp())
    r = client.get(URL, params={"start_time": now - 3600, "end_time": now + 60}, headers=keys.header(keys.paid))
    (result,) = [x for b in r.json()["data"] for x in b["results"]]
    return result


def _cancel(client, keys, db_url, job_id: str) -> None:
    r = client.post(f"/v1/jobs/{job_id}/cancel", headers=keys.header(keys.paid))
    assert r.status_code == 200, r.text


def _expire(client, keys, db_url, job_id: str) -> None:
    from sqlalchemy import update

    with session_scope(db_url) as s:  # the sweeper's end of a job whose deadline passed in the queue
        s.execute(update(Job).where(Job.id == job_id).values(status="expired", slo_met=False))


@pytest.mark.parametrize("end_first", [_cancel, _expire], ids=["cancelled", "expired"])
def test_a_request_whose_first_choice_never_ran_still_counts_its_prompt_and_request_once(client, keys, db_url,
                                                                                         settings, end_first):
    """n=2, the first choice cancelled by the tenant (POST /v1/jobs/{id}/cancel) or expired in the queue before it
    ran, the second run: the request and its prompt count once, as OpenAI bills them (not 0 requests and 0 input
    tokens with the second choice's output: a prompt never paid for), its cached tokens those of the choice run."""
    first, second = _choices_of(db_url, keys, settings, ["hello there"], n=2)
    end_first(client, keys, db_url, first)
    prompt_tokens = _ran(db_url, second, cached=2)
    result = _one_result(client, keys)
    assert (result["num_model_requests"], result["input_tokens"], result["input_cached_tokens"],
            result["output_tokens"]) == (1, prompt_tokens, 2, 4)


def test_each_prompt_counts_once_where_any_of_its_choices_ran(client, keys, db_url, settings):
    """Two prompts of n=2: the first prompt's choices both run (its prompt once), the second's first choice
    cancelled and its other run (its prompt still once); one request; a prompt none of whose choices ran is not
    counted (old rows, with no link between a request's jobs, keep the first job's rule)."""
    a1, a2, b1, b2 = _choices_of(db_url, keys, settings, ["hello there", "and a longer one again"], n=2)
    _cancel(client, keys, db_url, b1)
    a_tokens = _ran(db_url, a1) and _ran(db_url, a2)
    b_tokens = _ran(db_url, b2)
    result = _one_result(client, keys)
    assert (result["num_model_requests"], result["input_tokens"], result["output_tokens"]) == (
        1, a_tokens + b_tokens, 12)


def test_a_request_counts_once_where_only_a_later_prompt_ran(client, keys, db_url, settings):
    """Two prompts: the first prompt's only choice cancelled before it ran, the second's run: one request, the
    second prompt's tokens (the first prompt's, never run, are not counted)."""
    a, b = _choices_of(db_url, keys, settings, ["hello there", "and a longer one again"], n=1)
    _cancel(client, keys, db_url, a)
    b_tokens = _ran(db_url, b)
    result = _one_result(client, keys)
    assert (result["num_model_requests"], result["input_tokens"], result["output_tokens"]) == (1, b_tokens, 4)
