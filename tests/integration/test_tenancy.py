"""Tenancy, route by route: every route of the app that takes an id (in its path or its query) is tried by another
tenant with the ids of a tenant's resources, and every list by another tenant must hold none of them. A route that
names the caller's own resource and another id (a second path id, a cursor) is tried with the caller's own first and
another tenant's second.

The routes are enumerated from ``app.routes``: a route that takes an id and has no case here fails the test, so a
new route cannot forget its tenant's check unnoticed. Another tenant's id must answer as an id that never existed
does (a 404 for a path id, never a 403 that says it exists), and change nothing.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.dependencies.utils import get_flat_dependant
from fastapi.routing import APIRoute
from sqlalchemy import select

from app.auth import clear_cache
from app.db.models import ApiKey, Job, JobStatus
from app.db.session import session_scope
from tests.conftest import Keys

pytestmark = pytest.mark.integration

H = Keys.header
BATCH_LINE = (b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "tiny", '
              b'"messages": [{"role": "user", "content": "hi"}]}}\n')

# a route's path parameters -> the resource of tenant A whose id fills it
PATH_RESOURCE = {"job_id": "job", "response_id": "response", "message_batch_id": "message_batch",
                 "conversation_id": "conversation", "item_id": "item", "file_id": "file", "batch_id": "batch",
                 "run_id": "run", "webhook_endpoint_id": "webhook", "completion_id": "completion"}
# routes whose path names no tenant's resource: the served models (the deployment's, the same for every tenant)
NOT_TENANTS = {("GET", "/v1/models/{model_id:path}"), ("DELETE", "/v1/models/{model_id:path}"),
               ("GET", "/admin/static/{name}")}  # the dashboard's static files: no data (test_admin_routes.py)
# bodies a write route needs to get past its validation to its lookup
BODIES = {("POST", "/v1/conversations/{conversation_id}"): {"metadata": {"k": "v"}},
          ("POST", "/v1/conversations/{conversation_id}/items"): {"items": [
              {"type": "message", "role": "user", "content": "hi"}]},
          ("POST", "/v1/webhook_endpoints/{webhook_endpoint_id}"): {"name": "renamed"},
          ("POST", "/v1/webhook_endpoints/{webhook_endpoint_id}/test"): {"event_type": "batch.completed"},
          ("POST", "/v1/chat/completions/{completion_id}"): {"metadata": {"k": "v"}}}
# query parameters that carry an id or a cursor (a name here, or one ending in _id or _ids)
CURSORS = {"after", "before", "cursor", "starting_after", "page"}
# a route's id-taking query parameter -> the resource of tenant A whose id it is given (None: no tenant's)
QUERY_RESOURCE = {
    ("GET", "/v1/jobs", "batch_id"): "batch", ("GET", "/v1/jobs", "request_id"): "request",
    ("GET", "/v1/jobs", "cursor"): "job_cursor",
    ("GET", "/v1/responses/{response_id}", "starting_after"): "sequence",
    ("GET", "/v1/responses/{response_id}/input_items", "after"): "item",
    ("GET", "/v1/messages/batches", "after_id"): "message_batch",
    ("GET", "/v1/messages/batches", "before_id"): "message_batch",
    ("GET", "/v1/conversations/{conversation_id}/items", "after"): "item",
    ("GET", "/v1/models", "after_id"): None, ("GET", "/v1/models", "before_id"): None,  # the deployment's models
    ("GET", "/v1/files", "after"): "file", ("GET", "/v1/batches", "after"): "batch",
    ("GET", "/v1/summarize", "after"): "run", ("GET", "/v1/webhook_endpoints", "after"): "webhook",
    ("GET", "/v1/chat/completions", "after"): "completion",
    ("GET", "/v1/chat/completions/{completion_id}/messages", "after"): "message",
    ("GET", "/v1/organization/usage/completions", "project_ids"): "tenant",
    ("GET", "/v1/organization/usage/completions", "api_key_ids"): "key",
    ("GET", "/v1/organization/usage/completions", "user_ids"): "request",
    ("GET", "/v1/organization/usage/completions", "page"): None,  # a bucket's index, the same for every tenant
}
REQUIRED_QUERY = {"/v1/organization/usage/completions": {"start_time": 0}}


def admin_only(route: APIRoute) -> bool:
    return any(d.call is not None and d.call.__name__ == "require_admin"
               for d in get_flat_dependant(route.dependant).dependencies)


def api_routes(app) -> Iterator[tuple[str, str, APIRoute]]:
    """(method, path, route) of every route a tenant's key may call (admin routes: test_admin_routes.py)."""
    for route in app.routes:
        if isinstance(route, APIRoute) and not admin_only(route):
            # HEAD where it is a route's only method (a file's content): elsewhere it is GET's, answered alike
            for method in sorted(route.methods - {"HEAD"} or route.methods):
                yield method, route.path, route


def id_queries(route: APIRoute) -> list[str]:
    return [p.alias for p in get_flat_dependant(route.dependant).query_params
            if p.alias in CURSORS or p.alias.endswith(("_id", "_ids"))]


def fill(path: str, ids: dict[str, str]) -> str:
    return re.sub(r"{(\w+)(:path)?}", lambda m: ids[PATH_RESOURCE[m.group(1)]], path)


def never_existed(value: str) -> str:
    """An id shaped as ``value`` that names nothing."""
    return re.sub(r"[0-9a-f]{24}", "0" * 24, value) if re.search(r"[0-9a-f]{24}", value) else value + "x"


def resources_of(client, key: str, settings) -> dict[str, str]:
    """A resource of every kind, made by ``key``'s tenant; their ids by kind."""
    made_with = H(key)

    def made(method: str, path: str, **kw) -> dict[str, Any]:
        r = client.request(method, path, headers={**made_with, "X-Request-Id": "req-a"}, **kw)
        assert r.status_code in (200, 201), (path, r.text)
        return r.json()

    job = made("POST", "/v1/jobs", json={"prompt": "hi"})
    file = made("POST", "/v1/files", files={"file": ("in.jsonl", BATCH_LINE)}, data={"purpose": "batch"})
    batch = made("POST", "/v1/batches", json={"input_file_id": file["id"], "endpoint": "/v1/chat/completions",
                                              "completion_window": "24h"})
    message_batch = made("POST", "/v1/messages/batches", json={"requests": [{"custom_id": "r", "params": {
        "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}}]})
    conversation = made("POST", "/v1/conversations", json={"items": [
        {"type": "message", "role": "user", "content": "hi"}]})
    item = made("GET", f"/v1/conversations/{conversation['id']}/items")["data"][0]["id"]
    response = made("POST", "/v1/responses", json={"model": "tiny", "input": "hi", "background": True,
                                                   "max_output_tokens": 2})
    run = made("POST", "/v1/summarize", json={"documents": [{"id": "a", "text": "x y z"}]})
    webhook = made("POST", "/v1/webhook_endpoints", json={"url": "https://example.com/hook", "name": "a",
                                                          "event_types": ["batch.completed"]})
    stored = made("POST", "/v1/jobs", json={"prompt": "hi"})
    with session_scope(settings.sqlalchemy_url) as s:  # a finished stored chat completion of the tenant's
        row = s.get(Job, stored["id"])
        row.endpoint, row.status, row.output_text = "/v1/chat/completions", JobStatus.SUCCEEDED, "hello"
        row.response = {"store": True, "metadata": {}, "choices": [row.id]}
        tenant_id, key_id = row.tenant_id, row.api_key_id
    cursor = made("GET", "/v1/jobs", params={"limit": 1})
    return {"job": job["id"], "request": "req-a", "file": file["id"], "batch": batch["id"],
            "message_batch": message_batch["id"], "conversation": conversation["id"], "item": item,
            "response": response["id"], "run": run["id"], "webhook": webhook["id"],
            "completion": "chatcmpl-" + stored["id"], "message": stored["id"] + "-0", "sequence": "0",
            "job_cursor": cursor["next_cursor"], "tenant": tenant_id, "key": key_id}


@pytest.fixture
def tenant_a(client, keys, settings) -> dict[str, str]:
    """A resource of every kind, made by tenant A (keys.paid); their ids by kind."""
    return resources_of(client, keys.paid, settings)


def _without_request_id(text: str) -> str:
    """An answer's text without the id Anthropic's error shape gives each request (it differs request to request)."""
    return re.sub(r'"request_id":"[^"]*"', '"request_id":""', text)


def said_of_unknown(text: str, ids: dict[str, str]) -> str:
    """``text`` with each of ``ids``' ids (the longer first: an id may hold another) as ``never_existed`` writes it."""
    for value in sorted((v for v in ids.values() if re.search(r"[0-9a-f]{24}", v)), key=len, reverse=True):
        text = text.replace(value, never_existed(value))
    return _without_request_id(text)


def test_every_id_taking_route_answers_another_tenant_as_an_unknown_id(client, keys, tenant_a):
    b = H(keys.other)
    missing = []
    for method, path, route in api_routes(client.app):
        params = dict(REQUIRED_QUERY.get(path, {}))
        if "{" in path and (method, path) not in NOT_TENANTS:
            if not all(name in PATH_RESOURCE for name in re.findall(r"{(\w+)", path)):
                missing.append(f"{method} {path}")
                continue
            url = fill(path, tenant_a)
            r = client.request(method, url, headers=b, params=params, json=BODIES.get((method, path)))
            assert r.status_code == 404, f"{method} {url} as another tenant: {r.status_code} {r.text[:300]}"
            unknown = client.request(method, fill(path, {k: never_existed(v) for k, v in tenant_a.items()}),
                                     headers=b, params=params, json=BODIES.get((method, path)))
            assert said_of_unknown(r.text, tenant_a) == _without_request_id(unknown.text), f"{method} {url}"
        for name in id_queries(route):
            if (method, path, name) not in QUERY_RESOURCE:
                missing.append(f"{method} {path} ?{name}")
                continue
            if "{" in path or QUERY_RESOURCE[method, path, name] is None:
                continue  # a path id of A's: its 404 above comes first
            theirs = tenant_a[QUERY_RESOURCE[method, path, name]]
            r = client.request(method, path, headers=b, params={**params, name: theirs})
            unknown = client.request(method, path, headers=b, params={**params, name: never_existed(theirs)})
            assert r.status_code == unknown.status_code, f"{method} {path}?{name}=<A's>: {r.status_code} {r.text}"
            said = _without_request_id(r.text.replace(theirs, never_existed(theirs)))
            assert said == _without_request_id(unknown.text), f"{method} {path}?{name}"
    assert not missing, f"routes that take an id but have no tenancy case here: {missing}"
    # nothing B tried changed A's resources: each still answers A
    for path in ("/v1/jobs/{job_id}", "/v1/files/{file_id}", "/v1/batches/{batch_id}",
                 "/v1/messages/batches/{message_batch_id}", "/v1/conversations/{conversation_id}",
                 "/v1/conversations/{conversation_id}/items/{item_id}", "/v1/responses/{response_id}",
                 "/v1/summarize/{run_id}", "/v1/webhook_endpoints/{webhook_endpoint_id}",
                 "/v1/chat/completions/{completion_id}"):
        r = client.get(fill(path, tenant_a), headers=H(keys.paid))
        assert r.status_code == 200, (path, r.text)
        assert r.json().get("status") not in ("cancelled", "canceling", "cancelling"), (path, r.text)


def test_an_id_of_another_tenants_under_an_own_resource_answers_as_an_unknown_id(client, keys, settings, tenant_a):
    """A route whose path names the caller's own resource and also takes another id (a second path id, a query's
    cursor): each such id of another tenant's, the rest the caller's own, answers as an id that never existed does
    (a route that checks its first id's tenant and looks the second up anyone's fails here)."""
    b_owns = resources_of(client, keys.other, settings)
    b = H(keys.other)
    tried = []
    for method, path, route in api_routes(client.app):
        names = re.findall(r"{(\w+)", path)
        if not names or (method, path) in NOT_TENANTS or not all(n in PATH_RESOURCE for n in names):
            continue  # no tenant's id in its path, or one test_every_id_taking_route_... reports missing
        params = dict(REQUIRED_QUERY.get(path, {}))
        for name in names[1:] if len(names) > 1 else ():  # each later path id A's, those before it B's own
            kind = PATH_RESOURCE[name]
            pattern = path.replace("{" + name + "}", "<theirs>")
            url, unknown_url = (fill(pattern, b_owns).replace("<theirs>", value)
                                for value in (tenant_a[kind], never_existed(tenant_a[kind])))
            r = client.request(method, url, headers=b, params=params, json=BODIES.get((method, path)))
            unknown = client.request(method, unknown_url, headers=b, params=params, json=BODIES.get((method, path)))
            assert r.status_code == unknown.status_code == 404, f"{method} {url}: {r.status_code} {r.text[:300]}"
            assert said_of_unknown(r.text, tenant_a) == _without_request_id(unknown.text), f"{method} {url}"
            tried.append(f"{method} {path}")
        for name in id_queries(route):
            kind = QUERY_RESOURCE.get((method, path, name))
            if kind is None or kind == "sequence":  # none of a tenant's (a stream's event number)
                continue
            theirs, url = tenant_a[kind], fill(path, b_owns)
            r = client.request(method, url, headers=b, params={**params, name: theirs})
            unknown = client.request(method, url, headers=b, params={**params, name: never_existed(theirs)})
            assert r.status_code == unknown.status_code, f"{method} {url}?{name}=<A's>: {r.status_code} {r.text}"
            said = _without_request_id(r.text.replace(theirs, never_existed(theirs)))
            assert said == _without_request_id(unknown.text), f"{method} {url}?{name}"
            tried.append(f"{method} {path} ?{name}")
    assert tried, "no route names an own resource and another id: this test checks nothing"
    for path in ("/v1/conversations/{conversation_id}/items/{item_id}",):  # nothing B tried removed A's item
        assert client.get(fill(path, tenant_a), headers=H(keys.paid)).status_code == 200


def test_no_list_shows_another_tenants_items(client, keys, tenant_a):
    secrets = {v for k, v in tenant_a.items() if k not in ("sequence", "message")}
    for method, path, route in api_routes(client.app):
        if method != "GET" or "{" in path:
            continue
        r = client.get(path, headers=H(keys.other), params=REQUIRED_QUERY.get(path, {}))
        leaked = [v for v in secrets if v in r.text]
        assert not leaked, f"GET {path} as another tenant shows {leaked}"


def test_a_revoked_or_unknown_key_answers_alike(client, keys, settings):
    """A revoked key is refused as a key that never existed: the same status and message."""
    with session_scope(settings.sqlalchemy_url) as s:
        for row in s.scalars(select(ApiKey).where(ApiKey.tenant_id == keys.tenant_id)):
            row.revoked = True
    clear_cache()
    revoked = client.get("/v1/jobs", headers=H(keys.paid))
    unknown = client.get("/v1/jobs", headers=H(keys.paid[:-4] + "AAAA"))
    assert revoked.status_code == unknown.status_code == 401
    assert revoked.json() == unknown.json()


@pytest.mark.parametrize("path, field, kind, extra", [
    ("/v1/batches", "input_file_id", "file", {"endpoint": "/v1/chat/completions", "completion_window": "24h"}),
    ("/v1/responses", "previous_response_id", "response", {"model": "tiny", "input": "hi", "background": True}),
    ("/v1/responses", "conversation", "conversation", {"model": "tiny", "input": "hi", "background": True}),
    # a count of another tenant's conversation's tokens would tell its length
    ("/v1/responses/input_tokens", "previous_response_id", "response", {"model": "tiny", "input": "hi"}),
    ("/v1/responses/input_tokens", "conversation", "conversation", {"model": "tiny", "input": "hi"}),
])
def test_an_id_of_another_tenants_in_a_body_answers_as_an_unknown_id(client, keys, tenant_a, path, field, kind,
                                                                       extra):
    theirs = tenant_a[kind]
    r = client.post(path, headers=H(keys.other), json={**extra, field: theirs})
    unknown = client.post(path, headers=H(keys.other), json={**extra, field: never_existed(theirs)})
    assert r.status_code == unknown.status_code and r.status_code in (400, 404), r.text
    assert r.text.replace(theirs, never_existed(theirs)) == unknown.text
