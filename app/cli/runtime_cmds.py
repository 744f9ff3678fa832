"""Runtime commands: ``coserve simulate`` (policies on trace workloads) and ``coserve profile``."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from app.cli.options import VLLM_OPTIONS, finite, vllm_flags
from app.cli.output import Console, print_table
from app.cli.service_cmds import _from_settings, _servable_model, _settings

if TYPE_CHECKING:
    from collections.abc import Callable

    from rich.table import Table

    from gpu_runtime.costmodel.base import CostModel
    from gpu_runtime.sim.metrics import RunSummary
    from gpu_runtime.sim.runner import Experiment

log = logging.getLogger(__name__)

CAPACITY_TARGET = 0.01  # the violation rate the default sweep centers on (QoServe's goodput definition)
# what a run can finish: the simulator takes about 3 ms and 30 KB per request on one CPU core (3000 requests of conv,
# 10 s and 160 MB here), so 100000 requests are some 5 minutes and 3 GB per policy and rate; a sweep of 100 rates
# is a table of 100 rows per policy (the default sweep runs 8)
MAX_REQUESTS = 100_000
MAX_SWEEP_RATES = 100


def _qps_list(qps: float | None, sweep: str | None) -> list[float] | None:
    """The rates to run; None when neither is given (the sweep then brackets the capacity)."""
    if sweep:
        try:
            a, b, step = (float(x) for x in sweep.replace(":", ",").split(","))
        except ValueError as exc:
            raise typer.BadParameter(f"--sweep {sweep!r}: give FIRST,LAST,STEP, e.g. 0.5,4,0.5") from exc
        if not all(math.isfinite(x) for x in (a, b, step)) or a <= 0:
            raise typer.BadParameter(f"--sweep {sweep!r}: rates are queries per second: FIRST must be > 0, all finite")
        if step <= 0 or b < a:
            raise typer.BadParameter(f"--sweep {sweep!r}: STEP must be > 0 and LAST >= FIRST")
        if (count := math.floor((b - a) / step + 1e-9) + 1) > MAX_SWEEP_RATES:  # counted before a list is built
            raise typer.BadParameter(f"--sweep {sweep!r}: {count} rates; give at most {MAX_SWEEP_RATES} (a larger "
                                     "STEP or a narrower range)")
        out, x = [], a
        while x <= b + 1e-9:
            out.append(round(x, 6))
            x += step
        return out
    if qps is not None and not (math.isfinite(qps) and qps > 0):  # no arrivals at all, or every one at once
        raise typer.BadParameter(f"--qps {qps}: give a rate > 0 (queries per second)")
    return None if qps is None else [qps]


def _check_trace(trace: str) -> None:
    """A usage error where ``trace`` (a CSV path) cannot be simulated: missing, without the Azure columns
    (TIMESTAMP, ContextTokens, GeneratedTokens) or without rows."""
    from gpu_runtime.sim.workload import load_trace

    if not Path(trace).is_file():
        raise typer.BadParameter(f"--trace {trace!r}: give conv, code or the path of a CSV trace")
    try:
        rows = load_trace("custom", trace)
    except KeyError as exc:
        raise typer.BadParameter(f"--trace {trace!r}: no column {exc}; a trace's CSV has TIMESTAMP, ContextTokens "
                                 "and GeneratedTokens") from None
    except ValueError as exc:  # a timestamp or count that does not parse, a file that is not text
        raise typer.BadParameter(f"--trace {trace!r}: {exc}") from None
    if not rows:
        raise typer.BadParameter(f"--trace {trace!r}: no rows to sample requests from")


def simulate(
    profile: Annotated[str, typer.Option(help="profile JSON path or shipped name (cpu-smollm2-135m, "
                                               "synthetic-a100-llama3-8b)")] = "cpu-smollm2-135m",
    trace: Annotated[str, typer.Option(help="conv | code (Azure 2023) or a CSV path")] = "conv",
    qps: Annotated[float | None, typer.Option(help="mean arrival rate (QPS)")] = None,
    sweep: Annotated[str | None, typer.Option(help="QPS sweep FIRST,LAST,STEP (e.g. 0.5,4,0.5); default: 8 rates "
                                                   "from 1/4 to 2x the first policy's capacity, found by "
                                                   "simulation")] = None,
    policies: Annotated[str, typer.Option(help="comma-separated scheduler names")] = "qoserve,sarathi-fcfs,sarathi-edf",
    requests: Annotated[int, typer.Option(help="requests sampled from the trace per run",
                                                  min=1, max=MAX_REQUESTS)] = 300,
    free_share: Annotated[float, typer.Option(help="share of free-tier jobs", min=0.0, max=1.0,
                                                   callback=finite)] = 0.0,
    arrivals: Annotated[str, typer.Option(help="poisson | trace (the trace's timestamps rescaled to each QPS) | "
                                               "bursty (alternates QPS/2.5 and QPS every --period s)")] = "poisson",
    period: Annotated[float, typer.Option(help="bursty: seconds per rate (x SLO scale)",
                                                callback=finite)] = 900.0,
    max_tokens: Annotated[int, typer.Option(help="max_tokens every request asks for (it stops at the trace's "
                                                 "output length)", min=1)] = 4096,
    kv_blocks: Annotated[int, typer.Option(help="KV blocks of the simulated replica", min=1)] = 30000,
    seed: Annotated[int, typer.Option(help="seed of the sampled requests and arrivals")] = 0,
    out: Annotated[Path | None, typer.Option(help="directory for results.json and violations.png")] = None,
) -> None:
    """Simulate scheduling policies on a trace with QoServe's three tiers (SLOs scaled to the profile)."""
    import json

    from rich.progress import Progress
    from rich.table import Table

    from gpu_runtime.costmodel.profile import (
        SCHEDULING_MODEL,
        Profile,
        fit_report,
        resolve_profile,
        scheduling_cost_model,
        slo_scale,
    )
    from gpu_runtime.sim.runner import ARRIVALS, TRACES, Experiment, run_policy
    from gpu_runtime.sim.runner import policies as known
    from gpu_runtime.sim.workload import paper_tiers

    # every option is checked before the profile's cost model is fitted (seconds): a typo is a usage error at once
    if arrivals not in ARRIVALS:
        raise typer.BadParameter(f"--arrivals {arrivals!r}: choose from {', '.join(ARRIVALS)}")
    names = [p.strip() for p in policies.split(",") if p.strip()]
    if not names:
        raise typer.BadParameter("--policies: name at least one scheduler")
    if unknown := [n for n in names if n not in known()]:
        raise typer.BadParameter(f"--policies: no scheduler {', '.join(unknown)}; choose from {', '.join(known())}")
    if trace not in TRACES:
        _check_trace(trace)
    if period <= 0:
        raise typer.BadParameter(f"--period {period:g}: give the seconds each rate lasts, > 0")
    if out is not None and out.exists() and not out.is_dir():
        raise typer.BadParameter(f"--out {out}: a file; give a directory (results.json and violations.png go in it)")
    rates = _qps_list(qps, sweep)
    path = resolve_profile(profile)
    if not path.exists():
        raise typer.BadParameter(f"--profile {profile!r}: no such file or shipped profile")
    try:  # a file that is not a profile (not JSON, no samples) is the operator's to fix
        cm = scheduling_cost_model(path)
        scale = slo_scale(cm)
        report = fit_report(path)
        measured = "SYNTHETIC" if Profile.load(path).synthetic else "measured"
    except (ValueError, KeyError, TypeError) as exc:
        raise typer.BadParameter(f"--profile {profile!r} is not a latency profile (`coserve profile` writes one): "
                                 f"{type(exc).__name__}: {exc}") from None
    console = Console()
    console.print(f"profile {profile} ({measured}): cost model {SCHEDULING_MODEL}, {report.summary()}")
    console.print(f"batch-1 decode step {scale * 12.5:.1f} ms -> every SLO x {scale:.2f} "
                  f"(paper: 12.5 ms on Llama3-8B/A100); arrivals {arrivals}")
    exp = Experiment(trace=trace, num_requests=requests, seed=seed, kv_blocks=kv_blocks, max_tokens=max_tokens,
                     arrivals=arrivals)
    tiers = paper_tiers(scale, free_share)

    def bursty_at(q: float) -> tuple[float, float, float, float] | None:
        # bursty: low = QPS/2.5, high = QPS (QoServe 4.3's 2 <-> 5), long enough for ~--requests arrivals
        return (q / 2.5, q, period * scale, requests / (0.7 * q)) if arrivals == "bursty" else None

    def run(name: str, q: float) -> RunSummary:
        return run_policy(name, cm, exp, tiers, qps=q, bursty=bursty_at(q))

    def sustained(q: float, stop_above: float | None = None) -> float:
        """The first policy's share of late jobs at ``q``, or 1.0 if its backlog grew (a rate past capacity
        whose long deadlines hid it in a run of ``--requests``)."""
        from gpu_runtime.sim.capacity import sustained_violation_rate
        from gpu_runtime.sim.metrics import summarize
        from gpu_runtime.sim.runner import simulate as simulate_requests

        reqs = simulate_requests(names[0], cm, exp, tiers, qps=q, bursty=bursty_at(q), stop_above=stop_above)
        return sustained_violation_rate(summarize(reqs).violation_rate,
                                        [(r.arrival_time, r.finish_time) for r in reqs])

    if rates is None:
        rates = _default_sweep(names[0], exp, cm, sustained, console)
    table = Table(title=f"{trace}: violations (SLOs x {scale:.2f}, {arrivals} arrivals)")
    # policy names and rates never shrink to "sarath…": at 80 columns the figures wrap their headers instead
    table.add_column("policy", no_wrap=True, min_width=len(max(names, key=len)))
    table.add_column("qps", justify="right", no_wrap=True)
    for col in ("viol.", "paid viol.", "free viol.", "TTFT p99 s", "TBT p99 ms", "TTLT p50 s"):
        table.add_column(col, justify="right")
    results: dict[str, list[dict]] = {n: [] for n in names}
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("simulating", total=len(names) * len(rates))
        for name in names:
            for q in rates:
                progress.update(task, description=f"{name} @ {q:g} QPS")
                s = run(name, q)
                progress.advance(task)
                _add_row(table, results, name, q, s)
    print_table(console, table)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps({"profile": profile, "trace": trace, "slo_scale": scale,
                                                      "arrivals": arrivals, "cost_model": SCHEDULING_MODEL,
                                                      "cost_model_mape": report.mape, "results": results}, indent=1))
        _plot(results, out / "violations.png", f"{trace} ({profile}, SLOs x {scale:.2f})")
        console.print(f"wrote {out / 'results.json'} and {out / 'violations.png'}")


def _default_sweep(policy: str, exp: Experiment, cm: CostModel, violations: Callable[[float, float | None], float],
                   console: Console) -> list[float]:
    """Rates around ``policy``'s capacity on this very experiment (same trace, request count, arrivals
    and SLOs), so the first plot shows where violations start to climb; ``violations(qps, stop_above)``
    is a run's sustained violation rate (``sustained_violation_rate``). A fixed range cannot: with
    300 requests of ``conv``, the shipped CPU profile's capacity is about 0.05 QPS and the synthetic
    A100 profile's over a thousand times that."""
    from gpu_runtime.sim.capacity import find_capacity, sweep_around, throughput_guess
    from gpu_runtime.sim.runner import trace_rows

    rows = trace_rows(exp)
    mean_prompt = sum(min(r.prompt_len, exp.max_prompt) for r in rows) / len(rows)
    mean_output = sum(min(r.output_len, exp.max_tokens) for r in rows) / len(rows)
    guess = throughput_guess(cm, mean_prompt, mean_output)
    grow, steps = 3.0, 4  # from the guess, rates up to 81x above or below it are tried
    lowest = guess / grow**steps
    with console.status(f"finding {policy}'s capacity to center the sweep on"):
        # requests that miss even on an idle replica (a prompt whose prefill outlasts its TTFT) are a
        # floor no rate goes below: capacity is where violations climb CAPACITY_TARGET above it
        floor = violations(lowest, None)
        target = floor + CAPACITY_TARGET
        # stop_above: a run that already missed more than the target need not finish to answer
        capacity = find_capacity(lambda q: violations(q, target), guess, target=target, grow=grow,
                                 max_steps=steps)
    within = f"{target:.0%} violations" + (f" ({floor:.1%} miss even at {lowest:.3g} QPS)" if floor else "")
    if capacity > 0:
        note = f"{policy} stays within {within} up to ~{capacity:.3g} QPS"
    else:  # even the lowest rate tried violated: show the curve from there
        capacity = lowest
        note = f"{policy} exceeds {within} even at {lowest:.3g} QPS"
    rates = sweep_around(capacity)
    step = rates[1] - rates[0]
    console.print(f"{note}; sweeping {rates[0]:g} to {rates[-1]:g} QPS (--sweep {rates[0]:g},{rates[-1]:g},{step:.6g})")
    return rates


def _add_row(table: Table, results: dict[str, list[dict]], name: str, q: float, s: RunSummary) -> None:
    paid, free = s.tiers.get("paid"), s.tiers.get("free")
    row = {"qps": q, "n": s.n, "violation_rate": s.violation_rate, "ttft_p99": s.ttft_p99, "tbt_p99": s.tbt_p99,
           "ttlt_p50": s.ttlt_p50, "paid": paid.violation_rate if paid else None,
           "free": free.violation_rate if free else None}
    results[name].append(row)
    table.add_row(name, f"{q:g}", f"{s.violation_rate:.1%}", f"{row['paid']:.1%}" if paid else "-",
                  f"{row['free']:.1%}" if free else "-", f"{s.ttft_p99:.2f}", f"{s.tbt_p99 * 1000:.0f}",
                  f"{s.ttlt_p50:.1f}")


def _plot(results: dict[str, list[dict]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, rows in results.items():
        ax.plot([r["qps"] for r in rows], [100 * r["violation_rate"] for r in rows], marker="o", label=name)
    ax.axhline(1.0, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("QPS")
    ax.set_ylabel("deadline violations (%)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def profile(
    ctx: typer.Context,
    model: Annotated[str | None, typer.Option(
        help=f"bundled model name or checkpoint directory ({_from_settings('model')}, as the worker's)")] = None,
    out: Annotated[Path, typer.Option(help="where to write the JSON profile")] = Path("profile.json"),
    device: Annotated[str | None, typer.Option(
        help=f"auto | cpu | cuda | cuda:N ({_from_settings('device')}, as the worker's)")] = None,
    kv_blocks: Annotated[int | None, typer.Option(help="KV blocks of the profiled executor (default: what the "
                                                       "grid needs)", min=1)] = None,
    repeats: Annotated[int, typer.Option(help="timed passes per batch shape", min=1)] = 2,
    grid: Annotated[str, typer.Option(help="full | small (few shapes, for slow CPUs); vllm also: smoke (3 shapes, "
                                           "a check that profiling works)")] = "full",
    backend: Annotated[str, typer.Option(help="the engine to profile: vllm (what the worker serves on where "
                                              "installed) | torch (coserve's own engine)")] = "auto",
    from_steps: Annotated[list[Path] | None, typer.Option(
        "--from-steps", help="fit on a vLLM worker's step logs (COSERVE_VLLM_STEP_LOG) instead of timing a grid: "
                             "each step's latency plus the host time to the next; repeat the option for several "
                             "logs")] = None,
) -> None:
    """Time the real engine over a grid of batch shapes and write a latency profile (JSON).

    The scheduler plans with a cost model fitted on it: point COSERVE_COST_PROFILE at the file. Options after these
    go to the profiled vLLM engine, as `coserve worker` takes them (e.g. --max-num-seqs 64 --block-size 32)."""
    if out.is_dir() or not out.parent.is_dir():  # found before the grid is timed (minutes), not at the end
        raise typer.BadParameter(f"{out}: give a file name in a folder that exists", param_hint="--out")
    if from_steps:
        if ctx.args:
            raise typer.BadParameter(f"{' '.join(ctx.args)!r}: --from-steps fits on logged steps; it builds no engine "
                                     "to give vLLM options to")
        _profile_from_steps(from_steps, out)
        return

    from gpu_runtime.costmodel.machine import this_machine
    from gpu_runtime.costmodel.profile import annotate_profile
    from gpu_runtime.costmodel.profiler import ProfileGrid, profile_executor
    from gpu_runtime.factory import resolve_device

    console = Console()
    # the worker's model and device unless given: a profile of another model would mislead the worker's scheduler
    settings = _settings(model=model)  # the environment as it is now (not the API's cached settings)
    model = settings.model
    _servable_model(model)  # before the engine's imports (seconds), and not as a hub download's traceback
    try:
        dev = resolve_device(device or settings.device)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--device") from None
    if backend not in ("auto", "vllm", "torch"):
        raise typer.BadParameter(f"{backend!r}: choose auto, vllm or torch", param_hint="--backend")
    if backend == "auto":
        from gpu_runtime.vllm.build import vllm_available

        backend = "vllm" if vllm_available() else "torch"
    vllm_args = vllm_flags(ctx, settings, backend)[0]
    if backend == "vllm":
        _profile_vllm(console, model, out, dev, repeats, grid, settings.model_copy(update={"vllm_args": vllm_args}))
        return
    from gpu_runtime.executor.torch import TorchExecutor

    if grid not in ("full", "small"):  # smoke is the vLLM profiler's alone
        raise typer.BadParameter(f"{grid!r}: the torch engine's grids are full and small", param_hint="--grid")
    shapes = ProfileGrid(repeats=repeats) if grid == "full" else ProfileGrid(
        chunks=(0, 32, 128, 384), starts=(0, 256), decodes=(0, 1, 8, 24), contexts=(128,), repeats=repeats)
    kv_blocks = kv_blocks or int(1.1 * shapes.kv_blocks_needed(16)) + 8
    ex = TorchExecutor.from_pretrained(model, device=dev, kv_blocks=kv_blocks)
    vocab = getattr(getattr(ex, "tokenizer", None), "vocab_size", None) or 1000
    layout = getattr(ex, "attention_layout", None)
    prof = profile_executor(ex, shapes, name=f"{dev}-{Path(model).name}", vocab=min(vocab, 49152),
                            meta={"model": model, "device": dev, "attention_layout": layout,
                                  "machine": this_machine(dev).as_dict()},
                            progress=lambda i, n: console.print(f"  {i}/{n}", end="\r"))
    prof.save(out)
    report = annotate_profile(out, layout)  # cross-validated MAPE of each candidate, stored in meta["fit"]
    console.print(f"wrote {len(prof.samples)} samples to {out} (attention {layout}); {report.summary()}; "
                  f"lowest: {report.chosen}")


def _profile_vllm(console, model: str, out: Path, device: str, repeats: int, grid: str, settings: Any) -> None:
    """Whole vLLM engine steps (scheduling, forward, sampling, output processing) over the grid, on the engine the
    worker would build (COSERVE_VLLM_ENGINE_ARGS, then COSERVE_VLLM_ARGS and the command's vLLM options: the same
    parallelism, quantization, memory share)."""
    import dataclasses

    from gpu_runtime.costmodel.machine import this_machine
    from gpu_runtime.costmodel.profile import annotate_profile
    from gpu_runtime.vllm.build import build_vllm_engine
    from gpu_runtime.vllm.cli_args import operator_engine_args
    from gpu_runtime.vllm.profiling import GRIDS, profile_vllm

    if grid not in GRIDS:
        raise typer.BadParameter(f"--grid must be one of {', '.join(GRIDS)}")
    shapes = GRIDS[grid] if grid == "smoke" else dataclasses.replace(GRIDS[grid], repeats=repeats)
    # the grid times plain steps: a speculative_config the worker's engine takes is left out
    overrides = {k: v for k, v in operator_engine_args(settings.vllm_engine_args, settings.vllm_args).items()
                 if k != "speculative_config"}
    engine = build_vllm_engine(model, device=device, scheduler_policy="vllm-fcfs", overrides=overrides)
    prof = profile_vllm(engine, shapes, name=f"{device}-{Path(model).name}-vllm",
                        meta={"model": model, "device": device, "machine": this_machine(device).as_dict()},
                        progress=lambda i, n: console.print(f"  {i}/{n}", end="\r"))
    prof.save(out)
    report = annotate_profile(out)
    console.print(f"wrote {len(prof.samples)} samples of the vLLM engine to {out}; {report.summary()}; "
                  f"lowest: {report.chosen}")


def _profile_from_steps(logs: list[Path], out: Path) -> None:
    """A profile of the steps a worker ran in place (``gpu_runtime.vllm.step_log``)."""

    from gpu_runtime.costmodel.profile import annotate_profile
    from gpu_runtime.vllm.step_log import profile_from_steps

    missing = [str(p) for p in logs if not p.is_file()]
    if missing:
        raise typer.BadParameter(f"no such step log: {', '.join(missing)}", param_hint="--from-steps")
    try:
        prof = profile_from_steps(logs, name=out.stem)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--from-steps") from exc
    prof.save(out)
    report = annotate_profile(out)
    Console().print(f"wrote {len(prof.samples)} in-place steps to {out} (median host gap "
                    f"{prof.meta['host_gap_s_median'] * 1e3:.1f} ms); {report.summary()}")


def register(cli: typer.Typer) -> None:
    cli.command("simulate")(simulate)
    cli.command("profile", context_settings=VLLM_OPTIONS)(profile)
