"""The engine thread is the only caller of the engine: what the heartbeat learns for the engine (the runtime LoRA
adapters loaded now, whose others leave vLLM) reaches it through the inbox, applied on the engine thread (real DB and
Redis, the real heartbeat and engine loop around a stand-in engine that records which thread called it)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from app.db.session import session_scope
from app.services import lora_adapters
from tests.conftest import load_runtime_adapter, wait_for
from workers.gpu_worker import GpuWorker

pytestmark = pytest.mark.integration


class _Engine:
    """Records each ``retire_loras`` call with the thread that made it."""

    has_work = True

    def __init__(self) -> None:
        self.scheduler = SimpleNamespace()
        self.retired: list[tuple[str, dict[str, tuple[str, float]]]] = []

    def retire_loras(self, loaded: dict[str, tuple[str, float]]) -> None:
        self.retired.append((threading.current_thread().name, dict(loaded)))

    def step(self) -> list:
        return []


def test_heartbeat_hands_the_adapters_to_retire_by_to_the_engine_thread(settings, tmp_path):
    load_runtime_adapter(settings, tmp_path)  # runtime adapters on: the heartbeat reads which are loaded now
    worker = GpuWorker(settings)
    worker.backend = "vllm"  # whose engine retires runtime adapters (the stand-in records the call)
    engine_thread = worker.attach(_Engine())
    with session_scope(settings.sqlalchemy_url) as s:
        loaded = lora_adapters.versions(s, settings.model_name)
    assert list(loaded) == ["rt-lora"]

    worker.heartbeat()
    lora_adapters.unload(settings, "rt-lora")
    worker.heartbeat()  # unloaded since: the engine retires it
    assert worker.engine.retired == []  # nothing called from the heartbeat's thread

    loop = threading.Thread(target=engine_thread.run, name="coserve-engine", daemon=True)
    loop.start()
    try:
        wait_for(lambda: len(worker.engine.retired) == 2, 10, "the engine thread to retire adapters")
    finally:
        worker.stopping.set()
        loop.join(5)
    assert worker.engine.retired == [("coserve-engine", loaded), ("coserve-engine", {})]
    assert len(worker.inbox) == 0
