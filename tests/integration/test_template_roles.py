"""What the chat template sees of the instruction messages, on the real app with the bundled model's tokenizer:
OpenAI's ``developer`` role as the system message where the template does not know the role (SmolLM2's knows
system, user and assistant), as sent (vLLM's) where it does; a system message less Claude Code's billing header, as
vLLM's chat parser takes it. The prompt is read back with ``/tokenize`` and ``/detokenize``, and counted with
``/v1/responses/input_tokens``."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import Keys
from tests.unit.api.test_anthropic_conversation import QWEN_LIKE

pytestmark = pytest.mark.integration

H = Keys.header
ASK = {"role": "user", "content": "Hi!"}
# a template that has a developer turn of its own (as gpt-oss' and DeepSeek's)
NAMES_DEVELOPER = ("{%- for message in messages %}"
                   "{%- if message.role == 'developer' %}<dev>{%- else %}<{{ message.role }}>{%- endif %}"
                   "{{ message.content }}{%- endfor %}{%- if add_generation_prompt %}<assistant>{%- endif %}")


def rendered(client: Any, key: str, messages: list[dict[str, Any]]) -> str:
    """The text chat ``messages`` reach the model as (the job's prompt)."""
    r = client.post("/tokenize", json={"messages": messages}, headers=H(key))
    assert r.status_code == 200, r.text
    return client.post("/detokenize", json={"tokens": r.json()["tokens"]}, headers=H(key)).json()["prompt"]


def input_tokens(client: Any, key: str, body: dict[str, Any]) -> int:
    r = client.post("/v1/responses/input_tokens", json={"model": "tiny", **body}, headers=H(key))
    assert r.status_code == 200, r.text
    return r.json()["input_tokens"]


def test_a_developer_message_is_the_system_message_of_a_template_without_the_role(client, keys):
    # vLLM passes the role as sent: SmolLM2's template wrote "<|im_start|>developer" after its own default system
    # prompt ("You are a helpful AI assistant named SmolLM..."), which then stood in for the developer's instructions
    developer = rendered(client, keys.paid, [{"role": "developer", "content": "Answer in French."}, ASK])
    assert developer == rendered(client, keys.paid, [{"role": "system", "content": "Answer in French."}, ASK])
    assert "SmolLM" not in developer and "developer" not in developer

    as_system = input_tokens(client, keys.paid, {"input": [{"role": "system", "content": "Answer in French."}, ASK]})
    assert input_tokens(client, keys.paid, {"input": [
        {"role": "developer", "content": "Answer in French."}, ASK]}) == as_system
    # given as a system message, it joins the instructions' (vLLM's _consolidate_system_messages), a paragraph each
    merged = input_tokens(client, keys.paid, {"instructions": "Be brief.\n\nAnswer in French.", "input": [ASK]})
    assert input_tokens(client, keys.paid, {"instructions": "Be brief.", "input": [
        {"role": "developer", "content": "Answer in French."}, ASK]}) == merged > as_system


def template_client(settings, template: str) -> Any:
    """The real app with ``template`` in use (COSERVE_CHAT_TEMPLATE)."""
    from fastapi.testclient import TestClient

    from app.auth import clear_cache
    from app.main import create_app

    clear_cache()
    settings.chat_template = template
    return TestClient(create_app(settings))


@pytest.fixture
def names_developer_client(settings):
    with template_client(settings, NAMES_DEVELOPER) as c:
        yield c


@pytest.fixture
def system_first_client(settings):
    with template_client(settings, QWEN_LIKE) as c:  # a system message only first, as Qwen3's
        yield c


@pytest.fixture
def mentions_developer_client(settings):
    from tests.unit.api.test_chat_template_inputs import MENTIONS_DEVELOPER

    with template_client(settings, MENTIONS_DEVELOPER["comment"]) as c:  # SmolLM2's, naming the role in a comment
        yield c


def test_a_template_that_names_the_developer_role_only_in_a_comment_is_given_the_system_message(
        mentions_developer_client, keys):
    # the word anywhere in the template counted as knowing the role: "<|im_start|>developer" after SmolLM2's default
    # system prompt
    client = mentions_developer_client
    prompt = rendered(client, keys.paid, [{"role": "developer", "content": "Answer in French."}, ASK])
    assert prompt == "<|im_start|>system\nAnswer in French.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n" \
                     "<|im_start|>assistant\n"


def test_a_template_that_knows_the_developer_role_is_given_it_as_sent(names_developer_client, keys):
    prompt = rendered(names_developer_client, keys.paid, [{"role": "developer", "content": "Answer in French."}, ASK])
    assert prompt == "<dev>Answer in French.<user>Hi!<assistant>"  # as vLLM gives it


INSTRUCTED = [{"role": "system", "content": "Be brief."}, {"role": "developer", "content": "Answer in French."},
              ASK, {"role": "developer", "content": "Use metric."}]


def test_a_developer_message_after_a_system_message_joins_the_system_prompt_of_a_system_first_template(
        system_first_client, keys):
    # a developer message given as a system message after another reached Qwen's "system message must be first"
    # guard: a 400 with the template's error; it now joins the leading system prompt, in order, a paragraph each
    client = system_first_client
    prompt = rendered(client, keys.paid, INSTRUCTED)
    assert prompt == ("<|im_start|>system\nBe brief.\n\nAnswer in French.\n\nUse metric.<|im_end|>\n"
                      "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")
    r = client.post("/v1/jobs", json={"messages": INSTRUCTED, "max_tokens": 4}, headers=H(keys.paid))
    assert r.status_code == 201, r.text  # the job's prompt is the same
    tokens = client.post("/tokenize", json={"messages": INSTRUCTED}, headers=H(keys.paid)).json()["count"]
    assert r.json()["prompt_tokens"] == tokens

    merged = input_tokens(client, keys.paid, {"instructions": "Be brief.\n\nAnswer in French.", "input": [ASK]})
    assert input_tokens(client, keys.paid, {"instructions": "Be brief.", "input": [
        {"role": "developer", "content": "Answer in French."}, ASK]}) == merged


def test_a_developer_message_after_a_system_message_joins_the_system_prompt_where_the_template_takes_system_anywhere(
        client, keys):
    # vLLM merges every system message into the first wherever it gives a developer message as a system one
    # (_consolidate_system_messages), whatever the template: SmolLM2's, which renders a system message anywhere, got
    # three system turns here, the last after the user's
    prompt = rendered(client, keys.paid, INSTRUCTED)
    assert prompt == ("<|im_start|>system\nBe brief.\n\nAnswer in French.\n\nUse metric.<|im_end|>\n"
                      "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")
