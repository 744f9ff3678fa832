"""What the chat template sees of the instruction messages, on the real app with the bundled model's tokenizer:
OpenAI's ``developer`` role as the system message where the template does not know the role (SmolLM2's knows
system, user and assistant), as sent (vLLM's) where it does; a system message less Claude Code's billing header, as
vLLM's chat parser takes it. The prompt is read back with ``/tokenize`` and ``/detokenize``, and counted with
``/v1/responses/input_tokens``."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import Keys

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
    both = input_tokens(client, keys.paid, {"instructions": "Be brief.", "input": [
        {"role": "system", "content": "Answer in French."}, ASK]})
    assert input_tokens(client, keys.paid, {"instructions": "Be brief.", "input": [
        {"role": "developer", "content": "Answer in French."}, ASK]}) == both > as_system


@pytest.fixture
def names_developer_client(settings):
    from fastapi.testclient import TestClient

    from app.auth import clear_cache
    from app.main import create_app

    clear_cache()
    settings.chat_template = NAMES_DEVELOPER
    with TestClient(create_app(settings)) as c:
        yield c


def test_a_template_that_knows_the_developer_role_is_given_it_as_sent(names_developer_client, keys):
    prompt = rendered(names_developer_client, keys.paid, [{"role": "developer", "content": "Answer in French."}, ASK])
    assert prompt == "<dev>Answer in French.<user>Hi!<assistant>"  # as vLLM gives it


BILLED = "x-anthropic-billing-header: cc_version=2.1.3; cc_entrypoint=cli; cch=7f3a1;"


def test_a_system_messages_claude_code_billing_header_is_left_out_as_vllm_leaves_it_out(client, keys):
    # vLLM's chat parser drops the header line from a system message's text parts (gateways that put Claude Code on
    # chat completions keep it; its hash changes every request, so the prompt missed the prefix cache from there)
    plain = rendered(client, keys.paid, [{"role": "system", "content": "You are Claude Code."}, ASK])
    assert rendered(client, keys.paid, [{"role": "system", "content": BILLED + "\nYou are Claude Code."}, ASK]) == plain
    parts = [{"type": "text", "text": BILLED}, {"type": "text", "text": "You are Claude Code."}]
    assert rendered(client, keys.paid, [{"role": "system", "content": parts}, ASK]) == plain
    assert BILLED in rendered(client, keys.paid, [{"role": "user", "content": BILLED}])  # a system message's alone

    instructions = input_tokens(client, keys.paid, {"instructions": "You are Claude Code.", "input": "Hi!"})
    assert input_tokens(client, keys.paid, {"instructions": BILLED + "\nYou are Claude Code.",
                                            "input": "Hi!"}) == instructions


def test_anthropic_cache_control_on_the_system_blocks_and_content_blocks_is_read_as_plain_text(client, keys):
    # what Claude's SDKs send for prompt caching: accepted, and no trace of it in the prompt (vLLM's prefix cache
    # needs no marks)
    def count(body: dict[str, Any]) -> int:
        r = client.post("/v1/messages/count_tokens", json={"model": "tiny", **body}, headers={"x-api-key": keys.paid})
        assert r.status_code == 200, r.text
        return r.json()["input_tokens"]

    cached = {"type": "ephemeral", "ttl": "1h"}
    plain = {"system": [{"type": "text", "text": "Be brief."}],
             "tools": [{"name": "weather", "input_schema": {"type": "object"}}],
             "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi!"}]},
                          {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "weather",
                                                             "input": {}}]},
                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                        "content": [{"type": "text", "text": "Sunny."}]}]}]}
    marked = {"system": [{**plain["system"][0], "cache_control": cached}],
              "tools": [{**plain["tools"][0], "cache_control": cached}],
              "messages": [{"role": m["role"], "content": [{**b, "cache_control": cached} for b in m["content"]]}
                           for m in plain["messages"]]}
    marked["messages"][2]["content"][0]["content"][0]["cache_control"] = cached
    assert count(marked) == count(plain)
