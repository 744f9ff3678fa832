// coserve admin dashboard: polls /admin/api/overview with the admin key kept in sessionStorage.
"use strict";
const KEY = "coserve.adminKey";
const POLL_MS = 1000;
const TENANTS_POLL_MS = 30000; // the tenants' day of usage is a heavier read than the overview
const RUNS_POLL_MS = 5000;  // a run's progress reads its documents' jobs
const $ = (sel) => document.querySelector(sel);
// the configured tiers, lowest first (the page's data-tiers: its policy runs no inline script)
const TIERS = JSON.parse(document.body.dataset.tiers || "[]");
let timer = null;
let tenantsTimer = null;
let runsTimer = null;
// the jobs table's filter; its pages and the tenants' (pager below)
let jobsStatus = "";
let refreshing = false;  // one overview read at a time: a slow one is not overtaken by the next
let pointerDown = false;  // a press on a button the next redraw would replace
const pending = new Set();  // "action job-or-worker id" of the actions sent and not answered yet
document.addEventListener("pointerdown", () => { pointerDown = true; });
document.addEventListener("pointerup", () => { pointerDown = false; });
document.addEventListener("pointercancel", () => { pointerDown = false; });

// while the operator presses a button or selects text (a job id to copy), the tables stay as they are
function holding() {
  const sel = window.getSelection();
  return pointerDown || (sel && !sel.isCollapsed && $("#dash").contains(sel.anchorNode));
}

function key() { return sessionStorage.getItem(KEY); }

async function api(path, options = {}) {
  const r = await fetch(path, {
    ...options,
    headers: { "Authorization": "Bearer " + key(), "Content-Type": "application/json", ...(options.headers || {}) },
  });
  const body = await r.json().catch(() => ({}));
  if (r.status === 401 || r.status === 403) {  // the API's reason: not an admin key, revoked, its tenant disabled
    logout(errorText(body) || "this key is not an admin key");
    throw new Error("auth");
  }
  if (!r.ok) throw new Error(errorText(body) || r.statusText);
  return body;
}

// a 4xx's message: {"detail": "..."}, a 422's {"detail": [{"loc", "msg"}, ...]}, or OpenAI's {"error": {...}}
function errorText(body) {
  if (Array.isArray(body.detail)) {
    return body.detail.map((e) => (e.loc || []).filter((p) => p !== "body").join(".") + ": " + e.msg).join("; ");
  }
  return body.detail || body.error?.message;
}

function cell(row, text, cls) {
  const td = row.insertCell();
  td.textContent = text;
  if (cls) td.className = cls;
  return td;
}

// what an action's answer says happened: the API answers 200 also when no worker heard it (an ended job: a 409);
// delivered null: no worker holds the job (queued, dispatched), so nobody was to hear it and SQL's word is all
function outcome(body) {
  if (body.delivered === null) return "done (no worker holds the job yet: the one that leases it reads it from SQL)";
  if (body.delivered === false) {
    const who = body.worker_id ? `worker ${body.worker_id} holds the job and did not hear it`
      : "no worker is listening";
    return `not delivered: ${who} (what SQL holds stands)`;
  }
  if (body.skipped) return "not done";
  return "done";
}

// opts: action (data-action, default: the label in lower case), title (tooltip and status text), cls, id (what it
// acts on: a redraw keeps the button disabled while its action is pending)
function button(td, label, onClick, opts = {}) {
  const b = document.createElement("button");
  const what = opts.title || label;
  b.textContent = label;
  b.dataset.action = opts.action || label.toLowerCase();
  if (opts.title) b.title = opts.title;
  if (opts.cls) b.className = opts.cls;
  const key = b.dataset.action + " " + (opts.id || "") + " " + label;
  b.disabled = pending.has(key);
  b.addEventListener("click", async () => {
    b.disabled = true;
    pending.add(key);
    try { $("#status").textContent = what + ": " + outcome(await onClick()); }
    catch (e) { $("#status").textContent = what + " failed: " + e.message; }
    finally { pending.delete(key); }
    refresh();
  });
  td.appendChild(b);
  return b;
}

function renderQueues(queues) {
  const tbody = $("#queues tbody");
  tbody.replaceChildren();
  const tiers = [...new Set([...TIERS, ...queues.map((q) => q.tier)])];
  for (const tier of tiers) {
    const row = tbody.insertRow();
    row.dataset.tier = tier;
    cell(row, tier);
    for (const st of ["queued", "dispatched", "running", "relegated"]) {
      const q = queues.find((x) => x.tier === tier && x.status === st);
      cell(row, q ? q.count : 0, "num").dataset.status = st;
    }
  }
}

// a table paged by cursor (its First, Previous and Next page buttons: #<name>-first, -prev, -next): the cursors of
// the pages turned to (null: the first page), the next page's, and what to draw on a turn
function pager(name, turned) {
  const p = { pages: [null], next: null };
  p.after = () => p.pages[p.pages.length - 1];
  p.path = (path, q = new URLSearchParams()) => {
    if (p.after()) q.set("after", p.after());
    return path + (q.size ? "?" + q : "");
  };
  p.reset = () => { p.pages = [null]; };
  // the page shown: its buttons, and "(first–last of total)" where it is not the whole table, its row numbers as
  // the API counts them now (not from the pages turned: the rows before move on meanwhile)
  p.shown = (next, before, rows, total, order = "") => {
    p.next = next;
    $(`#${name}-next`).disabled = !next;
    $(`#${name}-prev`).disabled = $(`#${name}-first`).disabled = p.pages.length < 2;
    return total > rows ? `(${rows ? before + 1 : 0}–${before + rows} of ${total}${order})` : "";
  };
  $(`#${name}-next`).addEventListener("click", () => { if (p.next) { p.pages.push(p.next); turned(); } });
  $(`#${name}-prev`).addEventListener("click", () => { if (p.pages.length > 1) { p.pages.pop(); turned(); } });
  $(`#${name}-first`).addEventListener("click", () => { p.reset(); turned(); });
  return p;
}
const jobsPager = pager("jobs", () => refresh());
const tenantsPager = pager("tenants", () => refreshTenants());

function jobsPath() {
  const q = new URLSearchParams();
  if (jobsStatus) q.set("status", jobsStatus);
  return jobsPager.path("/admin/api/overview", q);
}

function renderJobs(jobs, total, next, before) {
  const tbody = $("#jobs tbody");
  tbody.replaceChildren();
  // the API sends the relegated jobs first, then running, dispatched and queued ones, each oldest first
  $("#jobs-shown").textContent = jobsPager.shown(next, before, jobs.length, total,
    ": the relegated first, then the oldest");
  for (const j of jobs) {
    const row = tbody.insertRow();
    row.id = "job-" + j.id;
    row.className = j.status;
    const idCell = cell(row, "");
    const link = document.createElement("a");
    link.href = "#job=" + encodeURIComponent(j.id);
    link.textContent = j.id;
    idCell.appendChild(link);
    cell(row, j.tenant_id, "tenant");
    cell(row, j.model, "model");
    cell(row, j.tier);
    cell(row, j.kind);
    cell(row, j.status).className = "status";
    cell(row, j.worker_id || "-");
    cell(row, j.age_s.toFixed(1), "num");
    cell(row, j.overdue_s.toFixed(1), j.overdue_s > 0 ? "num overdue" : "num");
    cell(row, j.relegation_count, "num");
    const td = row.insertCell();
    if (j.status === "relegated") {
      button(td, "Resume", () => api(`/admin/api/jobs/${j.id}/resume`, { method: "POST" }), { id: j.id });
    }
    button(td, "Cancel", () => api(`/admin/api/jobs/${j.id}/cancel`, { method: "POST" }),
      { title: `cancel ${j.id}`, id: j.id });
    // one button per other tier, labelled by its target; tiers are configured lowest first,
    // so a later tier is a promotion and an earlier one a demotion
    const here = TIERS.indexOf(j.tier);
    for (const t of TIERS.filter((t) => t !== j.tier)) {
      const up = here < 0 || TIERS.indexOf(t) > here;
      const verb = up ? "promote" : "demote";
      const b = button(td, (up ? "\u2191 " : "\u2193 ") + t, () => api(`/admin/api/jobs/${j.id}/promote`,
        { method: "POST", body: JSON.stringify({ tier: t }) }),
        { action: verb, title: `${verb} ${j.id} to ${t}`, cls: "tier " + verb, id: j.id });
      b.dataset.tier = t;
    }
  }
}

// {policy: "adaspec", scale: 1.0421, confidence: [0.9, 0.71]} -> ["policy: adaspec", "scale: 1.042",
// "confidence: 0.9, 0.71"]; nested objects as "outer.inner: value"
function keyValues(obj, prefix = "") {
  const fmt = (v) => v === null || v === undefined ? "-"
    : typeof v === "number" ? (Number.isInteger(v) ? String(v) : String(+v.toFixed(3)))
      : typeof v === "boolean" ? (v ? "yes" : "no")
        : Array.isArray(v) ? v.map(fmt).join(", ") : String(v);
  return Object.entries(obj).flatMap(([k, v]) => v && typeof v === "object" && !Array.isArray(v)
    ? keyValues(v, prefix + k + ".") : [`${prefix}${k}: ${fmt(v)}`]);
}

function lines(td, texts) {
  for (const t of texts) {
    const span = document.createElement("span");
    span.className = "kv";
    span.textContent = t;
    td.appendChild(span);
  }
}

function renderWorkers(workers) {
  const tbody = $("#workers tbody");
  tbody.replaceChildren();
  for (const w of workers) {
    const s = w.state || {};
    const row = tbody.insertRow();
    row.id = "worker-" + w.id;
    cell(row, w.id);
    cell(row, w.served.join(", "), "models");
    cell(row, w.device);
    cell(row, w.heartbeat_age_s.toFixed(1), "num");
    cell(row, s.kv_usage == null ? "-" : (100 * s.kv_usage).toFixed(1) + "%", "num");
    cell(row, s.queues ? Object.entries(s.queues).map(([k, v]) => `${k}=${v}`).join(" ") : "-");
    cell(row, s.routed_waiting == null ? "-" : String(s.routed_waiting), "num routed");  // its own queue (routing)
    // job attempts whose abort the engine never confirmed: not served (the worker's log names them)
    cell(row, s.set_aside_jobs == null ? "-" : String(s.set_aside_jobs), "num set-aside");
    // the profile's step costs x what this engine's steps measured (vLLM backend, COSERVE_COST_CALIBRATION)
    const cal = s.cost_calibration;
    cell(row, cal ? `${cal.scale.toFixed(2)}x (${cal.steps} steps)` : "-", "num");
    const spec = cell(row, s.speculation ? "" : "-", "speculation");
    if (s.speculation) lines(spec, keyValues(s.speculation));
    cell(row, s.draft_on_device == null ? "-" : (s.draft_on_device ? "on" : "off"));
    // a worker that stopped without a word keeps its row: its heartbeat says it is gone
    // a stopping one (a warm shutdown's grace) runs its last jobs and takes no new one, as a draining one
    const status = w.stopping ? "stopping" : w.draining ? "draining" : "serving";
    cell(row, !w.alive ? "lost (no heartbeat)" : status, w.alive ? "" : "lost");
    const td = row.insertCell();
    button(td, w.draining ? "Undrain" : "Drain", () => api(`/admin/api/workers/${encodeURIComponent(w.id)}/drain`,
      { method: "POST", body: JSON.stringify({ drain: !w.draining }) }), { id: w.id });
  }
}

// one row per tenant: its last day's usage, SLO met as a share of the jobs judged, its limits
function renderTenants(body) {
  const tbody = $("#tenants tbody");
  tbody.replaceChildren();
  const tenants = body.tenants;
  $("#tenants-shown").textContent = tenantsPager.shown(body.tenants_next, body.tenants_before, tenants.length,
    body.tenants_total);
  const n = (v) => v.toLocaleString("en-US");
  for (const t of tenants) {
    const d = t.day;
    const row = tbody.insertRow();
    row.id = "tenant-" + t.id;
    cell(row, t.name).title = t.id;
    cell(row, t.default_tier);
    cell(row, n(d.num_model_requests), "num requests");
    cell(row, n(d.input_tokens), "num");
    cell(row, n(d.output_tokens), "num");
    const judged = d.num_slo_met + d.num_slo_missed;
    cell(row, judged ? `${(100 * d.num_slo_met / judged).toFixed(1)}% of ${n(judged)}` : "-", "num slo");
    cell(row, n(d.num_relegated), "num");
    const rate = [t.requests_per_minute && `${n(t.requests_per_minute)} requests`,
      t.tokens_per_minute && `${n(t.tokens_per_minute)} tokens`].filter(Boolean);
    cell(row, rate.length ? rate.join(", ") : "none");
    cell(row, `${n(t.batch_queued_tokens)} / ${t.batch_queue_tokens ? n(t.batch_queue_tokens) : "no limit"}`,
      "num batch-queue");
    // a disabled tenant's keys are refused (403); disabling also cancels its open batches and jobs
    cell(row, t.disabled ? "disabled" : "active", "state");
    if (t.disabled) row.classList.add("disabled");
    const what = t.disabled ? `enable ${t.name}` : `disable ${t.name}`;
    button(row.insertCell(), t.disabled ? "Enable" : "Disable", () => setDisabled(t, !t.disabled),
      { title: what, id: t.id });
  }
}

// PATCH /v1/admin/tenants/{id}; disabling stops the tenant's work, so it asks first
async function setDisabled(t, disabled) {
  if (disabled && !window.confirm(`Disable ${t.name}? Its keys are refused and its open batches and jobs are ` +
    "cancelled.")) {
    return { skipped: true };
  }
  const body = await api(`/v1/admin/tenants/${encodeURIComponent(t.id)}`,
    { method: "PATCH", body: JSON.stringify({ disabled }) });
  await refreshTenants();
  return body;
}

async function refreshTenants() {
  try {
    const path = tenantsPager.path("/admin/api/tenants");
    const body = await api(path);
    if (path === tenantsPager.path("/admin/api/tenants")) renderTenants(body);  // else a turn since draws it
  }
  catch (e) { if (e.message !== "auth") $("#status").textContent = "tenants update failed: " + e.message; }
}

// every tenant's summarization runs, newest first: progress, why one failed or was cancelled, and a Cancel
function renderRuns(body) {
  const tbody = $("#runs tbody");
  tbody.replaceChildren();
  const counts = Object.entries(body.counts).map(([st, n]) => `${st}: ${n}`).join(", ");
  $("#runs-shown").textContent = `(${counts}${body.has_more ? `; the newest ${body.data.length} shown` : ""})`;
  for (const r of body.data) {
    const row = tbody.insertRow();
    row.id = "run-" + r.id;
    row.className = r.status;
    cell(row, r.id);
    cell(row, r.tenant || r.tenant_id, "tenant").title = r.tenant_id;
    cell(row, r.model || "-");
    cell(row, r.tier);
    cell(row, r.status, "status");
    cell(row, `${r.documents_done} / ${r.documents_failed} / ${r.documents}`, "num documents");
    cell(row, `${r.jobs_done} / ${r.jobs_submitted}`, "num jobs");
    cell(row, new Date(r.deadline_at).toLocaleString());
    cell(row, r.reason || "-", "reason");
    const td = row.insertCell();
    if (["validating", "running", "cancelling"].includes(r.status)) {  // a cancelling one: its cancel died
      button(td, "Cancel", () => cancelRun(r), { title: `cancel ${r.id}`, id: r.id });
    }
  }
}

// POST /admin/api/summarizations/{id}/cancel: the documents not done fail and their jobs are cancelled, so it asks
async function cancelRun(r) {
  if (!window.confirm(`Cancel summarization ${r.id} of ${r.tenant || r.tenant_id}? The documents not summarized ` +
    "yet fail; the summaries made so far stay.")) {
    return { skipped: true };
  }
  const body = await api(`/admin/api/summarizations/${encodeURIComponent(r.id)}/cancel`, { method: "POST" });
  await refreshRuns();
  return body;
}

async function refreshRuns() {
  const st = $("#runs-status").value;
  try {
    const body = await api("/admin/api/summarizations" + (st ? "?status=" + encodeURIComponent(st) : ""));
    if (st === $("#runs-status").value && !holding()) renderRuns(body);
  } catch (e) { if (e.message !== "auth") $("#status").textContent = "runs update failed: " + e.message; }
}

// SLO attainment (% met) per minute, one polyline per tier, drawn as inline SVG over a time axis that
// ends now and spans the minutes with points (at least 10, at most the window), labelled in local time.
function renderSlo(points, nowIso, windowS = 3600, bucketS = 60) {
  const svg = $("#slo-chart");
  const NS = "http://www.w3.org/2000/svg";
  const W = svg.width.baseVal.value, H = svg.height.baseVal.value;
  const left = 38, right = 80, top = 10, bottom = 36;  // the legend sits right of the plot
  svg.replaceChildren();
  const add = (name, attrs, text) => {
    const el = document.createElementNS(NS, name);
    for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
    if (text) el.textContent = text;
    svg.appendChild(el);
    return el;
  };
  const now = Date.parse(nowIso) / 1000 || Date.now() / 1000;
  const earliest = points.length ? Math.min(...points.map((p) => p.t)) : now;
  const span = Math.min(windowS, Math.max(600, now - earliest + bucketS));
  const t0 = now - span, t1 = now;
  const x = (t) => left + (W - left - right) * (Math.min(Math.max(t, t0), t1) - t0) / (t1 - t0);
  const y = (f) => H - bottom - (H - bottom - top) * f;
  // y: 0, 50, 100 %
  for (const f of [0, 0.5, 1]) {
    add("line", { x1: left, y1: y(f), x2: W - right, y2: y(f), stroke: f ? "#eee" : "#999" });
    add("text", { x: left - 4, y: y(f) + 4, "font-size": 10, "text-anchor": "end", class: "tick y" },
      `${100 * f}%`);
  }
  add("line", { x1: left, y1: top, x2: left, y2: H - bottom, stroke: "#999" });
  // x: a tick every 1, 2, 5, 10 or 15 minutes, at most 7, on whole minutes of the clock
  const step = [60, 120, 300, 600, 900].find((s) => span / s <= 7) || 900;
  const clock = (t) => new Date(t * 1000).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit", hour12: false });
  for (let t = Math.ceil(t0 / step) * step; t <= t1; t += step) {
    add("line", { x1: x(t), y1: H - bottom, x2: x(t), y2: H - bottom + 4, stroke: "#999" });
    add("text", { x: x(t), y: H - bottom + 15, "font-size": 10, "text-anchor": "middle", class: "tick x" },
      clock(t));
  }
  add("text", { x: (left + W - right) / 2, y: H - 4, "font-size": 10, "text-anchor": "middle", fill: "#6b7280" },
    "finished at (local time)");
  if (!points.length) {
    add("text", { x: (left + W - right) / 2, y: H / 2, fill: "#888", "text-anchor": "middle" }, "no finished jobs yet");
    return;
  }
  const colors = ["#1f6feb", "#d97706", "#16a34a", "#9333ea"];
  const tiers = [...new Set(points.map((p) => p.tier))].sort();
  tiers.forEach((tier, i) => {
    const color = colors[i % colors.length];
    const pts = points.filter((p) => p.tier === tier);
    const mid = (p) => p.t + bucketS / 2;  // a point stands for its minute
    const share = (p) => p.met / (p.met + p.violated);
    add("polyline", { points: pts.map((p) => `${x(mid(p)).toFixed(1)},${y(share(p)).toFixed(1)}`).join(" "),
      fill: "none", stroke: color, "stroke-width": 2, "data-tier": tier });
    for (const p of pts) {
      const dot = add("circle", { cx: x(mid(p)), cy: y(share(p)), r: 3, fill: color });
      const title = document.createElementNS(NS, "title");
      title.textContent = `${clock(p.t)} ${tier}: ${p.met} of ${p.met + p.violated} met`;
      dot.appendChild(title);
    }
    add("text", { x: W - right + 10, y: top + 10 + 14 * i, fill: color, "font-size": 12 }, tier);
  });
}

async function refresh() {
  if (refreshing || holding()) return;  // the next poll draws it
  refreshing = true;
  try {
    const path = jobsPath();
    const o = await api(path);
    if (holding() || path !== jobsPath()) return;  // the filter or page changed meanwhile: the next poll draws it
    renderQueues(o.queues);
    renderJobs(o.jobs, o.jobs_total, o.jobs_next, o.jobs_before);
    renderWorkers(o.workers);
    renderSlo(o.slo, o.now, o.slo_window_s, o.slo_bucket_s);
    $("#dash").dataset.updated = o.now;
  } catch (e) {
    if (e.message !== "auth") $("#status").textContent = "update failed: " + e.message;
  } finally {
    refreshing = false;
  }
}

// one job of any tenant, with its transitions and why each happened (#job=<id> in the address, or the search form)
async function showJob(jobId) {
  const box = $("#job-detail");
  box.replaceChildren();
  if (!jobId) { box.hidden = true; return; }
  box.hidden = false;
  let found;
  try { found = await api(`/admin/api/jobs/${encodeURIComponent(jobId)}`); }
  catch (e) {
    // not a job's id: the X-Request-Id a client reports names the jobs its request submitted
    const byRequest = await api(`/admin/api/jobs?request_id=${encodeURIComponent(jobId)}`).catch(() => null);
    if (!byRequest || !byRequest.data.length) { box.textContent = e.message; return; }
    if (byRequest.data.length > 1) { requestJobs(box, byRequest); return; }
    try { found = await api(`/admin/api/jobs/${encodeURIComponent(byRequest.data[0].id)}`); }
    catch (e2) { box.textContent = e2.message; return; }
  }
  const j = found.job;
  const facts = document.createElement("p");
  lines(facts, [`job: ${j.id}`, `tenant: ${found.tenant_id}`, `status: ${j.status}`, `tier: ${j.tier}`,
    `kind: ${j.kind}`, `worker: ${j.worker_id || "-"}`, `finish: ${j.finish_reason || "-"}`,
    `SLO met: ${j.metrics.slo_met == null ? "-" : j.metrics.slo_met ? "yes" : "no"}`,
    ...(j.error ? [`error: ${j.error}`] : [])]);
  const table = document.createElement("table");
  table.id = "job-events";
  const head = table.createTHead().insertRow();
  for (const h of ["at", "from", "to", "worker", "attempt", "why"]) {
    const th = document.createElement("th");
    th.textContent = h;
    head.appendChild(th);
  }
  const body = table.createTBody();
  for (const e of found.events) {
    const row = body.insertRow();
    for (const v of [e.at, e.from || "-", e.to, e.worker_id || "-", e.attempt, e.detail || "-"]) cell(row, v);
  }
  box.append(facts, table);
}

// a request's jobs (several prompts or choices), each a link to its own history
function requestJobs(box, found) {
  const list = document.createElement("ul");
  list.id = "request-jobs";
  for (const j of found.data) {
    const link = document.createElement("a");
    link.href = "#job=" + encodeURIComponent(j.id);
    link.textContent = j.id;
    const item = document.createElement("li");
    item.append(link, ` tenant: ${j.tenant_id}, status: ${j.status}, tier: ${j.tier}, created: ${j.created_at}`);
    list.appendChild(item);
  }
  const head = document.createElement("p");
  head.textContent = `request ${found.request_id}: ${found.data.length}${found.has_more ? "+" : ""} jobs`;
  box.append(head, list);
}

function jobInAddress() {
  const m = location.hash.match(/^#job=(.+)$/);
  return m ? decodeURIComponent(m[1]) : "";
}

function show(loggedIn) {
  $("#login").hidden = loggedIn;
  $("#dash").hidden = !loggedIn;
  $("#logout").hidden = !loggedIn;
  clearInterval(timer);
  clearInterval(tenantsTimer);
  clearInterval(runsTimer);
  if (loggedIn) {
    showJob(jobInAddress());
    refresh();
    timer = setInterval(refresh, POLL_MS);
    refreshTenants();
    tenantsTimer = setInterval(refreshTenants, TENANTS_POLL_MS);
    refreshRuns();
    runsTimer = setInterval(refreshRuns, RUNS_POLL_MS);
  }
}

function logout(message) {
  sessionStorage.removeItem(KEY);
  $("#login-error").textContent = message || "";
  show(false);
}

$("#login-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  sessionStorage.setItem(KEY, $("#admin-key").value.trim());
  $("#login-error").textContent = "";
  show(true);
});
$("#logout").addEventListener("click", () => logout());
$("#jobs-status").addEventListener("change", () => {
  jobsStatus = $("#jobs-status").value;
  jobsPager.reset();
  refresh();
});
$("#runs-status").addEventListener("change", refreshRuns);
$("#job-search").addEventListener("submit", (ev) => {
  ev.preventDefault();
  location.hash = "job=" + encodeURIComponent($("#job-id").value.trim());
});
window.addEventListener("hashchange", () => { if (key()) showJob(jobInAddress()); });
show(Boolean(key()));
