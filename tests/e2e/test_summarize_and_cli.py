"""`coserve summarize` and `coserve batch` against the real app, Redis, Celery worker and DB."""

from __future__ import annotations

import json

import httpx
import pytest
from sqlalchemy import select
from typer.testing import CliRunner

from app.cli import cli
from app.db.models import Job
from app.db.session import session_scope
from app.summarize.documents import specbench_summarization
from tests.conftest import Keys

pytestmark = [pytest.mark.e2e, pytest.mark.integration]


@pytest.mark.writes_text
def test_summarize_cli_map_reduce(live_server, keys, settings, start_worker, tmp_path):
    start_worker("w1")
    long_doc = specbench_summarization(limit=1)[0]
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"id": "long", "text": long_doc.text}) + "\n"
                    + json.dumps({"id": "short", "text": "The cat sat on the mat. It was warm."}) + "\n")
    out = tmp_path / "out.jsonl"
    result = CliRunner().invoke(cli, ["summarize", str(docs), "--deadline", "30m", "-o", str(out),
                                      "--chunk-tokens", "160", "--overlap-tokens", "16",
                                      "--max-summary-tokens", "12", "--url", live_server, "--key", keys.paid])
    assert result.exit_code == 0, result.output
    assert "2/2 documents summarized" in result.output and "before the deadline" in result.output
    rows = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert rows["short"]["chunks"] == 1 and rows["short"]["jobs"] == 1 and rows["short"]["error"] is None
    assert rows["short"]["summary"].strip(), rows["short"]
    assert rows["long"]["chunks"] >= 3 and rows["long"]["levels"] >= 2
    assert rows["long"]["jobs"] > rows["long"]["chunks"] and rows["long"]["summary"].strip(), rows["long"]
    with session_scope(settings.sqlalchemy_url) as s:
        jobs = list(s.scalars(select(Job).where(Job.endpoint == "/v1/summarize")))
        assert len(jobs) == rows["long"]["jobs"] + 1
        assert {j.kind for j in jobs} == {"batch"} and all(j.deadline_at is not None for j in jobs)
        assert {j.status for j in jobs} == {"succeeded"}
        assert {j.app_id for j in jobs} == {"summarize-map", "summarize-final"}


@pytest.mark.writes_text
def test_summarize_cli_fails_when_late(live_server, keys, start_worker, tmp_path):
    # 0.4 s per engine step: a 12-token summary cannot be done within a 2 s deadline
    start_worker("w1", COSERVE_ENGINE_FACTORY="tests.e2e.slow_engine:build", COSERVE_STEP_DELAY_S="0.4")
    doc = tmp_path / "doc.txt"
    doc.write_text("The cat sat on the mat. It was warm.")
    out = tmp_path / "out.jsonl"
    result = CliRunner().invoke(cli, ["summarize", str(doc), "--deadline", "2s", "-o", str(out),
                                      "--max-summary-tokens", "12", "--tier", "free",
                                      "--url", live_server, "--key", keys.paid])
    assert result.exit_code == 1, result.output
    assert "1/1 documents summarized" in result.output and "AFTER the deadline" in result.output
    assert "wall time" in result.output and "vs deadline 2s" in result.output
    assert json.loads(out.read_text())["summary"].strip()  # late, but the results are written


def test_summarize_api_validation(live_server, keys):
    h = Keys.header(keys.paid)
    r = httpx.post(f"{live_server}/v1/summarize", headers=h, json={"documents": [{"id": "a", "text": "x"}] * 2})
    assert r.status_code == 422 and "unique" in r.text
    r = httpx.post(f"{live_server}/v1/summarize", headers=h,
                   json={"documents": [{"id": "a", "text": "x"}], "deadline": "soon"})
    assert r.status_code == 422 and "window" in r.text
    assert httpx.get(f"{live_server}/v1/summarize/sum_nope", headers=h).status_code == 404


def test_cancel_cli_stops_a_job_and_says_when_one_had_ended(live_server, keys):
    auth = ["--url", live_server, "--key", keys.paid]
    job_id = httpx.post(f"{live_server}/v1/jobs", headers=Keys.header(keys.paid),
                        json={"prompt": "Hello", "max_tokens": 4}).json()["id"]  # no worker: it waits
    r = CliRunner().invoke(cli, ["cancel", job_id, *auth])
    assert r.exit_code == 0 and "cancelled" in r.output and "already ended" not in r.output, r.output
    assert httpx.get(f"{live_server}/v1/jobs/{job_id}", headers=Keys.header(keys.paid)).json()["status"] == "cancelled"
    r = CliRunner().invoke(cli, ["cancel", job_id, "--json", *auth])
    assert r.exit_code == 0 and json.loads(r.output)["status"] == "cancelled"
    # a job already cancelled showed again as if this cancel had stopped it
    r = CliRunner().invoke(cli, ["cancel", job_id, *auth])
    assert r.exit_code == 0 and f"{job_id} had already ended (cancelled): nothing to cancel" in r.stdout, r.output
    r = CliRunner().invoke(cli, ["cancel", "job_nope", *auth])
    assert r.exit_code != 0 and "404" in r.output


def test_cancel_cli_reports_the_cancels_own_answer_when_another_client_cancelled_first(live_server, keys,
                                                                                        monkeypatch):
    """`coserve cancel` read the job first and took the cancel's answer (the job, cancelled) as its own: a job
    another client cancelled between that read and this cancel was reported as cancelled by this command."""
    from app.cli import service_cmds

    auth = ["--url", live_server, "--key", keys.paid]
    h = Keys.header(keys.paid)
    job_id = httpx.post(f"{live_server}/v1/jobs", headers=h, json={"prompt": "Hello", "max_tokens": 4}).json()["id"]
    request = service_cmds._request

    def another_client_cancels_first(method: str, url: str, key: str, path: str, *args, **kw):
        if method == "POST" and path.endswith("/cancel"):
            assert httpx.post(url + path, headers=h).status_code == 200
        return request(method, url, key, path, *args, **kw)

    monkeypatch.setattr(service_cmds, "_request", another_client_cancels_first)
    r = CliRunner().invoke(cli, ["cancel", job_id, *auth])
    assert r.exit_code == 0 and f"{job_id} had already ended (cancelled): nothing to cancel" in r.stdout, r.output
    r = CliRunner().invoke(cli, ["cancel", job_id, "--json", *auth])
    assert r.exit_code == 0 and json.loads(r.stdout)["cancelled"] is False, r.output


def test_waiting_commands_exit_1_when_the_job_or_batch_did_not_succeed(live_server, keys, tmp_path):
    """A script's `coserve submit --wait && next` stops at a job that ended otherwise (no worker here: the job waits
    until another client cancels it); `batch create --wait` likewise at a batch that failed, or that completed with
    every request failed."""
    import threading

    auth = ["--url", live_server, "--key", keys.paid]
    h = Keys.header(keys.paid)

    def cancel_what_waits() -> None:
        for job in httpx.get(f"{live_server}/v1/jobs", headers=h, params={"status": "dispatched"}).json()["data"]:
            httpx.post(f"{live_server}/v1/jobs/{job['id']}/cancel", headers=h)

    timer = threading.Timer(2.0, cancel_what_waits)
    timer.start()
    r = CliRunner().invoke(cli, ["submit", "Hello", "--max-tokens", "4", "--wait", *auth])
    timer.join()
    assert r.exit_code == 1 and f"job {r.stdout.split('submitted ')[1].split()[0]} cancelled" in r.stderr, r.output
    src = tmp_path / "twice.jsonl"  # the same custom_id twice fails the whole batch
    src.write_text("\n".join(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                                         "body": {"model": "tiny", "prompt": "x", "max_tokens": 1}}) for _ in range(2)))
    r = CliRunner().invoke(cli, ["batch", "create", str(src), "--endpoint", "/v1/completions", "--wait", *auth])
    assert r.exit_code == 1 and "failed" in r.output, r.output
    # a batch that completed with every request failed (here every line is bad) has nothing to use: it exited 0
    # (a first line that is not JSON is refused before the upload: the bad JSON comes second)
    src.write_text(json.dumps({"custom_id": "b", "method": "POST", "url": "/v1/chat/completions",
                               "body": {"model": "tiny", "prompt": "x"}}) + "\n{oops\n")
    r = CliRunner().invoke(cli, ["batch", "create", str(src), "--endpoint", "/v1/completions", "--wait", *auth])
    batch_id = r.output.split("batch ")[1].split()[0]
    # what went wrong goes to stderr: stdout holds the batch's table alone
    assert r.exit_code == 1 and "2 of 2 requests failed" in _flat(r.stderr), (r.stdout, r.stderr)
    assert "requests failed" not in r.stdout, r.stdout
    b = httpx.get(f"{live_server}/v1/batches/{batch_id}", headers=h).json()
    assert b["status"] == "completed" and b["request_counts"] == {"total": 2, "completed": 0, "failed": 2}
    r = CliRunner().invoke(cli, ["batch", "results", batch_id, *auth])  # `> out.jsonl`: stdout holds JSONL only
    assert r.exit_code == 0 and "2 failed requests" in r.stderr, (r.stdout, r.stderr)
    assert all(json.loads(line) for line in r.stdout.splitlines()), r.stdout
    r = CliRunner().invoke(cli, ["batch", "status", batch_id, "--follow", *auth])  # following it ends the same way
    assert r.exit_code == 1, r.output
    r = CliRunner().invoke(cli, ["batch", "status", batch_id, *auth])  # a look is no wait: it says, and exits 0
    assert r.exit_code == 0, r.output


def test_a_followed_batchs_progress_bar_stays_off_stdout_that_is_not_a_terminal(live_server, keys, tmp_path):
    """Off a terminal rich prints a bar's last frame once it stops: `batch create --wait > out.txt` (or `batch status
    -f | ...`) held a line of bar characters above the batch's table. The bar goes to stderr there (every line of a
    bad request fails at validation here: the batch ends with no worker)."""
    auth = ["--url", live_server, "--key", keys.paid]
    src = tmp_path / "bad.jsonl"
    src.write_text(json.dumps({"custom_id": "b", "method": "POST", "url": "/v1/chat/completions",
                               "body": {"model": "tiny", "prompt": "x"}}) + "\n")
    created = CliRunner().invoke(cli, ["batch", "create", str(src), "--wait", *auth])
    batch_id = created.stdout.split("batch ")[1].split()[0]
    followed = CliRunner().invoke(cli, ["batch", "status", batch_id, "--follow", *auth])
    for r in (created, followed):
        assert r.exit_code == 1 and f"{batch_id}  completed" in r.stdout, r.output  # its table, on stdout
        assert "━" not in r.stdout and f"{batch_id} [completed]" not in r.stdout, r.stdout
        assert f"{batch_id} [completed]" in r.stderr, r.stderr  # the bar's last frame


def test_batch_cli_round_trip(live_server, keys, start_worker, tmp_path):
    start_worker("w1")
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                                         "body": {"model": "tiny", "prompt": f"Number {i}", "max_tokens": 3,
                                                  "ignore_eos": True}}) for i in range(3)) + "\n{oops\n")
    run = CliRunner()
    auth = ["--url", live_server, "--key", keys.paid]
    r = run.invoke(cli, ["batch", "create", str(src), "--endpoint", "/v1/completions", "-w", "2h", "--wait", *auth])
    assert r.exit_code == 3, r.output  # completed, some requests failed: a script tells it from all succeeded (0)
    batch_id = r.output.split("batch ")[1].split()[0]
    # the line that failed is not only a count in the table: the command says where its reason is
    assert f"1 of 4 requests failed: `coserve batch results {batch_id} --errors FILE` saves why" in _flat(r.stderr)
    assert "requests failed" not in r.stdout, r.stdout
    b = httpx.get(f"{live_server}/v1/batches/{batch_id}", headers=Keys.header(keys.paid)).json()
    assert b["status"] == "completed" and b["request_counts"] == {"total": 4, "completed": 3, "failed": 1}
    r = run.invoke(cli, ["batch", "list", *auth])
    assert r.exit_code == 0 and batch_id[:10] in r.output
    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    r = run.invoke(cli, ["batch", "results", batch_id, "-o", str(out), "--errors", str(err), *auth])
    assert r.exit_code == 0, r.output
    assert sorted(json.loads(t)["custom_id"] for t in out.read_text().splitlines()) == ["r0", "r1", "r2"]
    assert json.loads(err.read_text())["id"] == "batch_req_line_4"
    r = run.invoke(cli, ["batch", "cancel", batch_id, *auth])
    assert r.exit_code == 1 and "409" in r.output


def _flat(output: str) -> str:
    """The CLI's words as one line: rich wraps them, in an error's box too."""
    return " ".join(output.replace("\u2502", " ").split())


def test_a_summarize_run_is_named_followed_again_and_cancelled_from_the_cli(live_server, keys, tmp_path, monkeypatch):
    """No worker runs here: the CLI says so, names the run, and a run it stopped following can be followed again
    (`--run`) or cancelled (`--cancel`); bad options are refused before a run starts."""
    from app.cli import batch_cmds

    auth = ["--url", live_server, "--key", keys.paid]
    doc = tmp_path / "doc.txt"
    doc.write_text("The cat sat on the mat. It was warm.")
    out = tmp_path / "out.jsonl"

    def interrupted(*_args):
        raise KeyboardInterrupt  # Ctrl-C while the run is followed

    with monkeypatch.context() as m:
        m.setattr(batch_cmds, "_follow_run", interrupted)
        r = CliRunner().invoke(cli, ["summarize", str(doc), "-o", str(out), *auth])
    said = _flat(r.output)
    assert r.exit_code == 130 and "no live worker" in said, r.output
    run_id = said.split("summarization ", 1)[1].split(":", 1)[0]
    assert f"coserve summarize --run {run_id} -o " in said and f"--cancel {run_id}" in said  # (rich may cut the path)
    r = CliRunner().invoke(cli, ["summarize", "--cancel", run_id, *auth])
    assert r.exit_code == 0 and f"summarization {run_id}: cancelled" in _flat(r.output), r.output
    r = CliRunner().invoke(cli, ["summarize", "--run", run_id, "-o", str(out), *auth])
    assert r.exit_code == 1 and "the run was cancelled" in _flat(r.stderr), (r.stdout, r.stderr)
    assert "the run was cancelled" not in r.stdout, r.stdout
    assert json.loads(out.read_text())["error"] == "cancelled with its summarization run"
    # refused before any run starts: an output that cannot be written, SpecBench beside paths, a limit of 0
    for bad, says in ((["-o", str(tmp_path / "no" / "out.jsonl")], "does not exist"),
                      (["-o", str(tmp_path)], "is a folder"), (["--specbench"], "give no PATHS"),
                      (["--limit", "0"], "greater than or equal to 1")):
        r = CliRunner().invoke(cli, ["summarize", str(doc), *bad, *auth])
        said = _flat(r.output)
        assert r.exit_code == 2 and says in said and "summarization sum_" not in said, (bad, r.output)
    r = httpx.post(f"{live_server}/v1/summarize", headers=Keys.header(keys.paid),
                   json={"documents": [{"id": "a", "text": " \n\t "}]})
    assert r.status_code == 422 and "only whitespace" in r.text


def test_summarize_cli_says_a_run_cancelled_before_its_deadline_was_cancelled(live_server, keys, settings, tmp_path):
    """A run cancelled while the CLI followed it was said to have ended "before the deadline"; no worker runs its
    jobs here, and another client cancels it once it runs."""
    import threading

    from tests.conftest import wait_for

    doc = tmp_path / "doc.txt"
    doc.write_text("The cat sat on the mat. It was warm.")
    auth = Keys.header(keys.paid)

    def cancel_once_running() -> None:
        def running_id():
            runs = httpx.get(f"{live_server}/v1/summarize", headers=auth).json()["data"]
            return runs and runs[0]["status"] == "running" and runs[0]["id"]

        run_id = wait_for(running_id, 60, "the run to start")
        assert httpx.post(f"{live_server}/v1/summarize/{run_id}/cancel", headers=auth).status_code == 200

    canceller = threading.Thread(target=cancel_once_running)
    canceller.start()
    result = CliRunner().invoke(cli, ["summarize", str(doc), "--deadline", "30m", "-o", str(tmp_path / "out.jsonl"),
                                      "--url", live_server, "--key", keys.paid])
    canceller.join(60)
    said = " ".join(result.output.split())
    assert result.exit_code == 1, result.output
    assert "vs deadline 1800s (30m): cancelled (cancelled by request)" in said, result.output
    assert "before the deadline" not in said and "the run was cancelled" in _flat(result.stderr), result.output


def _interrupted(args: list[str], tmp_path) -> tuple[int, str]:
    """Runs ``coserve ARGS`` (``python -m app.cli``, a process of its own as in a terminal) until it says it waits (the
    no-worker warning, printed once the wait began), then presses Ctrl-C (SIGINT); its exit status and all it said."""
    code, out, err = _interrupted_apart(args, tmp_path)
    return code, out + err


def _interrupted_apart(args: list[str], tmp_path) -> tuple[int, str, str]:
    """``_interrupted`` with stdout and stderr apart: the exit status, what went to stdout and to stderr."""
    import os
    import signal
    import subprocess
    import sys

    from tests.conftest import ROOT

    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL" and not k.startswith("COSERVE_")}
    env.update(COSERVE_DATA_DIR=str(tmp_path), PYTHONPATH=str(ROOT), COLUMNS="250")
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", *args], env=env, cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    said = []
    try:
        for line in proc.stderr:  # the warning goes to stderr
            said.append(line)
            if line.startswith("warning:"):
                proc.send_signal(signal.SIGINT)
                break
        out, err = proc.communicate(timeout=30)
        return proc.returncode, out, "".join(said) + err
    finally:
        proc.kill()


def test_ctrl_c_while_waiting_stops_the_wait_and_says_how_to_find_the_work_again(live_server, keys, tmp_path):
    """No worker here: the job and the batch wait in the queue until Ctrl-C. The command stops with 130 and a line
    naming the work and the commands that show and cancel it; the work itself goes on."""
    auth = ["--url", live_server, "--key", keys.paid]
    h = Keys.header(keys.paid)
    code, said = _interrupted(["submit", "Hello", "--max-tokens", "4", "--wait", *auth], tmp_path)
    job_id = said.split("submitted ")[1].split()[0]
    assert code == 130 and "Traceback" not in said and "Aborted" not in said, said
    assert f"job {job_id} goes on on the server: `coserve status {job_id}` shows it, `coserve cancel {job_id}`" \
        in said, said
    assert httpx.get(f"{live_server}/v1/jobs/{job_id}", headers=h).json()["status"] in ("queued", "dispatched")
    src = tmp_path / "one.jsonl"
    src.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                               "body": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}}) + "\n")
    code, said = _interrupted(["batch", "create", str(src), "--wait", *auth], tmp_path)
    batch_id = said.split("batch ")[1].split()[0]
    assert code == 130 and "Traceback" not in said and "Aborted" not in said, said
    assert f"`coserve batch status {batch_id} --follow` shows it, `coserve batch cancel {batch_id}` stops it" in said
    assert httpx.get(f"{live_server}/v1/batches/{batch_id}", headers=h).json()["status"] not in ("cancelled",
                                                                                                   "cancelling")


def test_ctrl_c_while_summarize_starts_or_follows_its_run_exits_130_saying_how_to_find_it(live_server, keys,
                                                                                           tmp_path):
    """Ctrl-C pressed as summarize begins to wait (no worker here): during its start (a POST of many documents, where
    it lands here) it exited 130 without a word of the run the server may start anyway; during its wait, its message
    went to stdout. Either way now: 130, and on stderr how to find the run again and cancel it."""
    h = Keys.header(keys.paid)
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"id": f"d{i}", "text": "The cat sat on the mat. " * 40}) + "\n"
                            for i in range(2000)))
    try:
        code, out, err = _interrupted_apart(["summarize", str(docs), "-o", str(tmp_path / "out.jsonl"), "--url",
                                             live_server, "--key", keys.paid], tmp_path)
        said = _flat(err)
        assert code == 130 and "Traceback" not in out + err and "Aborted" not in out + err, (out, err)
        assert "stopped waiting" not in out and "coserve summarize --cancel " in said, (out, err)
        assert "coserve summarize --run " in said, (out, err)
    finally:  # the run it may have started has no worker: stop it, its jobs would wait for the next test's
        for run in httpx.get(f"{live_server}/v1/summarize", headers=h).json()["data"]:
            if run["status"] in ("validating", "running"):
                httpx.post(f"{live_server}/v1/summarize/{run['id']}/cancel", headers=h, timeout=600)


def test_an_api_error_goes_to_stderr_and_leaves_stdout_to_the_json(live_server, keys):
    auth = ["--url", live_server, "--key", keys.paid]
    for args in (["status", "job_nope", "--json"], ["cancel", "job_nope", "--json"], ["batch", "status", "batch_nope"]):
        r = CliRunner().invoke(cli, [*args, *auth])
        assert r.exit_code == 1 and r.stdout == "" and r.stderr.startswith("404 "), (args, r.stdout, r.stderr)
    r = CliRunner().invoke(cli, ["jobs", "--kind", "bogus", "--json", *auth])
    assert r.exit_code == 1 and r.stdout == "" and r.stderr.startswith("422 kind: "), (r.stdout, r.stderr)
    # an id is one path segment: "../batches" asked for the batch list and read it as a job (KeyError: 'id')
    for args in (["status", "../batches"], ["cancel", "../batches"], ["batch", "status", "../jobs"],
                 ["summarize", "--run", "../jobs"], ["status", "job_x?limit=1"]):
        r = CliRunner().invoke(cli, [*args, *auth])
        assert r.exit_code == 1 and isinstance(r.exception, SystemExit), (args, r.exception, r.output)
        assert r.stderr.startswith("404 ") and r.stdout == "", (args, r.stdout, r.stderr)
    # the 404 names the id looked for: one with a "/" (which the server reads as a path's) answered "404 Not Found",
    # and "." or ".." left the URL altogether ("." asked for the job list and read it as a job)
    for args, named in ((["status", "../jobs"], "no job '../jobs'"), (["cancel", "a/b"], "no job 'a/b'"),
                        (["status", "."], "no job '.'"), (["status", ".."], "no job '..'"),
                        (["batch", "status", "../jobs"], "no batch '../jobs'"),
                        (["batch", "results", ".."], "No such Batch object: .."),
                        (["summarize", "--run", "../jobs"], "no summarization run '../jobs'"),
                        (["summarize", "--cancel", "a/b"], "no summarization run 'a/b'")):
        r = CliRunner().invoke(cli, [*args, *auth])
        assert r.exit_code == 1 and r.stdout == "" and r.stderr == f"404 {named}\n", (args, r.stdout, r.stderr)


def test_lines_written_to_a_pipe_or_file_are_not_wrapped(live_server, keys, tmp_path, monkeypatch):
    """Off a terminal rich wrapped stdout at 80 columns: `batch create`'s "created from PATH (N bytes)" and
    summarize's start line broke mid-sentence, so a script's grep for the line, or a log that kept it, lost it."""
    from app.cli import batch_cmds

    auth = ["--url", live_server, "--key", keys.paid]
    folder = tmp_path / "a folder whose name makes the line longer than eighty columns"
    folder.mkdir()
    src = folder / "requests.jsonl"
    src.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                               "body": {"prompt": "x", "max_tokens": 1}}) + "\n")
    r = CliRunner().invoke(cli, ["batch", "create", str(src), "--endpoint", "/v1/completions", *auth])
    assert r.exit_code == 0, r.output
    batch_id = r.stdout.split()[1]
    try:
        line = f"batch {batch_id} created from {src} ({src.stat().st_size} bytes), window 24h"
        assert line in r.stdout.splitlines(), r.stdout
    finally:
        httpx.post(f"{live_server}/v1/batches/{batch_id}/cancel", headers=Keys.header(keys.paid))

    def interrupted(*_args):
        raise KeyboardInterrupt  # the start line is out: no need to follow the run (no worker here)

    doc = tmp_path / "doc.txt"
    doc.write_text("The cat sat on the mat. It was warm.")
    with monkeypatch.context() as m:
        m.setattr(batch_cmds, "_follow_run", interrupted)
        r = CliRunner().invoke(cli, ["summarize", str(doc), "-o", str(tmp_path / "out.jsonl"), *auth])
    run_id = r.stdout.split("summarization ", 1)[1].split(":", 1)[0]
    try:
        line = (f"summarization {run_id}: 1 documents (`coserve summarize --run {run_id}` follows it again, "
                f"`--cancel {run_id}` stops it)")
        assert r.exit_code == 130 and line in r.stdout.splitlines(), r.output
    finally:
        httpx.post(f"{live_server}/v1/summarize/{run_id}/cancel", headers=Keys.header(keys.paid))


def test_summarize_list_pages_the_runs_newest_first_as_a_table_or_json(live_server, keys, tmp_path):
    """A user who stopped following a run (Ctrl-C during its start: no id printed yet) finds it with
    `coserve summarize --list`, paged as GET /v1/summarize is; --json is the API's page and nothing else."""
    h = Keys.header(keys.paid)
    auth = ["--url", live_server, "--key", keys.paid]
    started = [httpx.post(f"{live_server}/v1/summarize", headers=h,
                          json={"documents": [{"id": f"d{i}", "text": "The cat sat on the mat."}]}).json()["id"]
               for i in range(3)]
    try:
        newest_first = [r["id"] for r in httpx.get(f"{live_server}/v1/summarize", headers=h).json()["data"]]
        assert set(newest_first) == set(started)
        r = CliRunner().invoke(cli, ["summarize", "--list", "--limit", "2", "--json", *auth])
        assert r.exit_code == 0 and r.stderr == "", r.output
        page = json.loads(r.stdout)  # stdout is the JSON alone
        assert [run["id"] for run in page["data"]] == newest_first[:2] and page["has_more"] is True
        r = CliRunner().invoke(cli, ["summarize", "--list", "--after", page["last_id"], "--json", *auth])
        assert r.exit_code == 0 and [run["id"] for run in json.loads(r.stdout)["data"]] == newest_first[2:]
        r = CliRunner().invoke(cli, ["summarize", "--list", "--limit", "2", *auth], env={"COLUMNS": "200"})
        assert r.exit_code == 0, r.output
        assert all(run_id in r.stdout for run_id in newest_first[:2]) and newest_first[2] not in r.stdout
        assert f"coserve summarize --list --limit 2 --after {newest_first[1]}" in _flat(r.stdout), r.stdout
        r = CliRunner().invoke(cli, ["summarize", "--list", "--after", newest_first[2], *auth])
        assert r.exit_code == 0 and "no summarization runs after" in r.stdout, r.output
        # a cursor naming none of the tenant's runs is the API's 422, on stderr
        r = CliRunner().invoke(cli, ["summarize", "--list", "--after", "sum_nope", "--json", *auth])
        assert r.exit_code == 1 and r.stdout == "" and r.stderr.startswith("422 "), (r.stdout, r.stderr)
        for bad in (["--list", "--limit", "101"], ["--json"], ["--list", "--run", newest_first[0]],
                    ["--list", str(tmp_path)]):
            r = CliRunner().invoke(cli, ["summarize", *bad, *auth])
            assert r.exit_code == 2 and r.stdout == "", (bad, r.output)
    finally:  # no worker runs their jobs: stop them, they would wait for the next test's
        for run_id in started:
            httpx.post(f"{live_server}/v1/summarize/{run_id}/cancel", headers=h, timeout=600)


def test_json_output_is_the_json_alone_and_an_open_batch_s_results_say_so_on_stderr(live_server, keys, settings,
                                                                                    tmp_path):
    """Every --json command's stdout is one JSON document a script parses (`coserve jobs --json | jq`), nothing
    else; and `batch results ID > out.jsonl` of a batch still running said so on stdout, into the file.
    `summarize --cancel`, `keys create` and `keys limits` had no --json: a script parsed their sentences."""
    h = Keys.header(keys.paid)
    auth = ["--url", live_server, "--key", keys.paid]
    run_id = httpx.post(f"{live_server}/v1/summarize", headers=h,
                        json={"documents": [{"id": "d", "text": "The cat sat on the mat."}]}).json()["id"]
    database = {"COSERVE_DATABASE_URL": settings.sqlalchemy_url, "COSERVE_DATA_DIR": str(settings.data_dir)}
    job_id = httpx.post(f"{live_server}/v1/jobs", headers=h,
                        json={"prompt": "[bold]Hi[/bold]", "max_tokens": 4}).json()["id"]
    src = tmp_path / "one.jsonl"
    src.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                               "body": {"prompt": "x", "max_tokens": 1}}) + "\n")
    r = CliRunner().invoke(cli, ["batch", "create", str(src), "--endpoint", "/v1/completions", *auth])
    batch_id = r.stdout.split("batch ")[1].split()[0]
    try:  # no worker here: the batch and the job wait
        r = CliRunner().invoke(cli, ["batch", "results", batch_id, *auth])
        assert r.exit_code == 1 and r.stdout == "" and "results come when it ends" in r.stderr, (r.stdout, r.stderr)
        for args, shows in ((["jobs"], lambda d: job_id in {j["id"] for j in d["data"]}),
                            (["batch", "list"], lambda d: d["data"][0]["id"] == batch_id),
                            (["status", job_id], lambda d: d["id"] == job_id),
                            (["cancel", job_id], lambda d: d["status"] == "cancelled"),
                            (["cancel", job_id], lambda d: d["status"] == "cancelled"),  # one that had ended
                            (["summarize", "--list"], lambda d: d["object"] == "list"),
                            (["usage"], lambda d: isinstance(d, list))):
            r = CliRunner().invoke(cli, [*args, "--json", *auth], env={"COLUMNS": "40"})
            assert r.exit_code == 0 and r.stderr == "", (args, r.output)
            assert shows(json.loads(r.stdout)), (args, r.stdout)
        r = CliRunner().invoke(cli, ["summarize", "--cancel", run_id, "--json", *auth], env={"COLUMNS": "40"})
        cancelled = json.loads(r.stdout)  # the run as the cancel left it, where a sentence said its status
        assert r.exit_code == 0 and r.stderr == "", r.output
        assert cancelled["id"] == run_id and cancelled["status"] in ("cancelling", "cancelled"), cancelled
        # the admin commands work on the database (no --url): the objects the admin API answers
        r = CliRunner().invoke(cli, ["keys", "create", "--tenant", "[scripts]", "--json"],
                               env={"COLUMNS": "40", **database})
        created = json.loads(r.stdout)
        assert r.exit_code == 0 and r.stderr == "", r.output
        assert set(created) == {"tenant_id", "key_id", "api_key", "tier", "is_admin"}, created
        assert httpx.get(f"{live_server}/v1/jobs", headers=Keys.header(created["api_key"])).status_code == 200
        r = CliRunner().invoke(cli, ["keys", "limits", "--tenant", "[scripts]", "--requests-per-minute", "60",
                                     "--json"], env={"COLUMNS": "40", **database})
        limits = json.loads(r.stdout)
        assert r.exit_code == 0 and r.stderr == "", r.output
        tenant = httpx.get(f"{live_server}/v1/admin/tenants/{created['tenant_id']}", headers=Keys.header(keys.admin))
        assert limits == tenant.json() and limits["requests_per_minute"] == 60, (limits, tenant.text)
    finally:
        httpx.post(f"{live_server}/v1/batches/{batch_id}/cancel", headers=h)
        httpx.post(f"{live_server}/v1/summarize/{run_id}/cancel", headers=h, timeout=600)


def test_jobs_and_batch_list_page_on_as_the_api_does(live_server, keys, tmp_path):
    """`coserve jobs` and `coserve batch list` showed the first page alone (at most 100): the jobs or batches after it
    could not be listed. The table ends with the command that shows the next page, and --json gives the cursor."""
    h = Keys.header(keys.paid)
    auth = ["--url", live_server, "--key", keys.paid]
    jobs = [httpx.post(f"{live_server}/v1/jobs", headers=h, json={"prompt": f"Hi {i}", "max_tokens": 1}).json()["id"]
            for i in range(3)]
    src = tmp_path / "one.jsonl"
    src.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                               "body": {"prompt": "x", "max_tokens": 1}}) + "\n")
    batches = []
    for _ in range(2):
        file_id = httpx.post(f"{live_server}/v1/files", headers=h, files={"file": ("one.jsonl", src.read_bytes())},
                             data={"purpose": "batch"}).json()["id"]
        batches.append(httpx.post(f"{live_server}/v1/batches", headers=h, json={
            "input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"}).json()["id"])
    try:  # no worker here: they wait
        r = CliRunner().invoke(cli, ["jobs", "--kind", "interactive", "--limit", "2", *auth], env={"COLUMNS": "200"})
        assert r.exit_code == 0 and jobs[2] in r.stdout and jobs[0] not in r.stdout, r.output
        more = _flat(r.stdout).split("more: `", 1)[1].split("`", 1)[0].split()  # the same filters, the next page
        assert more[:7] == ["coserve", "jobs", "--kind", "interactive", "--limit", "2", "--cursor"], more
        r = CliRunner().invoke(cli, [*more[1:], "--json", *auth])
        assert r.exit_code == 0 and [j["id"] for j in json.loads(r.stdout)["data"]] == [jobs[0]], r.output
        r = CliRunner().invoke(cli, ["batch", "list", "--limit", "1", *auth], env={"COLUMNS": "200"})
        assert r.exit_code == 0 and batches[1] in r.stdout and batches[0] not in r.stdout, r.output
        assert f"more: `coserve batch list --limit 1 --after {batches[1]}`" in _flat(r.stdout), r.stdout
        r = CliRunner().invoke(cli, ["batch", "list", "--limit", "1", "--after", batches[1], "--json", *auth])
        assert r.exit_code == 0 and [b["id"] for b in json.loads(r.stdout)["data"]] == [batches[0]], r.output
        r = CliRunner().invoke(cli, ["batch", "list", "--after", "batch_nope", "--json", *auth])
        assert r.exit_code == 1 and r.stdout == "" and r.stderr.startswith("400 "), (r.stdout, r.stderr)
    finally:
        for batch_id in batches:
            httpx.post(f"{live_server}/v1/batches/{batch_id}/cancel", headers=h)
        for job_id in jobs:
            httpx.post(f"{live_server}/v1/jobs/{job_id}/cancel", headers=h)


def test_the_commands_that_start_follow_or_cancel_work_print_its_json_alone(live_server, keys, tmp_path):
    """`batch create|status|cancel` and `submit` had no --json: a script parsed their tables and lines. Their stdout
    is now the API's object alone; with --wait / --follow once, as it ended, with the exit status of a wait and the
    notes (the id while waiting, the failure) on stderr. No worker here: what is not refused waits until cancelled."""
    import threading

    h = Keys.header(keys.paid)
    auth = ["--url", live_server, "--key", keys.paid]

    def run(*args: str):
        return CliRunner().invoke(cli, [*args, "--json", *auth], env={"COLUMNS": "40"})

    src = tmp_path / "one.jsonl"
    src.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                               "body": {"prompt": "x", "max_tokens": 1}}) + "\n")
    r = run("batch", "create", str(src), "--endpoint", "/v1/completions")
    assert r.exit_code == 0 and r.stderr == "", r.output
    created = json.loads(r.stdout)
    try:
        assert created["object"] == "batch" and created["endpoint"] == "/v1/completions", created
        r = run("batch", "status", created["id"])
        assert r.exit_code == 0 and r.stderr == "" and json.loads(r.stdout)["id"] == created["id"], r.output
    finally:
        r = run("batch", "cancel", created["id"])
    assert r.exit_code == 0 and json.loads(r.stdout)["status"] in ("cancelling", "cancelled"), r.output
    twice = tmp_path / "twice.jsonl"  # the same custom_id twice fails the whole batch: it ends without a worker
    twice.write_text("\n".join(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                                           "body": {"prompt": "x", "max_tokens": 1}}) for _ in range(2)))
    r = run("batch", "create", str(twice), "--endpoint", "/v1/completions", "--wait")
    ended = json.loads(r.stdout)
    assert r.exit_code == 1 and ended["status"] == "failed" and ended["errors"]["data"], r.output
    assert f"batch {ended['id']} created" in _flat(r.stderr), r.stderr
    r = run("batch", "status", ended["id"], "--follow")
    assert r.exit_code == 1 and json.loads(r.stdout) == ended, r.output
    r = run("submit", "Hello", "--max-tokens", "4")
    submitted = json.loads(r.stdout)
    assert r.exit_code == 0 and r.stderr == "" and submitted["id"].startswith("job_"), r.output
    httpx.post(f"{live_server}/v1/jobs/{submitted['id']}/cancel", headers=h)

    def cancel_what_waits() -> None:
        for status in ("queued", "dispatched"):
            for job in httpx.get(f"{live_server}/v1/jobs", headers=h, params={"status": status}).json()["data"]:
                httpx.post(f"{live_server}/v1/jobs/{job['id']}/cancel", headers=h)

    timer = threading.Timer(2.0, cancel_what_waits)
    timer.start()
    r = run("submit", "Hello", "--max-tokens", "4", "--wait")
    timer.join()
    job = json.loads(r.stdout)  # the text it would have streamed is in output_text, not before the JSON
    assert r.exit_code == 1 and job["status"] == "cancelled", r.output
    assert f"submitted {job['id']}" in r.stderr and f"job {job['id']} cancelled" in r.stderr, r.stderr

    # a summarization run started and followed: the run once, as it ended (cancelled by another client here);
    # its id, the progress bar and what was saved where on stderr, the results in --output as without --json
    returned = threading.Event()  # a command that started no run (and so waits for none) stops the canceller

    def cancel_the_run() -> None:
        while not returned.wait(0.2):
            runs = httpx.get(f"{live_server}/v1/summarize", headers=h).json()["data"]
            if runs and runs[0]["status"] in ("validating", "running"):
                httpx.post(f"{live_server}/v1/summarize/{runs[0]['id']}/cancel", headers=h, timeout=600)
                return

    doc = tmp_path / "doc.txt"
    doc.write_text("The cat sat on the mat. It was warm.")
    out = tmp_path / "summaries.jsonl"
    canceller = threading.Thread(target=cancel_the_run, daemon=True)
    canceller.start()
    r = run("summarize", str(doc), "-o", str(out))
    returned.set()
    canceller.join()
    ended = json.loads(r.stdout)
    assert r.exit_code == 1 and ended["status"] in ("cancelling", "cancelled"), r.output
    said = _flat(r.stderr)
    assert f"summarization {ended['id']}: 1 documents" in said and f"-> {out}" in said, r.stderr
    assert json.loads(out.read_text())["id"] == "doc"
    r = run("summarize", "--run", ended["id"], "-o", str(out))  # followed again: it has ended, the same object
    again = json.loads(r.stdout)
    assert r.exit_code == 1 and again["id"] == ended["id"] and again["status"] in ("cancelling", "cancelled"), r.output


def test_jobs_limit_is_the_apis_bound(live_server, keys):
    """`coserve jobs --limit` stopped at 100 while GET /v1/jobs pages up to 500: a page the API serves was a usage
    error. Beyond the API's bound it is still refused before the request."""
    auth = ["--url", live_server, "--key", keys.paid]
    r = CliRunner().invoke(cli, ["jobs", "--limit", "500", "--json", *auth])
    assert r.exit_code == 0 and json.loads(r.stdout)["data"] == [], r.output
    r = CliRunner().invoke(cli, ["jobs", "--limit", "501", "--json", *auth])
    assert r.exit_code == 2 and r.stdout == "" and "less than or equal to 500" in r.stderr, r.output
