"""How long ``POST /v1/summarize`` keeps its client for a large body, and what a driver's look at the run reads.

For each body size it migrates a fresh SQLite database, starts the real app (TestClient, no broker: the jobs stay
queued), and posts ``--docs`` documents of made-up sentences totalling about that many megabytes. It prints:

* ``submit s``: the request's wall time (what the client waits for, and holds an API worker);
* ``first level s``: from the request until the run's first level of jobs is in SQL (the run ``running``);
* ``jobs``: that level's jobs;
* ``look``: one look of the driver at the run while none of its jobs has ended (``driver.advance``): the SQL
  statements it runs and the job ids it binds (reads the status of), from this thread only.
* ``poll``: one poll of the run's progress (``GET /v1/summarize/{id}`` reads it), counted the same way;
* ``small ms idle`` / ``small ms split``: the median, 90th percentile and worst latency of a small submission (a
  batch job of one short message, ``POST /v1/jobs``) sent one after another with no run splitting, then while the
  large run's first step splits (the API's other requests share the process with that split).

With ``--baseline DIR`` (a checkout of other code, e.g. ``git worktree add /tmp/main main``) it measures that code
too and prints both side by side.

    python ops/bench_summarize_submit.py --mb 1,8 --baseline /tmp/main
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import side_by_side

ROOT = Path(__file__).resolve().parents[1]


def _body(megabytes: float, docs: int) -> dict:
    per_doc = int(megabytes * 1_000_000 / docs)
    documents = []
    for d in range(docs):
        words, i = [], 0
        while sum(len(w) + 1 for w in words) < per_doc:
            words.append(f"Document {d} states fact {i} about its topic, which matters for the summary.")
            i += 1
        documents.append({"id": f"d{d}", "text": " ".join(words)})
    return {"documents": documents, "deadline": "2h", "max_summary_tokens": 32, "overlap_tokens": 16}


def _count_look(settings, run_id: str, poll: bool = False) -> dict:
    """One look (``driver.advance``) with nothing ended, or with ``poll`` one poll of the run's progress (what
    ``GET /v1/summarize/{id}`` reads: ``service.view``): the statements and job ids it sends, this thread's only."""
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    from app.summarize import driver

    me, seen = threading.get_ident(), {"statements": 0, "job_ids": 0}

    def count(conn, cursor, statement, parameters, context, executemany):  # noqa: ARG001 - SQLAlchemy's signature
        if threading.get_ident() != me:
            return
        seen["statements"] += 1
        values = parameters.values() if isinstance(parameters, dict) else parameters or ()
        seen["job_ids"] += sum(1 for v in values if isinstance(v, str) and v.startswith("job_"))

    event.listen(Engine, "before_cursor_execute", count)
    try:
        if poll:
            from app.summarize import service

            outcome = service.view(settings, run_id).progress.status
        else:
            outcome = driver.advance(settings, run_id, "bench-look").outcome
    finally:
        event.remove(Engine, "before_cursor_execute", count)
    return {"outcome": str(outcome), **seen}


# a small batch job (POST /v1/jobs): it starts no thread of its own, so the probes add no load as they go on
SMALL = {"kind": "batch", "messages": [{"role": "user", "content": "A short note. It says little."}],
         "max_tokens": 8, "deadline_window_s": 7200}
IDLE_PROBES = 50


def _small(client, auth: dict) -> float:
    """One small submission's latency in milliseconds."""
    t0 = time.perf_counter()
    r = client.post("/v1/jobs", headers=auth, json=SMALL)
    if r.status_code not in (200, 201):
        raise SystemExit(f"small submission: HTTP {r.status_code}: {r.text[:300]}")
    return (time.perf_counter() - t0) * 1000


def _spread(ms: list[float]) -> dict:
    ms = sorted(ms)
    at = (lambda q: ms[min(len(ms) - 1, int(q * len(ms)))]) if ms else (lambda q: 0.0)
    return {"n": len(ms), "median": at(0.5), "p90": at(0.9), "max": at(1.0)}


def measure(megabytes: float, docs: int) -> dict:
    """One run with the code on ``sys.path``; returns the figures."""
    sys.path.insert(0, os.environ.get("COSERVE_CODE", str(ROOT)))
    from fastapi.testclient import TestClient
    from app.auth import clear_cache
    from app.db.models import SummarizationRun
    from app.db.session import session_scope
    from app.main import create_app

    _, settings, keys = side_by_side.fresh_stack("bench-summarize-", 2048)
    db_url = settings.sqlalchemy_url
    auth = {"Authorization": f"Bearer {keys.paid}"}
    body = _body(megabytes, docs)
    size = len(json.dumps(body))
    clear_cache()
    with TestClient(create_app(settings)) as client:
        idle = [_small(client, auth) for _ in range(IDLE_PROBES)]
        t0 = time.perf_counter()
        r = client.post("/v1/summarize", headers=auth, json=body)
        submit_s = time.perf_counter() - t0
        if r.status_code not in (200, 201):
            raise SystemExit(f"HTTP {r.status_code}: {r.text[:300]}")
        run_id, answered = r.json()["id"], r.json()["status"]
        busy = []  # small submissions while the first step splits
        while True:  # the first level is in when the run left "validating" (at once where the request split it)
            with session_scope(db_url) as s:
                status = s.get(SummarizationRun, run_id).status
            if status != "validating":
                break
            busy.append(_small(client, auth))
            time.sleep(0.05)
        first_level_s = time.perf_counter() - t0
        with session_scope(db_url) as s:
            jobs = s.get(SummarizationRun, run_id).jobs_submitted  # its first level's (the small runs' apart)
        look, poll = _count_look(settings, run_id), _count_look(settings, run_id, poll=True)
    return {"mb": size / 1e6, "submit_s": submit_s, "answered": answered, "first_level_s": first_level_s,
            "status": status, "jobs": jobs, "look": look, "poll": poll, "idle": _spread(idle), "split": _spread(busy)}


def _row(label: str, fig: dict) -> str:
    look = fig["look"]
    return " | ".join([f"{label:<9}", f"{fig['mb']:5.1f}", f"{fig['submit_s']:8.2f}", f"{fig['answered']:<10}",
                       f"{fig['first_level_s']:13.2f}", f"{fig['status']:<8}", f"{fig['jobs']:>6}",
                       f"{look['statements']:>10}", f"{look['job_ids']:>12}",
                       f"{fig['poll']['statements']:>10}", f"{fig['poll']['job_ids']:>12}",
                       "{median:4.0f} / {p90:4.0f} / {max:5.0f}".format(**fig["idle"]),
                       "{median:4.0f} / {p90:4.0f} / {max:5.0f} ({n})".format(**fig["split"])])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", default="8", help="comma-separated body sizes in megabytes")
    ap.add_argument("--docs", type=int, default=400, help="documents the body holds")
    ap.add_argument("--baseline", help="a checkout of other code to measure too (e.g. before a change)")
    ap.add_argument("--one", type=float, help=argparse.SUPPRESS)  # a child run: print one run's JSON
    args = ap.parse_args()
    if args.one:
        side_by_side.report(measure(args.one, args.docs))
        return
    header = ("code      |    MB | submit s | answered   | first level s | status   |   jobs | look stmts"
              " | look job ids | poll stmts | poll job ids | small ms idle (median / p90 / max)"
              " | small ms split (median / p90 / max, n)")
    runs = [(["--one", str(mb), "--docs", str(args.docs)], f"{mb} MB") for mb in (float(x) for x in args.mb.split(","))]
    rows = side_by_side.measured_rows(__file__, ROOT, args.baseline, runs, _row)
    print("\n" + header)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
