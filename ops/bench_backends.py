"""coserve's whole stack on vLLM, plain ``vllm serve``, and coserve on its own engine, side by side.

One system at a time on this machine (each started fresh, then stopped), all driven by vLLM's own
benchmark client (``vllm.benchmarks.serve``, the code behind ``vllm bench serve``) against their
OpenAI-compatible ``/v1/completions``, with the same model, prompts and request rate:

* ``coserve-vllm``: ``coserve up`` (API, Redis, SQLite, Celery worker) with ``COSERVE_BACKEND=vllm``;
* ``vllm-serve``: vLLM's OpenAI server on the same converted checkpoint, dtype and eager mode;
* ``coserve-torch``: ``coserve up`` with ``COSERVE_BACKEND=torch`` (the own engine).

Workloads: ``random`` (vLLM's random dataset) and ``specbench`` (SpecBench's 480 first turns).
Prints output tok/s, TTFT p50/p99 and mean TPOT per system, and each ratio to ``vllm serve``.

    python ops/bench_backends.py                       # both workloads, the three systems
    python ops/bench_backends.py --systems coserve-vllm vllm-serve --workloads random
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from app.embedded import terminate_group  # noqa: E402
from app.settings import Settings  # noqa: E402
from tests.conftest import free_port  # noqa: E402

console = Console(width=160)
MODEL_NAME = "smollm2-135m-instruct"


def start_coserve(backend: str, data: Path, port: int, log: Path) -> tuple[subprocess.Popen, str, float]:
    env = dict(os.environ, COSERVE_BACKEND=backend, COSERVE_MODEL_NAME=MODEL_NAME, PYTHONUNBUFFERED="1")
    t0 = time.monotonic()
    coserve = str(Path(sys.executable).parent / "coserve")
    proc = subprocess.Popen([coserve, "up", "--data-dir", str(data), "--port", str(port)],
                            cwd=ROOT, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    _wait_ready(proc, url + "/readyz", log)
    key = json.loads((data / "credentials.json").read_text())["api_key"]
    return proc, key, time.monotonic() - t0


def start_vllm_serve(checkpoint: Path, port: int, log: Path, kv_gib: int) -> tuple[subprocess.Popen, str, float]:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(kv_gib), PYTHONUNBUFFERED="1")
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint),
                             "--served-model-name", MODEL_NAME, "--dtype", "bfloat16", "--enforce-eager",
                             "--host", "127.0.0.1", "--port", str(port)],
                            cwd=ROOT, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    _wait_ready(proc, f"http://127.0.0.1:{port}/health", log)
    return proc, "none", time.monotonic() - t0


def _wait_ready(proc: subprocess.Popen, url: str, log: Path, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url}: the server exited during start-up; see {log}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url}: not ready after {timeout:.0f}s; see {log}")


def specbench_dataset(path: Path, output_tokens: int) -> Path:
    from gpu_runtime.data import specbench_path

    rows = [json.loads(line) for line in specbench_path().read_text().splitlines() if line.strip()]
    with path.open("w") as f:
        for r in rows:
            f.write(json.dumps({"prompt": r["turns"][0], "output_tokens": output_tokens}) + "\n")
    return path


def run_client(port: int, key: str, workload: str, args: argparse.Namespace, tmp: Path) -> dict:
    """vLLM's benchmark client in a child process (it prints a lot; the result comes back as JSON)."""
    out = tmp / f"client-{workload}-{port}.json"
    argv = ["--backend", "openai", "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions",
            "--model", MODEL_NAME, "--tokenizer", str(args.checkpoint), "--num-prompts", str(args.num_prompts),
            "--max-concurrency", str(args.concurrency), "--request-rate", str(args.request_rate),
            "--ignore-eos", "--save-result", "--result-dir", str(tmp), "--result-filename", out.name,
            "--seed", "0", "--disable-tqdm", "--goodput", f"ttft:{args.slo_ttft_ms:g}", f"tpot:{args.slo_tpot_ms:g}"]
    if workload == "random":
        argv += ["--dataset-name", "random", "--random-input-len", str(args.input_len),
                 "--random-output-len", str(args.output_len)]
    else:
        argv += ["--dataset-name", "custom", "--dataset-path", str(specbench_dataset(tmp / "specbench.jsonl",
                                                                                      args.output_len))]
    code = ("import sys; from vllm.benchmarks.serve import add_cli_args, main; "
            "from vllm.utils.argparse_utils import FlexibleArgumentParser as P; p = P(); add_cli_args(p); "
            "main(p.parse_args(sys.argv[1:]))")
    env = dict(os.environ, OPENAI_API_KEY=key)
    proc = subprocess.run([sys.executable, "-c", code, *argv], env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0 or not out.exists():
        raise SystemExit(f"benchmark client failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def met_slo(result: dict, sent: int) -> str:
    """Requests that kept both the TTFT and the mean time per output token of ``--slo-*`` (vLLM's client counts
    them, DistServe's goodput), of all sent: a request that failed counts as missed."""
    good = round(result["request_goodput"] * result["duration"])
    return f"{good}/{sent}"


OFFLINE_RUNS = (("vllm-fcfs", "interactive"), ("qoserve", "interactive"), ("qoserve", "batch"))


def offline_saturation(args: argparse.Namespace, tmp: Path) -> Table:
    """coserve's scheduler against vLLM's default one on the same engine, offline at saturation: every
    prompt submitted at once, no client or service in between; and the share of the time spent in
    coserve's scheduling code. QoServe runs the prompts once as interactive jobs (TTFT 10 s, TBT 1 s: it
    chunks prefills to keep the TBT) and once as batch jobs (a TTLT of an hour, what offline work is);
    vLLM's scheduler ignores QoS. Each is run ``--offline-repeats`` times, interleaved (one engine per
    run), and the median counts: on this box one run's throughput varies by up to ~10%."""
    runs: dict[tuple[str, str], list[dict]] = {key: [] for key in OFFLINE_RUNS}
    for i in range(args.offline_repeats):
        for policy, qos in OFFLINE_RUNS:
            out = tmp / f"offline-{policy}-{qos}-{i}.json"
            proc = subprocess.run([sys.executable, "-m", "gpu_runtime.vllm.offline", "--policy", policy, "--qos", qos,
                                   "--workload", "random", "--input-len", str(args.input_len), "--max-tokens",
                                   str(args.output_len), "--prompts", str(args.num_prompts), "--batch",
                                   str(args.num_prompts), "--out", str(out)],
                                  cwd=ROOT, capture_output=True, text=True, timeout=3600)
            if proc.returncode != 0:
                raise SystemExit(f"offline {policy} failed:\n{proc.stderr[-3000:]}")
            runs[policy, qos].append(next(iter(json.loads(out.read_text()).values())))

    def tok_s(r: dict) -> float:
        return r["output_tokens"] / r["elapsed_s"]

    medians = {key: statistics.median(tok_s(r) for r in rs) for key, rs in runs.items()}
    base = medians["vllm-fcfs", "interactive"]
    table = Table(title=f"offline at saturation: {args.num_prompts} random prompts of {args.input_len} tokens at "
                        f"once, {args.output_len} output tokens each, one engine per run, median of "
                        f"{args.offline_repeats}")
    for col in ("scheduler", "jobs' QoS", "output tok/s (median)", "runs", "x vLLM's",
                "coserve scheduling share of the time"):
        table.add_column(col)
    for (policy, qos), rs in runs.items():
        share = sum(r["policy_s"] for r in rs) / sum(r["elapsed_s"] for r in rs)
        table.add_row(policy, "ignored" if policy.startswith("vllm") else qos, f"{medians[policy, qos]:.1f}",
                      " ".join(f"{tok_s(r):.1f}" for r in rs), f"{medians[policy, qos] / base:.3f}", f"{share:.2%}")
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", nargs="+", default=["coserve-vllm", "vllm-serve", "coserve-torch"])
    ap.add_argument("--workloads", nargs="+", default=["random", "specbench"])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--request-rate", default="inf", help="requests/s (inf: all at once, capped by concurrency)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--kv-gib", type=int, default=2)
    ap.add_argument("--no-offline", action="store_true", help="skip the offline scheduler comparison")
    ap.add_argument("--offline-repeats", type=int, default=3, help="runs of each offline scheduler (median counts)")
    ap.add_argument("--slo-ttft-ms", type=float, default=Settings().default_ttft_ms,
                    help="TTFT of the 'met SLO' column (default: coserve's default QoS, what its requests get)")
    ap.add_argument("--slo-tpot-ms", type=float, default=Settings().default_tbt_ms,
                    help="mean time per output token of the 'met SLO' column (default: coserve's default TBT)")
    args = ap.parse_args()
    from gpu_runtime.vllm.checkpoint import vllm_checkpoint

    args.checkpoint = vllm_checkpoint("smollm2-135m")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_gib))
    results: dict[tuple[str, str], dict] = {}
    ready: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="bench-backends-") as tmp_s:
        tmp = Path(tmp_s)
        offline = None if args.no_offline else offline_saturation(args, tmp)
        for system in args.systems:
            port = free_port()
            log = tmp / f"{system}.log"
            if system == "vllm-serve":
                proc, key, ready[system] = start_vllm_serve(args.checkpoint, port, log, args.kv_gib)
            else:
                proc, key, ready[system] = start_coserve(system.split("-", 1)[1], tmp / system, port, log)
            console.print(f"{system}: ready in {ready[system]:.1f}s")
            try:
                for workload in args.workloads:
                    results[system, workload] = r = run_client(port, key, workload, args, tmp)
                    console.print(f"  {workload}: {r['output_throughput']:.1f} output tok/s, "
                                  f"{r['completed']}/{args.num_prompts} completed")
            finally:
                os.killpg(proc.pid, signal.SIGINT) if proc.poll() is None else None
                terminate_group([proc])
    table = Table(title=f"{args.num_prompts} requests, concurrency {args.concurrency}, rate {args.request_rate}, "
                        f"output {args.output_len} tokens (random input {args.input_len})")
    for col in ("workload", "system", "ready s", "output tok/s", "x vllm serve", "TTFT p50 ms", "TTFT p99 ms",
                "x vllm serve p99", "TPOT mean ms", "met SLO"):
        table.add_column(col, justify="right" if col not in ("workload", "system") else "left")
    for workload in args.workloads:
        peer = results.get(("vllm-serve", workload))
        for system in args.systems:
            r = results[system, workload]
            tput = r["output_throughput"]
            table.add_row(workload, system, f"{ready[system]:.1f}", f"{tput:.1f}",
                          f"{tput / peer['output_throughput']:.2f}" if peer else "-",
                          f"{r['median_ttft_ms']:.0f}", f"{r['p99_ttft_ms']:.0f}",
                          f"{r['p99_ttft_ms'] / peer['p99_ttft_ms']:.2f}" if peer else "-",
                          f"{r['mean_tpot_ms']:.1f}", met_slo(r, args.num_prompts))
    console.print(table)
    if offline is not None:
        console.print(offline)


if __name__ == "__main__":
    main()
