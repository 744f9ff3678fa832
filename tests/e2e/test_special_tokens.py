"""vLLM's ``add_special_tokens`` on /v1/completions and /v1/chat/completions, through the real app and a real
worker that runs the model: the prompt the API counts (usage, the context check) is the one the worker feeds.

The module's shared stack serves the tiny Llama with a tokenizer that adds its BOS token (the default model's adds
none, so the flag would change nothing there)."""

from __future__ import annotations

import httpx
import openai
import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

GREEDY = dict(model="tiny", max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
CHAT = [{"role": "user", "content": "Name a city"}]


@pytest.fixture(scope="module")
def tiny_model_dir(bos_tiny_model_dir):
    """The shared stack's model: the tiny Llama whose tokenizer adds BOS."""
    return bos_tiny_model_dir


@pytest.fixture
def oai(stack) -> openai.OpenAI:
    return stack.openai()


def _tokens(stack, **body) -> list[int]:
    r = httpx.post(f"{stack.url}/tokenize", headers={"Authorization": f"Bearer {stack.keys.paid}"}, json=body)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def _greedy(oai, prompt, **extra) -> tuple[str, int]:
    """The greedy completion's text and its usage.prompt_tokens."""
    answer = oai.completions.create(prompt=prompt, **{**GREEDY, "extra_body": {**GREEDY["extra_body"], **extra}})
    return answer.choices[0].text, answer.usage.prompt_tokens


def test_a_completion_prompt_gets_bos_unless_add_special_tokens_is_false(oai, stack):
    bare = _tokens(stack, prompt="Name a city", add_special_tokens=False)
    bos = _tokens(stack, prompt="Name a city")
    assert bos[1:] == bare and len(bos) == len(bare) + 1  # the tokenizer's BOS
    with_bos, without = _greedy(oai, "Name a city"), _greedy(oai, "Name a city", add_special_tokens=False)
    assert (with_bos[1], without[1]) == (len(bos), len(bare))
    # what the worker fed: the same greedy text as the prompt given as those token ids (fed as given, the flag or not)
    assert with_bos[0] == _greedy(oai, bos)[0] == _greedy(oai, bos, add_special_tokens=False)[0]
    assert without[0] == _greedy(oai, bare)[0]
    assert with_bos[0] != without[0]  # the BOS reached the model (else the comparisons above could not tell)


def test_a_chat_gets_the_special_tokens_on_top_of_its_template_with_add_special_tokens_true(oai, stack):
    templated = _tokens(stack, messages=CHAT)
    assert _tokens(stack, messages=CHAT, add_special_tokens=False) == templated
    on_top = _tokens(stack, messages=CHAT, add_special_tokens=True)
    assert on_top[1:] == templated and len(on_top) == len(templated) + 1
    plain = oai.chat.completions.create(messages=CHAT, **GREEDY)
    special = oai.chat.completions.create(messages=CHAT, **{**GREEDY, "extra_body": {
        **GREEDY["extra_body"], "add_special_tokens": True}})
    assert (plain.usage.prompt_tokens, special.usage.prompt_tokens) == (len(templated), len(on_top))
    assert plain.choices[0].message.content == _greedy(oai, templated)[0]
    assert special.choices[0].message.content == _greedy(oai, on_top)[0]


def test_the_context_check_counts_the_special_tokens_the_worker_would_feed(oai, stack):
    prompt = "city " * 490
    n = len(_tokens(stack, prompt=prompt, add_special_tokens=False))
    room = 512 - n  # the tiny model's context, filled by the bare prompt and the answer
    fits = oai.completions.create(prompt=prompt, **{**GREEDY, "max_tokens": room,
                                                    "extra_body": {"add_special_tokens": False, "ignore_eos": True}})
    assert (fits.usage.prompt_tokens, fits.usage.completion_tokens) == (n, room)
    with pytest.raises(openai.BadRequestError) as exc:  # with its BOS, one token too many
        oai.completions.create(prompt=prompt, **{**GREEDY, "max_tokens": room})
    assert str(n + 1) in exc.value.body["message"], exc.value.body


def test_truncate_prompt_tokens_keeps_the_bos_and_the_prompts_last_tokens(oai, stack):
    # vLLM cuts a text inside the tokenizer call: the BOS it adds stays and the text gives up its first tokens
    prompt, k = "Name a city in the north of France, then one in the south", 5
    bare = _tokens(stack, prompt=prompt, add_special_tokens=False)
    bos = _tokens(stack, prompt=prompt)[0]
    answer = oai.completions.create(prompt=prompt, **{**GREEDY, "extra_body": {
        **GREEDY["extra_body"], "truncate_prompt_tokens": k, "return_token_ids": True}})
    assert answer.choices[0].prompt_token_ids == [bos, *bare[-(k - 1):]] and answer.usage.prompt_tokens == k
    # what the worker fed: the same greedy text as those ids given as the prompt, not as the text's last k tokens
    assert answer.choices[0].text == _greedy(oai, [bos, *bare[-(k - 1):]])[0] != _greedy(oai, bare[-k:])[0]
    without = _greedy(oai, prompt, truncate_prompt_tokens=k, add_special_tokens=False)
    assert without == (_greedy(oai, bare[-k:])[0], k)  # no BOS asked for: the text's last k
