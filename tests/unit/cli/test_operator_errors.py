"""An operator's everyday mistakes get a message and an exit status, not a traceback: a port another server holds,
an IPv6 host, a credentials file that cannot be read, a saved key that was revoked (real migrated SQLite where a
database is read; no server runs)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from sqlalchemy import update
from typer.testing import CliRunner

from app.cli import cli
from app.cli.service_cmds import http_url
from app.credentials import ensure_credentials
from app.db.models import ApiKey
from app.db.session import session_scope
from tests.conftest import ROOT, wait_for


def test_up_refuses_a_port_another_server_holds_before_starting_anything(tmp_path):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        res = CliRunner().invoke(cli, ["up", "--port", str(port), "--data-dir", str(tmp_path)])
    assert res.exit_code == 2 and "cannot listen on 127.0.0.1" in res.output, res.output
    assert not (tmp_path / "credentials.json").exists()  # it started nothing and saved nothing
    res = CliRunner().invoke(cli, ["up", "--port", "0", "--data-dir", str(tmp_path)])
    assert res.exit_code == 2 and "port: Input should be greater than or equal to 1" in res.output, res.output


def test_up_refuses_a_data_directory_another_up_serves_from_before_starting_anything(tmp_path):
    """A second `coserve up` on one data directory (another terminal's, on another --port, as the port refusal
    suggests) started a second Redis on the first one's files and recorded its URL over the first one's, where
    `coserve keys revoke` then announced revocations to a Redis no API listened to."""
    from app.embedded import hold_data_dir, record_redis_url

    first = hold_data_dir(tmp_path, "http://127.0.0.1:8000")  # what the serving `coserve up` holds
    record_redis_url(tmp_path, "redis://127.0.0.1:6390/0")
    try:
        res = CliRunner().invoke(cli, ["up", "--port", "8001", "--data-dir", str(tmp_path), "--start-timeout", "5"],
                                 env={"COLUMNS": "300"})
    finally:
        first.close()
    out = " ".join(res.output.replace("│", " ").split())
    assert res.exit_code == 2 and "another `coserve up`" in out and "API http://127.0.0.1:8000" in out, res.output
    assert str(tmp_path.resolve()) in out and "--data-dir" in out, res.output
    assert (tmp_path / "redis" / "url").read_text() == "redis://127.0.0.1:6390/0\n"  # the first's, kept
    assert not (tmp_path / "credentials.json").exists()  # it started nothing
    hold_data_dir(tmp_path, "http://127.0.0.1:8001").close()  # free again once the first stopped


def test_up_that_gives_up_says_what_readyz_said_or_that_the_api_never_answered():
    from app.cli.service_cmds import not_ready

    # it printed "/readyz said: None" where the API had not answered at all
    assert not_ready("http://127.0.0.1:8000", None) == ("the API never answered http://127.0.0.1:8000/readyz (still "
                                                        "starting, or stopped: its log says which)")
    assert not_ready("http://127.0.0.1:8000", {"workers": "error: no live worker"}) == (
        "/readyz said: {'workers': 'error: no live worker'}")


def test_a_worker_without_redis_url_names_the_redis_coserve_up_recorded_in_its_data_directory(tmp_path):
    """A second worker beside `coserve up` (`coserve worker` in its directory) was told only to export REDIS_URL,
    whose value `coserve up` had chosen itself and recorded."""
    from app.embedded import record_redis_url

    env = {"COSERVE_DATA_DIR": str(tmp_path), "REDIS_URL": None, "COLUMNS": "300"}
    res = CliRunner().invoke(cli, ["worker"], env=env)
    assert res.exit_code == 1 and "REDIS_URL is not set; start Redis" in str(res.exception), res.exception
    record_redis_url(tmp_path, "redis://127.0.0.1:6390/0")
    res = CliRunner().invoke(cli, ["worker"], env=env)
    assert res.exit_code == 1 and "REDIS_URL=redis://127.0.0.1:6390/0 coserve worker" in str(res.exception), res


def test_the_api_url_brackets_an_ipv6_host_and_reaches_all_interfaces_through_loopback():
    assert http_url("::1", 8000) == "http://[::1]:8000" and http_url("::", 8000) == "http://[::1]:8000"
    assert http_url("0.0.0.0", 8000) == "http://127.0.0.1:8000" and http_url("api.local", 80) == "http://api.local:80"


def test_a_credentials_file_that_cannot_be_read_is_a_message_and_not_needed_with_url_and_key(tmp_path):
    (tmp_path / "credentials.json").write_text("{bad")
    env = {"COSERVE_DATA_DIR": str(tmp_path)}
    res = CliRunner().invoke(cli, ["status", "job_x"], env=env)
    assert res.exit_code == 2 and "cannot be read" in res.output and "Traceback" not in res.output, res.output
    res = CliRunner().invoke(cli, ["status", "job_x", "--key", "k", "--url", "http://127.0.0.1:1"], env=env)
    assert res.exit_code == 2 and "cannot reach http://127.0.0.1:1" in res.output, res.output


def test_a_revoked_saved_key_is_replaced_and_the_admin_key_saved_with_it_stays(tmp_path, db_url):
    first, created = ensure_credentials(db_url, tmp_path)
    assert created and ensure_credentials(db_url, tmp_path) == (first, False)
    with session_scope(db_url) as s:
        s.execute(update(ApiKey).where(ApiKey.prefix == first["api_key"][:10]).values(revoked=True))
    again, created = ensure_credentials(db_url, tmp_path)
    assert created and again["api_key"] != first["api_key"] and again["admin_key"] == first["admin_key"]


def test_submit_refuses_targets_of_the_other_kind_of_job():
    auth = ["--key", "k", "--url", "http://127.0.0.1:1"]
    res = CliRunner().invoke(cli, ["submit", "hi", "--deadline-s", "5", *auth])
    assert res.exit_code == 2 and "--deadline-s is a batch job's" in res.output, res.output
    res = CliRunner().invoke(cli, ["submit", "hi", "--batch", "--tbt-ms", "5", *auth])
    assert res.exit_code == 2 and "not TTFT/TBT targets" in res.output, res.output


def test_paths_that_do_not_exist_or_cannot_be_written_are_usage_errors(tmp_path):
    res = CliRunner().invoke(cli, ["summarize", str(tmp_path / "nothere.txt"), "--key", "k", "--url", "http://x"])
    assert res.exit_code == 2 and "no such file or folder" in res.output, res.output
    res = CliRunner().invoke(cli, ["simulate", "--trace", str(tmp_path / "none.csv")])
    assert res.exit_code == 2 and "--trace" in res.output, res.output
    res = CliRunner().invoke(cli, ["simulate", "--policies", "qoserve,bogus"])
    assert res.exit_code == 2 and "no scheduler bogus" in res.output, res.output


def test_keys_create_gives_a_new_tenant_the_configured_default_tier(db_url):
    env = {"COSERVE_DATABASE_URL": db_url, "COSERVE_TIERS": '["bronze","gold"]', "COSERVE_DEFAULT_TIER": "bronze"}
    res = CliRunner().invoke(cli, ["keys", "create", "--tenant", "a"], env=env)
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(cli, ["keys", "list", "--json"], env=env)
    assert [r["effective_tier"] for r in json.loads(res.output)] == ["bronze"]


def test_keys_create_names_the_keys_tier_and_refuses_a_default_tier_an_existing_tenant_does_not_have(db_url):
    """`keys create --tenant acme --default-tier free` for a paid acme made a paid key and said nothing of its tier."""
    env = {"COSERVE_DATABASE_URL": db_url}
    res = CliRunner().invoke(cli, ["keys", "create", "--tenant", "acme"], env=env)
    assert res.exit_code == 0 and "(tier paid):" in res.output, res.output
    res = CliRunner().invoke(cli, ["keys", "create", "--tenant", "acme", "--default-tier", "free"],
                             env={**env, "COLUMNS": "300"})
    out = " ".join(res.output.replace("│", " ").split())
    assert res.exit_code == 2 and "tenant 'acme' exists, with default tier 'paid'" in out, res.output
    assert "give --tier free for this key" in out, res.output
    res = CliRunner().invoke(cli, ["keys", "create", "--tenant", "acme", "--default-tier", "paid", "--tier", "free"],
                             env=env)  # what it has: no conflict
    assert res.exit_code == 0 and "(tier free):" in res.output, res.output
    res = CliRunner().invoke(cli, ["keys", "list", "--json"], env=env)
    assert [r["effective_tier"] for r in json.loads(res.output)] == ["paid", "free"]


def test_a_worker_whose_redis_does_not_answer_stops_with_the_reason_before_loading_a_model():
    from workers.gpu_worker import _wait_for_redis

    with pytest.raises(SystemExit, match="Redis at REDIS_URL does not answer"):
        _wait_for_redis("redis://127.0.0.1:1/0", wait_s=0)


def test_an_option_is_validated_as_its_setting_is(tmp_path):
    res = CliRunner().invoke(cli, ["up", "--device", "tpu", "--data-dir", str(tmp_path)])
    assert res.exit_code == 2 and "device" in res.output and "Traceback" not in res.output, res.output
    res = CliRunner().invoke(cli, ["keys", "list"], env={"COSERVE_DEFAULT_TIER": "gold"})
    assert res.exit_code == 2 and "COSERVE_DEFAULT_TIER 'gold'" in res.output, res.output


def test_keys_commands_outside_the_servers_directory_make_no_empty_database(tmp_path):
    """Run where no `coserve up` ran, `keys list` and `keys revoke` listed nothing and revoked nothing, each silently
    making an empty ./data/coserve.db; they say where they looked. `keys create` may start a database, and says so."""
    env = {"COSERVE_DATA_DIR": str(tmp_path / "data"), "COSERVE_DATABASE_URL": ""}
    for args in (["keys", "list"], ["keys", "revoke", "key_x"], ["keys", "limits", "--tenant", "a"]):
        res = CliRunner().invoke(cli, args, env=env)
        assert res.exit_code == 1 and "no database at" in res.output and "coserve up" in res.output, res.output
    assert not (tmp_path / "data" / "coserve.db").exists()
    res = CliRunner().invoke(cli, ["keys", "create", "--tenant", "a"], env=env)
    assert res.exit_code == 0 and "a new database at" in res.output, res.output
    res = CliRunner().invoke(cli, ["keys", "list", "--json"], env=env)
    assert res.exit_code == 0 and [r["tenant"] for r in json.loads(res.output)] == ["a"], res.output


def test_a_summarize_request_the_server_answers_too_late_is_said_to_maybe_go_on(tmp_path, monkeypatch):
    from app.cli import batch_cmds, service_cmds

    monkeypatch.setattr(batch_cmds, "LONG_TIMEOUT_S", 0.5)  # the start's and the cancel's (TIMEOUT_S stays)
    monkeypatch.setattr(service_cmds, "warn_without_workers", lambda url: None)
    (tmp_path / "doc.txt").write_text("The cat sat on the mat.")
    with socket.socket() as silent:  # accepts the connection, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        auth = ["--key", "k", "--url", f"http://127.0.0.1:{silent.getsockname()[1]}"]
        started = CliRunner().invoke(cli, ["summarize", str(tmp_path / "doc.txt"), "-o", str(tmp_path / "o.jsonl"),
                                           *auth])
        cancelled = CliRunner().invoke(cli, ["summarize", "--cancel", "sum_x", *auth])
    for res, path in ((started, "/v1/summarize "), (cancelled, "/v1/summarize/sum_x/cancel ")):
        said = " ".join(res.output.split())
        assert res.exit_code == 2 and f"POST {path}got no answer" in said and "within 0.5s" in said, res.output
        assert "may still be doing it" in said and "cannot reach" not in said, res.output


def test_keys_limits_refuses_a_limit_over_what_the_api_and_sql_hold(tmp_path):
    """`keys limits` took any size: past 2**31-1 PostgreSQL's integer column refused it (a traceback) and SQLite
    stored it, after which the admin API answered 500 reading the tenant."""
    env = {"COSERVE_DATA_DIR": str(tmp_path / "data"), "COSERVE_DATABASE_URL": ""}
    assert CliRunner().invoke(cli, ["keys", "create", "--tenant", "a"], env=env).exit_code == 0
    res = CliRunner().invoke(cli, ["keys", "limits", "--tenant", "a", "--tokens-per-minute", str(2**31)], env=env)
    assert res.exit_code == 2 and "2147483647" in res.output, res.output
    res = CliRunner().invoke(cli, ["keys", "limits", "--tenant", "a", "--tokens-per-minute", str(2**31 - 1)], env=env)
    assert res.exit_code == 0 and "2147483647 tokens per minute" in res.output, res.output


def test_a_client_command_outside_the_servers_directory_says_where_it_looked_for_the_keys(tmp_path, monkeypatch):
    """`coserve jobs` run away from `coserve up`'s directory said only "run `coserve up` first", which the user had
    done: it names the file it looked for and COSERVE_DATA_DIR."""
    monkeypatch.chdir(tmp_path)
    for args in (["jobs"], ["usage", "--admin"]):
        res = CliRunner().invoke(cli, args, env={"COLUMNS": "300", "COSERVE_API_KEY": None, "COSERVE_ADMIN_KEY": None,
                                                 "COSERVE_DATA_DIR": None})
        out = " ".join(res.output.replace("│", " ").split())
        assert res.exit_code == 2 and f"no {tmp_path.resolve() / 'data' / 'credentials.json'}" in out, res.output
        assert "COSERVE_DATA_DIR names its data directory" in out, res.output


def test_a_child_that_dies_at_start_up_leaves_its_last_words_for_coserve_up_to_show(tmp_path):
    """`coserve up --model /nowhere` said only "worker exited during start-up; see data/logs": the reason (the
    exception a real child process printed last) is what it shows now, from this run's part of the log alone."""
    from app.embedded import Supervisor

    log = tmp_path / "worker.log"
    log.write_text("FileNotFoundError: an earlier run's end\n")
    sup = Supervisor()
    dies = ("import sys; print('loading ...'); sys.exit(\"FileNotFoundError: model '/nowhere' is neither a bundled "
            "name nor a checkpoint directory\")")
    proc = sup.spawn("worker", [sys.executable, "-c", dies], {"PYTHONUNBUFFERED": "1"}, log)
    proc.wait(60)
    assert sup.dead() == ["worker"]
    assert sup.last_words("worker") == ("FileNotFoundError: model '/nowhere' is neither a bundled name nor a "
                                        "checkpoint directory")
    quiet = sup.spawn("api", [sys.executable, "-c", "pass"], {}, tmp_path / "api.log")
    quiet.wait(60)
    assert sup.last_words("api") is None and sup.last_words("redis") is None


def test_a_followed_run_is_said_to_end_as_it_did():
    """`coserve summarize` said "before the deadline" of any run that ended in time, a cancelled or failed one too."""
    from app.cli.batch_cmds import run_ending

    ended = {"status": "completed", "reason": None}
    assert "before the deadline" in run_ending(ended, 3.0) and "AFTER the deadline" in run_ending(ended, -2.0)
    cancelled = run_ending({"status": "cancelled", "reason": "cancelled by request"}, 3.0)
    assert "cancelled" in cancelled and "by request" in cancelled and "deadline" not in cancelled
    failed = run_ending({"status": "failed", "reason": "no document was summarized"}, 3.0)
    assert "failed" in failed and "no document" in failed and "deadline" not in failed
    assert "cancelled" in run_ending({"status": "cancelling"}, -1.0)


def test_a_followed_run_that_failed_as_a_whole_says_why_on_stderr():
    """A run failed as a whole (a refusal at its first step) said "2 documents failed; see 'error' in out.jsonl" where
    it was followed again (`--run ID`), and each document's error there only points to the run's reason."""
    from pathlib import Path

    from app.cli.batch_cmds import what_failed

    reason = "token_limit_exceeded: this summarization run's first level's 900 prompt tokens ..."
    failed = what_failed({"status": "failed", "reason": reason, "documents_failed": 2}, Path("out.jsonl"))
    assert "the run failed" in failed and "token_limit_exceeded" in failed and "2 documents" in failed, failed
    some = what_failed({"status": "completed", "reason": None, "documents_failed": 1}, Path("out.jsonl"))
    assert "see 'error' in out.jsonl" in some
    assert what_failed({"status": "completed", "reason": None, "documents_failed": 0}, Path("out.jsonl")) is None


CTRL_C_SAYS = {  # a command that makes or stops work, and what its Ctrl-C says the server may do anyway
    "summarize-cancel": (["summarize", "--cancel", "sum_x"],
                         "the server may cancel run sum_x anyway: `coserve summarize --list` shows"),
    "batch-create": (["batch", "create", "{tmp}/in.jsonl"],
                     "the server may make the batch anyway: `coserve batch list` shows"),
    "batch-cancel": (["batch", "cancel", "batch_x"],
                     "may cancel batch batch_x anyway: `coserve batch status batch_x` shows"),
    "submit": (["submit", "hi"], "the server may queue the job anyway: `coserve jobs` shows"),
    "cancel": (["cancel", "job_x"], "the server may cancel job job_x anyway: `coserve status job_x` shows")}
# the CLI run with a thread that, given a line on stdin, trips SIGINT in itself: Python's handler then waits for the
# main thread, as it does for a Ctrl-C that came just before the main thread went to sleep on the answer
TRIPS_SIGINT = """import runpy, signal, sys, threading
def trip():
    sys.stdin.readline()
    signal.pthread_kill(threading.get_ident(), signal.SIGINT)
threading.Thread(target=trip, daemon=True).start()
runpy.run_module("app.cli", run_name="__main__")
"""


@contextmanager
def _cli_waiting_on_a_silent_server(tmp_path, args: list[str], python: list[str], answers: tuple[bytes, ...] = (),
                                    begun: bytes = b"", asked: bytes = b"POST ") -> Iterator[subprocess.Popen]:
    """``coserve ARGS`` (run by ``python``, its argv before them) once the request reached a server that read it and
    does not answer (past ``begun``, the start of an answer); ``answers`` (whole HTTP answers, one a connection) go to
    the requests before it, and the one waited on starts with ``asked``. Its SIGINT as a shell's Ctrl-C finds it,
    whatever the test process ignores."""
    (tmp_path / "in.jsonl").write_text('{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", '
                                       '"body": {"messages": [{"role": "user", "content": "x"}]}}\n')
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        proc = subprocess.Popen([*python, *(a.format(tmp=tmp_path) for a in args), "--url", url, "--key", "k"],
                                cwd=ROOT, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "300",
                                                             "COSERVE_DATA_DIR": str(tmp_path)},
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            silent.settimeout(60)
            for answer in answers:
                conn, _ = silent.accept()
                with conn:
                    conn.settimeout(60)
                    conn.recv(65536)
                    conn.sendall(answer)
            conn, _ = silent.accept()
            conn.settimeout(60)
            with conn:
                request = conn.recv(65536)
                assert request.startswith(asked), f"the command sent no {asked!r} request: {request!r}"
                conn.sendall(begun)
                yield proc
        finally:
            proc.kill()
            proc.communicate()


def _said_may_be_done_anyway(proc: subprocess.Popen, says: str) -> None:
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and out == "" and "Traceback" not in err, (out, err)
    assert says in " ".join(err.split()), err


@pytest.mark.parametrize(("args", "says"), CTRL_C_SAYS.values(), ids=CTRL_C_SAYS.keys())
def test_ctrl_c_while_a_request_that_makes_or_stops_work_waits_says_it_may_be_done_anyway(tmp_path, args, says):
    """Ctrl-C while the server had not answered a cancel (`summarize --cancel` waits minutes by design), an upload or
    a start: the command exited 130 without a word, the operator left not knowing whether the run goes on being
    cancelled or the batch or job was made. The server here has the request and does not answer yet."""
    with _cli_waiting_on_a_silent_server(tmp_path, args, [sys.executable, "-m", "app.cli"]) as proc:
        proc.send_signal(signal.SIGINT)
        _said_may_be_done_anyway(proc, says)


# requests of batch_cmds' Api that wait a minute (`batch cancel`) or ten (`summarize --cancel`) for their answer, no
# less than the wait below (`submit` and `cancel` give up after 30 s and then act on the Ctrl-C, only late)
@pytest.mark.parametrize("command", ["batch-cancel", "summarize-cancel"])
def test_a_ctrl_c_that_comes_as_the_command_goes_to_sleep_on_the_answer_is_acted_on(tmp_path, command):
    """A SIGINT that came after Python's last look for one and before the main thread slept in the socket's poll()
    (a loaded machine preempts a process just there) only marked the signal: the command slept on to the request's
    timeout, a minute, before the Ctrl-C stopped it (CI: the Ctrl-C test above timed out). Here the main thread
    sleeps on the answer when the SIGINT is marked, in another thread, which leaves that sleep as it was."""
    args, says = CTRL_C_SAYS[command]
    with _cli_waiting_on_a_silent_server(tmp_path, args, [sys.executable, "-c", TRIPS_SIGINT]) as proc:
        _trip_sigint_once_asleep(proc, "the answer")
        _said_may_be_done_anyway(proc, says)


def _http_answer(head: str, body: bytes = b"") -> bytes:
    return f"HTTP/1.1 {head}\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n".encode() + body


SUBMITTED = _http_answer("201 Created", b'{"id": "job_x", "status": "queued"}')
READY = _http_answer("200 OK", b'{"status": "ready", "checks": {"workers": "1 live"}}')
# a queued job's stream: its head at once, then nothing until the job starts (a keep-alive comment each 15 s)
STREAM_BEGUN = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def test_a_ctrl_c_that_comes_as_submit_wait_goes_to_sleep_on_a_queued_jobs_stream_is_acted_on(tmp_path):
    """`coserve submit --wait` reads a queued job's stream, which sends nothing until a worker takes the job: a Ctrl-C
    that came just as the command went to sleep on the stream's next chunk only marked the signal, and the command
    slept on to the next keep-alive (15 s), or for an hour (the stream's read timeout) where nothing sends them."""
    with _cli_waiting_on_a_silent_server(tmp_path, ["submit", "hi", "--wait"], [sys.executable, "-c", TRIPS_SIGINT],
                                         (SUBMITTED, READY), STREAM_BEGUN, b"GET /v1/jobs/job_x/stream ") as proc:
        _trip_sigint_once_asleep(proc, "the stream")
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err, (out, err)
    assert "stopped waiting; job job_x goes on on the server" in " ".join(err.split()), err


# the CLI as TRIPS_SIGINT runs it, its /readyz read given ten minutes, not ten seconds: a /readyz that answers late
# (a Redis that does not answer its ping) then keeps a command that slept on it asleep past the wait below
SLOW_READYZ = """import httpx
get = httpx.get
httpx.get = lambda *args, **kw: get(*args, **{**kw, "timeout": 600.0})
""" + TRIPS_SIGINT


def test_a_ctrl_c_that_comes_as_submit_wait_goes_to_sleep_on_the_readyz_look_for_workers_is_acted_on(tmp_path):
    """`coserve submit --wait` (and `batch create --wait`, `batch follow`) first asks /readyz whether a worker serves
    the model: a Ctrl-C that came just as the command went to sleep on its answer only marked the signal, and the
    command slept on until /readyz answered, up to its 10 s timeout (here made longer, so as to show it)."""
    with _cli_waiting_on_a_silent_server(tmp_path, ["submit", "hi", "--wait"], [sys.executable, "-c", SLOW_READYZ],
                                         (SUBMITTED,), asked=b"GET /readyz ") as proc:
        _trip_sigint_once_asleep(proc, "/readyz")
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err, (out, err)
    assert "stopped waiting; job job_x goes on on the server" in " ".join(err.split()), err


def _trip_sigint_once_asleep(proc, on: str) -> None:
    """Once the command (run by TRIPS_SIGINT) sleeps ``on`` something, its own thread marks a SIGINT in it."""
    wait_for(lambda: _asleep(proc.pid), 60, f"the command to sleep on {on}", interval=0.01)
    proc.stdin.write("\n")
    proc.stdin.flush()


def _asleep(pid: int) -> bool:
    """The process's main thread sleeps in the kernel (its state in /proc, after the command's name)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "S"


@pytest.mark.parametrize("start", ["500", "drop"])
def test_a_batch_create_whose_start_got_a_5xx_or_no_answer_names_the_uploaded_file_and_how_to_check(tmp_path,
                                                                                                      start):
    """A 5xx or a dropped connection on the start (the batch may or may not exist): the command ended with the
    error alone, the file it had uploaded unnamed; a refused (4xx) start deletes it, this one must not."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    asked: list[str] = []

    class Api(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            self.rfile.read(int(self.headers.get("content-length") or 0))
            asked.append(f"POST {self.path}")
            if self.path == "/v1/batches" and start == "drop":
                self.close_connection = True  # no answer at all: the socket closes
                return
            body = (json.dumps({"id": "file-up1", "object": "file", "bytes": 99}).encode() if self.path == "/v1/files"
                    else json.dumps({"error": {"message": "internal error", "type": "server_error"}}).encode())
            self.send_response(200 if self.path == "/v1/files" else 500)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_DELETE(self):  # noqa: N802
            asked.append(f"DELETE {self.path}")
            self.send_response(500)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Api)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    (tmp_path / "in.jsonl").write_text('{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", '
                                       '"body": {"messages": [{"role": "user", "content": "x"}]}}\n')
    try:
        res = CliRunner().invoke(cli, ["batch", "create", str(tmp_path / "in.jsonl"), "--key", "k", "--url",
                                       f"http://127.0.0.1:{server.server_address[1]}"], env={"COLUMNS": "300"})
    finally:
        server.shutdown()
        server.server_close()
    said = " ".join(res.output.split())
    assert res.exit_code in (1, 2) and "Traceback" not in said, res.output
    assert asked == ["POST /v1/files", "POST /v1/batches"], asked  # the file kept: a batch may have been made of it
    assert "the batch may or may not have been made from the file file-up1" in said, res.output
    assert "`coserve batch list`" in said and "`coserve files delete file-up1`" in said, res.output
