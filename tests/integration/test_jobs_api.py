"""The jobs API over HTTP with a real migrated DB and a real Redis broker (no worker)."""

from __future__ import annotations

import importlib.metadata
import io
import json
import logging
import threading
import time
from datetime import UTC, datetime, timedelta, timezone

import pytest
import redis
from sqlalchemy import select

from app.db.models import Job, JobEvent
from app.db.session import get_engine, session_scope
from tests.conftest import Keys, wait_for

pytestmark = pytest.mark.integration

H = Keys.header


def submit(client, key, **body):
    body.setdefault("prompt", "Say hello")
    return client.post("/v1/jobs", json=body, headers=H(key))


def test_submit_get_and_dispatch(client, keys, settings):
    r = submit(client, keys.paid, ttft_ms=500, tbt_ms=100, max_tokens=8)
    assert r.status_code == 201, r.text
    job = r.json()
    # committed when answered; sent to the broker right after (group commit + dispatcher thread)
    assert job["status"] in ("queued", "dispatched") and job["tier"] == "paid" and job["kind"] == "interactive"
    assert job["ttft_ms"] == 500 and job["sampling"]["max_tokens"] == 8 and job["prompt_tokens"] > 0
    got = client.get(f"/v1/jobs/{job['id']}", headers=H(keys.paid)).json()
    assert got["id"] == job["id"]
    # the task in the model's queue carries only the id
    queued = wait_for(lambda: redis.Redis.from_url(settings.redis_url).lrange("coserve.tiny", 0, -1), 10, "the task")
    assert len(queued) == 1 and job["id"].encode() in queued[0] and b"Say hello" not in queued[0]
    def events():
        with session_scope(settings.sqlalchemy_url) as s:
            rows = s.scalars(select(JobEvent).where(JobEvent.job_id == job["id"]))
            return [(e.from_status, e.to_status) for e in rows]
    wait_for(lambda: len(events()) == 2, 10, "the dispatched transition")
    assert events() == [(None, "queued"), ("queued", "dispatched")]
    assert client.get(f"/v1/jobs/{job['id']}", headers=H(keys.paid)).json()["status"] == "dispatched"


def test_interactive_jobs_keep_where_their_tbt_deadlines_start(client, keys, settings):
    paced = submit(client, keys.paid, tbt_anchor="first-token").json()
    default = submit(client, keys.paid).json()
    batch = submit(client, keys.paid, kind="batch", deadline_window_s=600).json()
    assert (paced["tbt_anchor"], default["tbt_anchor"], batch["tbt_anchor"]) == (
        "first-token", settings.tbt_anchor, None)  # the server's default is resolved at submission


def test_auth_and_tenant_isolation(client, keys):
    assert client.post("/v1/jobs", json={"prompt": "x"}).status_code == 401
    assert client.get("/v1/jobs", headers=H("cs-not-a-key")).status_code == 401
    job = submit(client, keys.paid).json()
    assert client.get(f"/v1/jobs/{job['id']}", headers=H(keys.other)).status_code == 404
    assert client.post(f"/v1/jobs/{job['id']}/cancel", headers=H(keys.other)).status_code == 404
    assert client.get("/v1/jobs", headers=H(keys.other)).json()["data"] == []
    # same tenant, other key sees it
    assert client.get(f"/v1/jobs/{job['id']}", headers=H(keys.free)).status_code == 200


def test_admin_routes(client, keys):
    assert client.post("/v1/admin/tenants", json={"name": "x"}, headers=H(keys.paid)).status_code == 403
    r = client.post("/v1/admin/tenants", json={"name": "initech", "default_tier": "free"}, headers=H(keys.admin))
    assert r.status_code == 201, r.text
    new_key = r.json()["api_key"]
    job = submit(client, new_key)
    assert job.status_code == 201 and job.json()["tier"] == "free"
    assert client.post("/v1/admin/tenants", json={"name": "initech"}, headers=H(keys.admin)).status_code == 409


def test_a_tenants_new_key_takes_its_tier_and_admin_from_the_json_body(client, keys):
    """The body an admin sends, as for creating a tenant: a key asked for as free is a free key, never the
    tenant's default (paid) tier because the field went unread; a misspelt field or an unknown tier is a 422."""
    tenant = client.post("/v1/admin/tenants", json={"name": "umbrella"}, headers=H(keys.admin)).json()
    url = f"/v1/admin/tenants/{tenant['tenant_id']}/keys"
    r = client.post(url, json={"tier": "free"}, headers=H(keys.admin))
    assert r.status_code == 201 and r.json()["tier"] == "free" and r.json()["is_admin"] is False, r.text
    job = submit(client, r.json()["api_key"])
    assert job.status_code == 201 and job.json()["tier"] == "free"
    r = client.post(url, json={"admin": True}, headers=H(keys.admin))
    assert r.status_code == 201 and r.json()["is_admin"] is True and r.json()["tier"] == "paid", r.text
    r = client.post(url, json={"tier": "gold"}, headers=H(keys.admin))
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "tier"], r.text
    assert "choose one of ['free', 'paid']" in r.text
    r = client.post(url, json={"teir": "free"}, headers=H(keys.admin))
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "teir"], r.text
    r = client.post(url, params={"tier": "paid"}, json={"tier": "free"}, headers=H(keys.admin))
    assert r.status_code == 422 and "JSON body" in r.text, r.text
    assert client.post(url, params={"tier": "free"}, headers=H(keys.admin)).json()["tier"] == "free"  # as before
    assert client.post(url, headers=H(keys.admin)).json()["tier"] == "paid"  # no body: the tenant's tier
    listed = client.get(url, headers=H(keys.admin)).json()
    assert [(k["tier"], k["is_admin"]) for k in listed] == [(None, False), ("free", False), (None, True),
                                                            ("free", False), (None, False)]


def test_a_tenant_created_without_a_tier_gets_coserve_default_tier(settings, keys):
    """COSERVE_DEFAULT_TIER is the tier of a tenant that names none, through the admin API as through `coserve up`
    and `coserve keys create`: a deployment that sells free access by default does not hand out paid keys."""
    from fastapi.testclient import TestClient

    from app.main import create_app

    settings.default_tier = "free"
    with TestClient(create_app(settings)) as client:
        r = client.post("/v1/admin/tenants", json={"name": "hooli"}, headers=H(keys.admin))
        assert r.status_code == 201 and r.json()["tier"] == "free", r.text
        job = submit(client, r.json()["api_key"])
        assert job.status_code == 201 and job.json()["tier"] == "free", job.text
        r = client.post("/v1/admin/tenants", json={"name": "pied-piper", "default_tier": "paid"}, headers=H(keys.admin))
        assert r.status_code == 201 and r.json()["tier"] == "paid", r.text


def test_keys_stored_as_hashes(client, keys, settings):
    from app.db.models import ApiKey

    with session_scope(settings.sqlalchemy_url) as s:
        stored = [k.key_hash for k in s.scalars(select(ApiKey))]
    assert keys.paid not in stored and all(len(h) == 64 for h in stored)


@pytest.mark.parametrize("body, fragment", [
    ({"kind": "batch", "deadline_at": "2001-01-01T00:00:00Z"}, "in the past"),
    ({"prompt": "word " * 600}, "maximum context length is"),
    ({"max_tokens": 600}, "maximum context length is"),
    ({"tier": "gold"}, "unknown tier"),
    ({"ttft_ms": -5}, "greater than 0"),
    ({"tbt_ms": 1e12}, "less than or equal"),
    ({"kind": "batch", "ttft_ms": 100}, "batch jobs take deadline"),
    ({"kind": "batch", "tbt_anchor": "first-token"}, "batch jobs take deadline"),
    ({"tbt_anchor": "first"}, "'arrival' or 'first-token'"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "exactly one"),
    ({"model": "gpt-9"}, "unknown model"),
    ({"seed": 2**64}, "less than or equal"),  # would overflow the engine's generator
    ({"seed": -(2**63) - 1}, "greater than or equal"),  # OpenAI's and vLLM's int64: -1 is a seed
    ({"prompt": "x" * 100_000}, "cannot fit in it"),  # rejected before tokenizing
])
def test_validation_errors_say_what_to_fix(client, keys, body, fragment):
    r = submit(client, keys.paid, **body)
    assert r.status_code == 422, r.text
    assert fragment in r.text


def test_a_lora_adapter_is_a_model_a_request_may_name(settings, keys):
    """Adapters (COSERVE_LORA_MODULES) are listed under the model, accepted as a job's model and sent on their own
    queue, which the workers serving the model consume; other names are refused with the served ones."""
    from fastapi.testclient import TestClient

    from app.main import create_app

    settings.lora_modules = {"sql-lora": "/adapters/sql"}
    with TestClient(create_app(settings)) as client:
        listed = client.get("/v1/models", headers=H(keys.paid)).json()["data"]
        assert [(m["id"], m["parent"]) for m in listed] == [("tiny", None), ("sql-lora", "tiny")]
        assert "/adapters" not in str(listed)  # the server's paths are not shown
        assert client.get("/v1/models/sql-lora", headers=H(keys.paid)).json()["parent"] == "tiny"
        r = submit(client, keys.paid, model="sql-lora", max_tokens=4)
        assert r.status_code == 201 and r.json()["model"] == "sql-lora", r.text
        queued = wait_for(lambda: redis.Redis.from_url(settings.redis_url).lrange("coserve.sql-lora", 0, -1), 10,
                          "the adapter's task")
        assert r.json()["id"].encode() in queued[0]
        r = submit(client, keys.paid, model="other-lora")
        assert r.status_code == 422 and "this server serves 'tiny', 'sql-lora'" in r.text, r.text


def test_the_model_answers_to_its_aliases_under_its_own_name(settings, keys):
    """vLLM's --served-model-name NAME ALIAS...: each name is listed and accepted; jobs, their queue and their
    answers carry the first."""
    from fastapi.testclient import TestClient

    from app.main import create_app

    settings.model_aliases = ("gpt-4o-mini", "local/chat")
    with TestClient(create_app(settings)) as client:
        listed = client.get("/v1/models", headers=H(keys.paid)).json()["data"]
        assert [(m["id"], m["parent"], m["root"]) for m in listed] == [
            (name, None, settings.model) for name in ("tiny", "gpt-4o-mini", "local/chat")]
        assert client.get("/v1/models/local/chat", headers=H(keys.paid)).json()["root"] == settings.model
        r = submit(client, keys.paid, model="gpt-4o-mini", max_tokens=4)
        assert r.status_code == 201 and r.json()["model"] == "tiny", r.text
        queued = wait_for(lambda: redis.Redis.from_url(settings.redis_url).lrange("coserve.tiny", 0, -1), 10,
                          "the job on the model's queue")
        assert r.json()["id"].encode() in queued[0]
        assert client.post("/tokenize", json={"model": "local/chat", "prompt": "hi"}, headers=H(keys.paid)).is_success
        r = submit(client, keys.paid, model="gpt-4o")
        assert r.status_code == 422 and "this server serves 'tiny', 'gpt-4o-mini', 'local/chat'" in r.text, r.text


def _adapter_dir(path, rank: int = 8):
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank}))
    (path / "adapter_model.safetensors").write_bytes(b"")  # the API checks it is there; a worker loads it
    return str(path)


def test_an_admin_loads_a_lora_adapter_at_runtime_and_its_jobs_go_to_the_models_queue(settings, keys, tmp_path):
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter: the admin key, a directory checked with an error
    that says what to fix, the adapter listed and served at once, its jobs on the model's queue (every worker of
    the model serves it); unloaded, it is an unknown model again."""
    from fastapi.testclient import TestClient

    from app.main import create_app
    from app.services.lora_adapters import queue_models

    rt, big = _adapter_dir(tmp_path / "rt"), _adapter_dir(tmp_path / "big", rank=64)
    settings.lora_modules = {"sql-lora": "/adapters/sql"}

    def load(client, key=keys.admin, **body):
        return client.post("/v1/load_lora_adapter", json=body, headers=H(key))

    with TestClient(create_app(settings)) as client:  # runtime loading off, as vLLM's default
        r = load(client, lora_name="rt-lora", lora_path=rt)
        assert r.status_code == 404 and "COSERVE_RUNTIME_LORA=1" in r.json()["error"]["message"], r.text
    settings.runtime_lora = True
    with TestClient(create_app(settings)) as client:
        assert load(client, keys.paid, lora_name="rt-lora", lora_path=rt).status_code == 403
        for body, status, fragment in (
                ({"lora_name": "rt-lora"}, 400, "lora_path"),
                ({"lora_name": "rt-lora", "lora_path": "rt"}, 400, "give an absolute path"),
                ({"lora_name": "rt-lora", "lora_path": str(tmp_path / "none")}, 400, "is not a directory"),
                ({"lora_name": "rt-lora", "lora_path": str(tmp_path)}, 400, "no adapter_config.json"),
                ({"lora_name": "big-lora", "lora_path": big}, 400, "up to rank 16 (COSERVE_MAX_LORA_RANK"),
                ({"lora_name": "tiny", "lora_path": rt}, 400, "is a name of the model"),
                ({"lora_name": "sql-lora", "lora_path": rt}, 400, "an adapter of COSERVE_LORA_MODULES"),
                ({"lora_name": "my lora", "lora_path": rt}, 400, "no spaces")):
            r = load(client, **body)
            assert r.status_code == status and fragment in r.json()["error"]["message"], (body, r.text)
        r = load(client, lora_name="rt-lora", lora_path=rt)
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'rt-lora' loaded.", r.text
        r = load(client, lora_name="rt-lora", lora_path=rt)
        assert r.status_code == 400 and "already loaded" in r.text, r.text
        assert load(client, lora_name="rt-lora", lora_path=rt, load_inplace=True).status_code == 200

        listed = client.get("/v1/models", headers=H(keys.paid)).json()["data"]
        assert [(m["id"], m["parent"]) for m in listed] == [("tiny", None), ("sql-lora", "tiny"), ("rt-lora", "tiny")]
        assert str(tmp_path) not in str(listed)
        assert client.get("/v1/models/rt-lora", headers=H(keys.paid)).json()["parent"] == "tiny"
        assert client.post("/tokenize", json={"model": "rt-lora", "prompt": "hi"}, headers=H(keys.paid)).is_success
        r = submit(client, keys.paid, model="rt-lora", max_tokens=4)
        assert r.status_code == 201 and r.json()["model"] == "rt-lora", r.text
        queued = wait_for(lambda: redis.Redis.from_url(settings.redis_url).lrange("coserve.tiny", 0, -1), 10,
                          "the adapter's task on the model's queue")
        assert r.json()["id"].encode() in queued[0]
        with session_scope(settings.sqlalchemy_url) as s:  # the sweeper's resends take the same queue
            assert queue_models(s, {"rt-lora", "sql-lora", "tiny"}) == {"rt-lora": "tiny", "sql-lora": "sql-lora",
                                                                         "tiny": "tiny"}

        def unload(name):
            return client.post("/v1/unload_lora_adapter", json={"lora_name": name}, headers=H(keys.admin))

        r = unload("rt-lora")
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'rt-lora' unloaded.", r.text
        r = unload("rt-lora")
        assert r.status_code == 404 and "'rt-lora' is not loaded" in r.json()["error"]["message"], r.text
        r = unload("sql-lora")
        assert r.status_code == 400 and "remove it there" in r.text, r.text
        r = submit(client, keys.paid, model="rt-lora")
        assert r.status_code == 422 and "unknown model 'rt-lora'" in r.text, r.text


def test_an_adapter_that_is_not_lora_is_refused_at_load_naming_its_peft_type(settings, keys, tmp_path):
    """vLLM serves LoRA adapters only: /v1/load_lora_adapter refuses a PEFT adapter of another kind (its
    adapter_config.json's peft_type) with a 400 that names it, rather than accept it and fail each of its jobs."""
    from fastapi.testclient import TestClient

    from app.main import create_app

    settings.runtime_lora = True
    with TestClient(create_app(settings)) as client:
        for peft_type, config in (("IA3", {"peft_type": "IA3", "r": 8}),
                                  ("PREFIX_TUNING", {"peft_type": "PREFIX_TUNING", "num_virtual_tokens": 20})):
            path = _adapter_dir(tmp_path / peft_type)
            (tmp_path / peft_type / "adapter_config.json").write_text(json.dumps(config))
            r = client.post("/v1/load_lora_adapter", json={"lora_name": "not-lora", "lora_path": path},
                            headers=H(keys.admin))
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert f"peft_type {peft_type!r}" in error["message"] and error["param"] == "lora_path", r.text
        assert [m["id"] for m in client.get("/v1/models", headers=H(keys.paid)).json()["data"]] == ["tiny"]


def test_the_rank_a_load_is_held_to_is_the_one_the_engine_arguments_give_vllm(settings, keys, tmp_path):
    """The operator's engine arguments win over COSERVE_MAX_LORA_RANK in the engine (vLLM's max_lora_rank): the
    API holds runtime adapters to that rank, so one the engine would fail job by job is refused at load."""
    from fastapi.testclient import TestClient

    from app.main import create_app

    rank_16, rank_32 = _adapter_dir(tmp_path / "r16", rank=16), _adapter_dir(tmp_path / "r32", rank=32)
    settings.runtime_lora, settings.vllm_engine_args = True, {"max_lora_rank": 8}
    with TestClient(create_app(settings)) as client:
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "r16", "lora_path": rank_16},
                        headers=H(keys.admin))
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert "has rank 16; this server serves runtime adapters up to rank 8" in message and "max_lora_rank" in message
        settings.vllm_engine_args = {"max_lora_rank": 32}  # more than COSERVE_MAX_LORA_RANK: the engine's wins
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "r32", "lora_path": rank_32},
                        headers=H(keys.admin))
        assert r.status_code == 200, r.text


def test_a_request_naming_an_adapter_of_the_resolver_directory_loads_it(settings, keys, tmp_path):
    """vLLM's filesystem LoRA resolver: an adapter not loaded yet, found as <COSERVE_LORA_RESOLVER_DIR>/<name>, is
    loaded by the first request that names it (then listed, its jobs on the model's queue); a directory it cannot
    serve answers why; a name outside the directory is an unknown model."""
    from fastapi.testclient import TestClient

    from app.main import create_app
    from app.services import lora_adapters
    from app.settings import Settings

    root = tmp_path / "adapters"
    _adapter_dir(root / "ada")
    (root / "ada" / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 8, "base_model_name_or_path": "SomeOrg/TINY"}))  # the model's name, a hub id's
    _adapter_dir(root / "other-base")
    (root / "other-base" / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 8, "base_model_name_or_path": "meta-llama/Llama-3.1-8B"}))
    _adapter_dir(root / "big", rank=64)
    _adapter_dir(tmp_path / "outside")
    settings.runtime_lora, settings.lora_resolver_dir = True, root
    with TestClient(create_app(settings)) as client:
        assert [m["id"] for m in client.get("/v1/models", headers=H(keys.paid)).json()["data"]] == ["tiny"]
        r = submit(client, keys.paid, model="ada", max_tokens=2)
        assert r.status_code == 201 and r.json()["model"] == "ada", r.text
        job_id = r.json()["id"]
        queued = wait_for(lambda: redis.Redis.from_url(settings.redis_url).lrange("coserve.tiny", 0, -1), 10,
                          "the adapter's task on the model's queue")
        assert job_id.encode() in b"".join(queued)
        listed = client.get("/v1/models", headers=H(keys.paid)).json()["data"]
        assert [(m["id"], m["parent"]) for m in listed] == [("tiny", None), ("ada", "tiny")]
        assert submit(client, keys.paid, model="ada", max_tokens=2).status_code == 201  # loaded once, served after
        for name, status, fragment in (("other-base", 404, "adapts 'meta-llama/Llama-3.1-8B', not this server's"),
                                       ("big", 400, "up to rank 16"), ("missing", 404, "unknown model 'missing'"),
                                       ("../outside", 404, "unknown model '../outside'")):
            r = client.post("/v1/completions", headers=H(keys.paid), json={"model": name, "prompt": "x"})
            assert r.status_code == status and fragment in r.json()["error"]["message"], (name, r.text)
        assert [m["id"] for m in client.get("/v1/models", headers=H(keys.paid)).json()["data"]] == ["tiny", "ada"]
        # unloaded, the next request that names it loads it again (/tokenize too, as vLLM's does)
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "ada"}, headers=H(keys.admin)).is_success
        assert client.post("/tokenize", json={"model": "ada", "prompt": "x"}, headers=H(keys.paid)).is_success
        assert "ada" in lora_adapters.loaded(settings, fresh=True)
        assert submit(client, keys.paid, model="ada", max_tokens=2).status_code == 201
        assert client.post("/tokenize", json={"model": "big", "prompt": "x"}, headers=H(keys.paid)).status_code == 400
    with pytest.raises(ValueError, match="set COSERVE_RUNTIME_LORA=1 too"):
        Settings(lora_resolver_dir=root)


def test_a_resolver_adapter_this_server_cannot_serve_is_refused_without_the_servers_paths(settings, keys, tmp_path,
                                                                                         caplog):
    """The resolver's refusals reach whoever named the adapter: they name the adapter and COSERVE_LORA_RESOLVER_DIR,
    not where that directory is on the server (the log has it)."""
    from fastapi.testclient import TestClient

    from app.main import create_app

    root = tmp_path / "adapters"
    (root / "noweights").mkdir(parents=True)
    (root / "noweights" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    _adapter_dir(root / "norank")
    (root / "norank" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    settings.runtime_lora, settings.lora_resolver_dir = True, root
    with TestClient(create_app(settings)) as client:
        for name, fragment in (("noweights", "no adapter_model.safetensors or adapter_model.bin in "
                                             "COSERVE_LORA_RESOLVER_DIR/noweights"),
                               ("norank", "COSERVE_LORA_RESOLVER_DIR/norank/adapter_config.json has no rank 'r'")):
            r = client.post("/v1/completions", headers=H(keys.paid), json={"model": name, "prompt": "x"})
            message = r.json()["error"]["message"]
            # vLLM's resolver: 404 for an adapter it does not find, 400 for one found that it cannot load
            assert r.status_code == 400 and fragment in message and str(tmp_path) not in message, (name, r.text)
            assert r.json()["error"]["param"] == "model"
        counted = client.post("/v1/responses/input_tokens", headers=H(keys.paid),
                              json={"model": "norank", "input": "x"})
        assert counted.status_code == 400 and "norank" in counted.json()["error"]["message"], counted.text
    assert str(root / "noweights") in caplog.text


def test_adapter_names_are_checked_where_the_settings_are_read(tmp_path):
    from pydantic import ValidationError

    from app.settings import Settings

    with pytest.raises(ValidationError, match="has the model's own name"):
        Settings(data_dir=tmp_path, model_name="m", lora_modules={"m": "/a"})
    with pytest.raises(ValidationError, match="no spaces"):
        Settings(data_dir=tmp_path, lora_modules={"my lora": "/a"})
    assert Settings(data_dir=tmp_path, model_name="m", lora_modules={"a": "/a"}).served_models == ("m", "a")
    with pytest.raises(ValidationError, match="model alias 'a' is already the name of the model or of a LoRA"):
        Settings(data_dir=tmp_path, model_name="m", lora_modules={"a": "/a"}, model_aliases=["a"])
    with pytest.raises(ValidationError, match="model alias 'my model': 1-200 characters, no spaces"):
        Settings(data_dir=tmp_path, model_aliases=["my model"])


def test_free_key_cannot_ask_for_paid(client, keys):
    r = submit(client, keys.free, tier="paid")
    assert r.status_code == 422 and "allows tier 'free'" in r.text
    assert submit(client, keys.paid, tier="free").json()["tier"] == "free"


def test_batch_job_with_window_and_chat_messages(client, keys):
    r = client.post("/v1/jobs", headers=H(keys.paid), json={
        "kind": "batch", "deadline_window_s": 3600, "messages": [{"role": "user", "content": "Summarize: a b c"}]})
    assert r.status_code == 201, r.text
    deadline = datetime.fromisoformat(r.json()["deadline_at"].replace("Z", "+00:00"))
    deadline = deadline if deadline.tzinfo else deadline.replace(tzinfo=UTC)
    assert timedelta(minutes=59) < deadline - datetime.now(UTC) < timedelta(minutes=61)


def test_oversized_body_413(client, keys, settings):
    big = "x" * (settings.max_body_bytes + 10)
    assert submit(client, keys.paid, prompt=big).status_code == 413


def test_chunked_body_over_the_limit_is_413_and_uploads_have_their_own_limit(settings, keys):
    from fastapi.testclient import TestClient

    from app.main import create_app

    small = settings.model_copy(update={"max_body_bytes": 2000, "max_file_bytes": 20_000})
    with TestClient(create_app(small)) as client:
        def chunks():  # no Content-Length: the limit must count the bytes as they arrive
            yield b'{"prompt": "'
            for _ in range(10):
                yield b"x" * 500
            yield b'"}'

        r = client.post("/v1/jobs", content=chunks(), headers={**H(keys.paid), "Content-Type": "application/json"})
        assert r.status_code == 413 and "2000 bytes" in r.json()["detail"]
        line = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'
        upload = line * (6000 // len(line))  # over the JSON limit, under the upload limit
        r = client.post("/v1/files", files={"file": ("in.jsonl", upload)}, data={"purpose": "batch"},
                        headers=H(keys.paid))
        assert r.status_code == 200, r.text
        r = client.post("/v1/files", files={"file": ("in.jsonl", upload * 4)}, data={"purpose": "batch"},
                        headers=H(keys.paid))
        assert r.status_code == 413 and "smaller file" in r.json()["error"]["message"]  # OpenAI's files API


def test_a_chunked_upload_is_never_held_whole_in_memory(settings, keys):
    """A body without a Content-Length was held whole by the body limit (its pieces, then joined) and the route read
    the file whole again: about twice the file's size in memory (400 MiB at the 200 MiB default). The limit now
    spools the body to disk as it counts it, and the route copies the upload to storage in pieces: the server's
    allocations stay far under one copy of the file. Real uvicorn, fed in pieces as a client streams it."""
    import tracemalloc

    import requests

    from app.main import create_app
    from tests.conftest import served_by_uvicorn

    line = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'
    piece = line * (64 * 1024 // len(line))
    pieces = 512  # about 32 MiB
    boundary = "coserve-upload"

    def multipart(count: int):  # made as it is sent: the client holds one piece at a time
        yield (f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--{boundary}\r\n'
               'Content-Disposition: form-data; name="file"; filename="in.jsonl"\r\n'
               'Content-Type: application/jsonl\r\n\r\n').encode()
        for _ in range(count):
            yield piece
        yield f"\r\n--{boundary}--\r\n".encode()

    headers = {**H(keys.paid), "Content-Type": f"multipart/form-data; boundary={boundary}"}
    with served_by_uvicorn(create_app(settings), "uvicorn-upload") as base:
        first = requests.post(f"{base}/v1/files", data=multipart(1), headers=headers, timeout=60)  # imports done
        assert first.status_code == 200 and first.json()["bytes"] == len(piece), first.text
        tracemalloc.start()
        try:
            r = requests.post(f"{base}/v1/files", data=multipart(pieces), headers=headers, timeout=300)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    size = pieces * len(piece)
    assert r.status_code == 200 and r.json()["bytes"] == size, r.text
    assert peak < size // 4, f"{peak} bytes allocated at the peak of a {size}-byte upload"


def test_a_download_is_never_held_whole_in_memory(settings, keys, tmp_path):
    """GET /v1/files/{id}/content read the whole file into memory and answered it in one piece (a batch's output
    file may be hundreds of MiB): it is streamed from storage a piece at a time now, with the headers it had. Real
    uvicorn; the client reads it in pieces too, so the process's peak is the server's own."""
    import hashlib
    import tracemalloc

    import requests

    from app.batch import storage
    from app.main import create_app
    from tests.conftest import served_by_uvicorn

    line = b'{"id": "batch_req_1", "custom_id": "a", "response": null, "error": null}\n'
    piece = line * (64 * 1024 // len(line))
    source, whole = tmp_path / "out.jsonl", hashlib.sha256()
    with source.open("wb") as out:
        for _ in range(512):  # about 32 MiB, written a piece at a time
            out.write(piece)
            whole.update(piece)
    with session_scope(settings.sqlalchemy_url) as s, source.open("rb") as content:
        row = storage.save_file(s, settings.data_dir, keys.tenant_id, "out.jsonl", "batch", content)
        file_id, size = row.id, row.bytes
    url = f"/v1/files/{file_id}/content"
    with served_by_uvicorn(create_app(settings), "uvicorn-download") as base:
        assert requests.head(f"{base}{url}", headers=H(keys.paid), timeout=60).status_code == 200  # imports done
        tracemalloc.start()
        try:
            got, read = hashlib.sha256(), 0
            with requests.get(f"{base}{url}", headers=H(keys.paid), stream=True, timeout=300) as r:
                for chunk in r.iter_content(64 * 1024):
                    got.update(chunk)
                    read += len(chunk)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        gone = requests.get(f"{base}/v1/files/file_nope/content", headers=H(keys.paid), timeout=60)
    assert r.status_code == 200 and r.headers["content-length"] == str(size) == str(read)
    assert r.headers["content-disposition"] == "attachment; filename=\"out.jsonl\"; filename*=UTF-8''out.jsonl"
    assert got.digest() == whole.digest() and gone.status_code == 404
    assert peak < size // 4, f"{peak} bytes allocated at the peak of a {size}-byte download"


def test_deadline_beyond_the_longest_window_is_422(client, keys):
    far = (datetime.now(UTC) + timedelta(days=400)).isoformat()
    r = submit(client, keys.paid, kind="batch", deadline_at=far)
    assert r.status_code == 422 and "days away" in r.text


def test_sampling_fields_are_kept_or_refused_by_what_the_engine_applies(client, keys, settings):
    r = submit(client, keys.paid, top_k=-1, min_p=0.05, temperature=0.7, seed=5)
    assert r.status_code == 201, r.text
    assert r.json()["sampling"] | {"top_k": 0, "min_p": 0.05, "repetition_penalty": 1.0} == r.json()["sampling"]
    r = submit(client, keys.paid, repetition_penalty=1.3)  # these workers run the own engine (settings.backend)
    assert r.status_code == 422 and "repetition_penalty" in r.text and "COSERVE_BACKEND=vllm" in r.text
    settings.backend, settings.spec_policy = "vllm", "adaspec"
    r = submit(client, keys.paid, repetition_penalty=1.3, frequency_penalty=-0.5)
    assert r.status_code == 201 and r.json()["sampling"]["frequency_penalty"] == -0.5, r.text
    r = submit(client, keys.paid, min_p=0.1)  # vLLM's speculative decoding refuses min_p
    assert r.status_code == 422 and "min_p" in r.text


def test_a_prompt_of_token_ids(client, keys):
    r = client.post("/v1/jobs", json={"prompt_token_ids": [5, 6, 7], "max_tokens": 2}, headers=H(keys.paid))
    assert r.status_code == 201 and r.json()["prompt_tokens"] == 3, r.text
    r = client.post("/v1/jobs", json={"prompt_token_ids": [5], "prompt": "x"}, headers=H(keys.paid))
    assert r.status_code == 422 and "prompt_token_ids" in r.text


def test_a_schema_json_cannot_carry_is_a_4xx_not_a_500(client, keys, settings):
    settings.backend = "vllm"  # structured outputs pass the engine check; the schema itself must not
    body = '{"prompt": "x", "structured_outputs": {"json": {"type": "number", "maximum": NaN}}}'
    r = client.post("/v1/jobs", content=body, headers={**H(keys.paid), "Content-Type": "application/json"})
    assert r.status_code == 422 and "not finite" in r.text, r.text
    body = ('{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "response_format": '
            '{"type": "json_schema", "json_schema": {"name": "n", "schema": {"maximum": Infinity}}}}')
    r = client.post("/v1/chat/completions", content=body, headers={**H(keys.paid), "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text


def test_a_structural_tag_xgrammar_cannot_compile_is_a_4xx_saying_why(client, keys, settings):
    settings.backend = "vllm"  # structured outputs pass the engine check; the tag itself must not
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}
    bad = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<a"], "tags": [
        {"begin": "<b>", "content": {"type": "any_text"}, "end": "</b>"}]}}
    r = client.post("/v1/chat/completions", json={**chat, "response_format": bad}, headers=H(keys.paid))
    assert r.status_code == 400 and "does not match any trigger" in r.json()["error"]["message"], r.text
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "response_format": {
        "type": "structural_tag", "structures": []}}, headers=H(keys.paid))
    assert r.status_code == 400 and "triggers: Field required" in r.json()["error"]["message"], r.text
    r = client.post("/v1/jobs", json={"prompt": "x", "structured_outputs": {"structural_tag": "{"}},
                    headers=H(keys.paid))
    assert r.status_code == 422 and "structural_tag is not valid JSON" in r.text, r.text
    good = {**bad, "format": {**bad["format"], "triggers": ["<b"]}}
    r = client.post("/v1/jobs", json={"prompt": "x", "structured_outputs": {"structural_tag": json.dumps(good)}},
                    headers=H(keys.paid))
    assert r.status_code == 201 and r.json()["sampling"]["structured_outputs"] == {
        "structural_tag": json.dumps(good)}, r.text
    settings.backend = "torch"  # the own engine constrains nothing: refused, saying so
    r = client.post("/v1/chat/completions", json={**chat, "response_format": good}, headers=H(keys.paid))
    assert r.status_code == 400 and "vLLM backend" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("constraint, said", [
    ({"regex": "(unclosed"}, "regex does not compile (Regex parsing error at position 10: The parenthesis is not "),
    ({"grammar": "root ::= ("}, "grammar does not compile (EBNF parser error at line 1, column 11"),
    ({"json": {"type": "object", "properties": {"home": {"$ref": "#/$defs/Home"}}}},
     "json does not compile (Cannot find field $defs in #/$defs/Home)"),
    # a pattern nesting 40000 groups (80 KB) crashed the API process: xgrammar's schema converter overflows its stack
    ({"json": {"type": "string", "pattern": "(" * 40_000 + "a" + ")" * 40_000}},
     "json holds a pattern nesting groups deeper than 1000 levels"),
    # xgrammar compiles it, but vLLM's validation sends the schema to guidance, which refused it on the worker
    ({"json": {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}},
     "json is refused by the workers' engine: uniqueItems at #/properties/tags: xgrammar, the workers' engine's "
     "backend, does not follow it")], ids=["regex", "grammar", "json", "json-pattern", "json-uniqueItems"])
def test_a_constraint_vllm_cannot_compile_is_refused_as_it_is_submitted(client, keys, settings, constraint, said):
    """vLLM's server compiles a regex, grammar or JSON schema before its engine sees the request (xgrammar, then
    guidance): one neither reads is a 400 at once, a stream's too, not a job that fails on its worker."""
    settings.backend = "vllm"
    r = client.post("/v1/jobs", json={"prompt": "x", "structured_outputs": constraint}, headers=H(keys.paid))
    assert r.status_code == 422 and said in r.text, r.text
    (field, _), = constraint.items()
    assert r.json()["detail"][0]["loc"] == ["body", "structured_outputs", field], r.text
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": True}
    r = client.post("/v1/chat/completions", json={**chat, "structured_outputs": constraint}, headers=H(keys.paid))
    assert r.status_code == 400 and said in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == f"structured_outputs.{field}", r.text
    r = client.post("/v1/responses", json={"model": "tiny", "input": "x", "stream": True,
                                           "structured_outputs": constraint}, headers=H(keys.paid))
    assert r.status_code == 400 and said in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == f"structured_outputs.{field}", r.text  # vLLM's field, as written
    if field == "json":  # OpenAI's forms of a schema: chat's response_format, Responses' text.format
        fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": constraint["json"]}}
        r = client.post("/v1/chat/completions", json={**chat, "response_format": fmt}, headers=H(keys.paid))
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
        assert said in r.json()["error"]["message"], r.text
        r = client.post("/v1/responses", json={"model": "tiny", "input": "x", "stream": True, "text": {"format": {
            "type": "json_schema", "name": "n", "schema": constraint["json"]}}}, headers=H(keys.paid))
        assert r.status_code == 400 and said in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == "text.format", r.text


def test_a_structural_tag_whose_schema_pattern_nests_deep_is_refused_not_a_crash(client, keys, settings):
    """xgrammar's schema converter overflows its stack on a pattern nesting tens of thousands of groups (the process
    dies): a structural tag's schema is refused before xgrammar sees it, as a JSON schema is."""
    settings.backend = "vllm"
    deep = {"type": "string", "pattern": "(" * 40_000 + "a" + ")" * 40_000}
    tag = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<b"], "tags": [
        {"begin": "<b>", "content": {"type": "json_schema", "json_schema": deep}, "end": "</b>"}]}}
    r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                                  "response_format": tag}, headers=H(keys.paid))
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
    assert "structural_tag holds a pattern nesting groups deeper than 1000 levels" in r.text, r.text


@pytest.mark.parametrize("regex, said", [
    (r"\p{L}+", "Unicode character class"), ("a++", "Two consecutive repetition"),
    ("(?i)paris", "Group modifier flag"), ("(?P<city>Paris)", "Group modifier flag")],
    ids=["unicode-class", "possessive", "inline-flag", "named-group"])
def test_a_regex_only_guidance_reads_is_refused_as_the_workers_xgrammar_engine_refuses_it(client, keys, settings,
                                                                                          regex, said):
    """vLLM's validation sends a regex xgrammar cannot read to guidance, but the workers' engine compiles with
    xgrammar (``pin_grammar_backend``): it failed there after the API took it. It is a 400 as it is submitted,
    naming the field, xgrammar's reason and what to write instead."""
    settings.backend = "vllm"
    r = client.post("/v1/jobs", json={"prompt": "x", "structured_outputs": {"regex": regex}}, headers=H(keys.paid))
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "structured_outputs", "regex"], r.text
    assert said in r.text and "under xgrammar" in r.text and "spell the characters out" in r.text, r.text


def test_a_constraint_is_checked_with_the_backend_the_live_workers_publish(client, keys, settings, monkeypatch):
    """A worker whose engine compiles with guidance (COSERVE_VLLM_ENGINE_ARGS naming it) says so in its heartbeat:
    the API checks constraints with guidance then, accepting the ``\\p{L}`` regex guidance serves and refusing a
    schema guidance does not implement (``not``) with a 400 naming the field; with no worker up, xgrammar again."""
    from app.db.models import WorkerState
    from app.services import routing

    monkeypatch.setattr(routing, "REFRESH_S", 0.0)  # read the workers on every request here
    settings.backend = "vllm"
    with session_scope(settings.sqlalchemy_url) as s:  # its heartbeat's row (workers.gpu_worker's _state)
        s.add(WorkerState(id="w-guidance", model=settings.model_name, queue="q", device="cpu",
                          state={"served": [settings.model_name], "grammar_backend": "guidance"}))
    r = client.post("/v1/jobs", json={"prompt": "x", "structured_outputs": {"regex": r"\p{L}+"}}, headers=H(keys.paid))
    assert r.status_code == 201, r.text
    schema = {"type": "object", "properties": {"name": {"type": "string", "not": {"const": "x"}}}}
    r = client.post("/v1/chat/completions", json={
        "model": settings.model_name, "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}},
        headers=H(keys.paid))
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
    assert "Unimplemented keys" in r.text and "under guidance" in r.text and "give a JSON schema without" in r.text
    with session_scope(settings.sqlalchemy_url) as s:  # that worker stops beating: no longer live
        s.get(WorkerState, "w-guidance").heartbeat_at = datetime.now(UTC) - timedelta(minutes=5)
    r = client.post("/v1/jobs", json={"prompt": "x", "structured_outputs": {"regex": r"\p{L}+"}}, headers=H(keys.paid))
    assert r.status_code == 422 and "under xgrammar" in r.text, r.text


def test_a_structured_output_is_refused_at_submit_where_no_live_worker_can_run_its_backend(client, keys, settings,
                                                                                          monkeypatch):
    """A worker whose named backend vLLM cannot make (lm-format-enforcer 0.11 under vLLM 0.32) says so in its
    heartbeat (``grammar_unavailable``): a constrained request is a 400 at submit naming the field and what to do,
    not a job that fails on the worker; one without a structured output is taken."""
    from app.db.models import WorkerState
    from app.services import routing

    monkeypatch.setattr(routing, "REFRESH_S", 0.0)  # read the workers on every request here
    settings.backend = "vllm"
    why = ("the worker's structured-output backend lm-format-enforcer cannot run on this engine: vllm is not "
           "installed; send the request without a structured output, or have the operator name another backend "
           "(--structured-outputs-config in COSERVE_VLLM_ENGINE_ARGS)")
    with session_scope(settings.sqlalchemy_url) as s:  # its heartbeat's row (workers.gpu_worker's _state)
        s.add(WorkerState(id="w-lmfe", model=settings.model_name, queue="q", device="cpu", state={
            "served": [settings.model_name], "grammar_backend": "lm-format-enforcer", "grammar_unavailable": why}))
    r = client.post("/v1/jobs", json={"prompt": "x", "structured_outputs": {"choice": ["yes", "no"]}},
                    headers=H(keys.paid))
    assert r.status_code == 422 and "no live worker of the model can run a structured output" in r.text, r.text
    assert why in r.text, r.text
    r = client.post("/v1/chat/completions", json={  # a chat request waits on no job that cannot run
        "model": settings.model_name, "messages": [{"role": "user", "content": "x"}],
        "structured_outputs": {"regex": "[ab]+"}}, headers=H(keys.paid))
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs", r.text
    assert client.post("/v1/jobs", json={"prompt": "x"}, headers=H(keys.paid)).status_code == 201


@pytest.mark.parametrize("path, body, status, field", [
    ("/v1/jobs", {"prompt": "x", "structured_outputs": {"json_object": True}}, 422, "structured_outputs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_object"}}, 400, "response_format"),
    ("/v1/responses", {"input": "x", "text": {"format": {"type": "json_object"}}}, 400, "text.format")],
    ids=["jobs", "chat", "responses"])
def test_a_json_object_constraint_is_refused_where_the_workers_compile_with_outlines(client, keys, settings,
                                                                                     monkeypatch, path, body,
                                                                                     status, field):
    """vLLM's outlines backend refuses a json_object constraint (``validate_structured_output_request_outlines``:
    "does not support json_object specifications"): the API took one, and its job failed on a worker whose engine
    compiles with outlines. It is a 400 as it is submitted, saying what to give instead; a JSON schema of an object
    is taken."""
    from app.db.models import WorkerState
    from app.services import routing

    monkeypatch.setattr(routing, "REFRESH_S", 0.0)  # read the workers on every request here
    settings.backend = "vllm"
    with session_scope(settings.sqlalchemy_url) as s:  # its heartbeat's row (workers.gpu_worker's _state)
        s.add(WorkerState(id="w-outlines", model=settings.model_name, queue="q", device="cpu",
                          state={"served": [settings.model_name], "grammar_backend": "outlines"}))
    r = client.post(path, json={"model": settings.model_name, **body}, headers=H(keys.paid))
    assert r.status_code == status and field in r.text and "outlines" in r.text, r.text
    said = r.json()["detail"][0]["msg"] if status == 422 else r.json()["error"]["message"]
    assert 'give the JSON schema {"type": "object"} instead' in said, said
    r = client.post("/v1/jobs", json={"prompt": "x", "structured_outputs": {"json": {"type": "object"}}},
                    headers=H(keys.paid))
    assert r.status_code == 201, r.text


def test_a_property_class_inside_a_character_class_is_refused_as_xgrammar_misreads_it(client, keys, settings):
    """xgrammar reads ``[\\p{L}]`` as the characters p, {, L and } without an error: the API passed a regex whose
    meaning changed on the worker. It is a 400 naming the field and what to write instead."""
    settings.backend = "vllm"
    r = client.post("/v1/jobs", json={"prompt": "x", "structured_outputs": {"regex": r"[\p{L} ]+"}},
                    headers=H(keys.paid))
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "structured_outputs", "regex"], r.text
    assert "inside [...]" in r.text and "spell the characters out as ranges" in r.text, r.text


_TAG = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<b"], "tags": [
    {"begin": "<b>", "content": {"type": "any_text"}, "end": "</b>"}]}}


def test_a_structural_tags_schema_is_held_to_what_xgrammar_misreads(client, keys, settings):
    r"""A tag's JSON schema compiles with xgrammar inside the tag (vLLM 0.32 never sends a tag to guidance): a pattern
    xgrammar misreads ([\p{L}]) is refused naming the tag's schema, as it is in a json_schema; a feature xgrammar
    does not follow but compiles (uniqueItems), which a json_schema's check refuses as vLLM sends it to guidance, is
    taken in a tag, as vLLM takes it."""
    settings.backend = "vllm"

    def sent(schema: dict):
        tag = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<b"], "tags": [
            {"begin": "<b>", "content": {"type": "json_schema", "json_schema": schema}, "end": "</b>"}]}}
        return client.post("/v1/jobs", json={"prompt": "x", "structured_outputs": {"structural_tag": json.dumps(tag)}},
                           headers=H(keys.paid))

    r = sent({"type": "string", "pattern": r"[\p{L} ]+"})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == "structural_tag", r.text
    assert "structural_tag's" in r.text and "#/format/tags/0/content/json_schema" in r.text and "inside [...]" in r.text
    assert sent({"type": "array", "uniqueItems": True}).status_code == 201


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                              "response_format": _TAG}),
    ("/v1/responses", {"model": "tiny", "input": "x", "text": {"format": _TAG}}),
    ("/v1/jobs", {"prompt": "x", "structured_outputs": {"structural_tag": json.dumps(_TAG)}})])
def test_another_request_is_answered_while_a_structural_tag_compiles(client, keys, settings, monkeypatch, path, body):
    """xgrammar's first import takes seconds: a request's structural tag compiles off the event loop, so the API
    answers other requests meanwhile (here the compile is held until the other request is answered)."""
    _answered_while_compiling(client, keys, settings, monkeypatch, path, {"json": body})


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded"])  # the latter: curl -d's
@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                              "response_format": _TAG}),
    ("/v1/responses", {"model": "tiny", "input": "x", "text": {"format": _TAG}}),
    ("/v1/jobs", {"prompt": "x", "structured_outputs": {"structural_tag": json.dumps(_TAG)}})])
def test_a_structural_tag_in_a_body_sent_as_another_content_type_is_refused_before_it_compiles(
        client, keys, settings, monkeypatch, path, body, ctype):
    """A JSON body sent as another content type is a 415 (as in vLLM's server) before any of it is read: its
    structural tag never reaches xgrammar."""
    from app import structural_tag

    settings.backend = "vllm"
    compiled = []

    def compile_(tag, text):  # refuses it, so a route that read the body answers at once (no worker here)
        compiled.append(tag)
        raise ValueError("compiled")

    monkeypatch.setattr(structural_tag, "_compile", compile_)
    r = client.post(path, content=json.dumps(body), headers={**H(keys.paid), "Content-Type": ctype})
    assert r.status_code == 415 and "Content-Type: application/json" in r.text and compiled == [], r.text


def _answered_while_compiling(client, keys, settings, monkeypatch, path: str, sent: dict) -> None:
    from app import structural_tag

    settings.backend = "vllm"
    compiling, answered, compiled = threading.Event(), threading.Event(), threading.Event()

    def held(tag, text):
        compiling.set()
        answered.wait(20)  # on the event loop this would hold the other request until it gives up
        compiled.set()
        raise ValueError("held compile done")

    monkeypatch.setattr(structural_tag, "_compile", held)
    headers = {**H(keys.paid), **sent.get("headers", {})}
    tagged = []
    chat = threading.Thread(target=lambda: tagged.append(client.post(path, **{**sent, "headers": headers})))
    chat.start()
    assert compiling.wait(60), "the structural tag never reached its compile"
    r = client.get("/v1/models", headers=H(keys.paid))
    held_meanwhile = not compiled.is_set()
    answered.set()
    chat.join()
    assert r.status_code == 200 and held_meanwhile, "the other request waited for the structural tag's compile"
    assert tagged[0].status_code in (400, 422) and "held compile done" in tagged[0].text, tagged[0].text


def test_an_api_on_vllm_imports_xgrammar_at_start_up_not_at_a_request(settings, monkeypatch):
    from fastapi.testclient import TestClient

    from app import output_constraints
    from app.main import create_app

    warmed = []
    monkeypatch.setattr(output_constraints, "warm_up", lambda: warmed.append(True))
    with TestClient(create_app(settings)):
        assert warmed == []  # the own torch engine constrains nothing: no structural tag is ever compiled
    settings.backend = "vllm"
    with TestClient(create_app(settings)):
        assert warmed == [True]


def test_a_native_job_asking_alternatives_out_of_range_hears_the_range_and_why(client, keys):
    for field in ("logprobs", "prompt_logprobs"):
        for asked, said in ((-1, "0-20; got -1 (-1, the whole vocabulary, is more than the 20 vLLM's max_logprobs"),
                            (21, "0-20; got 21")):
            r = client.post("/v1/jobs", json={"prompt": "x", field: asked}, headers=H(keys.paid))
            assert r.status_code == 422 and said in r.text, r.text
            assert r.json()["detail"][0]["loc"] == ["body", field], r.text


def test_idempotency_key_returns_same_job(client, keys):
    h = {**H(keys.paid), "Idempotency-Key": "abc-1"}
    a = client.post("/v1/jobs", json={"prompt": "hi"}, headers=h)
    b = client.post("/v1/jobs", json={"prompt": "hi"}, headers=h)
    assert a.status_code == 201 and b.status_code == 200 and a.json()["id"] == b.json()["id"]
    # the same key for another request is a client bug: say so instead of returning the old job
    d = client.post("/v1/jobs", json={"prompt": "something else"}, headers=h)
    assert d.status_code == 409 and a.json()["id"] in d.json()["detail"]
    # the key is per tenant
    c = client.post("/v1/jobs", json={"prompt": "hi"}, headers={**H(keys.other), "Idempotency-Key": "abc-1"})
    assert c.json()["id"] != a.json()["id"]


def test_an_idempotent_retry_after_its_deadline_passed_answers_the_job(client, keys):
    body = {"prompt": "hi", "kind": "batch", "deadline_at": (datetime.now(UTC) + timedelta(seconds=1)).isoformat()}
    a = client.post("/v1/jobs", json=body, headers={**H(keys.paid), "Idempotency-Key": "late-1"})
    assert a.status_code == 201, a.text
    time.sleep(1.2)
    b = client.post("/v1/jobs", json=body, headers={**H(keys.paid), "Idempotency-Key": "late-1"})
    assert b.status_code == 200 and b.json()["id"] == a.json()["id"], b.text
    c = client.post("/v1/jobs", json=body, headers={**H(keys.paid), "Idempotency-Key": "late-2"})  # a new request
    assert c.status_code == 422 and "in the past" in c.text


def test_idempotency_race_loser_gets_409_for_a_different_body(client, keys, settings, monkeypatch):
    """Two submissions with one key race past the lookup; the insert's unique constraint decides,
    and the loser gets the winner's job only when it sent the same request."""
    from app.auth import authenticate
    from app.schemas import JobCreate
    from app.services import jobs as job_service

    h = {**H(keys.paid), "Idempotency-Key": "race-1"}
    first = client.post("/v1/jobs", json={"prompt": "hi"}, headers=h).json()
    monkeypatch.setattr(job_service, "_by_idempotency_key", _miss_once(job_service._by_idempotency_key))
    with session_scope(settings.sqlalchemy_url) as s:
        principal = authenticate(s, keys.paid)
        with pytest.raises(job_service.IdempotencyConflict):
            job_service.submit_job(s, principal, JobCreate(prompt="other"), settings, idempotency_key="race-1",
                                   dispatch=False)
    monkeypatch.setattr(job_service, "_by_idempotency_key", _miss_once(job_service._by_idempotency_key))
    with session_scope(settings.sqlalchemy_url) as s:
        same = job_service.submit_job(s, principal, JobCreate(prompt="hi"), settings, idempotency_key="race-1",
                                      dispatch=False)
    assert not same.created and same.job.id == first["id"]


def _miss_once(lookup):
    calls = []

    def lookup_missing_first(*args):
        calls.append(args)
        return None if len(calls) == 1 else lookup(*args)
    return lookup_missing_first


def test_list_rejects_unknown_filter_values(client, keys):
    r = client.get("/v1/jobs", params={"status": "done"}, headers=H(keys.paid))
    assert r.status_code == 422 and "'queued'" in r.text and "'succeeded'" in r.text
    r = client.get("/v1/jobs", params={"tier": "gold"}, headers=H(keys.paid))
    assert r.status_code == 422 and "'free'" in r.text and "'paid'" in r.text
    r = client.get("/v1/jobs", params={"kind": "offline"}, headers=H(keys.paid))
    assert r.status_code == 422 and "'interactive'" in r.text
    r = client.get("/v1/jobs", params={"created_after": "2030-01-01T00:00:00"}, headers=H(keys.paid))
    assert r.status_code == 422 and "timezone" in r.text


def test_list_by_creation_time_and_batch(client, keys, settings):
    from sqlalchemy import update

    before = submit(client, keys.paid).json()["id"]
    time.sleep(0.05)
    mark = datetime.now(UTC)
    time.sleep(0.05)
    after = submit(client, keys.paid).json()["id"]

    def ids(**params):
        return [j["id"] for j in client.get("/v1/jobs", params=params, headers=H(keys.paid)).json()["data"]]
    assert ids(created_after=mark.isoformat()) == [after]
    assert ids(created_before=mark.isoformat()) == [before]
    assert ids(created_after=(mark - timedelta(hours=1)).isoformat(),
               created_before=(mark + timedelta(hours=1)).isoformat()) == [after, before]
    assert ids(created_after=mark.astimezone(timezone(timedelta(hours=5))).isoformat()) == [after]  # any offset
    with session_scope(settings.sqlalchemy_url) as s:  # a batch line's job (the Batch API sets batch_id)
        from app.db.models import Batch, File

        s.add(File(id="file_x", tenant_id=keys.tenant_id, filename="in.jsonl", purpose="batch", bytes=0, path="x"))
        s.flush()
        s.add(Batch(id="batch_x", tenant_id=keys.tenant_id, endpoint="/v1/chat/completions", input_file_id="file_x",
                    completion_window="24h", tier="paid"))
        s.flush()
        s.execute(update(Job).where(Job.id == before).values(batch_id="batch_x"))
    assert ids(batch_id="batch_x") == [before]
    assert ids(batch_id="batch_none") == []


def test_revoked_key_gets_401(client, keys):
    tenant = client.post("/v1/admin/tenants", json={"name": "revokee"}, headers=H(keys.admin)).json()
    key, key_id = tenant["api_key"], tenant["key_id"]
    assert client.get("/v1/jobs", headers=H(key)).status_code == 200  # cached as valid
    assert client.post(f"/v1/admin/keys/{key_id}/revoke", headers=H(keys.paid)).status_code == 403
    r = client.post(f"/v1/admin/keys/{key_id}/revoke", headers=H(keys.admin))
    assert r.status_code == 200 and r.json()["revoked"] is True and key not in r.text
    assert client.get("/v1/jobs", headers=H(key)).status_code == 401
    assert client.post("/v1/jobs", json={"prompt": "hi"}, headers=H(key)).status_code == 401
    assert client.post(f"/v1/admin/keys/{key_id}/revoke", headers=H(keys.admin)).status_code == 200  # idempotent
    assert client.post("/v1/admin/keys/key_nope/revoke", headers=H(keys.admin)).status_code == 404
    listed = client.get(f"/v1/admin/tenants/{tenant['tenant_id']}/keys", headers=H(keys.admin)).json()
    assert [(k["id"], k["revoked"]) for k in listed] == [(key_id, True)]
    assert client.get("/v1/jobs", headers=H(keys.paid)).status_code == 200  # other keys unaffected


def test_list_filters_and_cursor_pagination(client, keys):
    ids = [submit(client, keys.paid).json()["id"] for _ in range(5)]
    ids.append(client.post("/v1/jobs", headers=H(keys.paid),
                           json={"prompt": "b", "kind": "batch", "deadline_window_s": 60}).json()["id"])
    seen, cursor = [], None
    while True:
        page = client.get("/v1/jobs", params={"limit": 2, **({"cursor": cursor} if cursor else {})},
                          headers=H(keys.paid)).json()
        seen += [j["id"] for j in page["data"]]
        cursor = page["next_cursor"]
        if not cursor:
            break
    assert sorted(seen) == sorted(ids) and len(seen) == len(set(seen))
    batch = client.get("/v1/jobs", params={"kind": "batch"}, headers=H(keys.paid)).json()["data"]
    assert [j["id"] for j in batch] == [ids[-1]]
    off = client.get("/v1/jobs", params={"limit": 2, "offset": 2}, headers=H(keys.paid)).json()["data"]
    assert [j["id"] for j in off] == seen[2:4]
    assert client.get("/v1/jobs", params={"status": "succeeded"}, headers=H(keys.paid)).json()["data"] == []


def test_cancel_queued_job(client, keys, settings):
    job = submit(client, keys.paid).json()
    r = client.post(f"/v1/jobs/{job['id']}/cancel", headers=H(keys.paid))
    assert r.status_code == 200 and (r.json()["status"], r.json()["cancelled"]) == ("cancelled", True), r.text
    # cancelling again changes nothing, and its answer says this cancel did not stop the job (it had ended): the job
    # alone read the same as the answer of the cancel that did
    again = client.post(f"/v1/jobs/{job['id']}/cancel", headers=H(keys.paid)).json()
    assert (again["status"], again["cancelled"]) == ("cancelled", False), again
    with session_scope(settings.sqlalchemy_url) as s:
        terminal = s.scalars(select(JobEvent).where(JobEvent.job_id == job["id"],
                                                    JobEvent.to_status == "cancelled")).all()
    assert len(terminal) == 1


def test_the_cancel_of_a_running_job_answers_once_its_worker_wrote_what_it_kept(client, keys, settings, monkeypatch):
    """A worker (played here by a thread that does what ``workers/engine_thread.py`` does) hears the cancel, writes
    what the attempt produced and says so with a ``kept`` event; the cancel's answer holds that. Where no worker
    answers, the cancel answers after ``cancel_wait_s`` with the job cancelled and nothing kept."""
    import threading

    from app.services.streaming import CANCEL_CHANNEL, StreamEvent, publish
    from workers import lease as leases

    url, r = settings.sqlalchemy_url, redis.Redis.from_url(settings.redis_url)
    silent, heard = (submit(client, keys.paid).json()["id"] for _ in range(2))
    with session_scope(url) as s:
        held = {job_id: leases.acquire(s, job_id, "w1", 30) for job_id in (silent, heard)}
    monkeypatch.setattr(settings, "cancel_wait_s", 0.3)
    got = client.post(f"/v1/jobs/{silent}/cancel", headers=H(keys.paid)).json()
    assert (got["status"], got["output_text"], got["completion_tokens"]) == ("cancelled", None, None)

    pubsub = r.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(CANCEL_CHANNEL)

    def worker() -> None:
        for message in pubsub.listen():
            if message["data"] == heard.encode():
                time.sleep(0.2)  # the engine's step ends first
                with session_scope(url) as s:
                    assert leases.keep_cancelled(s, held[heard], {"output_text": "abc", "completion_tokens": 3})
                publish(r, heard, StreamEvent("kept", held[heard].attempt, status="cancelled"))
                return
    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    monkeypatch.setattr(settings, "cancel_wait_s", 30.0)
    got = client.post(f"/v1/jobs/{heard}/cancel", headers=H(keys.paid)).json()
    assert (got["status"], got["output_text"], got["completion_tokens"]) == ("cancelled", "abc", 3)
    thread.join(5)


def test_broker_down_job_stays_queued(client, keys, settings, monkeypatch):
    from app.services import dispatch

    # a broker on a port where nothing listens: the job is accepted and stays queued
    monkeypatch.setattr(settings, "redis_url", "redis://127.0.0.1:1/0")
    r = submit(client, keys.paid)
    # committed as dispatched (with a broker configured, rows go in ready to send)
    assert r.status_code == 201 and r.json()["status"] == "dispatched"

    def events():
        with session_scope(settings.sqlalchemy_url) as s:
            return [(e.from_status, e.to_status) for e in s.scalars(
                select(JobEvent).where(JobEvent.job_id == r.json()["id"]).order_by(JobEvent.id))]
    # the dispatcher fails to send it (with retries) and hands it back to the sweeper
    wait_for(lambda: len(events()) == 3, 20, "the failed send to be undone")
    assert events() == [(None, "queued"), ("queued", "dispatched"), ("dispatched", "queued")]
    with session_scope(settings.sqlalchemy_url) as s:
        assert s.get(Job, r.json()["id"]).status == "queued"
    dispatch.get_celery.cache_clear()


def test_health_and_readiness(client, settings):
    assert client.get("/healthz").json() == {"status": "ok"}
    r = client.get("/readyz")
    assert r.status_code == 503 and r.json()["checks"]["workers"].startswith("error")
    assert r.json()["checks"]["database"] == "ok" and r.json()["checks"]["redis"] == "ok"
    assert client.get("/health").status_code == 503  # vLLM's probe says the same, by its status alone
    assert client.get("/version").json()["version"] == importlib.metadata.version("coserve")


def test_the_api_migrates_a_database_behind_it_and_says_when_one_is_ahead(tmp_path, redis_url, tiny_model_dir,
                                                                          caplog):
    """An API started before any worker, on a database behind its migrations, migrates it as the workers do (it
    failed every request that read a new column, and refused COSERVE_ADMIN_KEY until restarted); on a database
    newer than it knows, its /readyz says so and what to do (it said the database was ok), and its start-up logs
    it."""
    from fastapi.testclient import TestClient
    from sqlalchemy import text

    from app.db.migrate import upgrade
    from app.main import create_app
    from tests.conftest import make_settings

    url = f"sqlite:///{tmp_path / 'behind.db'}"
    upgrade(url, "0021")
    s = make_settings(tmp_path, url, redis_url, tiny_model_dir)
    s.admin_key = "sk-admin-from-the-environment"
    with TestClient(create_app(s)) as c:
        assert c.get("/readyz").json()["checks"]["database"] == "ok"
        assert c.get("/v1/admin/tenants", headers={"Authorization": f"Bearer {s.admin_key}"}).status_code == 200
    with get_engine(url).begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = '9999'"))
    with caplog.at_level("ERROR"), TestClient(create_app(s)) as c:
        database = c.get("/readyz").json()["checks"]["database"]
    assert database.startswith("error: the database's schema is at revision 9999, newer than this coserve "
                               "knows"), database
    assert any("schema is at revision 9999" in r.getMessage() for r in caplog.records)


def test_readiness_needs_a_live_worker_of_the_model_and_warns_of_an_unserved_adapter(settings, keys, tmp_path):
    from fastapi.testclient import TestClient

    from app.db.models import WorkerState
    from app.main import create_app
    from workers.engine_thread import KEPT_ABORT_LEASES

    def beat(model: str, served: list[str] | None) -> None:
        with session_scope(settings.sqlalchemy_url) as s:
            row = s.get(WorkerState, "w1") or WorkerState(id="w1", queue="q", device="cpu")
            row.model, row.heartbeat_at, row.draining = model, datetime.now(UTC), False
            row.state = {"served": served} if served is not None else {}
            s.add(row)

    s = settings.model_copy(update={"lora_modules": {"tilted": str(tmp_path)}})
    with TestClient(create_app(s)) as c:
        beat("another-model", None)  # workers of a model the API does not name: its jobs would never run
        r = c.get("/readyz")
        assert r.status_code == 503 and f"none serving {s.model_name!r}" in r.json()["checks"]["workers"]
        assert "'another-model'" in r.json()["checks"]["workers"] and c.get("/health").status_code == 503
        beat(s.model_name, None)  # a row without its served list (an older worker) serves its model
        r = c.get("/readyz")
        assert r.status_code == 200 and r.json()["checks"]["workers"] == "1 live"
        assert r.json()["checks"]["adapters"].startswith("warning: no live worker serves 'tilted'")
        beat(s.model_name, [s.model_name, "tilted"])
        assert c.get("/readyz").json()["checks"] == {"database": "ok", "redis": "ok", "workers": "1 live"}
        assert [w["served"] for w in c.get("/admin/api/overview", headers=H(keys.admin)).json()["workers"]] \
            == [[s.model_name, "tilted"]]
    s.runtime_lora = True  # adapters loaded at runtime need workers that load them
    with TestClient(create_app(s)) as c:
        r = c.get("/readyz")
        assert r.status_code == 200 and "COSERVE_RUNTIME_LORA=1 on the workers" in r.json()["checks"]["runtime_lora"]
        with session_scope(settings.sqlalchemy_url) as db:
            db.get(WorkerState, "w1").state = {"served": [s.model_name, "tilted"], "runtime_lora": True}
        assert "runtime_lora" not in c.get("/readyz").json()["checks"]
        s.lora_resolver_dir = tmp_path / "no-such-dir"  # (the app reads its settings object per request)
        assert "is not a directory" in c.get("/readyz").json()["checks"]["lora_resolver_dir"]
        s.lora_resolver_dir = tmp_path
        assert "lora_resolver_dir" not in c.get("/readyz").json()["checks"]
        # a worker whose engine serves less context than the API holds jobs to (the tiny model's 512 tokens)
        with session_scope(settings.sqlalchemy_url) as db:
            db.get(WorkerState, "w1").state = {"served": [s.model_name, "tilted"], "runtime_lora": True,
                                               "context_length": 256}
        r = c.get("/readyz")
        assert r.status_code == 200 and r.json()["checks"]["context_length"] == (
            "warning: a live worker serves a context of 256 tokens, this API's engine settings say 512; jobs are "
            "held to 256 (the own engine fits its context to its KV cache: give the worker more COSERVE_KV_BLOCKS, "
            "or more device memory, to serve the model's)")
        s.backend = "vllm"  # a vLLM worker serving less: its engine's max_model_len, which the API can be told
        assert "(set COSERVE_VLLM_MAX_MODEL_LEN=256 on the API to match)" in c.get("/readyz").json()["checks"][
            "context_length"]
        s.vllm_max_model_len = 256  # the API told so: no warning
        assert "context_length" not in c.get("/readyz").json()["checks"]
        # a worker whose engine never confirmed some aborts: ready, with a warning that counts them
        assert "set_aside" not in c.get("/readyz").json()["checks"]
        with session_scope(settings.sqlalchemy_url) as db:
            db.get(WorkerState, "w1").state = {"served": [s.model_name, "tilted"], "runtime_lora": True,
                                               "set_aside_jobs": 2}
        r = c.get("/readyz")
        assert r.status_code == 200 and r.json()["checks"]["set_aside"].startswith(
            "warning: w1 set aside 2 job attempts whose abort the engine has not confirmed (a rerun of their job runs "
            "beside them")  # no id is held: each attempt has its own request id in the engine
        assert (f"holds one {KEPT_ABORT_LEASES} leases ({KEPT_ABORT_LEASES * s.lease_seconds:g} s) after its abort;"
                in r.json()["checks"]["set_aside"])  # the bound the engine thread gives an engine up at
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "rt", "lora_path": _adapter_dir(tmp_path / "rt")},
                   headers=H(keys.admin))
        assert r.status_code == 200, r.text
        assert [w["served"] for w in c.get("/admin/api/overview", headers=H(keys.admin)).json()["workers"]] \
            == [[s.model_name, "tilted", "rt"]]  # the dashboard's models of the worker


def test_readiness_names_a_worker_whose_engine_cannot_run_structured_outputs(settings):
    """A worker whose named structured-output backend vLLM cannot make says so in its heartbeat
    (``grammar_unavailable``), and the API refuses every structured output while it is live; /readyz said nothing
    of it, so an operator could not see which worker to restart. It warns, naming the worker and why (the model
    still serves requests without one: ready), and stops warning once the worker's engine can run one."""
    from fastapi.testclient import TestClient

    from app.db.models import WorkerState
    from app.main import create_app

    why = ("the worker's structured-output backend lm-format-enforcer cannot run on this engine: vllm is not "
           "installed; send the request without a structured output, or have the operator name another backend "
           "(--structured-outputs-config in COSERVE_VLLM_ENGINE_ARGS)")
    with TestClient(create_app(settings)) as c:
        with session_scope(settings.sqlalchemy_url) as s:  # its heartbeat's row (workers.gpu_worker's _state)
            s.add(WorkerState(id="w-lmfe", model=settings.model_name, queue="q", device="cpu", state={
                "served": [settings.model_name], "grammar_backend": "lm-format-enforcer", "grammar_unavailable": why}))
            s.add(WorkerState(id="w-ok", model=settings.model_name, queue="q", device="cpu", state={
                "served": [settings.model_name], "grammar_backend": "xgrammar"}))
        r = c.get("/readyz")
        assert r.status_code == 200 and r.json()["checks"]["workers"] == "2 live", r.text
        warned = r.json()["checks"].get("structured_outputs", "")
        assert warned.startswith("warning: worker 'w-lmfe' cannot run a structured output (") and why in warned, r.text
        assert "'w-ok'" not in warned and "refused" in warned, warned
        with session_scope(settings.sqlalchemy_url) as s:  # restarted with a backend that runs
            s.get(WorkerState, "w-lmfe").state = {"served": [settings.model_name], "grammar_backend": "xgrammar"}
        assert "structured_outputs" not in c.get("/readyz").json()["checks"]


@pytest.mark.parametrize("routing_state", [{}, {"own_queue": False}], ids=["own-queue", "model-queue"])
def test_jobs_are_held_to_the_least_context_a_live_worker_serves(client, settings, keys, monkeypatch, routing_state):
    """A worker whose vLLM engine serves less context than the API's settings say (the tiny model's 512 tokens):
    the API refuses what that worker could not run, as vLLM would, instead of accepting a job that then fails
    there; and it says so where clients read the context. Once no live worker serves less, the model's holds. A
    worker that reads only its model's queue (``COSERVE_ROUTING=queue``) takes jobs too: it was left out, as it is
    of prefix routing, and the API took jobs it could not run."""
    from app.db.models import WorkerState
    from app.services import routing

    monkeypatch.setattr(routing, "REFRESH_S", 0.0)  # read the workers on every request here
    assert client.get(f"/v1/models/{settings.model_name}", headers=H(keys.paid)).json()["max_model_len"] == 512
    with session_scope(settings.sqlalchemy_url) as s:
        s.add(WorkerState(id="w-short", model=settings.model_name, queue="q", device="cpu",
                          state={"served": [settings.model_name], "context_length": 256, **routing_state}))
    assert client.get(f"/v1/models/{settings.model_name}", headers=H(keys.paid)).json()["max_model_len"] == 256
    assert client.post("/tokenize", json={"prompt": "hi"}, headers=H(keys.paid)).json()["max_model_len"] == 256
    r = submit(client, keys.paid, max_tokens=300)
    assert r.status_code == 422 and "maximum context length is 256 tokens" in r.text, r.text
    r = client.post("/v1/completions", json={"model": settings.model_name, "prompt": "hi", "max_tokens": 300},
                    headers=H(keys.paid))
    assert r.status_code == 400 and "maximum context length is 256 tokens" in r.json()["error"]["message"], r.text
    assert submit(client, keys.paid, max_tokens=200).status_code == 201
    with session_scope(settings.sqlalchemy_url) as s:  # that worker stops beating: no longer live
        s.get(WorkerState, "w-short").heartbeat_at = datetime.now(UTC) - timedelta(minutes=5)
    assert submit(client, keys.paid, max_tokens=300).status_code == 201
    assert client.get(f"/v1/models/{settings.model_name}", headers=H(keys.paid)).json()["max_model_len"] == 512


def test_admin_key_from_settings_is_registered(settings, keys):
    from fastapi.testclient import TestClient

    from app.main import create_app

    s = settings.model_copy(update={"admin_key": "cs-deployment-admin-key-0123456789"})
    with TestClient(create_app(s)) as c:
        r = c.post("/v1/admin/tenants", json={"name": "from-env"}, headers=H("cs-deployment-admin-key-0123456789"))
    assert r.status_code == 201, r.text


def test_a_pipeline_stage_past_its_deadline_is_still_accepted(settings, keys):
    # summarization's reduce jobs carry the run's deadline, which the map phase may have overrun
    from app.auth import Principal
    from app.summarize.service import SqlBackend

    backend = SqlBackend(settings, Principal(key_id="", tenant_id=keys.tenant_id, tier="paid", is_admin=False), None)
    past = datetime.now(UTC) - timedelta(seconds=5)
    job_id = backend.submit([{"role": "user", "content": "Summarize: a b c"}], 8, past, "summarize")
    with session_scope(settings.sqlalchemy_url) as s:
        job = s.get(Job, job_id)
        assert job.status in ("queued", "dispatched") and job.kind == "batch"


def test_a_pipeline_on_sql_counts_a_levels_prompts_in_one_call_as_the_service_does(settings, keys, monkeypatch):
    """``SqlBackend`` (scripts, tests) counted each job's prompt alone (``build_job``'s own path) where the service
    counts a level's together (``driver.prompt_counter``): it counts as the service does now, to the same counts."""
    from app.auth import Principal
    from app.services import jobs as job_service
    from app.summarize import driver
    from app.summarize.documents import Document
    from app.summarize.pipeline import SummarizeRun
    from app.services.model_info import get_tokenizer
    from app.summarize.service import SqlBackend
    from app.summarize.split import TokenSplitter

    calls = {"level": 0, "alone": 0}
    level_counts, fed_prompt = driver.count_inputs, job_service.fed_prompt

    def counting_a_level(model, conversations):
        calls["level"] += 1
        return level_counts(model, conversations)

    def counting_alone(*args, **kwargs):
        calls["alone"] += 1
        return fed_prompt(*args, **kwargs)

    monkeypatch.setattr(driver, "count_inputs", counting_a_level)
    monkeypatch.setattr(job_service, "fed_prompt", counting_alone)
    backend = SqlBackend(settings, Principal(key_id="", tenant_id=keys.tenant_id, tier="paid", is_admin=False), None)
    text = " ".join(f"Fact number {i} is about the topic of the document." for i in range(20))
    run = SummarizeRun.create("sum_sql", [Document("d", text)], datetime.now(UTC) + timedelta(hours=1), 8)
    split = TokenSplitter(get_tokenizer(settings.model), 64, 0)
    run.step(backend, split, count=backend.count)
    assert run.jobs_submitted > 1 and calls == {"level": 1, "alone": 0}  # one call for the level's prompts
    monkeypatch.undo()
    with session_scope(settings.sqlalchemy_url) as s:
        jobs = s.scalars(select(Job).where(Job.app_id == "summarize-map")).all()
        assert len(jobs) == run.jobs_submitted
        assert [j.prompt_tokens for j in jobs] == [len(fed_prompt(settings, j)) for j in jobs]  # as alone


def test_the_stream_of_a_cancelled_job_whose_events_expired_gives_the_text_it_kept(client, keys, settings):
    from sqlalchemy import update

    from app.services.streaming import stream_key

    job = client.post("/v1/jobs", json={"prompt": "hi"}, headers=H(keys.paid)).json()
    with session_scope(settings.sqlalchemy_url) as s:  # cancelled while it ran: its worker wrote what it produced
        s.execute(update(Job).where(Job.id == job["id"]).values(
            status="cancelled", output_text="abc def", completion_tokens=3, prompt_tokens=5, finish_reason="cancelled"))
    redis.Redis.from_url(settings.redis_url).delete(stream_key(job["id"]))  # its events expire after an hour
    body = client.get(f"/v1/jobs/{job['id']}/stream", headers=H(keys.paid)).text
    fields = [dict(line.split(": ", 1) for line in block.split("\n")) for block in body.strip().split("\n\n")]
    events = [("event: " + f["event"], json.loads(f["data"])) for f in fields]
    assert [(e, d.get("text", d.get("status"))) for e, d in events] == [
        ("event: delta", "abc def"), ("event: end", "cancelled")]
    assert events[-1][1]["completion_tokens"] == 3


def test_every_answer_carries_a_request_id(client, keys, settings):
    """OpenAI's ``x-request-id`` (the SDK's ``_request_id``): the client's own echoed, as vLLM's server echoes it,
    else a new one per request; a refusal before any route (413) carries it too."""
    given = client.get("/v1/models", headers={**H(keys.paid), "X-Request-Id": "trace-42"})
    assert given.headers["x-request-id"] == "trace-42"
    made = [client.get("/v1/models", headers=H(keys.paid)).headers["x-request-id"] for _ in range(2)]
    assert made[0] != made[1] and all(len(m) == 32 for m in made)
    too_big = client.post("/v1/jobs", content=b"x" * (settings.max_body_bytes + 1), headers=H(keys.paid))
    assert too_big.status_code == 413 and len(too_big.headers["x-request-id"]) == 32
    odd = client.get("/v1/models", headers={**H(keys.paid), "X-Request-Id": "x" * 300})
    assert odd.headers["x-request-id"] != "x" * 300


def test_a_job_keeps_the_id_of_the_request_that_sent_it(client, keys):
    """The client's X-Request-Id (or the one the API answered with) is the job's ``request_id``, and a tenant finds
    its jobs by it; another tenant's job of the same request id is not shown."""
    given = client.post("/v1/jobs", json={"prompt": "hi", "max_tokens": 2},
                        headers={**H(keys.paid), "X-Request-Id": "trace-7"})
    made = submit(client, keys.paid, max_tokens=2)
    other = client.post("/v1/jobs", json={"prompt": "hi", "max_tokens": 2},
                        headers={**H(keys.other), "X-Request-Id": "trace-7"})
    assert given.json()["request_id"] == "trace-7"
    assert made.json()["request_id"] == made.headers["x-request-id"]
    found = client.get("/v1/jobs", params={"request_id": "trace-7"}, headers=H(keys.paid)).json()["data"]
    assert [j["id"] for j in found] == [given.json()["id"]]
    assert other.json()["id"] not in {j["id"] for j in found}


def test_a_server_error_names_its_request(settings, caplog):
    """A 500 (a defect) answers with the request's id in its body and header, in the shape of the route's API, and
    the traceback's log line names the id too, so a client's report leads to it."""
    from fastapi.testclient import TestClient

    from app.api.anthropic_messages import AnthropicRoute
    from app.main import create_app
    from app.observability.logs import API_LOG_FORMAT
    from app.openai_schemas import OpenAIRoute
    from app.request_id import LogRequestId

    def broken():
        raise RuntimeError("a defect")

    app = create_app(settings)
    for path, route_class in (("/v1/models/broken", OpenAIRoute), ("/v1/messages/broken", AnthropicRoute)):
        app.router.routes.insert(0, route_class(path, broken, methods=["GET"]))  # before /v1/models/{model}
    app.add_api_route("/broken", broken)
    lines = io.StringIO()  # the API's log lines as `coserve up` writes them (configure_logging)
    handler = logging.StreamHandler(lines)
    handler.setFormatter(logging.Formatter(API_LOG_FORMAT))
    handler.addFilter(LogRequestId())
    logging.getLogger().addHandler(handler)
    try:
        with TestClient(app, raise_server_exceptions=False) as c, caplog.at_level("ERROR"):
            openai, anthropic, native = (c.get(path, headers={"X-Request-Id": "trace-500"}) for path in (
                "/v1/models/broken", "/v1/messages/broken", "/broken"))
    finally:
        logging.getLogger().removeHandler(handler)
    assert lines.getvalue().count("[request trace-500] request trace-500 (GET /broken) failed") == 1
    for r in (openai, anthropic, native):
        assert r.status_code == 500 and r.headers["x-request-id"] == "trace-500"
    assert openai.json()["error"]["type"] == "server_error" and "trace-500" in openai.json()["error"]["message"]
    assert anthropic.json()["type"] == "error" and anthropic.json()["error"]["type"] == "api_error"
    assert anthropic.json()["request_id"] == anthropic.headers["request-id"] == "trace-500"  # as Anthropic's errors
    assert "trace-500" in native.json()["detail"]
    assert any("trace-500" in rec.getMessage() and rec.exc_info for rec in caplog.records)
