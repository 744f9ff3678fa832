"""`coserve up` brings up Redis + API + worker; the CLI talks to it; a worker killed comes back; Ctrl-C stops all
of it."""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import stat
import subprocess
import sys
import time

import httpx
import pytest
import redis

from tests.conftest import ROOT, free_port, wait_for

pytestmark = pytest.mark.integration


def _cli(args, env, timeout=120):
    exe = os.path.join(os.path.dirname(sys.executable), "coserve")
    return subprocess.run([exe, *args], env={**env, "COLUMNS": "250"}, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def _workers(data) -> list[tuple[str, str, int]]:
    """Each worker's id, start and pid (its heartbeat's state), from the workers table."""
    with sqlite3.connect(data / "coserve.db") as db:
        rows = db.execute("SELECT id, started_at, state FROM workers").fetchall()
    return [(worker_id, started, json.loads(state)["pid"]) for worker_id, started, state in rows]


def test_up_submit_status_jobs_then_ctrl_c(tmp_path, tiny_model_dir):
    port = free_port()
    data = tmp_path / "data"
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL" and not k.startswith("COSERVE_")}
    env.update(COSERVE_DATA_DIR=str(data), COSERVE_MODEL=str(tiny_model_dir), COSERVE_MODEL_NAME="tiny",
               COSERVE_DEVICE="cpu", COSERVE_KV_BLOCKS="256", COSERVE_HEARTBEAT_SECONDS="0.5", OMP_NUM_THREADS="1",
               COSERVE_BACKEND="torch")  # the tiny random model; tests/vllm runs the whole stack on vLLM
    if "COSERVE_ENGINE_FACTORY" in os.environ:
        env["COSERVE_ENGINE_FACTORY"] = os.environ["COSERVE_ENGINE_FACTORY"]
    up = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "coserve"), "up", "--port", str(port),
                           "--demo"], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True)  # a shell job: its own process group, as in a terminal
    lines: list[str] = []
    try:
        def says(text: str, since: int = 0):
            """A predicate: `coserve up` printed ``text`` (rich wraps it on a pipe) after its first ``since`` lines."""
            def read():
                line = up.stdout.readline()
                if not line and up.poll() is not None:
                    raise AssertionError("coserve up exited:\n" + "".join(lines))
                lines.append(line)
                return text in " ".join("".join(lines[since:]).split())
            return read
        wait_for(says("serving; Ctrl-C"), 180, "coserve up to serve", interval=0)
        out = "".join(lines)
        assert "ready in" in out and "API key" in out and "(succeeded)" in out

        creds_file = data / "credentials.json"
        assert stat.S_IMODE(creds_file.stat().st_mode) == 0o600
        creds = json.loads(creds_file.read_text())
        assert creds["url"] == f"http://127.0.0.1:{port}" and creds["api_key"].startswith("cs-")
        assert creds["api_key"] not in (data / "coserve.db").read_bytes().decode("latin1")  # only hashes stored
        assert httpx.get(f"{creds['url']}/readyz").status_code == 200

        sub = _cli(["submit", "Hello there", "--tbt-ms", "200", "--max-tokens", "6", "--wait"], env)
        assert sub.returncode == 0, sub.stdout + sub.stderr
        assert "succeeded" in sub.stdout
        job_id = sub.stdout.split("submitted ")[1].split()[0]
        st = _cli(["status", job_id, "--json"], env)
        assert st.returncode == 0 and json.loads(st.stdout)["status"] == "succeeded"
        # --wait printed the text as it streamed (the same text the job stored)
        text = json.loads(st.stdout)["output_text"]
        assert text and text.strip() in sub.stdout
        jobs = _cli(["jobs"], env)
        assert jobs.returncode == 0 and job_id in jobs.stdout

        # the worker killed (as by the OOM killer): `coserve up` starts a new one, the API serving on (it stopped all)
        (worker_id, started, pid), = _workers(data)
        assert worker_id == f"{socket.gethostname()}-{up.pid}"  # README: `host-<pid of coserve up>`
        os.kill(pid, signal.SIGKILL)
        wait_for(says("worker exited (killed by signal 9); starting a new one", len(lines)), 60,
                 "coserve up to start the worker again", interval=0)  # raises where `coserve up` exited
        assert httpx.get(f"{creds['url']}/healthz").status_code == 200
        wait_for(lambda: _workers(data)[0][1] != started, 120, "the new worker to register")
        assert [(row[0], row[2] != pid) for row in _workers(data)] == [(worker_id, True)]  # the same worker id
        again = _cli(["submit", "Hello again", "--tbt-ms", "200", "--max-tokens", "6", "--wait", "--json"], env)
        assert again.returncode == 0 and json.loads(again.stdout)["status"] == "succeeded", again.stdout + again.stderr
        assert json.loads(again.stdout)["worker_id"] == worker_id
        redis_port = int(next(line for line in lines if "redis-server (embedded)" in line).split(":")[-1].split("/")[0])
    finally:
        if up.poll() is None:  # (it stopped itself where it gave up)
            os.killpg(up.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the whole foreground group
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
            raise
    rest = up.stdout.read()
    assert up.returncode == 0, "".join(lines) + rest
    assert "stopping" in rest and "Traceback" not in rest
    # the worker shut down cleanly (its last step deletes its row): Redis, in its own session and
    # stopped last, was still there for it
    worker_log = (data / "logs" / "worker.log").read_text()
    assert "Traceback" not in worker_log, worker_log[-3000:]
    with sqlite3.connect(data / "coserve.db") as db:
        assert db.execute("SELECT id FROM workers").fetchall() == [], worker_log[-3000:]
    # nothing left listening: API and embedded Redis are gone
    time.sleep(0.5)
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1)
    with pytest.raises(redis.ConnectionError):
        redis.Redis(port=redis_port, socket_connect_timeout=1).ping()


def test_keys_create_cli_stores_only_the_hash(tmp_path):
    from app.auth import authenticate, clear_cache
    from app.db.session import session_scope

    env = {k: v for k, v in os.environ.items() if not k.startswith("COSERVE_")}
    env["COSERVE_DATA_DIR"] = str(tmp_path)
    out = _cli(["keys", "create", "--tenant", "acme", "--tier", "free"], env)
    assert out.returncode == 0, out.stderr
    key = out.stdout.strip().splitlines()[-1]
    assert key.startswith("cs-")
    url = f"sqlite:///{tmp_path / 'coserve.db'}"
    clear_cache()
    with session_scope(url) as s:
        principal = authenticate(s, key)
    assert principal is not None and principal.tier == "free" and not principal.is_admin
    assert key.encode() not in (tmp_path / "coserve.db").read_bytes()
    # closing any descriptor of the file drops this process's SQLite locks (POSIX), so the
    # pooled connection's WAL view may go stale: start over with fresh connections
    from app.db.session import get_engine

    get_engine(url).dispose()
    bad = _cli(["keys", "create", "--tenant", "acme", "--tier", "gold"], env)
    assert bad.returncode != 0 and "unknown tier" in bad.stdout + bad.stderr
    key_id = out.stdout.split(", key ")[1].split()[0].rstrip(":")
    revoked = _cli(["keys", "revoke", key_id], env)
    assert revoked.returncode == 0 and "revoked" in revoked.stdout, revoked.stdout + revoked.stderr
    clear_cache()
    with session_scope(url) as s:
        assert authenticate(s, key) is None
    assert _cli(["keys", "revoke", "key_nope"], env).returncode != 0
