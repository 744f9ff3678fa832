"""A worker learns the output lengths its model's other workers finish: its heartbeat reads them
from SQL and its engine thread records them before the next step (real DB and Redis, the real
heartbeat and engine loop around a stand-in engine with the scheduler's real history)."""

from __future__ import annotations

import threading
from datetime import timedelta
from types import SimpleNamespace

import pytest

from app.db.models import Job
from app.db.session import session_scope
from app.services.transitions import utcnow
from gpu_runtime.scheduler.decode_length import DecodeLengthHistory
from tests.conftest import wait_for
from workers.decode_history import PeerLengths, history_key
from workers.gpu_worker import GpuWorker

pytestmark = pytest.mark.integration


class _Engine:
    has_work = True

    def __init__(self, key: str) -> None:
        self.key = key
        self.scheduler = SimpleNamespace(history=DecodeLengthHistory())
        self.predicted_at_step: list[int] = []

    def step(self) -> list:
        self.predicted_at_step.append(self.scheduler.history.predict(self.key, 4096))
        return []


def test_heartbeat_brings_other_workers_finished_lengths_into_the_history(settings, keys):
    worker = GpuWorker(settings)
    key = history_key("summarize", keys.tenant_id, "batch")
    engine_thread = worker.attach(_Engine(key))
    start = utcnow()
    worker.peers = PeerLengths(settings.model_name, worker.worker_id, since=start)
    with session_scope(settings.sqlalchemy_url) as s:
        for i, (tokens, by) in enumerate(((90, "peer"), (100, "peer"), (110, "peer"), (4000, worker.worker_id))):
            s.add(Job(tenant_id=keys.tenant_id, kind="batch", tier="paid", model=settings.model_name,
                      status="succeeded", prompt="x", sampling={}, app_id="summarize", completion_tokens=tokens,
                      worker_id=by, finished_at=start + timedelta(seconds=1 + i)))
    assert worker.engine.scheduler.history.predict(key, 4096) == 4096  # nothing known yet

    worker.heartbeat()
    (learned,) = worker.inbox.drain()
    assert sorted(learned.lengths) == [(key, 90), (key, 100), (key, 110)]
    worker.inbox.put(learned)

    loop = threading.Thread(target=engine_thread.run, daemon=True)
    loop.start()
    try:
        wait_for(lambda: worker.engine.predicted_at_step, 10, "an engine step")
    finally:
        worker.stopping.set()
        loop.join(5)
    # recorded before the first step; the 4000-token job this worker finished itself is not counted twice
    assert worker.engine.predicted_at_step[0] == 120 and len(worker.inbox) == 0
    worker.heartbeat()
    assert len(worker.inbox) == 0  # each job read once


def test_heartbeat_learns_from_the_jobs_of_an_adapter_loaded_at_runtime(settings, keys, tmp_path):
    from app.services import lora_adapters

    settings.runtime_lora = True
    worker = GpuWorker(settings)
    worker.attach(_Engine("unused"))
    start = utcnow()
    worker.peers = PeerLengths(settings.model_name, worker.worker_id, since=start)  # before the adapter was loaded
    lora = tmp_path / "rt"
    lora.mkdir()
    (lora / "adapter_config.json").write_text('{"r": 8}')
    (lora / "adapter_model.safetensors").write_bytes(b"")
    lora_adapters.load(settings, "rt-lora", str(lora))
    with session_scope(settings.sqlalchemy_url) as s:
        s.add(Job(tenant_id=keys.tenant_id, kind="interactive", tier="paid", model="rt-lora", status="succeeded",
                  prompt="x", sampling={}, app_id="chat", completion_tokens=77, worker_id="peer",
                  finished_at=start + timedelta(seconds=1)))
    worker.heartbeat()
    (learned,) = worker.inbox.drain()
    assert list(learned.lengths) == [(history_key("chat", keys.tenant_id, "interactive", "rt-lora"), 77)]
