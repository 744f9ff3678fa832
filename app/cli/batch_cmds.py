"""CLI: ``coserve batch create|status|list|cancel|results`` and ``coserve summarize``.

Both talk to a running API (``--url``/``--key``, or ``COSERVE_URL``/``COSERVE_API_KEY``,
or the credentials ``coserve up`` wrote).
"""

from __future__ import annotations

import json
import logging
import os
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from app.bounds import BATCHES_PAGE_MAX, RUNS_PAGE_MAX
from app.cli.interruptible import interruptible
from app.cli.loopback import trust_env
from app.cli.options import AsJson, Key, Tier, Url, given_beside, in_path
from app.cli.output import (
    Console,
    asking,
    bar_on,
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

log = logging.getLogger(__name__)
console = Console()

batch_app = typer.Typer(help="OpenAI-compatible Batch API: submit a JSONL of requests with a completion window.",
                        no_args_is_help=True)

BatchId = Annotated[str, typer.Argument(help="batch id (batch_...)", callback=in_path)]
BATCH_DONE = {"completed", "failed", "expired", "cancelled"}


PATIENCE_S = 120.0  # how long a poll rides out an unreachable API (a restart) before it gives up
TIMEOUT_S = 60.0  # a request's answer
# starting a summarization (its first level's jobs, thousands of documents) and cancelling one (every job it waited
# for) take minutes on a busy server
LONG_TIMEOUT_S = 600.0


class Refused(typer.Exit):
    """The API answered an error (exit status 1, its line printed already); ``response`` is that answer."""

    def __init__(self, response: httpx.Response) -> None:
        super().__init__(1)
        self.response = response


class Api:
    def __init__(self, url: str | None, key: str | None) -> None:
        from app.cli.service_cmds import _client_config

        self.url, key = _client_config(url, key)
        self.http = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {key}"}, timeout=TIMEOUT_S,
                                 trust_env=trust_env(self.url))

    def call(self, method: str, path: str, patient: bool = False, looked_up: tuple[str, str] | None = None,
             **kw: Any) -> httpx.Response:
        """``patient``: a read that is retried, with growing pauses, while the API cannot be reached for up to
        ``PATIENCE_S`` (a long run's poll outlives an API restart). ``looked_up``: what the path names by id, for
        a 404's line (``error_line``). ``timeout`` (s) in ``kw``: httpx's."""
        give_up, pause = time.monotonic() + (PATIENCE_S if patient else 0.0), 1.0
        while True:
            try:
                r = interruptible(lambda: self.http.request(method, path, **kw))
                break
            except httpx.HTTPError as exc:
                if time.monotonic() + pause > give_up:
                    stderr.print(self._failure(method, path, exc, kw.get("timeout", TIMEOUT_S)))
                    raise typer.Exit(2) from exc
                time.sleep(pause)
                pause = min(pause * 2, 15.0)
        if r.status_code >= 400:
            stderr.print(error_line(r, looked_up))
            raise Refused(r)
        return r

    def _failure(self, method: str, path: str, exc: httpx.HTTPError, timeout_s: float) -> str:
        """Why a request got no answer: an API that answered too late may still be doing what it was asked."""
        if isinstance(exc, httpx.ReadTimeout | httpx.WriteTimeout):
            return (f"[red]{method} {path} got no answer from {self.url} within {timeout_s:g}s[/red]: the server "
                    "may still be doing it; look before you ask again")
        return f"[red]cannot reach {escape(self.url)}: {escape(str(exc))}[/red] (is `coserve up` running?)"


def _batch_table(batches: list[dict[str, Any]]) -> Table:
    t = list_table(kept("batch", (b["id"] for b in batches)), kept("status", (b["status"] for b in batches)),
                   other("endpoint"), other("window"), other("done / failed / total"), date("created"),
                   date("expires"))
    for b in batches:
        c = b["request_counts"]
        t.add_row(b["id"], b["status"], b["endpoint"], b["completion_window"],
                  f"{c['completed']} / {c['failed']} / {c['total']}", when(b["created_at"]), when(b["expires_at"]))
    return t


def _follow(api: Api, batch_id: str, warn: bool = False, bar: Console = console) -> dict[str, Any]:
    """Polls the batch with a progress bar until it ends; Ctrl-C stops the polling, not the batch. ``warn``: say
    first where no worker serves the model (a batch just created would wait). ``bar``: where the bar is drawn (stderr
    when stdout is the batch's JSON)."""
    from app.cli.service_cmds import warn_without_workers

    try:
        if warn:
            warn_without_workers(api.url)
        return _poll(api, batch_id, bar)
    except KeyboardInterrupt:
        raise stopped_waiting(f"batch {batch_id}", f"coserve batch status {batch_id} --follow",
                              f"coserve batch cancel {batch_id}") from None


def _poll(api: Api, batch_id: str, shown: Console) -> dict[str, Any]:
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=bar_on(shown)) as bar:
        task = bar.add_task(batch_id, total=None)
        while True:
            b = api.call("GET", f"/v1/batches/{batch_id}", patient=True, looked_up=("batch", batch_id)).json()
            c = b["request_counts"]
            bar.update(task, total=c["total"] or None, completed=c["completed"] + c["failed"],
                       description=f"{batch_id} {escape('[' + b['status'] + ']')}")
            if b["status"] in BATCH_DONE:
                return b
            time.sleep(1.0)


# `batch create --wait` and `batch status --follow` exit with these once the batch has ended (2: no answer from the
# API, or a usage error; an API error is 1 too)
ALL_SUCCEEDED, NOT_COMPLETED, SOME_FAILED = 0, 1, 3
# --json of a command that waits (`batch create --wait`, `batch status --follow`, `submit --wait`) prints the object
# once, as it ended, like `gh run view --json` or `openai api batches retrieve`: stdout stays one JSON document
# (`| jq .output_file_id`) and the exit status says how it ended; the progress bar and notes go to stderr
EXIT_CODES_HELP = ("Exit status once the batch ended: 0 every request succeeded; 1 the batch failed, expired or was "
                   "cancelled, or not one of its requests succeeded; 3 it completed with some requests failed (the "
                   "output file holds the others); 2 the API could not be reached.")


def exit_code(batch: dict[str, Any]) -> int:
    """What an ended batch tells a script: a batch that completed with every request failed has nothing to use."""
    counts = batch["request_counts"]
    if batch["status"] != "completed" or counts["completed"] == 0 < counts["total"]:
        return NOT_COMPLETED
    return SOME_FAILED if counts["failed"] else ALL_SUCCEEDED


def _end(batch: dict[str, Any]) -> None:
    """Says where the failed requests' reasons are (the table's count alone does not), then exits as
    ``exit_code`` says: a script's ``coserve batch create --wait && next`` goes no further unless all succeeded."""
    counts = batch["request_counts"]
    if counts["failed"]:  # what went wrong goes to stderr, as every failure does: stdout is the batch's table
        stderr.print(f"[yellow]{counts['failed']} of {counts['total']} requests failed[/yellow]: `coserve batch "
                     f"results {batch['id']} --errors FILE` saves why")
    if code := exit_code(batch):
        raise typer.Exit(code)


FIRST_LINE_BYTES = 1 << 20  # the most of a file read to check its first request before the upload


def _looks_like_jsonl(path: Path) -> None:
    """A usage error where the file's first request is not a JSON object on its own line (a CSV, a JSON array, not
    text), checked before the upload as the API parses it (UTF-8, blank lines skipped); the rest is the API's to
    check, so a large file is read once, by the upload. A first line longer than ``FIRST_LINE_BYTES`` is left to it."""
    with path.open("rb") as f:
        for line_no, raw in enumerate(iter(lambda: f.readline(FIRST_LINE_BYTES), b""), start=1):
            if not raw.endswith(b"\n") and len(raw) == FIRST_LINE_BYTES:
                return
            try:
                text = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
            except UnicodeDecodeError:
                raise typer.BadParameter(f"{path}: line {line_no} is not UTF-8 text; give a JSONL file of requests",
                                         param_hint="PATH") from None
            if not text.strip():
                continue
            try:
                request = json.loads(text)
            except json.JSONDecodeError as exc:
                request, why = None, f"not JSON ({exc.msg})"
            else:
                why = "not a JSON object"
            if not isinstance(request, dict):
                raise typer.BadParameter(f"{path}: line {line_no} is {why}; a batch file is JSONL, one request "
                                         "object per line", param_hint="PATH")
            return
    raise typer.BadParameter(f"{path}: the file has no requests", param_hint="PATH")


@batch_app.command("create", epilog=EXIT_CODES_HELP)
def create(path: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="JSONL of requests")],
           endpoint: Annotated[str, typer.Option(help="/v1/chat/completions, /v1/completions or /v1/responses")] =
           "/v1/chat/completions",
           window: Annotated[str, typer.Option("--window", "-w", help="completion window: 30m, 2h, 24h, 7d")] = "24h",
           wait: Annotated[bool, typer.Option(help="follow it with a progress bar until it ends; exit status below")] =
           False,
           as_json: Annotated[bool, typer.Option("--json", help="print the batch the API created (with --wait: as it "
                                                                "ended) as JSON, alone on stdout")] = False,
           tier: Tier = None, url: Url = None, key: Key = None) -> None:
    """Upload PATH and start a batch whose requests must finish within --window.

    With --wait it exits non-zero unless every request succeeded (the exit status is below)."""
    from typing import get_args

    from app.openai_schemas import EndpointKind, parse_window

    # checked before the upload: a batch the API then refuses would leave the uploaded file behind
    if endpoint not in get_args(EndpointKind):
        raise typer.BadParameter(f"{endpoint!r}: choose {', '.join(get_args(EndpointKind))}", param_hint="--endpoint")
    try:
        parse_window(window)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--window") from None
    _looks_like_jsonl(path)
    api = Api(url, key)
    with asking("the server may make the batch", "`coserve batch list` shows your batches, newest first, and "
                "`coserve files list --purpose batch` the file uploaded for it (`coserve files delete ID` deletes "
                "one no batch was made from)"):
        f = api.call("POST", "/v1/files", files={"file": (path.name, path.read_bytes())},
                     data={"purpose": "batch"}).json()
        try:
            b = api.call("POST", "/v1/batches", json={"input_file_id": f["id"], "endpoint": endpoint,
                                                       "completion_window": window, "tier": tier}).json()
        except typer.Exit as exc:  # refused (``Refused``), or no answer
            if isinstance(exc, Refused) and exc.response.is_client_error:  # no batch: the upload was its own
                _drop_upload(api, f["id"])
            else:  # a 5xx or no answer: the batch may exist, made of the file, so the file stays
                stderr.print(f"the batch may or may not have been made from the file {f['id']}: `coserve batch "
                             f"list` shows your batches; if none was made from it, `coserve files delete {f['id']}` "
                             "deletes the file")
            raise
    if as_json and not wait:
        print_json(b)
        return
    said = stderr if as_json else console  # the id, while the wait goes on
    said.print(f"batch [bold]{b['id']}[/bold] created from {path} ({f['bytes']} bytes), window {window}")
    if wait:
        b = _follow(api, b["id"], warn=True, bar=said)
        if as_json:
            print_json(b)
        else:
            _show_batch(b)  # as `batch status` shows it: its files, and why it failed on stderr
        _end(b)


def _drop_upload(api: Api, file_id: str) -> None:
    """Deletes the file a refused ``batch create`` uploaded; where that fails too, names it and how to delete it."""
    try:
        api.call("DELETE", f"/v1/files/{file_id}")
    except typer.Exit:
        stderr.print(f"the file {file_id} uploaded for the batch is left: `coserve files delete {file_id}` deletes it")
        return
    stderr.print(f"the file {file_id} uploaded for the batch is deleted")


@batch_app.command("status", epilog="With --follow: " + EXIT_CODES_HELP)
def status(batch_id: BatchId,
           follow: Annotated[bool, typer.Option("--follow", "-f", help="poll with a progress bar until it ends; exit "
                                                                    "status below")] =
           False,
           as_json: Annotated[bool, typer.Option("--json", help="print the batch (with --follow: once, as it ended) "
                                                                "as the API's JSON, alone on stdout")] = False,
           url: Url = None, key: Key = None) -> None:
    """Show a batch (request counts, status, files)."""
    api = Api(url, key)
    if follow:
        b = _follow(api, batch_id, bar=stderr if as_json else console)
    else:
        b = api.call("GET", f"/v1/batches/{batch_id}", looked_up=("batch", batch_id)).json()
    if as_json:
        print_json(b)
    else:
        _show_batch(b)
    if follow:  # a script follows a batch as `batch create --wait` does, and learns how it ended the same way
        _end(b)


def _show_batch(b: dict[str, Any]) -> None:
    """A batch as a table with its files below; why it failed (its ``errors``) goes to stderr, as every failure does
    (stdout holds the batch alone)."""
    print_table(console, _batch_table([b]))
    for name in ("output_file_id", "error_file_id"):
        if b.get(name):
            console.print(f"{name}: {b[name]}")
    for err in (b.get("errors") or {}).get("data", []):
        stderr.print(f"[red]{escape(str(err.get('code')))}[/red]: {escape(str(err.get('message')))}")


@batch_app.command("list")
def list_(limit: Annotated[int, typer.Option(min=1, max=BATCHES_PAGE_MAX, help="how many batches to show")] = 20,
          after: Annotated[str | None, typer.Option(help="the page after this batch id (the last one the page "
                                                        "before showed)")] = None,
          as_json: AsJson = False,
          url: Url = None, key: Key = None) -> None:
    """List your batches, newest first."""
    page = Api(url, key).call("GET", "/v1/batches", params={"limit": limit, **({"after": after} if after else {})}
                              ).json()
    if as_json:
        print_json(page)
        return
    if not page["data"]:  # not a table of headers alone
        console.print("no batches" + (f" after {escape(after)}" if after else ""))
        return
    print_table(console, _batch_table(page["data"]))
    if page["has_more"]:
        limit_arg = f"--limit {limit} " if limit != 20 else ""
        console.print(f"more: `coserve batch list {limit_arg}--after {page['last_id']}`")


@batch_app.command("cancel")
def cancel(batch_id: BatchId,
           as_json: Annotated[bool, typer.Option("--json", help="print the batch the API answered (cancelling or "
                                                                "cancelled) as JSON, alone on stdout")] = False,
           url: Url = None, key: Key = None) -> None:
    """Cancel a batch: pending requests are dropped, running ones aborted; finished ones are kept."""
    with asking(f"the server may cancel batch {batch_id}", f"`coserve batch status {batch_id}` shows it"):
        b = Api(url, key).call("POST", f"/v1/batches/{batch_id}/cancel", looked_up=("batch", batch_id)).json()
    if as_json:
        print_json(b)
        return
    console.print(f"batch {batch_id}: {b['status']}")


def _writable(path: Path) -> None:
    """A usage error naming ``path`` where a file cannot be written there (checked before the work, not after)."""
    if path.is_dir():
        raise typer.BadParameter(f"{path} is a folder; give a file name", param_hint="--output")
    if not path.parent.is_dir():
        raise typer.BadParameter(f"{path.parent} does not exist; create it or give another path", param_hint="--output")
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise typer.BadParameter(f"cannot write {path}: permission denied", param_hint="--output")


def _save(path: Path, text: str) -> None:
    """Writes a downloaded file whole or not at all (a temporary file beside it, then renamed: two runs saving to
    the same path leave one's whole file); a path that cannot be written is a usage error naming it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise typer.BadParameter(f"cannot write {path}: {exc.strerror}") from None


@batch_app.command("results")
def results(batch_id: BatchId,
            output: Annotated[Path | None, typer.Option("--output", "-o", help="write the output JSONL here")] = None,
            errors: Annotated[Path | None, typer.Option(help="write the error JSONL (failed requests) here")] = None,
            url: Url = None, key: Key = None) -> None:
    """Download a finished batch's output (and error) file; prints the output when no --output."""
    api = Api(url, key)
    b = api.call("GET", f"/v1/batches/{batch_id}", looked_up=("batch", batch_id)).json()
    if b["status"] not in BATCH_DONE:  # stderr: `batch results ID > out.jsonl` would have held this line
        stderr.print(f"batch {batch_id} is {b['status']}; results come when it ends (`coserve batch status "
                     f"{batch_id} -f`)")
        raise typer.Exit(1)
    if b.get("output_file_id"):
        text = api.call("GET", f"/v1/files/{b['output_file_id']}/content").text
        if output:
            _save(output, text)
            console.print(f"{len(text.splitlines())} results -> {output}")
        else:
            typer.echo(text, nl=False)
    if b.get("error_file_id"):
        text = api.call("GET", f"/v1/files/{b['error_file_id']}/content").text
        if errors:
            _save(errors, text)
        # stderr: `batch results ID > out.jsonl` keeps its file JSONL
        stderr.print(f"[yellow]{len(text.splitlines())} failed requests[/yellow]"
                      + (f" -> {errors}" if errors else " (use --errors FILE to save them)"))


def summarize(ctx: typer.Context,
              paths: Annotated[list[Path], typer.Argument(help="txt/md files, folders of them, or JSONL of "
                                                                '{"id","text"}')] = None,
              deadline: Annotated[str, typer.Option("--deadline", "-d", help="finish within: 30m, 2h, 1d")] = "2h",
              output: Annotated[Path, typer.Option("--output", "-o", help="results JSONL")] = Path("summaries.jsonl"),
              specbench: Annotated[bool, typer.Option(help="summarize SpecBench's 80 summarization prompts")] = False,
              limit: Annotated[int | None, typer.Option(min=1, help="only the first N documents (with --list: "
                                                                    "the runs a page shows)")] = None,
              max_summary_tokens: Annotated[int, typer.Option(help="tokens per summary")] = 128,
              chunk_tokens: Annotated[int, typer.Option(help="largest chunk of text per job")] = 1024,
              overlap_tokens: Annotated[int, typer.Option(help="tokens shared by neighbouring chunks")] = 64,
              model: Annotated[str | None, typer.Option(help="the server's model (default) or one of its LoRA "
                                                             "adapters")] = None,
              run_id: Annotated[str | None, typer.Option("--run", help="follow a run started before (its id, "
                                                                       "sum_...) and save its results",
                                                         callback=in_path)] = None,
              cancel_id: Annotated[str | None, typer.Option(
                  "--cancel", help="cancel a run (its id): the documents not done fail, its summaries stay",
                  callback=in_path)] = None,
              list_runs: Annotated[bool, typer.Option(
                  "--list", help=f"list your runs, newest first (--limit of them, at most {RUNS_PAGE_MAX}; 20 unless "
                                 "given)")] = False,
              after: Annotated[str | None, typer.Option(help="with --list: the page after this run id (the last one "
                                                            "the page before showed)")] = None,
              as_json: Annotated[bool, typer.Option("--json", help="print the run as the API answered it, alone on "
                                                                   "stdout: as it ended (the results still go to "
                                                                   "--output), as --cancel left it, or --list's page "
                                                                   "instead of a table")] = False,
              tier: Tier = None, url: Url = None, key: Key = None) -> None:
    """Summarize long documents map-reduce as deadline batch jobs; writes one JSON line per document.

    The run goes on on the server if this command stops: `--run ID` follows it again and saves its results, and
    `--list` shows your runs (ids, status, progress). Exits 1 if a document failed or the run ended after the deadline.
    """
    if list_runs or after is not None:
        if not list_runs:
            raise typer.BadParameter("--after goes with --list", param_hint="--list")
        _only(ctx, "--list", "shows your runs", {"list_runs", "limit", "after"})
        if limit is not None and limit > RUNS_PAGE_MAX:
            raise typer.BadParameter(f"{limit}: a page holds at most {RUNS_PAGE_MAX} runs; --after pages on",
                                     param_hint="--limit")
        _list_runs(Api(url, key), limit or LIST_DEFAULT, after, as_json)
        return
    if cancel_id:
        _only(ctx, "--cancel", "stops a run", {"cancel_id"})
    elif run_id:
        _only(ctx, "--run", "follows a run started before and saves its results", {"run_id", "output"})
    api = Api(url, key)
    # with --json stdout holds the run alone: the id, the progress bar and what was saved where go to stderr
    said = stderr if as_json else console
    if cancel_id:
        with asking(f"the server may cancel run {cancel_id}", "`coserve summarize --list` shows its status"):
            run = api.call("POST", f"/v1/summarize/{cancel_id}/cancel", timeout=LONG_TIMEOUT_S,
                           looked_up=("summarization run", cancel_id)).json()
        if as_json:
            print_json(run)
            return
        console.print(f"summarization {cancel_id}: {run['status']} ({run['documents_done'] - run['documents_failed']}"
                      f"/{run['documents']} documents summarized; `coserve summarize --run {cancel_id}` saves them)")
        return
    _writable(output)
    if run_id:
        run = api.call("GET", f"/v1/summarize/{run_id}", looked_up=("summarization run", run_id)).json()
    else:
        run = _start_run(api, paths, specbench, limit, output, {
            "deadline": deadline, "max_summary_tokens": max_summary_tokens, "chunk_tokens": chunk_tokens,
            "overlap_tokens": overlap_tokens, "tier": tier, "model": model}, said)
    t0, started_at, deadline_at = time.monotonic(), datetime.now(UTC), datetime.fromisoformat(run["deadline_at"])
    try:
        run = _follow_run(api, run, deadline_at, said)
    except KeyboardInterrupt:
        raise stopped_waiting(f"summarization {run['id']}", f"coserve summarize --run {run['id']} -o {output}",
                              f"coserve summarize --cancel {run['id']}") from None
    # judged when the run ended (its last poll), not after the results download
    finished_at, elapsed = datetime.now(UTC), time.monotonic() - t0
    _save(output, api.call("GET", f"/v1/summarize/{run['id']}/results", patient=True).text)
    said.print(f"{run['documents_done'] - run['documents_failed']}/{run['documents']} documents summarized "
               f"({run['jobs_done']} jobs) -> {output}")
    spare_s = (deadline_at - finished_at).total_seconds()
    met = spare_s >= 0
    if not run_id:  # a run followed again began before this command: its wall time is not this command's
        said.print(f"wall time {elapsed:.1f}s vs deadline {(deadline_at - started_at).total_seconds():.0f}s "
                   f"({deadline}): {run_ending(run, spare_s)}")
    elif not met and run["status"] == "completed":
        stderr.print(f"[red]the run ended after its deadline[/red] (by {-spare_s:.1f}s at the latest)")
    if note := what_failed(run, output):  # to stderr, as every failure (stdout says what was saved where)
        stderr.print(note)
    if as_json:  # once, as it ended (as `batch create --wait --json`); the exit status says how
        print_json(run)
    if run["documents_failed"] or not met:
        raise typer.Exit(1)


def what_failed(run: dict[str, Any], output: Path) -> str | None:
    """What a followed run's end says went wrong (None: nothing): a run cancelled or failed as a whole says why (its
    ``reason``: its documents' errors in ``output`` only point to it), else where its failed documents' errors are."""
    why = escape(f" ({run['reason']})") if run.get("reason") else ""  # an older server names none
    if run["status"] in ("cancelled", "cancelling"):  # cancelling: its jobs are still being stopped
        return f"[yellow]the run was cancelled{why}; {run['documents_failed']} documents were not summarized[/yellow]"
    if run["status"] == "failed" and why:
        return f"[red]the run failed{why}[/red]; {run['documents_failed']} documents were not summarized"
    if run["documents_failed"]:
        return f"[yellow]{run['documents_failed']} documents failed; see 'error' in {escape(str(output))}[/yellow]"
    return None


LIST_DEFAULT = 20  # GET /v1/summarize's default page


def _only(ctx: typer.Context, mode: str, does: str, applying: set[str]) -> None:
    """A usage error naming what the operator gave beside ``mode`` (`--cancel ID`, `--run ID`, `--list`) that it
    would not use: a run cut to --limit documents, a --deadline moved, results saved to -o, as the operator thinks."""
    if extra := given_beside(ctx, applying | {"as_json", "url", "key"}):
        named = ", ".join("documents" if p.param_type_name == "argument" else max(p.opts, key=len) for p in extra)
        verb = "does" if len(extra) == 1 else "do"
        raise typer.BadParameter(f"{mode} {does}: give no {named} with it ({verb} not apply)", param_hint=mode)


def _list_runs(api: Api, limit: int, after: str | None, as_json: bool) -> None:
    """One page of the tenant's runs, newest first, as ``GET /v1/summarize`` answers it (a table, or its JSON)."""
    page = api.call("GET", "/v1/summarize",
                    params={k: v for k, v in {"limit": limit, "after": after}.items() if v}).json()
    if as_json:
        print_json(page)
        return
    runs = page["data"]
    if not runs:  # not a table of headers alone
        console.print("no summarization runs" + (f" after {escape(after)}" if after else ""))
        return
    table = list_table(kept("run", (r["id"] for r in runs)), kept("status", (r["status"] for r in runs)),
                       other("documents done / failed / total", justify="right"),
                       other("jobs done / submitted", justify="right"), date("deadline"), other("model"))
    for r in runs:
        table.add_row(r["id"], r["status"], f"{r['documents_done']} / {r['documents_failed']} / {r['documents']}",
                      f"{r['jobs_done']} / {r['jobs_submitted']}", when(r["deadline_at"]), escape(r["model"] or "-"))
    print_table(console, table)
    if page["has_more"]:
        limit_arg = f"--limit {limit} " if limit != LIST_DEFAULT else ""
        console.print(f"more: `coserve summarize --list {limit_arg}--after {page['last_id']}`")


def run_ending(run: dict[str, Any], spare_s: float) -> str:
    """How a followed run ended, as its last line says it: cancelled, failed, after or before its deadline (a run
    cancelled or failed within its deadline had been said to end "before the deadline")."""
    why = f" ({escape(run['reason'])})" if run.get("reason") else ""  # an older server names none
    if run["status"] in ("cancelled", "cancelling"):  # cancelling: its jobs are still being stopped
        return f"[yellow]cancelled[/yellow]{why}"
    if run["status"] == "failed":
        return f"[red]failed[/red]{why}"
    if spare_s < 0:
        return f"[red]AFTER the deadline[/red] (late by {-spare_s:.1f}s)"
    return f"[green]before the deadline[/green] ({spare_s:.1f}s to spare)"


def _start_run(api: Api, paths: list[Path] | None, specbench: bool, limit: int | None, output: Path,
               options: dict[str, Any], said: Console = console) -> dict[str, Any]:
    """Reads the documents, starts the run and says its id (to follow it again, or cancel it) on ``said``."""
    from app.cli.service_cmds import warn_without_workers
    from app.summarize.documents import load_paths, specbench_summarization

    from app.openai_schemas import parse_window

    if specbench and paths:
        raise typer.BadParameter("--specbench summarizes SpecBench's prompts: give no PATHS with it")
    try:  # checked before the documents are read and sent, as the API checks it
        parse_window(options["deadline"])
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--deadline") from None
    try:
        docs = specbench_summarization() if specbench else load_paths(list(paths or []), skip=[output])
    except FileNotFoundError as exc:
        raise typer.BadParameter(f"no such file or folder: {exc.filename or exc}", param_hint="PATHS") from None
    except ValueError as exc:  # a bad JSONL line, ids given twice, a file that is not UTF-8 or holds no text
        raise typer.BadParameter(str(exc), param_hint="PATHS") from None
    docs = docs[:limit] if limit else docs
    if not docs:
        raise typer.BadParameter("no documents: give files/folders/JSONL or --specbench")
    with asking("the server may start the run", "`coserve summarize --list` lists your runs, newest first, "
                "`coserve summarize --run ID` follows one and `coserve summarize --cancel ID` stops it"):
        warn_without_workers(api.url)
        run = api.call("POST", "/v1/summarize", json={
            "documents": [{"id": d.id, "text": d.text} for d in docs], **options}, timeout=LONG_TIMEOUT_S).json()
    said.print(f"summarization [bold]{run['id']}[/bold]: {len(docs)} documents (`coserve summarize --run "
               f"{run['id']}` follows it again, `--cancel {run['id']}` stops it)")
    return run


def _left(seconds: float) -> str:
    """Time to the deadline: 2d03h, 4h05m, 3m07s; or passed."""
    if seconds <= 0:
        return "passed"
    s = int(seconds)
    if s >= 86400:
        return f"in {s // 86400}d{s % 86400 // 3600:02d}h"
    if s >= 3600:
        return f"in {s // 3600}h{s % 3600 // 60:02d}m"
    return f"in {s // 60}m{s % 60:02d}s"


def _follow_run(api: Api, run: dict[str, Any], deadline_at: datetime, shown: Console = console) -> dict[str, Any]:
    """Polls the run with a progress bar (drawn on ``shown``) until it ends."""
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("jobs {task.fields[jobs]}"), TimeElapsedColumn(),
                  TextColumn("deadline {task.fields[left]}"), console=bar_on(shown)) as bar:
        task = bar.add_task("documents", total=run["documents"], jobs="0/0", left="-")
        while True:
            run = api.call("GET", f"/v1/summarize/{run['id']}", patient=True).json()
            bar.update(task, completed=run["documents_done"], jobs=f"{run['jobs_done']}/{run['jobs_submitted']}",
                       left=_left((deadline_at - datetime.now(UTC)).total_seconds()))
            if run["status"] not in ("validating", "running"):
                return run
            time.sleep(1.0)


def register(cli: typer.Typer) -> None:
    cli.add_typer(batch_app, name="batch")
    cli.command("summarize")(summarize)
