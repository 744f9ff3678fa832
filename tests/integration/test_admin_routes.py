"""Admin, route by route: every admin, dashboard and operator route of the app (enumerated from ``app.routes``)
refuses a request without a key (401) and a tenant's key (403). The few an operator's browser loads before it has
a key (the dashboard's page and static files) must carry no tenant's data."""

from __future__ import annotations

import re

import pytest
from fastapi.dependencies.utils import get_flat_dependant
from fastapi.routing import APIRoute

from tests.conftest import Keys

pytestmark = pytest.mark.integration

H = Keys.header
GUARDS = {"require_admin", "require_metrics_reader"}
# what a browser loads to show the login form: no data of any tenant's (checked below)
DASHBOARD_SHELL = {"/admin", "/admin/static/{name}", "/favicon.ico"}
OPERATOR_TAGS = {"admin", "metrics"}


def guarded(route: APIRoute) -> bool:
    return any(d.call is not None and d.call.__name__ in GUARDS
               for d in get_flat_dependant(route.dependant).dependencies)


def operator_route(route: APIRoute) -> bool:
    return (guarded(route) or route.path.startswith(("/admin", "/v1/admin")) or route.path == "/metrics"
            or bool(OPERATOR_TAGS & set(route.tags)))


def test_every_operator_route_refuses_no_key_and_a_tenants_key(client, keys):
    routes = [r for r in client.app.routes if isinstance(r, APIRoute) and operator_route(r)]
    assert {"/metrics", "/admin/api/overview", "/v1/admin/tenants", "/reset_prefix_cache",
            "/v1/load_lora_adapter"} <= {r.path for r in routes}
    unguarded = [r.path for r in routes if not guarded(r) and r.path not in DASHBOARD_SHELL]
    assert not unguarded, f"operator routes that take no admin key: {unguarded}"
    for route in routes:
        if route.path in DASHBOARD_SHELL:
            continue
        url = re.sub(r"{\w+(:path)?}", "x", route.path)
        for method in route.methods - {"HEAD"}:
            anonymous = client.request(method, url, json={})
            assert anonymous.status_code == 401, (method, url, anonymous.text)
            tenant = client.request(method, url, json={}, headers=H(keys.paid))
            assert tenant.status_code == 403, (method, url, tenant.text)
    assert client.get("/metrics", headers=H(keys.admin)).status_code == 200


def test_the_dashboards_shell_carries_no_tenants_data(client, keys, settings):
    client.post("/v1/jobs", json={"prompt": "hi"}, headers=H(keys.paid))
    names = [keys.tenant_id, "acme", "globex", keys.paid[:10], keys.admin[:10]]
    page = client.get("/admin")
    assert page.status_code == 200 and not [n for n in names if n in page.text]
    for name in ("admin.js", "admin.css"):
        static = client.get(f"/admin/static/{name}")
        assert static.status_code == 200 and not [n for n in names if n in static.text]
    # the login form posts nowhere with its key: submitted before its script runs, a GET form would put the admin
    # key in the address (the access log, the browser's history)
    form = re.search(r"<form id=\"login-form\"[^>]*>", page.text).group(0)
    assert 'method="post"' in form, form


def test_every_status_the_dashboards_jobs_filter_offers_is_one_the_overview_takes(client, keys):
    """Each option of the jobs table's status filter is a query the overview answers (a 422 left the table as it
    was, under an 'update failed')."""
    page = client.get("/admin").text
    select = re.search(r'<select id="jobs-status">(.*?)</select>', page, re.S).group(1)
    offered = re.findall(r'<option value="(\w*)">', select)
    assert {"", "relegated", "running", "queued", "dispatched"} <= set(offered), offered
    for status in offered:
        r = client.get("/admin/api/overview", params={"status": status} if status else {}, headers=H(keys.admin))
        assert r.status_code == 200, (status, r.text)


def test_the_dashboards_page_runs_only_its_own_script_and_is_framed_by_no_site(client):
    """The page's policy lets only its own files run (a tenant's text that slipped past the script's escaping would
    not run: the page has no inline script to allow) and no other site frame it, where its buttons (a Cancel asks
    nothing) could be clicked through a page laid over it."""
    page = client.get("/admin")
    policy = dict(d.strip().split(" ", 1) for d in page.headers["content-security-policy"].split(";") if d.strip())
    assert (policy["script-src"], policy["frame-ancestors"], policy["object-src"]) == ("'self'", "'none'", "'none'")
    assert "unsafe" not in page.headers["content-security-policy"]
    assert page.headers["x-frame-options"] == "DENY"
    assert not re.findall(r"<script(?![^>]*\bsrc=)[^>]*>", page.text)  # an inline one would not run under it
