"""Runtime LoRA adapters (``app.services.lora_adapters``) on a real migrated SQLite DB: the names listed and served
once the settings change under adapters already loaded."""

from __future__ import annotations

import json

import pytest

from app.services import lora_adapters
from app.settings import Settings


def _adapter_dir(path) -> str:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    (path / "adapter_model.safetensors").write_bytes(b"")  # a worker loads it; the API checks it is there
    return str(path)


def test_a_runtime_adapter_named_by_the_settings_since_is_listed_once_and_can_be_unloaded(tmp_path, db_url):
    """Adapters loaded at runtime whose names a restart then gives a configured adapter (COSERVE_LORA_MODULES) or
    the model (an alias): /v1/models lists each name once, and an admin can still remove the runtime rows."""
    settings = Settings(data_dir=tmp_path, database_url=db_url, model_name="tiny", runtime_lora=True)
    for name in ("rt-a", "rt-b", "rt-c"):
        lora_adapters.load(settings, name, _adapter_dir(tmp_path / name))
    restarted = settings.model_copy(update={"lora_modules": {"rt-a": "/adapters/a"}, "model_aliases": ("rt-b",)})
    assert lora_adapters.listed_models(restarted) == ("tiny", "rt-b", "rt-a", "rt-c")
    assert lora_adapters.served_models(restarted) == ("tiny", "rt-a", "rt-c")
    lora_adapters.unload(restarted, "rt-a")
    lora_adapters.unload(restarted, "rt-b")
    assert set(lora_adapters.loaded(restarted, fresh=True)) == {"rt-c"}
    with pytest.raises(lora_adapters.AdapterError, match="configured by COSERVE_LORA_MODULES; remove it there"):
        lora_adapters.unload(restarted, "rt-a")  # the configured adapter itself stays
    with pytest.raises(lora_adapters.AdapterError, match="'rt-b' is not loaded"):
        lora_adapters.unload(restarted, "rt-b")


def test_an_unloaded_adapters_row_goes_once_its_jobs_have_ended(tmp_path, db_url):
    """``unloaded_lora_adapters`` routes an unloaded adapter's jobs still to end: the sweeper's prune keeps a row
    while a job of it waits or a summarization on it runs, and for a while after the unload, then drops it."""
    from datetime import timedelta

    from sqlalchemy import select, update

    from app.db.models import Job, SummarizationRun, Tenant, UnloadedLoraAdapter
    from app.db.session import session_scope
    from app.services.transitions import utcnow

    settings = Settings(data_dir=tmp_path, database_url=db_url, model_name="tiny", runtime_lora=True)
    for name in ("rt-a", "rt-b", "rt-c"):
        lora_adapters.load(settings, name, _adapter_dir(tmp_path / name))
        lora_adapters.unload(settings, name)
    with session_scope(db_url) as s:
        s.add(Tenant(id="ten_1", name="t"))
        s.flush()
        for job_id, model, status in (("job_a", "rt-a", "succeeded"), ("job_b", "rt-b", "queued")):
            s.add(Job(id=job_id, tenant_id="ten_1", kind="interactive", tier="paid", model=model, status=status,
                      prompt="hi", sampling={}))
        s.add(SummarizationRun(id="sum_c", tenant_id="ten_1", model="rt-c", tier="paid", deadline_at=utcnow(),
                               max_summary_tokens=8, chunk_tokens=8, overlap_tokens=0))
        s.flush()
        assert lora_adapters.prune_unloaded(s) == 0  # unloaded a moment ago: a request may still route by it
        assert lora_adapters.prune_unloaded(s, kept=timedelta(0)) == 1  # rt-a: its one job has ended
        assert lora_adapters.queue_models(s, {"rt-b", "rt-c"}) == {"rt-b": "tiny", "rt-c": "tiny"}
        s.execute(update(Job).values(status="failed"))
        s.execute(update(SummarizationRun).values(status="failed"))
        assert lora_adapters.prune_unloaded(s, kept=timedelta(0)) == 2
        assert s.scalars(select(UnloadedLoraAdapter.name)).all() == []


def test_an_unloaded_adapters_row_stays_while_a_summarization_on_it_validates(tmp_path, db_url):
    """A run answered ``validating`` writes its first level's jobs at its first step: until then it has no job that
    keeps the adapter's row, and a prune would leave those jobs routed to a queue no worker reads."""
    from datetime import timedelta

    from sqlalchemy import select

    from app.db.models import SummarizationRun, Tenant, UnloadedLoraAdapter
    from app.db.session import session_scope
    from app.services.transitions import utcnow

    settings = Settings(data_dir=tmp_path, database_url=db_url, model_name="tiny", runtime_lora=True)
    lora_adapters.load(settings, "rt-v", _adapter_dir(tmp_path / "rt-v"))
    lora_adapters.unload(settings, "rt-v")
    with session_scope(db_url) as s:
        s.add(Tenant(id="ten_1", name="t"))
        s.flush()
        s.add(SummarizationRun(id="sum_v", tenant_id="ten_1", model="rt-v", tier="paid", deadline_at=utcnow(),
                               max_summary_tokens=8, chunk_tokens=8, overlap_tokens=0, status="validating"))
        s.flush()
        assert lora_adapters.prune_unloaded(s, kept=timedelta(0)) == 0
        assert lora_adapters.queue_models(s, {"rt-v"}) == {"rt-v": "tiny"}
        assert s.scalars(select(UnloadedLoraAdapter.name)).all() == ["rt-v"]


def test_the_versions_a_worker_retires_by_are_those_its_jobs_load(tmp_path, db_url):
    """``versions``: each runtime adapter of the model loaded now, with the path and version a job of it loads
    (``adapter_source``); a reload is a new version, an unloaded adapter is gone, another model's is left out."""
    from app.db.session import session_scope

    settings = Settings(data_dir=tmp_path, database_url=db_url, model_name="tiny", runtime_lora=True)
    for name in ("rt-a", "rt-b"):
        lora_adapters.load(settings, name, _adapter_dir(tmp_path / name))
    with session_scope(db_url) as s:
        first = lora_adapters.versions(s, "tiny")
        assert first == {name: lora_adapters.adapter_source(s, name) for name in ("rt-a", "rt-b")}
        assert lora_adapters.versions(s, "other") == {}
    lora_adapters.load(settings, "rt-a", str(tmp_path / "rt-a"), load_inplace=True)
    lora_adapters.unload(settings, "rt-b")
    with session_scope(db_url) as s:
        now = lora_adapters.versions(s, "tiny")
    assert set(now) == {"rt-a"} and now["rt-a"][0] == first["rt-a"][0] and now["rt-a"][1] > first["rt-a"][1]


def test_a_name_another_models_adapter_holds_is_refused_saying_so(tmp_path, db_url):
    """Deployments of two models on one database: a name the other model's runtime adapter holds is refused saying
    whose it is, not that it is "already loaded; unload it first" (an unload here finds nothing of that name)."""
    other = Settings(data_dir=tmp_path, database_url=db_url, model_name="other", runtime_lora=True)
    lora_adapters.load(other, "shared-name", _adapter_dir(tmp_path / "a"))
    settings = other.model_copy(update={"model_name": "tiny"})
    for inplace in (False, True):
        with pytest.raises(lora_adapters.AdapterError, match="'shared-name' adapts model 'other'") as refused:
            lora_adapters.load(settings, "shared-name", _adapter_dir(tmp_path / f"b{inplace}"), load_inplace=inplace)
        assert "choose another name" in str(refused.value)
    with pytest.raises(lora_adapters.AdapterError, match="'shared-name' is not loaded"):
        lora_adapters.unload(settings, "shared-name")
    assert lora_adapters.loaded(other, fresh=True)["shared-name"].model == "other"


def _rank_dir(path, rank: int) -> str:
    directory = _adapter_dir(path)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank}))
    return directory


def test_a_load_is_held_to_the_lora_limits_the_models_live_workers_publish(tmp_path, db_url):
    """A split deployment: the workers' own engine arguments set max_lora_rank, max_loras or enable_lora apart from
    the API's settings (rank 16 here). Each worker's heartbeat says what its engine serves (``lora``); a load is
    refused, naming the worker and its limit, where a live worker of the model could not serve the adapter, and at
    once (before its directory is read) where one loads no adapters at runtime. A heartbeat without the field (an
    older worker), another model's worker and a lost one hold nothing."""
    from datetime import timedelta

    from app.db.models import WorkerState
    from app.db.session import session_scope
    from app.services.transitions import utcnow
    from gpu_runtime.vllm.lora import NO_LORA

    settings = Settings(data_dir=tmp_path, database_url=db_url, model_name="tiny", runtime_lora=True)
    small = {"runtime": True, "max_lora_rank": 8, "max_loras": 2}

    def beat(worker: str, lora: dict | None, model: str = "tiny", ago_s: float = 0.0) -> None:
        state = {"served": [model], "runtime_lora": True, **({"lora": lora} if lora is not None else {})}
        with session_scope(db_url) as s:
            s.merge(WorkerState(id=worker, model=model, queue=f"coserve.{model}", device="cpu", state=state,
                                heartbeat_at=utcnow() - timedelta(seconds=ago_s)))

    beat("w-old", None)  # an older worker: says nothing of LoRA
    beat("w-other", {**small, "max_lora_rank": 1}, model="other")
    beat("w-lost", {**small, "max_lora_rank": 1}, ago_s=3600)
    lora_adapters.load(settings, "r16-a", _rank_dir(tmp_path / "r16-a", 16))  # nothing live of the model says less
    beat("w-8", small)
    with pytest.raises(lora_adapters.AdapterError, match="rank 16; worker 'w-8' of the model serves runtime adapters "
                                                         r"up to rank 8 \(max_lora_rank of its vLLM engine\)"):
        lora_adapters.load(settings, "r16-b", _rank_dir(tmp_path / "r16-b", 16))
    lora_adapters.load(settings, "r8", _rank_dir(tmp_path / "r8", 8))
    for lora, why in ((NO_LORA, "its engine serves no LoRA"), ({**small, "runtime": False}, "COSERVE_RUNTIME_LORA")):
        beat("w-8", lora)
        with pytest.raises(lora_adapters.AdapterError, match=f"worker 'w-8' of the model loads none \\({why}"):
            lora_adapters.load(settings, "r1", str(tmp_path / "not-read"))  # refused before the directory is read
    assert set(lora_adapters.loaded(settings, fresh=True)) == {"r16-a", "r8"}


def test_the_lora_limits_check_on_hand_built_heartbeats():
    """The checks on what workers published (worker id -> ``lora``): every worker below the rank or loading none
    is named; none refuses where each serves the adapter."""
    limits = {"w2": {"runtime": True, "max_lora_rank": 8, "max_loras": 1},
              "w1": {"runtime": True, "max_lora_rank": 16, "max_loras": 4},
              "w3": {"runtime": True, "max_lora_rank": 32, "max_loras": 4}}
    assert lora_adapters.lora_off_refusal(limits) is None and lora_adapters.lora_off_refusal({}) is None
    assert lora_adapters.worker_rank_refusal(limits, "a", 8) is None
    refused = lora_adapters.worker_rank_refusal(limits, "a", 32)
    assert refused is not None and refused.startswith(
        "LoRA adapter 'a' has rank 32; worker 'w1' of the model serves runtime adapters up to rank 16, worker 'w2' of "
        "the model serves runtime adapters up to rank 8"), refused
    off = {**limits, "w4": {"runtime": False, "max_lora_rank": None, "max_loras": None}}
    refused = lora_adapters.lora_off_refusal(off)
    assert refused is not None and "worker 'w4' of the model loads none" in refused and "'w1'" not in refused
    assert lora_adapters.worker_rank_refusal(off, "a", 512) is not None  # a rank limit nowhere said is no limit


def test_an_older_workers_heartbeat_that_says_runtime_lora_off_holds_loads(tmp_path, db_url):
    """A worker of an older coserve publishes no ``lora``, only ``runtime_lora`` (its COSERVE_RUNTIME_LORA); off, its
    engine refuses every runtime adapter's job (``LoraRegistry.refusal``), so a load is refused naming it, as for a
    newer worker; on, nothing it says holds a load."""
    from app.db.models import WorkerState
    from app.db.session import session_scope
    from app.services.transitions import utcnow

    settings = Settings(data_dir=tmp_path, database_url=db_url, model_name="tiny", runtime_lora=True)
    with session_scope(db_url) as s:
        s.add(WorkerState(id="w-old", model="tiny", queue="coserve.tiny", device="cpu",
                          state={"served": ["tiny"], "runtime_lora": False}, heartbeat_at=utcnow()))
    r8 = _rank_dir(tmp_path / "r8", 8)
    with pytest.raises(lora_adapters.AdapterError, match=r"worker 'w-old' of the model loads none \(COSERVE_RUNTIME_"
                                                         r"LORA is off there\)"):
        lora_adapters.load(settings, "r8", r8)
    with session_scope(db_url) as s:
        s.get(WorkerState, "w-old").state = {"served": ["tiny"], "runtime_lora": True}
    lora_adapters.load(settings, "r8", r8)


def test_what_a_worker_cannot_serve_of_the_runtime_adapters_loaded():
    """A worker's engine limits against the runtime adapters loaded (name -> rank): those above its rank, or all
    where it loads none, with why; none where it says nothing. ``serves`` reads another worker's heartbeat alike."""
    small = {"runtime": True, "max_lora_rank": 8, "max_loras": 2}
    loaded = {"r8": 8, "r16": 16}
    assert lora_adapters.unserved(small, loaded) == {"r16": "its rank 16 is above the max_lora_rank 8 of its vLLM "
                                                            "engine"}
    assert set(lora_adapters.unserved({"runtime": False, "max_lora_rank": None}, loaded)) == {"r8", "r16"}
    assert lora_adapters.unserved(None, loaded) == {}
    assert lora_adapters.serves({"lora": small}, "r8", 8) and not lora_adapters.serves({"lora": small}, "r16", 16)
    assert not lora_adapters.serves({"runtime_lora": False}, "r8", 8)  # an older worker with it off
    assert not lora_adapters.serves({"lora_unserved": {"r8": "why"}}, "r8", 8)
    assert lora_adapters.serves({"runtime_lora": True}, "r16", 16)  # an older worker: nothing known holds it
