"""The worker turns a job row into the engine's request with the job's own QoS (real DB and Redis,
the API's submission path; the engine is not started)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from app.auth import authenticate
from app.db.models import Job
from app.db.session import session_scope
from app.schemas import JobCreate
from app.services.jobs import submit_job
from gpu_runtime.qos import QoSClass, TbtAnchor
from workers.decode_history import history_key
from workers.gpu_worker import GpuWorker

pytestmark = pytest.mark.integration


def test_requests_carry_each_jobs_tbt_anchor_targets_and_history_key(settings, keys):
    worker = GpuWorker(settings)
    worker.engine = SimpleNamespace(executor=SimpleNamespace(now=lambda: 100.0))
    url = settings.sqlalchemy_url
    specs = {"paced": JobCreate(prompt="hi", ttft_ms=800, tbt_ms=40, tbt_anchor="first-token", app_id="chat"),
             "default": JobCreate(prompt="hi"),
             "batch": JobCreate(prompt="hi", kind="batch", deadline_window_s=600)}
    with session_scope(url) as s:
        principal = authenticate(s, keys.paid)
        ids = {name: submit_job(s, principal, spec, settings, dispatch=False).job.id for name, spec in specs.items()}
    with session_scope(url) as s:
        req = {name: worker._request(s.get(Job, job_id), s) for name, job_id in ids.items()}
    paced, default, batch = req["paced"].qos, req["default"].qos, req["batch"].qos
    assert (paced.ttft_s, paced.tbt_s, paced.tbt_anchor) == (0.8, 0.04, TbtAnchor.FIRST_TOKEN)
    assert default.tbt_anchor is TbtAnchor(settings.tbt_anchor) and default.tbt_s == settings.default_tbt_ms / 1e3
    assert batch.qos_class is QoSClass.BATCH and 590 < batch.ttlt_s <= 600
    assert req["paced"].app_id == history_key("chat", keys.tenant_id, "interactive")
    assert req["batch"].app_id == history_key(None, keys.tenant_id, "batch")


def test_a_job_of_a_runtime_adapter_carries_its_directory_until_the_adapter_is_unloaded(settings, keys, tmp_path):
    """A LoRA adapter loaded at runtime reaches the engine as its name and the directory SQL holds for it; a job
    whose adapter was unloaded before it began is refused with what to do."""
    from app.services import lora_adapters

    settings.runtime_lora = True
    worker = GpuWorker(settings)
    worker.engine = SimpleNamespace(executor=SimpleNamespace(now=lambda: 100.0))
    lora = tmp_path / "rt"
    lora.mkdir()
    (lora / "adapter_config.json").write_text('{"r": 8}')
    (lora / "adapter_model.safetensors").write_bytes(b"")
    url = settings.sqlalchemy_url
    with session_scope(url) as s:
        lora_adapters.load(settings, "rt-lora", str(lora))
        job_id = submit_job(s, authenticate(s, keys.paid), JobCreate(prompt="hi", model="rt-lora"), settings,
                            dispatch=False).job.id
    with session_scope(url) as s:
        req = worker._request(s.get(Job, job_id), s)
        assert (req.lora_name, req.lora_path) == ("rt-lora", str(lora.resolve())) and req.lora_version > 0
        assert req.app_id == history_key(None, keys.tenant_id, "interactive", "rt-lora")
    lora_adapters.load(settings, "rt-lora", str(lora), load_inplace=True)  # new weights at the same path: a new version
    with session_scope(url) as s:
        again = worker._request(s.get(Job, job_id), s)
        assert again.lora_path == req.lora_path and again.lora_version > req.lora_version
    lora_adapters.unload(settings, "rt-lora")
    with session_scope(url) as s:
        with pytest.raises(ValueError, match="'rt-lora' was unloaded before this job began; load it again"):
            worker._request(s.get(Job, job_id), s)


def test_a_job_of_an_adapter_this_worker_does_not_serve_is_refused_saying_so(settings, keys):
    """A configured adapter (COSERVE_LORA_MODULES) another worker has, or a worker with none (the own engine), is
    not served here: its job fails saying so, not that the adapter "was unloaded" (it never was)."""
    settings.lora_modules = {"sql-lora": "/adapters/sql"}  # the API's
    with session_scope(settings.sqlalchemy_url) as s:
        job_id = submit_job(s, authenticate(s, keys.paid), JobCreate(prompt="hi", model="sql-lora"), settings,
                            dispatch=False).job.id
    for served in ({"other-lora": "/adapters/other"}, {}):
        worker = GpuWorker(settings.model_copy(update={"lora_modules": served}))
        worker.engine = SimpleNamespace(executor=SimpleNamespace(now=lambda: 100.0))
        with session_scope(settings.sqlalchemy_url) as s, pytest.raises(ValueError) as refused:
            worker._request(s.get(Job, job_id), s)
        assert "unloaded" not in str(refused.value)
        assert str(refused.value).startswith("LoRA adapter 'sql-lora' is not served by this worker"), refused.value


def test_a_completion_without_max_tokens_makes_16_tokens_or_what_the_context_leaves(settings, keys):
    """OpenAI's legacy completions and vLLM's default to 16, a chat to the server's default; either is cut to what
    the context leaves beside the prompt, as vLLM cuts it."""
    from app.services.jobs import build_job
    from app.services.workers import held_context_length

    context = held_context_length(settings)
    with session_scope(settings.sqlalchemy_url) as s:
        principal = authenticate(s, keys.paid)

    def max_tokens(endpoint: str, spec: JobCreate) -> int:
        return build_job(settings, principal, spec, endpoint=endpoint).sampling["max_tokens"]

    assert max_tokens("/v1/completions", JobCreate(prompt="hi")) == 16
    assert max_tokens("/v1/completions", JobCreate(prompt="hi", max_tokens=40)) == 40
    assert max_tokens("/v1/chat/completions", JobCreate(prompt="hi")) == settings.default_max_tokens
    assert max_tokens("/v1/completions", JobCreate(prompt_token_ids=[7] * (context - 5))) == 5


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(settings, keys):
    # vLLM's truncate_prompt_tokens: the API counts and bills what the worker feeds, the prompt's last k tokens
    from app.services.jobs import JobValidationError, encode_spec

    worker = GpuWorker(settings)
    worker.engine = SimpleNamespace(executor=SimpleNamespace(now=lambda: 100.0))
    long = "one two three four five six seven eight nine ten " * 60  # over the tiny model's 512 tokens
    full = encode_spec(settings.model, JobCreate(prompt=long))
    assert len(full) > 512
    specs = {"last 7": JobCreate(prompt=long, max_tokens=8, truncate_prompt_tokens=7),
             "fits": JobCreate(messages=[{"role": "user", "content": long}], max_tokens=16,
                               truncate_prompt_tokens=-1),
             "short": JobCreate(prompt="hi there", max_tokens=8, truncate_prompt_tokens=100)}
    with session_scope(settings.sqlalchemy_url) as s:
        principal = authenticate(s, keys.paid)
        jobs = {name: submit_job(s, principal, spec, settings, dispatch=False).job for name, spec in specs.items()}
        with pytest.raises(JobValidationError, match="maximum context length is"):  # without it: too long
            submit_job(s, principal, JobCreate(prompt=long, max_tokens=8), settings, dispatch=False)
    with session_scope(settings.sqlalchemy_url) as s:
        fed = {name: worker._request(s.get(Job, job.id), s).prompt_token_ids for name, job in jobs.items()}
    assert fed["last 7"] == full[-7:] and jobs["last 7"].prompt_tokens == 7
    chat = encode_spec(settings.model, specs["fits"])
    # -1, as vLLM 0.32: all the context but one token (its TokenizeParams.max_truncation_tokens), and the answer
    # what the context leaves (its get_max_tokens), not max_tokens' 16 (which used to cut the prompt to 496)
    assert fed["fits"] == chat[-(512 - 1):] and jobs["fits"].prompt_tokens == 512 - 1  # ends with its turn
    assert jobs["fits"].sampling["max_tokens"] == 1
    assert fed["short"] == encode_spec(settings.model, specs["short"]) == fed["short"][-100:]
    with pytest.raises(ValueError, match="0 would leave no prompt"):
        JobCreate(prompt="x", truncate_prompt_tokens=0)


def test_a_requests_cache_salt_narrows_its_tenants_prefix_cache_scope(settings, keys):
    worker = GpuWorker(settings)
    with session_scope(settings.sqlalchemy_url) as s:
        principal = authenticate(s, keys.paid)
        plain, salted = (submit_job(s, principal, JobCreate(prompt="hi", cache_salt=salt), settings,
                                    dispatch=False).job for salt in (None, "project-a"))
    assert worker._cache_salt(plain) == keys.tenant_id  # COSERVE_PREFIX_CACHE_SCOPE=tenant, the default
    assert worker._cache_salt(salted) == f"{keys.tenant_id}:project-a"
    worker.settings = settings.model_copy(update={"prefix_cache_scope": "shared"})
    assert (worker._cache_salt(plain), worker._cache_salt(salted)) == (None, "project-a")
