"""The admin dashboard in a real headless Chromium: an overloaded worker relegates a free-tier
job, the dashboard shows it, and its Resume button brings it back to running; a running job's
Cancel button cancels it; the jobs table filters by status and pages; a tenant's summarization runs show
their progress and why one failed, and a running one's Cancel button cancels it; a tenant's Disable and Enable
buttons switch it; the SLO chart has a time
axis, speculation state reads as key: value lines, a job found by its id shows why it was relegated, a
worker without a heartbeat reads as lost, and nothing the page loads answers 404 (the favicon included)."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from tests.conftest import ROOT, Keys, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

CHROMIUM = Path("/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]


def job_status(base, key, job_id):
    return httpx.get(f"{base}/v1/jobs/{job_id}", headers=Keys.header(key)).json()["status"]


def submit(base, key, **body):
    r = httpx.post(f"{base}/v1/jobs", headers=Keys.header(key), json=body, timeout=30)
    assert r.status_code == 201, r.text
    return r.json()["id"]


@pytest.fixture
def overloaded(live_server, keys, start_worker):
    """A paid job holding the whole (tiny) KV pool, and a free job with a 1 ms TTFT: relegated."""
    # 32 blocks x 16 tokens; the paid job reserves prompt + max_tokens at admission (not the 2 tokens the
    # warm-up jobs' history would predict), so the free job cannot start beside it
    start_worker("w1", COSERVE_ENGINE_FACTORY="tests.e2e.slow_engine:build", COSERVE_KV_BLOCKS="32",
                 COSERVE_STEP_DELAY_S="0.08", COSERVE_KV_RESERVE="max_tokens")
    # a few finished jobs first, so the SLO chart has points
    done = [submit(live_server, key, prompt="Hi", max_tokens=2, ignore_eos=True, ttft_ms=ttft)
            for key, ttft in ((keys.paid, 60_000), (keys.free, 60_000), (keys.free, 1))]
    wait_for(lambda: all(job_status(live_server, keys.paid, j) == "succeeded" for j in done), 60, "warm-up jobs")
    hog = submit(live_server, keys.paid, prompt="Write a long story.", max_tokens=470, ignore_eos=True)
    wait_for(lambda: job_status(live_server, keys.paid, hog) == "running", 60, "the paid job to run")
    late = submit(live_server, keys.free, prompt="Quick question?", max_tokens=8, ttft_ms=1)
    wait_for(lambda: job_status(live_server, keys.free, late) == "relegated", 60, "the free job's relegation")
    yield live_server, hog, late
    httpx.post(f"{live_server}/v1/jobs/{hog}/cancel", headers=Keys.header(keys.paid))


def test_admin_api_requires_admin_key(live_server, keys):
    assert httpx.get(f"{live_server}/admin/api/overview").status_code == 401
    assert httpx.get(f"{live_server}/admin/api/overview", headers=Keys.header(keys.paid)).status_code == 403
    body = httpx.get(f"{live_server}/admin/api/overview", headers=Keys.header(keys.admin)).json()
    assert body["jobs"] == [] and body["workers"] == []
    page = httpx.get(f"{live_server}/admin")
    assert page.status_code == 200 and "Admin API key" in page.text
    assert httpx.get(f"{live_server}/admin/static/admin.js").status_code == 200
    assert httpx.get(f"{live_server}/admin/static/..%2Fmain.py").status_code == 404
    icon = httpx.get(f"{live_server}/favicon.ico")  # browsers ask for it on every page
    assert icon.status_code == 200 and icon.headers["content-type"] == "image/x-icon"
    assert icon.content[:4] == b"\x00\x00\x01\x00"  # an ICO header
    assert (body["slo_window_s"], body["slo_bucket_s"]) == (3600, 60)  # the chart's time axis


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs /usr/bin/chromium (apt-get install -y chromium)")
def test_dashboard_shows_relegated_job_and_resumes_it(overloaded, keys, settings, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    from datetime import timedelta

    from app.db.models import SummarizationDocument, SummarizationRun, WorkerState
    from app.db.session import session_scope
    from app.services.transitions import utcnow

    base, hog, late = overloaded
    with session_scope(settings.sqlalchemy_url) as s:  # a worker that died without a word two hours ago
        s.add(WorkerState(id="w-gone", model=settings.model_name, queue="q", device="cpu",
                          heartbeat_at=utcnow() - timedelta(hours=2)))
        runs = [SummarizationRun(tenant_id=keys.tenant_id, model="no-worker-model", tier="paid", status=st,
                                 deadline_at=utcnow() + timedelta(hours=1), max_summary_tokens=64, chunk_tokens=256,
                                 overlap_tokens=0, documents=1, reason=why) for st, why in (
            ("failed", "no document was summarized"), ("running", None))]  # no worker serves its model: it waits
        s.add_all(runs)
        s.flush()
        s.add_all(SummarizationDocument(run_id=r.id, position=0, doc_id="d0", text="text") for r in runs)
        failed_run, running_run = (r.id for r in runs)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        missing = []
        page.on("response", lambda r: missing.append(r.url) if r.status == 404 else None)
        page.goto(f"{base}/admin")
        page.fill("#admin-key", keys.admin)
        page.click("#login-form button[type=submit]")
        row = page.locator(f"#job-{late}")
        expect(row.locator("td.status")).to_have_text("relegated", timeout=20_000)
        expect(page.locator(f"#job-{hog} td.status")).to_have_text("running")
        expect(page.locator(f"#job-{hog} td.model")).to_have_text(settings.model_name)
        expect(row.locator("td.tenant")).to_have_text(keys.tenant_id)
        expect(page.locator("#queues tr[data-tier=free] td[data-status=relegated]")).to_have_text("1")
        expect(page.locator("#worker-w1")).to_contain_text("serving")
        expect(page.locator("#worker-w-gone td.lost")).to_have_text("lost (no heartbeat)")
        expect(page.locator("#slo-chart polyline")).to_have_count(2)  # one line per tier
        # the tenants' last day: acme's three finished warm-up jobs (the running and relegated ones not yet)
        acme = page.locator(f"#tenant-{keys.tenant_id}")
        expect(acme.locator("td.requests")).to_have_text("3")
        expect(acme.locator("td.batch-queue")).to_have_text("0 / no limit")
        assert "% of" in acme.locator("td.slo").inner_text()
        # a tenant's state and its Disable button (the admin PATCH; a confirm dialog first), then Enable
        expect(acme.locator("td.state")).to_have_text("active")
        globex = page.locator("#tenants tr", has_text="globex")
        page.once("dialog", lambda dialog: dialog.accept())
        globex.locator("button[data-action=disable]").click()
        expect(globex.locator("td.state")).to_have_text("disabled", timeout=10_000)
        assert httpx.get(f"{base}/v1/models", headers=Keys.header(keys.other)).status_code == 403
        globex.locator("button[data-action=enable]").click()
        expect(globex.locator("td.state")).to_have_text("active", timeout=10_000)
        # a time axis: clock labels (HH:MM) under the plot, at least two of them
        ticks = page.locator("#slo-chart text.tick.x").all_text_contents()
        assert len(ticks) >= 2 and all(len(t) == 5 and t[2] == ":" for t in ticks), ticks
        # speculation as key: value lines, not JSON
        expect(page.locator("#worker-w1 td.speculation span.kv").first).to_have_text("policy: none")
        expect(page.locator("#worker-w1 td.models")).to_have_text(settings.model_name)  # with adapters: them too
        expect(page.locator("#worker-w1 td.routed")).to_have_text("0")  # nothing waits on its own queue
        expect(page.locator("#worker-w1 td.set-aside")).to_have_text("0")  # no abort left unconfirmed
        assert "{" not in page.locator("#worker-w1 td.speculation").inner_text()
        assert page.evaluate("keyValues({policy: 'adaspec', scale: 1.04213, confidence: [0.9, 0.712], "
                             "drafter: {on: true, k: 4}, last: null})") == [
            "policy: adaspec", "scale: 1.042", "confidence: 0.9, 0.712", "drafter.on: yes", "drafter.k: 4",
            "last: -"]
        # an error answer reads as its message, a 422's list of errors too (not "[object Object]")
        assert page.evaluate("errorText({detail: [{loc: ['body', 'tier'], msg: 'tier must be one of [a]'}]})") == (
            "tier: tier must be one of [a]")
        assert page.evaluate("errorText({detail: 'job x already ended'})") == "job x already ended"
        # an action the API answered but that did nothing says so
        assert page.evaluate("outcome({delivered: false})").startswith("not delivered: no worker is listening")
        # any job by its id: its tenant and its transitions, a relegation with its reason
        page.fill("#job-id", late)
        page.click("#job-search button[type=submit]")
        expect(page.locator("#job-detail")).to_contain_text(f"tenant: {keys.tenant_id}")
        why = page.locator("#job-events tr", has_text="relegated").last.locator("td").last
        expect(why).to_contain_text("engine relegated it (free tier): its 0.001 s TTFT deadline passed")
        # every running or relegated job has a Cancel button
        expect(row.locator("button[data-action=cancel]")).to_have_count(1)
        expect(page.locator(f"#job-{hog} button[data-action=cancel]")).to_have_text("Cancel")
        assert float(row.locator("td.overdue").inner_text()) > 0  # a 1 ms TTFT is overdue at once
        # tier buttons are labelled by their target and direction: free -> paid is up, paid -> free down
        expect(row.locator("button[data-action=promote][data-tier=paid]")).to_have_text("\u2191 paid")
        expect(page.locator(f"#job-{hog} button[data-action=demote][data-tier=free]")).to_have_text("\u2193 free")
        # the jobs table by status, and a page at a time (one row a page here: the overview asked with limit=1)
        page.select_option("#jobs-status", "running")
        expect(page.locator("#jobs tbody tr")).to_have_count(1)
        expect(page.locator(f"#job-{hog}")).to_have_count(1)
        page.select_option("#jobs-status", "")
        page.route("**/admin/api/overview*", lambda route: route.continue_(
            url=route.request.url + ("&" if "?" in route.request.url else "?") + "limit=1"))
        expect(page.locator("#jobs-shown")).to_contain_text("1\u20131 of 2")
        expect(page.locator("#jobs tbody tr")).to_have_attribute("id", f"job-{late}")  # the relegated first
        page.click("#jobs-next")
        expect(page.locator("#jobs tbody tr")).to_have_attribute("id", f"job-{hog}")
        expect(page.locator("#jobs-shown")).to_contain_text("2\u20132 of 2")  # the API's count of the rows before
        expect(page.locator("#jobs-next")).to_be_disabled()
        page.click("#jobs-prev")  # back a page, as the First page button goes back to the first
        expect(page.locator("#jobs tbody tr")).to_have_attribute("id", f"job-{late}")
        expect(page.locator("#jobs-prev")).to_be_disabled()
        page.click("#jobs-next")
        expect(page.locator("#jobs tbody tr")).to_have_attribute("id", f"job-{hog}")
        page.click("#jobs-first")
        expect(page.locator("#jobs tbody tr")).to_have_attribute("id", f"job-{late}")
        page.unroute("**/admin/api/overview*")
        # the summarization runs: a failed one says why; a running one's Cancel (a confirm dialog first)
        expect(page.locator(f"#run-{failed_run} td.reason")).to_have_text("no document was summarized")
        expect(page.locator(f"#run-{running_run} td.documents")).to_have_text("0 / 0 / 1")
        page.once("dialog", lambda dialog: dialog.accept())
        page.locator(f"#run-{running_run} button[data-action=cancel]").click()
        expect(page.locator(f"#run-{running_run} td.status")).to_have_text("cancelled", timeout=10_000)
        expect(page.locator(f"#run-{running_run} td.reason")).to_have_text("cancelled by an admin")
        # the tracked docs/dashboard.png changes only on purpose
        shot = ROOT / "docs" / "dashboard.png" if os.environ.get("COSERVE_UPDATE_SCREENSHOT") == "1" else (
            tmp_path / "dashboard.png")
        shot.parent.mkdir(exist_ok=True)
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 0

        row.locator("button[data-action=resume]").click()
        expect(page.locator(f"#job-{late} td.status")).to_have_text("running", timeout=20_000)
        assert job_status(base, keys.free, late) == "running"

        # the key survives a reload (sessionStorage); drain flips the worker row
        page.reload()
        page.locator("#worker-w1 button[data-action=drain]").click()
        expect(page.locator("#worker-w1")).to_contain_text("draining", timeout=10_000)

        admin = Keys.header(keys.admin)
        r = httpx.post(f"{base}/admin/api/jobs/{late}/promote", json={"tier": "paid"}, headers=admin).json()
        assert r["delivered"] is True  # the worker's control listener got it
        job = httpx.get(f"{base}/v1/jobs/{late}", headers=Keys.header(keys.paid)).json()
        assert job["tier"] == "paid"
        assert httpx.post(f"{base}/admin/api/jobs/{late}/cancel", headers=admin).json()["cancelled"] is True
        assert job_status(base, keys.paid, late) == "cancelled"
        assert httpx.post(f"{base}/admin/api/jobs/{late}/resume", headers=admin).status_code == 409

        # the running paid job's Cancel button: it ends cancelled and leaves the table
        assert job_status(base, keys.paid, hog) == "running"
        page.locator(f"#job-{hog} button[data-action=cancel]").click()
        expect(page.locator(f"#job-{hog}")).to_have_count(0, timeout=10_000)
        assert job_status(base, keys.paid, hog) == "cancelled"
        expect(page.locator("#status")).to_have_text(f"cancel {hog}: done")
        assert missing == [], missing  # the favicon too
        browser.close()


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs /usr/bin/chromium (apt-get install -y chromium)")
def test_the_dashboard_tells_a_job_no_worker_holds_from_a_worker_that_did_not_hear(live_server, keys, settings):
    """A tier button on a queued job (no worker holds it: the one that leases it reads the tier) says it is done;
    on a running job whose worker does not listen, that this worker did not hear it. Both stand in SQL."""
    from playwright.sync_api import expect, sync_playwright
    from sqlalchemy import update

    from app.db.models import Job
    from app.db.session import session_scope

    waiting, held = (submit(live_server, keys.paid, prompt="Hi", max_tokens=2) for _ in range(2))
    with session_scope(settings.sqlalchemy_url) as s:  # no worker runs here: the states are set as workers set them
        s.execute(update(Job).where(Job.id == waiting).values(status="queued", worker_id=None))
        s.execute(update(Job).where(Job.id == held).values(status="running", worker_id="w-deaf"))
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        page = browser.new_page()
        page.goto(f"{live_server}/admin")
        page.fill("#admin-key", keys.admin)
        page.click("#login-form button[type=submit]")
        page.select_option("#jobs-status", "queued")
        page.locator(f"#job-{waiting} button[data-action=demote][data-tier=free]").click()
        expect(page.locator("#status")).to_have_text(
            f"demote {waiting} to free: done (no worker holds the job yet: the one that leases it reads it from SQL)")
        page.select_option("#jobs-status", "running")
        page.locator(f"#job-{held} button[data-action=demote][data-tier=free]").click()
        expect(page.locator("#status")).to_have_text(
            f"demote {held} to free: not delivered: worker w-deaf holds the job and did not hear it "
            "(what SQL holds stands)")
        browser.close()
    for job_id in (waiting, held):
        assert httpx.get(f"{live_server}/v1/jobs/{job_id}", headers=Keys.header(keys.paid)).json()["tier"] == "free"


MARKUP = '<script>alert(1)</script>"><img src=x onerror=alert(2)>'


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs /usr/bin/chromium (apt-get install -y chromium)")
def test_the_dashboard_shows_markup_in_what_tenants_and_workers_write_as_text(live_server, keys, settings):
    """Markup in a tenant's name, a job's error, a summarization run's model and reason, a worker's id, device and
    speculation state reads as its text: nothing of it runs or loads, and the page's policy (only its own script)
    refuses nothing the page needs (its tiers' buttons come from its data-tiers)."""
    from playwright.sync_api import expect, sync_playwright
    from sqlalchemy import update

    from app.db.models import Job, SummarizationRun, WorkerState
    from app.db.session import session_scope
    from app.services.transitions import utcnow

    assert httpx.post(f"{live_server}/v1/admin/tenants", json={"name": MARKUP},
                      headers=Keys.header(keys.admin)).status_code == 201
    relegated, failed = (submit(live_server, keys.paid, prompt=MARKUP, max_tokens=2) for _ in range(2))
    with session_scope(settings.sqlalchemy_url) as s:  # no worker runs here: the states are set as workers set them
        s.execute(update(Job).where(Job.id == relegated).values(status="relegated", worker_id=MARKUP))
        s.execute(update(Job).where(Job.id == failed).values(status="failed", error=MARKUP))
        s.add(WorkerState(id=MARKUP, model=MARKUP, queue="q", device=MARKUP, state={"speculation": {"policy": MARKUP}}))
        s.add(SummarizationRun(tenant_id=keys.tenant_id, model=MARKUP, tier="paid", status="failed", reason=MARKUP,
                               deadline_at=utcnow(), max_summary_tokens=64, chunk_tokens=256, overlap_tokens=0,
                               documents=1))
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        page = browser.new_page()
        console, dialogs = [], []
        page.on("console", lambda m: console.append(m.text))
        page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
        page.goto(f"{live_server}/admin")
        page.fill("#admin-key", keys.admin)
        page.click("#login-form button[type=submit]")
        expect(page.locator(f"#job-{relegated} button[data-tier=free]")).to_have_count(1, timeout=10_000)
        expect(page.locator("#queues tbody tr")).to_have_count(len(settings.tiers))
        for table in ("#jobs", "#tenants", "#runs", "#workers"):
            expect(page.locator(f"{table} tbody tr", has_text=MARKUP).first).to_be_visible(timeout=10_000)
        page.fill("#job-id", failed)
        page.click("#job-search button[type=submit]")
        expect(page.locator("#job-detail")).to_contain_text("error: " + MARKUP)
        assert page.locator("img").count() == 0 and not dialogs, dialogs
        assert not [c for c in console if "Content Security Policy" in c], console
        browser.close()
