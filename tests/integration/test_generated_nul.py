"""A model that generates a NUL (a byte token of the default model's tokenizer decodes to one): a real worker on a
tiny Llama whose every greedy token is that byte, behind the real API. PostgreSQL's text refuses NUL where SQLite
takes it, so run this under ``COSERVE_TEST_DATABASE=postgres`` too: each answer and what is stored of it (the job,
a stored chat completion, a stored Response and its conversation's items) holds U+FFFD in the NUL's place
(``app.wire.storable``, applied to the engine's text in ``workers/engine_thread.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.db.models import Job
from app.db.session import session_scope
from tests.conftest import Keys, api_and_worker, wait_for
from tests.integration.test_worker import Service

pytestmark = pytest.mark.integration

NUL_TOKEN = 190  # the default model's tokenizer decodes this byte token to "\x00"
H = Keys.header


def nul_writing_llama(path: Path) -> Path:
    """A 2-layer Llama with the default model's tokenizer whose greedy token is always ``NUL_TOKEN``: its layers add
    nothing to the residual stream, every token's embedding holds 10 in dimension 0, and only that dimension
    reaches the (untied) output layer, where only ``NUL_TOKEN``'s row reads it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from app.services.model_info import get_tokenizer

    tok = get_tokenizer("smollm2-135m")
    assert tok.decode([NUL_TOKEN]) == "\x00"
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.get_input_embeddings().weight[:, 0] = 10.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[NUL_TOKEN, 0] = 10.0
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def service(tmp_path_factory, redis_server):
    model = nul_writing_llama(tmp_path_factory.mktemp("nul-llama"))
    with api_and_worker(tmp_path_factory.mktemp("nul-service"), redis_server, model) as service:
        yield Service(*service)


def stored_job(service: Service, job_id: str) -> Job:
    with session_scope(service.settings.sqlalchemy_url) as s:
        job = s.get(Job, job_id)
        s.expunge(job)
        return job


def output_text(response: dict) -> str:
    """A Response's text, as the SDKs' ``output_text`` joins it."""
    return "".join(part["text"] for item in response["output"] for part in item.get("content") or ()
                   if part["type"] == "output_text")


def test_a_generated_nul_is_answered_and_stored_as_the_replacement_character(service):
    client, key = service.client, service.keys.paid
    r = client.post("/v1/jobs", json={"prompt": "Say it.", "max_tokens": 3, "temperature": 0}, headers=H(key))
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    job = wait_for(lambda: (j := stored_job(service, job_id)).status == "succeeded" and j, 60, "the job to end")
    assert (job.status, job.output_text, job.output_token_ids) == ("succeeded", "\ufffd" * 3, [NUL_TOKEN] * 3)


def test_a_stored_chat_completion_that_generated_a_nul_is_kept(service):
    client, key = service.client, service.keys.paid
    r = client.post("/v1/chat/completions", headers=H(key), json={
        "model": "tiny", "messages": [{"role": "user", "content": "Say it."}], "max_tokens": 3, "temperature": 0,
        "store": True})
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["choices"][0]["message"]["content"] == "\ufffd" * 3
    kept = client.get(f"/v1/chat/completions/{answer['id']}", headers=H(key))
    assert kept.status_code == 200, kept.text
    assert kept.json()["choices"][0]["message"]["content"] == "\ufffd" * 3


def test_a_stored_response_that_generated_a_nul_is_kept_in_its_conversation(service):
    client, key = service.client, service.keys.paid
    conversation = client.post("/v1/conversations", json={}, headers=H(key))
    assert conversation.status_code == 200, conversation.text
    conv_id = conversation.json()["id"]
    r = client.post("/v1/responses", headers=H(key), json={
        "model": "tiny", "input": "Say it.", "max_output_tokens": 3, "temperature": 0, "store": True,
        "conversation": conv_id})
    assert r.status_code == 200, r.text
    assert output_text(r.json()) == "\ufffd" * 3, r.json()
    kept = client.get(f"/v1/responses/{r.json()['id']}", headers=H(key))
    assert kept.status_code == 200 and output_text(kept.json()) == "\ufffd" * 3, kept.text
    items = client.get(f"/v1/conversations/{conv_id}/items?order=asc", headers=H(key))
    assert items.status_code == 200, items.text
    texts = [part["text"] for item in items.json()["data"] for part in item["content"]]
    assert texts == ["Say it.", "\ufffd" * 3]
