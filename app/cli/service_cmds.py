"""CLI: ``coserve up`` (embedded service), ``worker``, ``submit``, ``status``, ``jobs``,
``keys create|list|revoke``."""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import socket
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from rich.markup import escape
from rich.table import Table

from app.bounds import JOBS_PAGE_MAX, MAX_RATE
from app.cli.interruptible import interruptible, interruptible_items
from app.cli.loopback import trust_env
from app.cli.options import VLLM_OPTIONS, AsJson, JobId, Key, Tier, Url, finite, vllm_flags
from app.cli.output import (
    Console,
    asking,
    date,
    error_line,
    kept,
    list_table,
    other,
    print_json,
    print_table,
    stderr,
    stopped_waiting,
    when,
)
from app.embedded import ChildExit, RestartDelay, RestartLimit

log = logging.getLogger(__name__)
console = Console()

TERMINAL = {"succeeded", "failed", "cancelled", "expired"}
DEMO_PROMPT = "In two sentences: why do interactive and batch LLM jobs benefit from sharing GPUs?"


def _settings(**overrides: Any):
    """The environment's settings with the command's options over them, validated alike (a bad value in either is
    a usage error naming the setting)."""
    from pydantic import ValidationError

    from app.settings import Settings

    try:
        s = Settings()
        updates = {k: v for k, v in overrides.items() if v is not None}
        return Settings.model_validate({**s.model_dump(), **updates}) if updates else s
    except ValidationError as exc:
        raise typer.BadParameter("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
                                 ) from None


def _database(settings: Any, new_ok: bool = False) -> str:
    """The settings' database, migrated. Where it is an SQLite file that does not exist yet (a command run outside
    the directory where `coserve up` ran), a command that reads it stops saying so instead of making an empty one;
    one that may start it (``new_ok``) says that it did. Its connections are the settings' (``database_pool``: the
    pool, PostgreSQL's lock and statement timeouts), as the API's and the workers' are."""
    from sqlalchemy.engine import make_url

    from app.db.session import size_pool

    url = make_url(_usable_database_url(settings.sqlalchemy_url))
    path = Path(url.database) if url.get_backend_name() == "sqlite" and url.database else None
    if path is not None and not path.exists():
        where = (f"no database at {path.resolve()}: run this where `coserve up` ran (its ./data), or set "
                 "COSERVE_DATA_DIR or COSERVE_DATABASE_URL")
        if not new_ok:
            stderr.print(f"[red]{escape(where)}[/red]")
            raise typer.Exit(1)
        # a note, on stderr: `keys create --json`'s stdout is the key alone
        stderr.print(escape(f"(a new database at {path.resolve()}; a server started elsewhere does not see it)"))
    _migrated(settings.sqlalchemy_url)
    size_pool(settings.sqlalchemy_url, settings.database_pool)
    return settings.sqlalchemy_url


def _usable_database_url(url: str) -> str:
    """``url`` where SQLAlchemy can parse it and its driver is installed; else a usage error naming what to fix
    (it was a traceback from deep in SQLAlchemy). The URL is shown without its password."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        parsed = make_url(url)
    except ArgumentError:  # not echoed: it may hold a password
        raise typer.BadParameter("COSERVE_DATABASE_URL is not a database URL (e.g. "
                                 "postgresql+psycopg2://user:password@host/coserve)") from None
    shown = parsed.render_as_string(hide_password=True)
    try:
        parsed.get_dialect().import_dbapi()
    except NoSuchModuleError:
        raise typer.BadParameter(f"{shown}: no SQLAlchemy dialect {parsed.drivername!r} (COSERVE_DATABASE_URL: "
                                 "sqlite:///PATH or postgresql+psycopg2://...)") from None
    except ImportError as exc:
        raise typer.BadParameter(f"{shown}: its driver is not installed ({exc}); install it, or name an installed "
                                 "one in COSERVE_DATABASE_URL (postgresql+psycopg2://...)") from None
    return url


def _migrated(url: str) -> None:
    """Migrates the database at ``url``; one that does not answer (a server down, a file that cannot be opened)
    stops the command with one line saying so (exit 1), as an unreachable API does, not a traceback."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import OperationalError

    from app.db.migrate import upgrade

    try:
        upgrade(_usable_database_url(url))
    except OperationalError as exc:
        reason = " ".join(str(exc.orig or exc).split())  # the driver's words, on one line (psycopg2 writes two)
        shown = make_url(url).render_as_string(hide_password=True)
        stderr.print(f"[red]the database {escape(shown)} does not answer: {escape(reason)}[/red]", soft_wrap=True)
        raise typer.Exit(1) from None


def _servable_model(model: str) -> None:
    """A usage error where ``model`` is neither a bundled name nor a checkpoint: the API and the worker both load
    its tokenizer at start and die on it, which `coserve up` learnt only after starting all of them."""
    from app.services.model_info import resolve_model

    try:
        resolve_model(model)
    except FileNotFoundError as exc:
        raise typer.BadParameter(str(exc), param_hint="'--model' / COSERVE_MODEL") from None


def _split_env(env: dict[str, str], vllm_args: str, engine_flags: dict[str, Any]) -> tuple[dict[str, str], ...]:
    """The API's and the worker's environments under `coserve up`: the worker takes the vLLM flags; the API only
    the context length and the LoRA rank they set (it holds jobs and adapter loads to them without reading vLLM's
    flags, or importing vLLM)."""
    api_env = dict(env, COSERVE_VLLM_ARGS="")
    context = engine_flags.get("max_model_len")
    if isinstance(context, int) and context > 0:
        api_env["COSERVE_VLLM_MAX_MODEL_LEN"] = str(context)
    if isinstance(rank := engine_flags.get("max_lora_rank"), int):  # the engine's (runtime_rank_limit)
        api_env["COSERVE_MAX_LORA_RANK"] = str(rank)
    return api_env, dict(env, COSERVE_VLLM_ARGS=vllm_args)


def _saved_credentials() -> dict[str, str]:
    """What ``coserve up`` saved (empty: nothing saved); a file that cannot be read is a usage error saying so."""
    from app.credentials import CredentialsError, load_credentials

    try:
        return load_credentials(_settings().data_dir) or {}
    except CredentialsError as exc:
        raise typer.BadParameter(str(exc)) from None


def _client_config(url: str | None, key: str | None) -> tuple[str, str]:
    url = url or os.environ.get("COSERVE_URL")
    key = key or os.environ.get("COSERVE_API_KEY")
    creds = _saved_credentials() if not (url and key) else {}  # given both, no file is read
    url = url or creds.get("url") or "http://127.0.0.1:8000"
    key = key or creds.get("api_key")
    if not key:
        raise typer.BadParameter(f"no API key: pass --key, set COSERVE_API_KEY, or {_where_up_saves_keys()}")
    # an OpenAI client's base URL ends in /v1; the commands' paths begin with it (/v1/jobs): one, not /v1/v1/jobs
    return url.rstrip("/").removesuffix("/v1"), key


def admin_key() -> str:
    """The admin key ``coserve up`` saved in its credentials (``COSERVE_ADMIN_KEY`` first)."""
    key = os.environ.get("COSERVE_ADMIN_KEY") or _saved_credentials().get("admin_key")
    if not key:
        raise typer.BadParameter(f"no admin key: pass --key, set COSERVE_ADMIN_KEY, or {_where_up_saves_keys()}")
    return key


def _where_up_saves_keys() -> str:
    """The end of a "no key" message: where the keys `coserve up` saved were looked for, which is where a command
    run outside that directory looked in vain."""
    from app.credentials import credentials_path

    path = credentials_path(_settings().data_dir).resolve()
    return (f"run this where `coserve up` ran (no {path}; COSERVE_DATA_DIR names its data directory), or run "
            "`coserve up` first")


def _answer(method: str, url: str, key: str, path: str, **kw: Any) -> httpx.Response:
    """The API's answer, whatever its status; an API that cannot be reached stops the command (exit 2)."""
    try:
        return interruptible(lambda: httpx.request(method, url + path, headers={"Authorization": f"Bearer {key}"},
                                                   timeout=30, trust_env=trust_env(url), **kw))
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        stderr.print(f"[red]cannot reach {escape(url)}: {escape(str(exc))}[/red] (is `coserve up` running?)")
        raise typer.Exit(2) from exc


def _request(method: str, url: str, key: str, path: str, looked_up: tuple[str, str] | None = None,
             **kw: Any) -> dict[str, Any]:
    """The API's JSON answer; an error answer stops the command (exit 1) with its line (``error_line``'s, which
    ``looked_up`` is for) on stderr."""
    r = _answer(method, url, key, path, **kw)
    if r.status_code >= 400:
        stderr.print(error_line(r, looked_up))
        raise typer.Exit(1)
    return r.json()


def is_admin_key(url: str, key: str) -> bool:
    """Whether ``key`` is an admin key: an admin route answers it (403: a tenant's key)."""
    r = _answer("GET", url, key, "/v1/admin/tenants")
    if r.status_code == 403:
        return False
    if r.status_code >= 400:  # an unknown or revoked key (401): what any request with it would say
        stderr.print(error_line(r))
        raise typer.Exit(1)
    return True


def warn_without_workers(url: str) -> None:
    """Says so where no live worker serves the API's model (its ``/readyz``): the jobs about to be sent would wait in
    the queue, and a wait for them would show nothing."""
    try:
        readyz = interruptible(lambda: httpx.get(url + "/readyz", timeout=10, trust_env=trust_env(url)))
        workers = readyz.json().get("checks", {}).get("workers", "")
    except (httpx.HTTPError, ValueError, AttributeError):
        return  # an older server, or one that cannot say: the request itself will tell
    if workers.startswith("error"):
        stderr.print(f"[yellow]warning: {escape(workers.removeprefix('error: '))}: the jobs wait in the queue until "
                      "a worker serves the model (`coserve worker`, or `coserve up`)[/yellow]")


def _job_table(job: dict[str, Any]) -> Table:
    t = Table(show_header=False, title=f"job {job['id']}")
    m = job.get("metrics") or {}
    rows = [("status", job["status"]), ("kind / tier", f"{job['kind']} / {job['tier']}"), ("model", job["model"]),
            ("attempt / worker", f"{job['attempt']} / {job.get('worker_id') or '-'}"),
            ("tokens (prompt / completion)", f"{job.get('prompt_tokens')} / {job.get('completion_tokens')}"),
            ("TTFT / TTLT (s)", f"{_fmt(m.get('ttft_s'))} / {_fmt(m.get('ttlt_s'))}"),
            ("TBT p50 / p99 (ms)", f"{_fmt(m.get('tbt_p50_s'), 1e3)} / {_fmt(m.get('tbt_p99_s'), 1e3)}"),
            ("SLO met", _slo_met(job, m.get("slo_met")))]
    why = slo_explanation(job)
    if why:
        rows.append(("first missed deadline", why))
    rows.append(("relegations", str(m.get("relegation_count", 0))))
    if job.get("error"):
        rows.append(("error", escape(job["error"])))
    for k, v in rows:
        t.add_row(k, v)
    return t


def _slo_met(job: dict[str, Any], met: bool | None) -> str:
    """"SLO met" as the job has it, or why it has none (a table cell read "None")."""
    if met is not None:
        return str(met)
    if job["status"] not in TERMINAL:
        return f"not yet ({job['status']})"
    return f"not judged ({job['status']})"  # only a job that produced its answer is judged


def slo_explanation(job: dict[str, Any]) -> str | None:
    """Why a finished job's "SLO met" is False: the first deadline it missed, from ``metrics.slo_miss``
    (token n, when it was due and when it came, in seconds after arrival, and how late); None when
    the SLO was met or is not judged yet. Jobs recorded without ``slo_miss`` get what their
    TTFT / TTLT columns can tell."""
    m = job.get("metrics") or {}
    if m.get("slo_met") is not False:
        return None
    miss = m.get("slo_miss")
    interactive = job.get("kind") != "batch"
    if not miss:  # recorded before per-token details were kept
        miss = _miss_from_columns(job, m)
        if miss is None:
            return "a token after the first came after its deadline (no per-token details recorded)"
    n, due, at = miss["token"], miss["due_s"], miss.get("at_s")
    if interactive:
        which = f"token {n}" + (" (the first)" if n == 1 else "")
        how = _interactive_due(job, m, n)
    else:
        which = f"the last token ({n})"
        how = "the batch deadline"
    due_text = f"was due {due:.3f} s after arrival ({how})"
    if at is None:
        return f"{which} {due_text} and never came"
    late_ms = miss.get("late_ms")
    late_ms = (at - due) * 1e3 if late_ms is None else late_ms
    return f"{which} {due_text} and came at {at:.3f} s: {late_ms:.1f} ms late"


def _interactive_due(job: dict[str, Any], m: dict[str, Any], n: int) -> str:
    """How token n's deadline is made: TTFT + (n-1) TBT, or from the first token (tbt_anchor first-token)."""
    ttft_ms, tbt_ms = job.get("ttft_ms"), job.get("tbt_ms")
    first = m.get("ttft_s")
    if n == 1:
        return f"TTFT {ttft_ms:g} ms" if ttft_ms is not None else "TTFT"
    tbt = f"{n - 1} x TBT {tbt_ms:g} ms" if tbt_ms is not None else f"{n - 1} x TBT"
    if job.get("tbt_anchor") == "first-token" and first is not None and (ttft_ms is None or first * 1e3 < ttft_ms):
        return f"first token at {first:.3f} s + {tbt}, tbt_anchor first-token"
    start = f"TTFT {ttft_ms:g} ms" if ttft_ms is not None else "TTFT"
    return f"{start} + {tbt}"


def _miss_from_columns(job: dict[str, Any], m: dict[str, Any]) -> dict[str, Any] | None:
    """The miss the stored TTFT (interactive) or TTLT (batch) shows, when that is the one."""
    if job.get("kind") == "batch":
        created, deadline, ttlt = job.get("created_at"), job.get("deadline_at"), m.get("ttlt_s")
        if not (created and deadline and ttlt is not None):
            return None
        due = (datetime.fromisoformat(deadline.replace("Z", "+00:00"))
               - datetime.fromisoformat(created.replace("Z", "+00:00"))).total_seconds()
        return {"token": job.get("completion_tokens") or 1, "due_s": due, "at_s": ttlt} if ttlt > due else None
    ttft, ttft_ms = m.get("ttft_s"), job.get("ttft_ms")
    if ttft_ms is None:
        return None
    if ttft is None:
        return {"token": 1, "due_s": ttft_ms / 1e3, "at_s": None}
    return {"token": 1, "due_s": ttft_ms / 1e3, "at_s": ttft} if ttft * 1e3 > ttft_ms else None


def _jobs_table(jobs: list[dict[str, Any]]) -> Table:
    t = list_table(kept("id", (j["id"] for j in jobs)), kept("status", (j["status"] for j in jobs)), other("kind"),
                   other("tier"), date("created"), other("tokens", "right"), other("TTFT s", "right"), other("SLO"))
    for j in jobs:
        t.add_row(j["id"], j["status"], j["kind"], j["tier"], when(j["created_at"]),
                  str(j.get("completion_tokens") or "-"), _fmt(j["metrics"].get("ttft_s")),
                  _yes_no(j["metrics"].get("slo_met")))
    return t


def _keys_table(keys: list[dict[str, Any]]) -> Table:
    t = list_table(kept("key", (k["id"] for k in keys)), other("tenant"), other("prefix"), other("tier"),
                   other("admin"), kept("state", ["revoked"]), date("created"))
    for k in keys:
        t.add_row(k["id"], escape(k["tenant"]), k["prefix"], k["effective_tier"], "yes" if k["is_admin"] else "-",
                  "revoked" if k["revoked"] else "active", when(k["created_at"]))
    return t


def _yes_no(v: bool | None) -> str:
    return "-" if v is None else "yes" if v else "no"


def _fmt(v: float | None, scale: float = 1.0) -> str:
    return "-" if v is None else f"{v * scale:.3f}"


def _wait(url: str, key: str, job_id: str, timeout: float, stop: Callable[[], bool] = lambda: False
          ) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        job = _request("GET", url, key, f"/v1/jobs/{job_id}")
        if job["status"] in TERMINAL or time.monotonic() > deadline or stop():
            return job
        time.sleep(0.2)


def _stream_text(url: str, key: str, job_id: str, timeout: float) -> bool:
    """Prints the job's tokens as they arrive (``GET /v1/jobs/{id}/stream``); False when the
    stream is unavailable (an older server, a proxy that buffers), so the caller polls instead."""
    try:
        with ExitStack() as opened:  # its head too may wait long (a proxy that buffers)
            r = interruptible(lambda: opened.enter_context(httpx.stream(
                "GET", f"{url}/v1/jobs/{job_id}/stream", headers={"Authorization": f"Bearer {key}"},
                timeout=httpx.Timeout(timeout, connect=10.0), trust_env=trust_env(url))))
            if r.status_code != 200:
                return False
            event = None
            for line in interruptible_items(r.iter_lines()):
                if line.startswith("event: "):
                    event = line[7:]
                elif line.startswith("data: ") and event == "delta":
                    sys.stdout.write(json.loads(line[6:]).get("text", ""))
                    sys.stdout.flush()
                elif line.startswith("data: ") and event == "end":
                    sys.stdout.write("\n")
                    return True
    except httpx.HTTPError as exc:
        log.debug("stream of %s broke off (%s); polling", job_id, exc)
    return False


def _show_job(job: dict[str, Any], as_json: bool) -> None:
    """A job as the API answered it: its JSON, or the table and its output text."""
    if as_json:
        print_json(job)
        return
    print_table(console, _job_table(job))
    if job.get("output_text"):
        console.print(job["output_text"], markup=False)


JOBS_PAGE = 20  # the jobs a `coserve jobs` page shows unless --limit says


def _next_page(status: str | None, kind: str | None, limit: int, cursor: str) -> str:
    """The `coserve jobs` call that shows the page after this one: the same filters and page size, and its cursor."""
    args = [*(["--status", status] if status else []), *(["--kind", kind] if kind else []),
            *(["--limit", str(limit)] if limit != JOBS_PAGE else []), "--cursor", cursor]
    return shlex.join(["coserve", "jobs", *args])


def _from_settings(field: str) -> str:
    """Where an option's value comes from when it is not given: its setting's variable, else the setting's default
    (read from app/settings.py, so the help cannot drift from it)."""
    from app.settings import Settings

    default = Settings.model_fields[field].default
    shown = f"./{default}" if isinstance(default, Path) and not default.is_absolute() else default
    return f"default: COSERVE_{field.upper()}, else {shown}"


def _why(sup: Any, dead: list[str]) -> str:
    """What the processes that died last wrote (a worker's bad --model, an engine argument vLLM refused), so the
    reason is on the screen and not only in the logs."""
    return _said([(name, sup.last_words(name)) for name in dead])


def _said(last_words: list[tuple[str, str | None]]) -> str:
    said = [f"{name}: {words}" for name, words in last_words if words]
    return escape("".join(f"\n  {line}" for line in said))


def worker_restarted(ended: ChildExit, limit: RestartLimit) -> str:
    """What `coserve up` says of a worker it starts again (``ended``: its ``ChildExit``): how it ended, why (its last
    words), how soon the new one starts, and how many of its restarts are used."""
    how = f"killed by signal {-ended.status}" if ended.status < 0 else f"status {ended.status}"
    # a killed process wrote nothing as it died: its last line says nothing of why it went
    why = _said([(ended.name, ended.last_words)]) if ended.status > 0 else ""
    return (f"[yellow]{ended.name} exited ({how}); starting a new one with the same worker id in "
            f"{ended.restart_in_s:g}s, restart {limit.taken} of {limit.restarts} allowed in {limit.window_s:g}s"
            f"[/yellow]{why}")


def not_ready(api_url: str, checks: Any) -> str:
    """What `coserve up` saw of its API when it gave up waiting: what ``/readyz`` said, or that it never answered."""
    if checks is None:
        return f"the API never answered {api_url}/readyz (still starting, or stopped: its log says which)"
    return f"/readyz said: {checks}"


def http_url(host: str, port: int) -> str:
    """The API's URL for ``host`` (an IPv6 address in brackets; all interfaces: this machine's loopback)."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _unusable_port(host: str, port: int) -> str | None:
    """Why the API cannot listen on ``host``:``port`` (None: it can); a port another server holds would answer
    `coserve up`'s readiness check in its place."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a closing socket is no bar
        try:
            probe.bind((host, port))
        except OSError as exc:
            return f"the API cannot listen on {host}:{port} ({exc.strerror}); another server holds it? pick --port"
    return None


STARTING_STOP_S = 2.0  # how long a child of `coserve up` still starting is given to end on SIGTERM


def stop_children(sup: Any, serving: bool) -> None:
    """Stops what `coserve up` started, Redis last. Before the stack served, the API and the worker have no request
    or job to finish: they get ``STARTING_STOP_S`` and not the full grace, which uvicorn's worker processes, loading
    the app on through a SIGTERM, took whole (a Ctrl-C at start-up waited some 16 s on "stopping ...")."""
    if not serving:
        for name in ("api", "worker"):
            sup.stop_one(name, STARTING_STOP_S)
    sup.stop()


def register(cli: typer.Typer) -> None:  # noqa: C901 - one place that lists the service commands
    keys_app = typer.Typer(help="Manage API keys (direct DB access).", no_args_is_help=True)
    cli.add_typer(keys_app, name="keys")

    @cli.command(context_settings=VLLM_OPTIONS)
    def up(
        ctx: typer.Context,
        demo: Annotated[bool, typer.Option("--demo", help="submit a demo job once ready and print its text")] = False,
        exit_after_demo: Annotated[bool, typer.Option("--exit-after-demo", help="stop after the demo")] = False,
        host: Annotated[str | None, typer.Option(help=f"API host ({_from_settings('host')})")] = None,
        port: Annotated[int | None, typer.Option(help=f"API port ({_from_settings('port')})")] = None,
        data_dir: Annotated[Path | None, typer.Option(
            help=f"SQLite, Redis data, logs, credentials ({_from_settings('data_dir')})")] = None,
        model: Annotated[str | None, typer.Option(
            help=f"'smollm2-135m' or a checkpoint directory ({_from_settings('model')})")] = None,
        device: Annotated[str | None, typer.Option(help=f"auto | cpu | cuda ({_from_settings('device')})")] = None,
        api_workers: Annotated[int | None, typer.Option(
            help="uvicorn worker processes (default: 2 with 2+ CPUs; one process tops out near 700 submissions/s)",
            min=1)] = None,
        start_timeout: Annotated[float, typer.Option(
            help="seconds to wait for the API and the worker to be ready (the model's first load included)",
            min=1, callback=finite)] = 1800.0,
        worker_restarts: Annotated[int, typer.Option(
            help="times a worker that exits once serving is started again within --worker-restart-window; one "
                 "more exit there stops everything (0: the first exit does)", min=0)] = RestartLimit.restarts,
        worker_restart_window: Annotated[float, typer.Option(
            help="seconds in which --worker-restarts restarts are allowed", min=1,
            callback=finite)] = RestartLimit.window_s,
        worker_restart_delay: Annotated[float, typer.Option(
            help="seconds a worker that exited waits before it is started again; twice the last wait at each restart "
                 "after, up to --worker-restart-max-delay, and this again after a run of "
                 f"{RestartDelay.steady_s:g}s (0: no wait)", min=0, callback=finite)] = RestartDelay.first_s,
        worker_restart_max_delay: Annotated[float, typer.Option(
            help="the longest wait before a worker is started again", min=0,
            callback=finite)] = RestartDelay.max_s,
    ) -> None:
        """Run everything on this machine: Redis (embedded unless REDIS_URL), API, one GPU/CPU worker. A worker that
        exits once serving (an engine given up on, an out-of-memory kill) is started again with the same worker id
        (COSERVE_WORKER_ID, else host-<pid of coserve up>), after a growing delay (--worker-restart-delay), within
        --worker-restarts; Redis or the API exiting stops everything. Options after these go to the worker's vLLM
        engine, as `vllm serve` takes them (e.g. --max-num-seqs 64)."""
        from app.credentials import CredentialsError, credentials_path, ensure_credentials
        from app.db.session import size_pool
        from app.embedded import (
            DataDirInUse,
            RedisDidNotStart,
            Supervisor,
            hold_data_dir,
            record_redis_url,
            start_redis,
        )

        t0 = time.monotonic()
        if api_workers is None:
            api_workers = min(2, os.cpu_count() or 1)
        settings = _settings(host=host, port=port, data_dir=data_dir, model=model, device=device)
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        data = settings.data_dir.resolve()
        try:  # first: another `coserve up` here holds the port too, and the way out is not another port
            held = hold_data_dir(data, http_url(settings.host, settings.port))
        except DataDirInUse as exc:
            raise typer.BadParameter(str(exc), param_hint="--data-dir") from None
        try:
            if refused := _unusable_port(settings.host, settings.port):
                raise typer.BadParameter(refused, param_hint="--port")
            _servable_model(settings.model)
            vllm_args, engine_flags = vllm_flags(ctx, settings)
            _migrated(settings.sqlalchemy_url)  # before Redis: a database that does not answer stops it all
            size_pool(settings.sqlalchemy_url, settings.database_pool)  # this process's writes (the credentials)
        except (typer.BadParameter, typer.Exit):
            held.close()
            raise
        sup = Supervisor()
        stop = {"now": False}
        serving = False  # the API and the worker were ready once

        def on_signal(signum, _frame):
            stop["now"] = True

        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # SIGHUP: its terminal closed
            signal.signal(signum, on_signal)
        try:
            redis_url = settings.redis_url
            if not redis_url:
                try:
                    proc, redis_url = start_redis(data / "redis", persist=True)
                except RedisDidNotStart as exc:  # its reason on the screen, not a traceback
                    console.print(f"[red]{escape(str(exc))}[/red]")
                    raise typer.Exit(1) from None
                sup.adopt("redis", proc, data / "redis" / "redis.log")  # why it stopped, where it says
                record_redis_url(data, redis_url)  # `keys revoke` announces revocations through it
                console.print(f"[dim]redis-server (embedded) on {redis_url}[/dim]")
            api_url = http_url(settings.host, settings.port)
            try:
                creds, created = ensure_credentials(settings.sqlalchemy_url, data, default_tier=settings.default_tier,
                                                    admin_key=settings.admin_key, api_url=api_url)
            except CredentialsError as exc:
                raise typer.BadParameter(str(exc)) from None
            env = dict(os.environ, REDIS_URL=redis_url, COSERVE_DATA_DIR=str(data),
                       COSERVE_DATABASE_URL=settings.sqlalchemy_url, COSERVE_MODEL=settings.model,
                       COSERVE_DEVICE=settings.device, PYTHONUNBUFFERED="1")
            api_env, worker_env = _split_env(env, vllm_args, engine_flags)
            # one id for every process of the worker: a restarted one takes up its predecessor's own queue and marks
            worker_env["COSERVE_WORKER_ID"] = settings.worker_name
            restarts = RestartLimit(worker_restarts, worker_restart_window,
                                    RestartDelay(worker_restart_delay, worker_restart_max_delay))
            sup.spawn("api", [sys.executable, "-m", "uvicorn", "--factory", "app.main:app_factory", "--host",
                              settings.host, "--port", str(settings.port), "--workers", str(api_workers),
                              "--log-level", "warning", "--no-access-log"], api_env, data / "logs" / "api.log")
            sup.spawn("worker", [sys.executable, "-m", "workers.gpu_worker"], worker_env, data / "logs" / "worker.log",
                      restart=restarts)
            if created:
                console.print(f"[bold]API key[/bold] (shown once, saved to {credentials_path(data)}): "
                              f"{creds['api_key']}")
                if "admin_key" in creds:
                    console.print(f"[bold]admin key[/bold]: {creds['admin_key']}")
            console.print(f"waiting for the API and the worker (model {settings.model}) ...")
            checks: Any = None
            while True:
                if stop["now"]:
                    return
                if dead := sup.dead():
                    console.print(f"[red]{', '.join(dead)} exited during start-up[/red]{_why(sup, dead)}; see "
                                  f"{data / 'logs'}")
                    raise typer.Exit(1)
                if time.monotonic() - t0 > start_timeout:
                    console.print(f"[red]not ready after {start_timeout:.0f}s[/red]; "
                                  f"{escape(not_ready(api_url, checks))}; see {data / 'logs'}")
                    raise typer.Exit(1)
                try:
                    r = httpx.get(api_url + "/readyz", timeout=2, trust_env=trust_env(api_url))
                    if r.status_code == 200:
                        break
                    checks = r.json().get("checks", r.text)
                except (httpx.HTTPError, ValueError):
                    pass
                time.sleep(0.25)
            serving = True
            ready_s = time.monotonic() - t0
            console.print(f"[green]ready in {ready_s:.1f}s[/green]: API {api_url} (docs {api_url}/docs, "
                          f"dashboard {api_url}/admin), keys in {credentials_path(data)}, logs {data / 'logs'}, "
                          f"database {settings.sqlalchemy_url}")
            if demo:
                job = _request("POST", api_url, creds["api_key"], "/v1/jobs", json={
                    "messages": [{"role": "user", "content": DEMO_PROMPT}], "max_tokens": 64, "tbt_ms": 200})
                job = _wait(api_url, creds["api_key"], job["id"], 300, stop=lambda: stop["now"])
                if stop["now"]:
                    return
                console.print(f"[bold]demo job {job['id']}[/bold] ({job['status']}): {DEMO_PROMPT}")
                console.print(job.get("output_text") or job.get("error") or "", markup=False)  # model text, not markup
                print_table(console, _job_table(job))
                if exit_after_demo:
                    return
            console.print("serving; Ctrl-C stops everything")
            while not stop["now"]:
                exits = sup.tend()  # a worker comes back (its jobs' leases lapse and the sweeper sends them again)
                for ended in (e for e in exits if e.restarted):
                    console.print(worker_restarted(ended, restarts))
                if dead := [(e.name, e.last_words) for e in exits if not e.restarted]:
                    # the API cannot serve without Redis, nor the worker take jobs without either
                    names = ", ".join(name for name, _words in dead)
                    given_up = f" ({restarts.restarts} restarts in {restarts.window_s:g}s used)" \
                        if "worker" in dict(dead) else ""
                    console.print(f"[red]{names} exited[/red]{given_up}{_said(dead)}; stopping; see {data / 'logs'}")
                    raise typer.Exit(1)
                time.sleep(0.5)
        finally:
            console.print("stopping ...")
            stop_children(sup, serving)
            held.close()  # the data directory is free for the next `coserve up`

    @cli.command(context_settings=VLLM_OPTIONS)
    def worker(
        ctx: typer.Context,
        model: Annotated[str | None, typer.Option(
            help=f"'smollm2-135m' or a checkpoint directory ({_from_settings('model')})")] = None,
        device: Annotated[str | None, typer.Option(
            help=f"auto | cpu | cuda | cuda:N ({_from_settings('device')})")] = None,
        worker_id: Annotated[str | None, typer.Option(help="default: COSERVE_WORKER_ID, else host-pid")] = None,
    ) -> None:
        """Run one long-lived GPU worker (needs REDIS_URL and the database URL). Options after these go to its vLLM
        engine, as `vllm serve` takes them (e.g. --tensor-parallel-size 2 --gpu-memory-utilization 0.85)."""
        from app.observability.logs import configure_logging
        from workers.gpu_worker import run_worker

        settings = _settings(model=model, device=device, worker_id=worker_id)
        _servable_model(settings.model)
        settings = settings.model_copy(update={"vllm_args": vllm_flags(ctx, settings)[0]})
        configure_logging()
        run_worker(settings)

    @cli.command()
    def submit(
        prompt: Annotated[str, typer.Argument(help="the user message (or raw prompt with --raw)")],
        tbt_ms: Annotated[float | None, typer.Option(help="interactive: time-between-tokens target (default: the "
                                                          "API's COSERVE_DEFAULT_TBT_MS)", callback=finite)] = None,
        ttft_ms: Annotated[float | None, typer.Option(help="interactive: time-to-first-token target (default: the "
                                                           "API's COSERVE_DEFAULT_TTFT_MS)", callback=finite)] = None,
        batch: Annotated[bool, typer.Option("--batch", help="a batch job with a deadline")] = False,
        deadline_s: Annotated[float | None, typer.Option(
            help="batch: seconds from now (default: the API's COSERVE_DEFAULT_BATCH_WINDOW_S)",
            callback=finite)] = None,
        max_tokens: Annotated[int | None, typer.Option(help="most tokens to generate (default: the API's)")] = None,
        tier: Tier = None,
        raw: Annotated[bool, typer.Option("--raw", help="send as a raw prompt (no chat template)")] = False,
        wait: Annotated[bool, typer.Option("--wait", help="wait for the result and print it")] = False,
        url: Url = None, key: Key = None,
        as_json: Annotated[bool, typer.Option("--json", help="print the job as submitted (with --wait: as it ended, "
                                                             "its text in output_text) as the API's JSON, alone on "
                                                             "stdout")] = False,
    ) -> None:
        """Submit a job to a running coserve."""
        if batch and (tbt_ms is not None or ttft_ms is not None):
            raise typer.BadParameter("a batch job has a deadline, not TTFT/TBT targets; drop --batch or them")
        if not batch and deadline_s is not None:
            raise typer.BadParameter("--deadline-s is a batch job's; add --batch")
        url, key = _client_config(url, key)
        body: dict[str, Any] = {"kind": "batch" if batch else "interactive", "max_tokens": max_tokens, "tier": tier}
        body.update({"prompt": prompt} if raw else {"messages": [{"role": "user", "content": prompt}]})
        if batch:
            body["deadline_window_s"] = deadline_s
        else:
            body.update(tbt_ms=tbt_ms, ttft_ms=ttft_ms)
        with asking("the server may queue the job", "`coserve jobs` shows your jobs, newest first"):
            job = _request("POST", url, key, "/v1/jobs", json={k: v for k, v in body.items() if v is not None})
        if as_json and not wait:
            print_json(job)
            return
        # with --json: the id on stderr while the wait goes on, and the job once, as it ended (as batch create does)
        (stderr if as_json else console).print(f"submitted [bold]{job['id']}[/bold] ({job['status']})")
        if wait:
            try:
                warn_without_workers(url)
                streamed = not as_json and _stream_text(url, key, job["id"], 3600)
                job = _wait(url, key, job["id"], 3600)
            except KeyboardInterrupt:
                raise stopped_waiting(f"job {job['id']}", f"coserve status {job['id']}",
                                      f"coserve cancel {job['id']}") from None
            if as_json:
                print_json(job)
            else:
                if not streamed:
                    console.print(job.get("output_text") or "", markup=False)
                print_table(console, _job_table(job))
            if job["status"] != "succeeded":  # a script's `coserve submit --wait && ...` goes no further
                stderr.print(f"[red]job {job['id']} {job['status']}[/red]"
                              + ("" if job["status"] in TERMINAL else " after an hour's wait"))
                raise typer.Exit(1)

    @cli.command()
    def status(job_id: JobId, url: Url = None, key: Key = None, as_json: AsJson = False) -> None:
        """Show one job."""
        url, key = _client_config(url, key)
        _show_job(_request("GET", url, key, f"/v1/jobs/{job_id}", ("job", job_id)), as_json)

    @cli.command()
    def cancel(job_id: JobId, url: Url = None, key: Key = None, as_json: AsJson = False) -> None:
        """Cancel a job that has not ended; a running one keeps what it produced (shown)."""
        url, key = _client_config(url, key)
        with asking(f"the server may cancel job {job_id}", f"`coserve status {job_id}` shows it"):
            job = _request("POST", url, key, f"/v1/jobs/{job_id}/cancel", ("job", job_id))
        # the answer's own word: the job alone reads "cancelled" whether this cancel or another client's stopped it
        # (a read before the cancel took another's, made in between, for this one's); an older server says nothing
        ended = not job.get("cancelled", job["status"] == "cancelled")
        if ended and not as_json:
            console.print(f"{job['id']} had already ended ({job['status']}): nothing to cancel")
        _show_job(job, as_json)

    @cli.command()
    def jobs(status_: Annotated[str | None, typer.Option("--status", help="only jobs in this status: queued, "
                                                          "dispatched, running, relegated, succeeded, failed, "
                                                          "cancelled or expired")] = None,
             kind: Annotated[str | None, typer.Option(help="only interactive or batch jobs")] = None,
             limit: Annotated[int, typer.Option(min=1, max=JOBS_PAGE_MAX,
                                                help="how many jobs a page shows")] = JOBS_PAGE,
             cursor: Annotated[str | None, typer.Option(help="the next page: the cursor the page before ended with "
                                                             "(its next_cursor)")] = None,
             url: Url = None, key: Key = None, as_json: AsJson = False) -> None:
        """List your jobs, newest first."""
        url, key = _client_config(url, key)
        params = {k: v for k, v in {"status": status_, "kind": kind, "limit": limit, "cursor": cursor}.items()
                  if v is not None}
        page = _request("GET", url, key, "/v1/jobs", params=params)
        if as_json:
            print_json(page)
            return
        if not page["data"]:  # not a table of headers alone
            console.print(" ".join(w for w in ("no", status_, kind, "jobs") if w))
            return
        print_table(console, _jobs_table(page["data"]))
        if page.get("next_cursor"):  # the same filters, the next page
            console.print(escape(f"more: `{_next_page(status_, kind, limit, page['next_cursor'])}`"), soft_wrap=True)

    @keys_app.command("create")
    def keys_create(tenant: Annotated[str, typer.Option(help="tenant name (created if missing)")],
                    tier: Annotated[str | None, typer.Option(help="key tier; default: the tenant's")] = None,
                    admin: Annotated[bool, typer.Option("--admin", help="an admin key (the dashboard's actions "
                                                                        "and every tenant's usage)")] = False,
                    default_tier: Annotated[str | None, typer.Option(
                        help="tier of a new tenant; default: COSERVE_DEFAULT_TIER")] = None,
                    as_json: Annotated[bool, typer.Option("--json", help="print the new key as the admin API answers "
                                                                         "it (api_key, key_id, tenant_id, tier, "
                                                                         "is_admin) as JSON, alone on stdout")] = False
                    ) -> None:
        """Create an API key (printed once; only its hash is stored)."""
        from sqlalchemy import select

        from app.auth import create_key, create_tenant
        from app.db.models import Tenant
        from app.db.session import session_scope
        from app.schemas import KeyCreated

        if not tenant.strip():  # a tenant nobody can name again in `keys list --tenant` or `keys limits`
            raise typer.BadParameter("give the tenant a name", param_hint="--tenant")
        settings = _settings()
        asked_default = default_tier
        default_tier = default_tier or settings.default_tier
        for t in (tier, default_tier):
            if t is not None and t not in settings.tiers:
                raise typer.BadParameter(f"unknown tier {t!r}; choose one of {list(settings.tiers)}")
        with session_scope(_database(settings, new_ok=True), immediate=True) as s:
            row = s.scalar(select(Tenant).where(Tenant.name == tenant))
            if row is not None and asked_default not in (None, row.default_tier):
                # it would have made a key of the tenant's own tier without a word
                raise typer.BadParameter(f"tenant {tenant!r} exists, with default tier {row.default_tier!r}; "
                                         f"--default-tier is a new tenant's: give --tier {asked_default} for this key",
                                         param_hint="--default-tier")
            row = row or create_tenant(s, tenant, default_tier)
            key_row, plaintext = create_key(s, row, tier=tier, is_admin=admin)
            tenant_id, key_id, key_tier = row.id, key_row.id, tier or row.default_tier
        if as_json:  # what POST /v1/admin/tenants (or .../keys) answers
            print_json(KeyCreated(tenant_id=tenant_id, key_id=key_id, api_key=plaintext, tier=key_tier,
                                  is_admin=admin).model_dump(mode="json"))
            return
        # escaped: rich would take "[admin]" (or brackets in a tenant's name) for markup and drop it;
        # soft_wrap: one line however narrow the console, so the ids copy whole
        console.print(escape(f"tenant {tenant} ({tenant_id}), key {key_id} (tier {key_tier})"
                             f"{' [admin]' if admin else ''}:"), soft_wrap=True)
        print(plaintext)

    @keys_app.command("limits")
    def keys_limits(tenant: Annotated[str, typer.Option(help="the tenant's name")],
                    requests_per_minute: Annotated[int | None, typer.Option(
                        min=0, max=MAX_RATE, help="its API requests per minute; 0: no limit")] = None,
                    tokens_per_minute: Annotated[int | None, typer.Option(
                        min=0, max=MAX_RATE, help="its tokens per minute (prompt + max_tokens); 0: no limit")] = None,
                    batch_queue_tokens: Annotated[int | None, typer.Option(
                        min=0, max=MAX_RATE,
                        help="prompt tokens its batches may have queued at once; 0: no limit")] = None,
                    as_json: Annotated[bool, typer.Option("--json", help="print the tenant as the admin API answers "
                                                                         "it (its limits: null for none) as JSON, "
                                                                         "alone on stdout")] = False
                    ) -> None:
        """Show or set a tenant's rate limits and batch queue limit (every key of it shares them; API processes
        apply a rate limit's change within seconds). Without a limit given, shows them."""
        from sqlalchemy import select

        from app.db.models import Tenant
        from app.db.session import session_scope
        from app.schemas import TenantPublic

        with session_scope(_database(_settings()), immediate=True) as s:
            row = s.scalar(select(Tenant).where(Tenant.name == tenant))
            if row is None:
                stderr.print(f"[red]no tenant {escape(repr(tenant))}[/red]")
                raise typer.Exit(1)
            if requests_per_minute is not None:
                row.requests_per_minute = requests_per_minute or None
            if tokens_per_minute is not None:
                row.tokens_per_minute = tokens_per_minute or None
            if batch_queue_tokens is not None:
                row.batch_queue_tokens = batch_queue_tokens or None
            rpm, tpm, queue = row.requests_per_minute, row.tokens_per_minute, row.batch_queue_tokens
            shown = TenantPublic.model_validate(row).model_dump(mode="json")  # as GET/PATCH /v1/admin/tenants/{id}
        if as_json:
            print_json(shown)
            return
        console.print(escape(f"tenant {tenant}: {rpm or 'no limit of'} requests per minute, "
                             f"{tpm or 'no limit of'} tokens per minute, "
                             f"{queue or 'no limit of'} tokens queued in batches"), soft_wrap=True)

    @keys_app.command("list")
    def keys_list(tenant: Annotated[str | None, typer.Option(help="only this tenant's keys")] = None,
                  as_json: Annotated[bool, typer.Option("--json", help="print JSON instead of a table")] = False
                  ) -> None:
        """List API keys, revoked ones included (ids and prefixes; the keys themselves are never stored)."""
        from sqlalchemy import select

        from app.db.models import ApiKey, Tenant
        from app.db.session import session_scope
        from app.schemas import KeyPublic

        with session_scope(_database(_settings())) as s:
            query = select(ApiKey, Tenant).join(Tenant).order_by(Tenant.name, ApiKey.created_at)
            if tenant is not None:
                query = query.where(Tenant.name == tenant)
            rows = [{**KeyPublic.model_validate(k).model_dump(mode="json"), "tenant": t.name,
                     "effective_tier": k.tier or t.default_tier} for k, t in s.execute(query)]
        if tenant is not None and not rows:
            stderr.print(f"[red]no keys for tenant {escape(repr(tenant))}[/red]")
            raise typer.Exit(1)
        if as_json:
            print_json(rows)
            return
        print_table(console, _keys_table(rows))

    @keys_app.command("revoke")
    def keys_revoke(key_id: Annotated[str, typer.Argument(help="the key's id (key_...), as `keys create` printed")]
                    ) -> None:
        """Revoke an API key: every API process answers 401 to it from its next request on. The last active admin
        key is refused, as the admin API refuses it: create another admin key first."""
        from app.auth import CACHE_TTL_S, admin_key_left, announce_revocation
        from app.db.models import ApiKey
        from app.db.session import session_scope
        from app.embedded import recorded_redis_url

        with session_scope(_database(settings := _settings()), immediate=True) as s:
            row = s.get(ApiKey, key_id)
            if row is None:
                stderr.print(f"[red]no API key {escape(repr(key_id))}[/red]")
                raise typer.Exit(1)
            if row.is_admin and not row.revoked and not admin_key_left(s, revoking=row.id):
                stderr.print(f"[red]{escape(key_id)} is the last active admin key: create another admin key first "
                             "(`coserve keys create --tenant admin --admin`), then revoke this one[/red]")
                raise typer.Exit(1)
            already, row.revoked = row.revoked, True
        # the API processes check Redis's revocation token on every request: change it (also for a key
        # already revoked, in case that revocation could not tell them)
        told = announce_revocation(settings.redis_url or recorded_redis_url(settings.data_dir))
        console.print(f"key {key_id} {'was already revoked' if already else 'revoked'}"
                      + ("" if told else f" (Redis not reachable: API processes that cached the key accept it "
                                         f"for up to {CACHE_TTL_S:g} s more)"))
