"""SSE time-to-first-token vs the job's own TTFT, and Batch API throughput vs plain job submission.

Runs against a live coserve (``coserve up``; URL/key from its credentials file, or
``--url``/``--key``). Two measurements, each with its baseline taken in the same run:

1. Streaming: for N ``/v1/chat/completions`` requests with ``stream: true``, the client's
   time from sending to the first content chunk (SSE) beside the job's TTFT as the worker
   measured it (engine clock, from submission). The difference is what the API path
   (HTTP, SQL write, Celery dispatch, Redis stream, SSE framing) adds.
2. Batch: M requests through ``/v1/files`` + ``/v1/batches`` (from create to ``completed``,
   output file written) beside the same M requests sent as individual ``/v1/jobs`` batch
   jobs and polled until all are terminal.

Usage: python ops/bench_sse.py [--n 12] [--concurrency 4] [--batch-n 24] [--max-tokens 16]
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from rich.console import Console
from rich.table import Table

console = Console()
PROMPTS = ["Name three colours.", "What is 2 + 2?", "Say hello in French.", "Give one fact about the Moon.",
           "What is a noun?", "Name a large animal."]


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def stream_one(http: httpx.Client, model: str, i: int, max_tokens: int) -> dict:
    body = {"model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]}
    t0 = time.perf_counter()
    first_byte = first_token = None
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        job_id = r.headers["x-coserve-job-id"]
        for line in r.iter_lines():
            if first_byte is None:
                first_byte = time.perf_counter() - t0
            if line.startswith("data: {") and first_token is None:
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    first_token = time.perf_counter() - t0
    total = time.perf_counter() - t0
    return {"job_id": job_id, "first_byte": first_byte, "first_token": first_token, "total": total}


def job_metrics(http: httpx.Client, job_id: str) -> dict:
    for _ in range(50):
        job = http.get(f"/v1/jobs/{job_id}").json()
        if job["metrics"]["ttft_s"] is not None:
            return job
        time.sleep(0.1)
    return job


def bench_streaming(http: httpx.Client, model: str, n: int, concurrency: int, max_tokens: int) -> None:
    with ThreadPoolExecutor(concurrency) as pool:
        runs = list(pool.map(lambda i: stream_one(http, model, i, max_tokens), range(n)))
    for r in runs:
        r["ttft_job"] = job_metrics(http, r["job_id"])["metrics"]["ttft_s"]
    rows = [r for r in runs if r["first_token"] is not None and r["ttft_job"] is not None]
    client = [r["first_token"] for r in rows]
    job = [r["ttft_job"] for r in rows]
    headers = [r["first_byte"] for r in rows]
    over = [c - j for c, j in zip(client, job, strict=True)]
    t = Table(title=f"SSE time to first token vs the job's TTFT ({len(rows)} streams, concurrency {concurrency}, "
                    f"max_tokens {max_tokens})")
    for col in ("measure", "p50 (ms)", "p90 (ms)", "max (ms)"):
        t.add_column(col, justify="right" if col != "measure" else "left")
    for name, vals in (("client: first SSE line (role chunk)", headers),
                       ("client: first content chunk (SSE TTFT)", client),
                       ("baseline: job TTFT (worker, from submission)", job),
                       ("API path overhead (client - job)", over)):
        t.add_row(name, f"{1e3 * pct(vals, 0.5):.1f}", f"{1e3 * pct(vals, 0.9):.1f}", f"{1e3 * max(vals):.1f}")
    console.print(t)


def batch_lines(m: int, model: str, max_tokens: int) -> list[dict]:
    return [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                      "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]}} for i in range(m)]


def bench_batch(http: httpx.Client, model: str, m: int, max_tokens: int) -> None:
    lines = batch_lines(m, model, max_tokens)
    t0 = time.perf_counter()
    f = http.post("/v1/files", data={"purpose": "batch"},
                  files={"file": ("bench.jsonl", "\n".join(json.dumps(x) for x in lines).encode())}).json()
    b = http.post("/v1/batches", json={"input_file_id": f["id"], "endpoint": "/v1/chat/completions",
                                        "completion_window": "1h"}).json()
    while (b := http.get(f"/v1/batches/{b['id']}").json())["status"] not in ("completed", "failed", "expired"):
        time.sleep(0.2)
    batch_s = time.perf_counter() - t0
    assert b["status"] == "completed" and b["request_counts"]["completed"] == m, b

    t0 = time.perf_counter()
    ids = []
    for x in lines:
        body = {k: v for k, v in x["body"].items()}
        body.update(kind="batch", deadline_window_s=3600)
        ids.append(http.post("/v1/jobs", json=body).json()["id"])
    pending = set(ids)
    while pending:
        for job_id in list(pending):
            if http.get(f"/v1/jobs/{job_id}").json()["status"] in ("succeeded", "failed", "cancelled", "expired"):
                pending.discard(job_id)
        time.sleep(0.2)
    jobs_s = time.perf_counter() - t0
    t = Table(title=f"Batch throughput ({m} requests x {max_tokens} output tokens)")
    for col in ("path", "wall (s)", "requests/s", "output tok/s"):
        t.add_column(col, justify="right" if col != "path" else "left")
    for name, s in (("Batch API (upload, validate, fan-out, fan-in, output file)", batch_s),
                    ("baseline: same requests as /v1/jobs, polled", jobs_s)):
        t.add_row(name, f"{s:.2f}", f"{m / s:.2f}", f"{m * max_tokens / s:.1f}")
    console.print(t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url")
    ap.add_argument("--key")
    ap.add_argument("--n", type=int, default=12)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--batch-n", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    from app.cli.service_cmds import _client_config

    url, key = _client_config(args.url, args.key)
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=600) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        stream_one(http, model, 0, 2)  # warm-up
        bench_streaming(http, model, args.n, args.concurrency, args.max_tokens)
        if args.batch_n:
            bench_batch(http, model, args.batch_n, args.max_tokens)


if __name__ == "__main__":
    main()
