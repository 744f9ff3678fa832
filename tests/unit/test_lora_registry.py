"""The vLLM engine's LoRA registry: runtime adapters get ids per version, and the entries of those vLLM's LoRA cache
has evicted (an unloaded or replaced version) are dropped, so the registry stays as small as that cache."""

from __future__ import annotations

from gpu_runtime.vllm.lora import LoraRegistry


def test_versions_vllm_no_longer_holds_are_dropped_unless_a_request_uses_them():
    registry = LoraRegistry({}, runtime=True)
    ids = {}
    for version in range(1, 101):  # an adapter reloaded 100 times (new weights each time)
        lora, new = registry.request("ada", "/adapters/ada", float(version))
        assert new
        ids[version] = lora.lora_int_id
    assert registry.request("ada", "/adapters/ada", 100.0) == (registry.loaded[("ada", "/adapters/ada", 100.0)],
                                                               False)
    # vLLM's cache (max_cpu_loras 2) holds the last two; a request still running holds version 7
    registry.prune({ids[99], ids[100]}, [("ada", "/adapters/ada", 7.0), (None, None, 0.0)])
    assert sorted(registry.loaded) == [("ada", "/adapters/ada", v) for v in (7.0, 99.0, 100.0)]
    assert registry.request("ada", "/adapters/ada", 7.0) == (registry.loaded[("ada", "/adapters/ada", 7.0)], False)
    registry.prune({ids[100]}, [])  # that request ended, and vLLM evicted 99
    assert list(registry.loaded) == [("ada", "/adapters/ada", 100.0)]
    again, new = registry.request("ada", "/adapters/ada", 99.0)  # named again: a new id, loaded from disk again
    assert new and again.lora_int_id not in ids.values()


def test_the_adapters_the_engine_started_with_are_kept():
    registry = LoraRegistry({"fixed": "/adapters/fixed"}, runtime=True)
    registry.prune(set(), [])
    lora, new = registry.request("fixed", None)
    assert not new and lora.lora_int_id == 1


def test_versions_unloaded_or_replaced_are_retired_once_no_request_uses_them():
    registry = LoraRegistry({"fixed": "/adapters/fixed"}, runtime=True)
    v1, _ = registry.request("ada", "/adapters/ada", 1.0)
    v2, _ = registry.request("ada", "/adapters/ada", 2.0)  # loaded again in place
    other, _ = registry.request("bob", "/adapters/bob", 1.0)
    loaded = {"ada": ("/adapters/ada", 2.0), "bob": ("/adapters/bob", 1.0)}
    # a request still running on version 1 keeps it; the current versions and the fixed adapter stay
    assert registry.retired(loaded, [("ada", "/adapters/ada", 1.0)]) == []
    assert registry.retired(loaded, [(None, None, 0.0)]) == [v1]
    assert registry.retired({"ada": ("/adapters/ada", 2.0)}, []) == [other]  # bob unloaded
    assert registry.retired({"ada": ("/adapters/elsewhere", 2.0)}, []) == [v2]  # loaded from another path
    assert registry.loaded == {} and registry.request("fixed", None) == (registry.fixed["fixed"], False)
    again, new = registry.request("ada", "/adapters/ada", 1.0)  # named again: a new id, loaded from disk again
    assert new and again.lora_int_id not in {v1.lora_int_id, v2.lora_int_id, other.lora_int_id}


def test_a_request_that_read_a_version_replaced_since_loads_the_current_one():
    """A job read version 1 of ``ada`` just before a reload replaced it (from another directory); the engine retired
    version 1 (removed from vLLM) before the job's request came: the request runs on version 2, not on version 1 loaded
    again from a directory the admin may have deleted."""
    registry = LoraRegistry({}, runtime=True)
    v1, _ = registry.request("ada", "/adapters/ada-1", 1.0)
    assert registry.retired({"ada": ("/adapters/ada-2", 2.0)}, []) == [v1]
    assert registry.source("ada", "/adapters/ada-1", 1.0) == ("/adapters/ada-2", 2.0)
    assert registry.source("ada", "/adapters/ada-3", 3.0) == ("/adapters/ada-3", 3.0)  # newer than the engine heard
    assert registry.source("bob", "/adapters/bob", 1.0) == ("/adapters/bob", 1.0)  # nothing said of it yet
    assert registry.source("fixed", None) == (None, 0.0)  # one the engine started with


def test_a_request_for_an_adapter_unloaded_since_its_job_read_it_is_refused():
    """vLLM's server answers a request naming an adapter its /v1/unload_lora_adapter removed with a 404; a job that
    read runtime adapter ``ada`` before its unload reached the engine is refused with the reason, where the engine
    loaded it from disk again (and failed only where the directory was gone). A reload the engine heard of, or a
    version newer than the last it heard of (loaded again after the word), runs."""
    registry = LoraRegistry({"fixed": "/adapters/fixed"}, runtime=True)
    registry.retired({"ada": ("/adapters/ada", 1.0)}, [])
    registry.request("bob", "/adapters/bob", 1.0)  # loaded by a request before the engine heard of it
    assert registry.unloaded_refusal("ada", "/adapters/ada", 1.0) is None
    registry.retired({}, [])  # both unloaded
    for name in ("ada", "bob"):
        refused = registry.unloaded_refusal(name, f"/adapters/{name}", 1.0)
        assert refused is not None and f"{name!r} was unloaded" in refused and "load_lora_adapter" in refused
    assert registry.unloaded_refusal("ada", "/adapters/ada", 2.0) is None  # loaded again since the word
    assert registry.unloaded_refusal("fixed", None) is None and registry.unloaded_refusal(None, None) is None
    registry.retired({"ada": ("/adapters/ada", 3.0)}, [])  # ada loaded again: its jobs run
    assert registry.unloaded_refusal("ada", "/adapters/ada", 1.0) is None
    assert registry.unloaded_refusal("bob", "/adapters/bob", 1.0) is not None
