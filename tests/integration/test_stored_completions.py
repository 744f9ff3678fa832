"""Stored chat completions over jobs in a real SQLite database migrated by Alembic, through the real app: which
jobs are listed (every choice succeeded, stored, chat), pages that a sparse filter fills across many rows, ties on
the creation time, and the answers for what is not (yet) kept."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from app.db.models import Job
from app.db.session import session_scope
from app.services import stored_completions
from tests.sql_statements import statements

pytestmark = pytest.mark.integration

T0 = datetime(2026, 11, 1, tzinfo=UTC)
CHAT = "/v1/chat/completions"


def _job(tenant: str, i: int, *, status: str = "succeeded", response: dict | None = None, endpoint: str = CHAT,
         job_id: str | None = None, created: datetime | None = None) -> Job:
    return Job(id=job_id or f"job_{i:04d}", tenant_id=tenant, kind="interactive", tier="paid", model="tiny",
               sampling={}, status=status, endpoint=endpoint, created_at=created or T0 + timedelta(seconds=i),
               messages=[{"role": "user", "content": f"q{i}"}], output_text=f"a{i}", finish_reason="stop",
               prompt_tokens=3, completion_tokens=1, response=response)


def _stored(i: int, **metadata: str) -> dict:
    return {"store": True, "metadata": metadata, "choices": [f"job_{i:04d}"]}


@pytest.fixture
def jobs(db_url, keys):
    """200 stored completions of acme (rows 0-199, three tagged rare), and rows that must not show."""
    with session_scope(db_url) as s:
        t = keys.tenant_id
        rare = {7, 120, 190}
        s.add_all([_job(t, i, response=_stored(i, rare="yes" if i in rare else "no")) for i in range(200)])
        s.add_all([
            _job(t, 300, status="running", response=_stored(300, rare="yes")),  # not finished
            _job(t, 301, response={"store": True, "metadata": {"rare": "yes"}, "choices": ["job_0301", "job_0302"]}),
            _job(t, 302, status="failed"),  # the other choice of 301 failed: 301 is not kept
            _job(t, 303, response={"store": True, "metadata": {"rare": "yes"}, "choices": ["job_0303", "job_0304"]}),
            _job(t, 304),  # both choices of 303 succeeded
            _job(t, 305, response={"store": False, "metadata": {"rare": "yes"}, "choices": ["job_0305"]}),
            _job(t, 306, response={"store": True, "metadata": {"rare": "yes"}}, endpoint="/v1/responses"),
            _job(t, 307),  # not stored
            _job(t, 308, response=_stored(308, rare="tie"), job_id="job_0308b", created=T0 + timedelta(seconds=400)),
            _job(t, 309, response=_stored(309, rare="tie"), job_id="job_0308a", created=T0 + timedelta(seconds=400)),
        ])
    return t


def _ids(client, auth, **params) -> tuple[list[str], bool]:
    r = client.get("/v1/chat/completions", headers=auth, params=params)
    assert r.status_code == 200, r.text
    body = r.json()
    return [c["id"].removeprefix("chatcmpl-") for c in body["data"]], body["has_more"]


def test_a_sparse_filter_fills_its_pages_across_many_rows(client, keys, jobs, monkeypatch):
    monkeypatch.setattr(stored_completions, "SCAN_ROWS", 16)  # each page reads several queries' rows
    auth = {"Authorization": f"Bearer {keys.paid}"}
    assert _ids(client, auth, **{"metadata[rare]": "yes", "limit": 2}) == (["job_0007", "job_0120"], True)
    assert _ids(client, auth, **{"metadata[rare]": "yes", "limit": 2, "after": "chatcmpl-job_0120"}) == \
        (["job_0190", "job_0303"], False)
    assert _ids(client, auth, **{"metadata[rare]": "yes", "order": "desc"}) == \
        (["job_0303", "job_0190", "job_0120", "job_0007"], False)
    everything, more = _ids(client, auth, limit=100)
    assert everything[:3] == ["job_0000", "job_0001", "job_0002"] and len(everything) == 100 and more
    rest, more = _ids(client, auth, limit=100, after="chatcmpl-job_0099")
    assert rest == [f"job_{i:04d}" for i in range(100, 200)] and more
    assert _ids(client, auth, after="chatcmpl-job_0199") == (["job_0303", "job_0308a", "job_0308b"], False)
    # two completions created in the same instant: the id breaks the tie, so the cursor skips neither
    assert _ids(client, auth, **{"metadata[rare]": "tie", "limit": 1}) == (["job_0308a"], True)
    assert _ids(client, auth, **{"metadata[rare]": "tie", "after": "chatcmpl-job_0308a"}) == (["job_0308b"], False)
    assert _ids(client, auth, **{"metadata[rare]": "tie", "order": "desc", "after": "chatcmpl-job_0308b"}) == \
        (["job_0308a"], False)


def test_what_is_not_kept_says_so(client, keys, jobs):
    auth = {"Authorization": f"Bearer {keys.paid}"}
    running = client.get("/v1/chat/completions/chatcmpl-job_0300", headers=auth)
    assert running.status_code == 404 and "has not finished" in running.json()["error"]["message"]
    assert client.get("/v1/chat/completions/chatcmpl-job_0301", headers=auth).status_code == 404  # a choice failed
    pair = client.get("/v1/chat/completions/chatcmpl-job_0303", headers=auth).json()
    assert [c["message"]["content"] for c in pair["choices"]] == ["a303", "a304"]
    assert pair["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    for not_kept in ("job_0305", "job_0306", "job_0307", "job_0302", "nope"):
        r = client.get(f"/v1/chat/completions/chatcmpl-{not_kept}", headers=auth)
        assert r.status_code == 404 and "store: true" in r.json()["error"]["message"], not_kept
        assert client.get(f"/v1/chat/completions/chatcmpl-{not_kept}/messages", headers=auth).status_code == 404
        assert client.delete(f"/v1/chat/completions/chatcmpl-{not_kept}", headers=auth).status_code == 404
    assert client.post("/v1/chat/completions/chatcmpl-job_0300", headers=auth,
                       json={"metadata": {"a": "b"}}).status_code == 404
    messages = client.get("/v1/chat/completions/chatcmpl-job_0303/messages", headers=auth,
                          params={"after": "chatcmpl-job_0303-9"})
    assert messages.status_code == 400 and messages.json()["error"]["param"] == "after"
    # a tenant's cursor is no other tenant's
    assert client.get("/v1/chat/completions", headers={"Authorization": f"Bearer {keys.other}"},
                      params={"after": "chatcmpl-job_0001"}).status_code == 400
    for params in ({"limit": 0}, {"limit": 101}, {"order": "sideways"}):
        r = client.get("/v1/chat/completions", headers=auth, params=params)
        assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(params)), r.text


def _listed_with_statements(client, auth: dict, **params) -> tuple[list[dict], list[str]]:
    """``GET /v1/chat/completions``'s completions, and the SQL statements the app ran for them."""
    with statements() as seen:
        r = client.get("/v1/chat/completions", headers=auth, params=params)
    assert r.status_code == 200, r.text
    return r.json()["data"], seen


def test_a_page_of_completions_of_several_choices_reads_their_choices_in_one_query(client, db_url, keys):
    """The list read each completion's other choices with a query of its own (N+1); now one query a page, with
    each completion's choices in order and a completion whose other choice failed still left out."""
    auth = {"Authorization": f"Bearer {keys.paid}"}
    with session_scope(db_url) as s:
        for n in range(6):  # completions 10, 20, ..., 60: three choices each, the last one's third choice failed
            ids = [f"job_{10 * (n + 1) + c:04d}" for c in range(3)]
            s.add(_job(keys.tenant_id, 10 * (n + 1), response={"store": True, "metadata": {}, "choices": ids}))
            s.add_all([_job(keys.tenant_id, 10 * (n + 1) + c, status="failed" if n == 5 and c == 2 else "succeeded")
                       for c in (1, 2)])
    listed, statements = _listed_with_statements(client, auth)
    assert [c["id"] for c in listed] == [f"chatcmpl-job_{10 * n:04d}" for n in range(1, 6)]
    assert [[ch["message"]["content"] for ch in c["choices"]] for c in listed][0] == ["a10", "a11", "a12"]
    assert sum("FROM jobs" in q for q in statements) == 2, statements  # the page's rows, then their choices
