"""A worker's process freezes what it holds as it exits (its interpreter's last full collection walks none of it),
unless it imported vLLM, whose triton bindings would report each frozen object of theirs as leaked."""

from __future__ import annotations

import gc
import sys
import types

from workers.gpu_worker import exit_quickly


def test_the_exit_freezes_the_heap_of_a_process_without_vllm(monkeypatch):
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    gc.unfreeze()
    try:
        exit_quickly()
        assert gc.get_freeze_count() > 1_000
    finally:
        gc.unfreeze()


def test_the_exit_leaves_the_heap_of_a_process_with_vllm_to_the_collector(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    gc.unfreeze()
    exit_quickly()
    assert gc.get_freeze_count() == 0
