"""`coserve up` as a process supervisor, run for real: behind an HTTP proxy it still reaches its own API on loopback,
and killed outright (SIGKILL, the OOM killer) it leaves none of its children behind."""

from __future__ import annotations

import http.server
import os
import signal
import subprocess
import sys
import threading

import psutil
import pytest

from tests.conftest import ROOT, free_port, wait_for

pytestmark = pytest.mark.integration


def _env(data, model_dir) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL" and not k.startswith("COSERVE_")
           and not k.lower().endswith("_proxy")}
    env.update(COSERVE_DATA_DIR=str(data), COSERVE_MODEL=str(model_dir), COSERVE_MODEL_NAME="tiny",
               COSERVE_DEVICE="cpu", COSERVE_KV_BLOCKS="256", COSERVE_HEARTBEAT_SECONDS="0.5", OMP_NUM_THREADS="1",
               COSERVE_BACKEND="torch", COLUMNS="250")
    return env


def _coserve(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "coserve"), *args], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _says(up: subprocess.Popen, lines: list[str], text: str):
    """A predicate: `coserve up` printed ``text``; raises where it exited first."""
    def read():
        line = up.stdout.readline()
        if not line and up.poll() is not None:
            raise AssertionError("coserve up exited:\n" + "".join(lines))
        lines.append(line)
        return text in " ".join("".join(lines).split())
    return read


def _ctrl_c(up: subprocess.Popen) -> None:
    if up.poll() is None:
        os.killpg(up.pid, signal.SIGINT)
    try:
        up.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(up.pid, signal.SIGKILL)
        raise


class _Proxy(http.server.BaseHTTPRequestHandler):
    """A corporate proxy that cannot reach this machine's loopback: 502 to all, and it notes what it was asked."""

    asked: list[str] = []

    def do_GET(self):  # noqa: N802 - http.server's name
        self.asked.append(self.path)
        self.send_response(502)
        self.end_headers()

    do_POST = do_CONNECT = do_GET  # noqa: N815

    def log_message(self, *args):
        pass


def test_up_behind_a_proxy_checks_its_api_directly(tmp_path, tiny_model_dir):
    """HTTP_PROXY/HTTPS_PROXY/ALL_PROXY set (a user behind a corporate proxy): `up`'s readiness check and the CLI's
    requests to the loopback API go to it directly; through the proxy `up` waited out its start timeout."""
    proxy = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Proxy)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    env = _env(tmp_path / "data", tiny_model_dir)
    proxy_url = f"http://127.0.0.1:{proxy.server_port}"
    env.update(HTTP_PROXY=proxy_url, HTTPS_PROXY=proxy_url, ALL_PROXY=proxy_url)
    up = _coserve(["up", "--port", str(free_port()), "--start-timeout", "120"], env)
    lines: list[str] = []
    try:
        wait_for(_says(up, lines, "serving; Ctrl-C"), 180, "coserve up to serve", interval=0)
        jobs = subprocess.run([os.path.join(os.path.dirname(sys.executable), "coserve"), "jobs"], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert jobs.returncode == 0 and "no jobs" in jobs.stdout, jobs.stdout + jobs.stderr
    finally:
        _ctrl_c(up)
        proxy.shutdown()
    assert _Proxy.asked == []
    assert up.returncode == 0, "".join(lines) + up.stdout.read()


def _gone(proc: psutil.Process) -> bool:
    """Ended (a zombie too: it holds no port, memory nor device)."""
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_up_killed_takes_its_children_along(tmp_path, tiny_model_dir):
    """`coserve up` SIGKILLed (no chance to stop anything): Redis, the API and the worker, with their own children,
    end too, and a new `coserve up` serves from the same data directory; they used to run on, orphaned, holding the
    port and the data directory's Redis."""
    data = tmp_path / "data"
    env = _env(data, tiny_model_dir)
    port = free_port()
    up = _coserve(["up", "--port", str(port)], env)
    lines: list[str] = []
    children: list[psutil.Process] = []
    try:
        wait_for(_says(up, lines, "serving; Ctrl-C"), 180, "coserve up to serve", interval=0)
        children = psutil.Process(up.pid).children(recursive=True)
        commands = " ".join(" ".join(c.cmdline()) for c in children)
        assert all(name in commands for name in ("redis-server", "uvicorn", "celeryd")), commands
        os.kill(up.pid, signal.SIGKILL)
        up.wait(10)
        wait_for(lambda: all(_gone(c) for c in children), 60, "the children of a killed `coserve up` to end")
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
        for child in children:  # what the old code left running
            if not _gone(child):
                child.kill()
    again = _coserve(["up", "--port", str(port)], env)
    lines = []
    try:
        wait_for(_says(again, lines, "serving; Ctrl-C"), 180, "a new coserve up to serve", interval=0)
    finally:
        _ctrl_c(again)
    assert again.returncode == 0, "".join(lines) + again.stdout.read()


def test_up_says_why_its_redis_did_not_start(tmp_path, tiny_model_dir):
    """The embedded Redis refuses its data (an append-only file cut short mid-command): `up` exits 1 with what Redis
    said, not a Python traceback ending in "see redis.log"."""
    data = tmp_path / "data"
    (data / "redis").mkdir(parents=True)
    (data / "redis" / "appendonly.aof").write_bytes(b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\ngarbage")
    up = subprocess.run([os.path.join(os.path.dirname(sys.executable), "coserve"), "up", "--port", str(free_port())],
                        env=_env(data, tiny_model_dir), cwd=ROOT, capture_output=True, text=True, timeout=120)
    said = " ".join((up.stdout + up.stderr).split())
    assert "Bad file format reading the append only file" in said, said
    assert up.returncode == 1 and "Traceback" not in said, said
    assert not (data / "logs" / "worker.log").exists()  # nothing else was started
