"""Anthropic's Messages API with the official ``anthropic`` client against the real app (HTTP), Redis, Celery
worker and DB: plain and streamed messages, stop sequences, a conversation holding tool calls, token counting,
the key as ``x-api-key``, and errors in Anthropic's shape."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta

import anthropic
import httpx
import openai
import pytest
import redis

from app.db.models import Job
from app.db.session import session_scope
from app.services import rate_limits
from tests.conftest import Keys

pytestmark = [pytest.mark.e2e, pytest.mark.integration]


@pytest.fixture
def claude(stack) -> anthropic.Anthropic:
    """The paid key's client of the module's shared stack (its plain worker ``w1``)."""
    return anthropic.Anthropic(base_url=stack.url, api_key=stack.keys.paid, max_retries=0, timeout=120)  # x-api-key


def _job(settings, msg_id: str) -> Job:
    """The message's job (SQL)."""
    with session_scope(settings.sqlalchemy_url) as s:
        job = s.get(Job, "job_" + msg_id.removeprefix("msg_"))
        s.expunge(job)
        return job


def _limit(live_server, keys, **limits) -> None:
    """The test tenant's rate limits (admin API)."""
    r = httpx.patch(f"{live_server}/v1/admin/tenants/{keys.tenant_id}", json=limits, headers=Keys.header(keys.admin))
    assert r.status_code == 200, r.text


@pytest.fixture
def shared_limits(stack) -> Iterator[Callable[..., None]]:
    """Sets the shared stack's test tenant's rate limits for one test; after it, the tenant has none again and its
    buckets are gone (the module's other tests run unlimited, and a later limit starts full)."""
    yield lambda **limits: _limit(stack.url, stack.keys, **limits)
    _limit(stack.url, stack.keys, requests_per_minute=None, tokens_per_minute=None)
    client = redis.Redis.from_url(stack.settings.redis_url)
    if buckets := client.keys(f"{rate_limits.KEY_PREFIX}{stack.keys.tenant_id}:*"):
        client.delete(*buckets)


def test_a_message_is_a_chat_job_plain_and_streamed(claude, stack, shared_limits, monkeypatch):
    monkeypatch.setattr(stack.settings, "chat_ttft_ms", 1500.0)
    monkeypatch.setattr(stack.settings, "chat_tbt_ms", 90.0)
    shared_limits(requests_per_minute=100, tokens_per_minute=100000)
    ask = dict(model="tiny", max_tokens=7, system="Be brief", messages=[{"role": "user", "content": "Say hi"}],
               extra_body={"ignore_eos": True, "temperature": 0})  # this SDK has no temperature argument
    raw = claude.messages.with_raw_response.create(**ask)
    message = raw.parse()
    # Anthropic's headers: request-id (the SDK's _request_id) and anthropic-ratelimit-*, not OpenAI's x-ratelimit-*
    assert message._request_id and message._request_id == raw.headers["request-id"] == raw.headers["x-request-id"]
    assert raw.headers["anthropic-ratelimit-requests-limit"] == "100"
    assert raw.headers["anthropic-ratelimit-requests-remaining"] == "99"
    assert raw.headers["anthropic-ratelimit-tokens-limit"] == "100000"
    reset = datetime.fromisoformat(raw.headers["anthropic-ratelimit-requests-reset"])  # RFC 3339, when full again
    assert reset.tzinfo is not None and reset > datetime.now(UTC) - timedelta(seconds=5)
    assert not [h for h in raw.headers if h.startswith("x-ratelimit-")]
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert [b.type for b in message.content] == ["text"] and message.content[0].text
    assert message.usage.output_tokens == 7 and message.usage.input_tokens > 3
    job = _job(stack.settings, message.id)
    assert job.endpoint == "/v1/messages" and (job.ttft_ms, job.tbt_ms) == (1500.0, 90.0)
    assert job.messages[0] == {"role": "system", "content": "Be brief"}

    # streamed: the SDK's accumulator reads every event, and the text is the plain answer's (greedy)
    with claude.messages.stream(**ask) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert final.content[0].text == message.content[0].text and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 7 and final.usage.input_tokens == message.usage.input_tokens
    with claude.messages.stream(**ask) as stream:  # the SDK's text helpers: the deltas, then the whole text
        assert "".join(stream.text_stream) == stream.get_final_text() == message.content[0].text
        assert stream.request_id and stream.response.headers["request-id"] == stream.request_id

    # a stop sequence from the answer ends it there: stop_reason "stop_sequence", naming it
    full = message.content[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    stopped = claude.messages.create(**ask, stop_sequences=[stop, "\u2603never"])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert "".join(b.text for b in stopped.content) == full[:full.index(stop)]
    # one the answer begins with leaves no text: one empty text block, as vLLM answers it (content[0] is there)
    at_once = claude.messages.create(**ask, stop_sequences=[full[:3]])
    assert (at_once.stop_reason, at_once.stop_sequence) == ("stop_sequence", full[:3])
    assert [(b.type, b.text) for b in at_once.content] == [("text", "")] and at_once.content[0].text == ""
    with claude.messages.stream(**ask, stop_sequences=[full[:3]]) as stream:  # streamed, vLLM opens no block
        assert [e.type for e in stream] == ["message_start", "message_delta", "message_stop"]


def test_tool_turns_and_token_counts(claude, stack):
    # a conversation holding a tool call and its result runs as chat's assistant call and tool message
    weather = {"name": "get_weather", "description": "Weather", "input_schema": {"type": "object"}}
    turns = [{"role": "user", "content": "Weather?"},
             {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                               {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                "input": {"city": "Oslo"}}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                                          {"type": "text", "text": "And tomorrow?"}]}]
    message = claude.messages.create(model="tiny", max_tokens=3, messages=turns, tools=[weather],
                                     tool_choice={"type": "none"}, extra_body={"ignore_eos": True})
    assert message.content[0].type == "text" and message.stop_reason == "max_tokens"
    ran = _job(stack.settings, message.id).messages
    assert [m["role"] for m in ran] == ["user", "assistant", "tool", "user"]
    assert ran[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert ran[2] == {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"}

    # count_tokens counts what the job would: its prompt tokens
    counted = claude.messages.count_tokens(model="tiny", messages=turns, tools=[weather])
    assert counted.input_tokens == message.usage.input_tokens

    # a last assistant turn is a prefill: the answer continues it, not a new turn after it
    prefill = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "It is"}]
    continued = claude.messages.create(model="tiny", max_tokens=2, messages=prefill, extra_body={"ignore_eos": True})
    job = _job(stack.settings, continued.id)
    assert job.template_options == {"add_generation_prompt": False, "continue_final_message": True}
    assert claude.messages.count_tokens(model="tiny", messages=prefill).input_tokens == continued.usage.input_tokens


@pytest.mark.parametrize(("body", "status", "kind", "says"), [
    ({"messages": [{"role": "user", "content": "x"}]}, 400, "invalid_request_error", "max_tokens"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "stop_sequences": "x"}, 400,
     "invalid_request_error", "stop_sequences"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
     "invalid_request_error", "messages.0.content.0"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "mcp_servers": [{"url": "x"}]}, 400,
     "invalid_request_error", "mcp_servers"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "model": "nope"}, 404, "not_found_error",
     "nope"),
    ({"max_tokens": 100000, "messages": [{"role": "user", "content": "x"}]}, 400, "invalid_request_error",
     "input length and `max_tokens` exceed context limit"),
    # vLLM's fields, taken as chat takes them: request_id names vLLM's answer, where coserve's id is its job's
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "request_id": "trace-7"}, 400,
     "invalid_request_error", "X-Request-Id"),
    # a disaggregated prefill leg (vLLM's Messages request takes it): coserve has no KV connector
    ({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "kv_transfer_params": {
        "do_remote_decode": True}}, 400, "invalid_request_error", "kv_transfer_params"),
    # this stack runs the own engine and no tool-call parser: the choices it refuses and those left, in this API's
    # forms (they were chat's 'required', 'none' and "auto")
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f", "input_schema": {
        "type": "object"}}], "tool_choice": {"type": "any"}}, 400, "invalid_request_error",
     'a forced tool choice (tool_choice {"type": "any"} or {"type": "tool", "name": ...}) is generated'),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f", "input_schema": {
        "type": "object"}}]}, 400, "invalid_request_error",
     'send tool_choice {"type": "any"}, tool_choice {"type": "tool", "name": ...} or tool_choice {"type": "none"}'),
])
def test_bad_requests_are_answered_in_anthropic_shape(body, status, kind, says, stack):
    resp = httpx.post(f"{stack.url}/v1/messages", headers={"x-api-key": stack.keys.paid},
                      json={"model": "tiny", **body})
    assert resp.status_code == status, resp.text
    assert resp.json()["type"] == "error" and resp.json()["error"]["type"] == kind
    assert says in resp.json()["error"]["message"], resp.json()
    assert resp.json()["request_id"] == resp.headers["request-id"]  # Anthropic's errors name their request


def test_a_missing_or_wrong_key_is_an_authentication_error(stack):
    with pytest.raises(anthropic.AuthenticationError) as exc:
        anthropic.Anthropic(base_url=stack.url, api_key="sk-wrong", max_retries=0).messages.create(
            model="tiny", max_tokens=2, messages=[{"role": "user", "content": "x"}])
    assert exc.value.body["error"]["type"] == "authentication_error"
    resp = httpx.post(f"{stack.url}/v1/messages", json={"model": "tiny", "max_tokens": 2, "messages": []})
    assert resp.status_code == 401 and resp.json()["type"] == "error" and resp.headers["request-id"]


def test_a_rate_limit_refusal_is_a_rate_limit_error_with_anthropics_headers(live_server, keys):
    _limit(live_server, keys, tokens_per_minute=5)  # the request may use more than the minute's tokens
    client = anthropic.Anthropic(base_url=live_server, api_key=keys.paid, max_retries=0)
    with pytest.raises(anthropic.RateLimitError) as exc:
        client.messages.create(model="tiny", max_tokens=8, messages=[{"role": "user", "content": "x"}])
    refused = exc.value.response
    assert exc.value.body["error"]["type"] == "rate_limit_error" and "request too large" in exc.value.message
    assert refused.headers["anthropic-ratelimit-tokens-limit"] == "5"
    assert refused.headers["x-should-retry"] == "false"  # too large for any minute: its SDK does not retry it
    assert not [h for h in refused.headers if h.startswith("x-ratelimit-")]
    # the error names its request, in the body (request_id) and the header (the SDK's request_id)
    assert exc.value.request_id == refused.headers["request-id"] == exc.value.body["request_id"]


def test_the_anthropic_sdk_lists_and_retrieves_models_in_anthropics_shape(claude, stack):
    name = stack.settings.model_name
    page = claude.models.list()
    assert [m.id for m in page.data] == [name] and page.has_more is False
    assert (page.data[0].type, page.data[0].display_name, page.first_id, page.last_id) == ("model", name, name, name)
    assert page.data[0].created_at.tzinfo is not None  # an RFC 3339 time the SDK parses
    model = claude.models.retrieve(name)
    assert (model.type, model.id) == ("model", name)
    # the SDK reads an answer's id from Anthropic's request-id header, on these routes as on /v1/messages
    for raw in (claude.models.with_raw_response.list(), claude.models.with_raw_response.retrieve(name)):
        assert raw.headers["request-id"] == raw.headers["x-request-id"] == raw.parse()._request_id
    assert "request-id" not in stack.openai().models.with_raw_response.list().headers  # OpenAI's: x-request-id
    with pytest.raises(anthropic.NotFoundError) as exc:
        claude.models.retrieve("nope")
    assert exc.value.body["type"] == "error" and exc.value.body["error"]["type"] == "not_found_error"
    # a page past the last model is empty; OpenAI's clients still read OpenAI's list
    raw = httpx.get(f"{stack.url}/v1/models", params={"after_id": name},
                    headers={"x-api-key": stack.keys.paid, "anthropic-version": "2023-06-01"}).json()
    assert raw == {"data": [], "has_more": False, "first_id": None, "last_id": None}
    listed = stack.openai().models.list()
    assert listed.data[0].object == "model" and listed.data[0].id == name


def test_an_unknown_path_under_messages_answers_in_anthropics_shape(claude, stack):
    with pytest.raises(anthropic.NotFoundError) as exc:
        claude.get("/v1/messages/no-such-route", cast_to=object)
    body = exc.value.body
    assert body["type"] == "error" and body["error"]["type"] == "not_found_error", body
    assert "/v1/messages/no-such-route" in body["error"]["message"] and body["request_id"]


@pytest.mark.parametrize(("method", "path", "allowed"), [("GET", "/v1/messages", "POST"),
                                                       ("PUT", "/v1/messages/batches", "GET, OPTIONS, POST"),
                                                       ("POST", "/v1/messages/batches/msgbatch_1", "DELETE, GET")])
def test_a_wrong_method_under_messages_answers_in_anthropics_shape(method, path, allowed, stack):
    resp = httpx.request(method, stack.url + path, headers={"x-api-key": stack.keys.paid})
    assert resp.status_code == 405 and allowed in resp.headers["allow"], resp.headers
    body = resp.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    assert f"{method} is not allowed here" in body["error"]["message"]
    assert body["request_id"] == resp.headers["request-id"]


def test_a_wrong_method_on_a_path_shared_with_openai_answers_anthropics_sdk_in_its_shape(claude, stack):
    with pytest.raises(anthropic.APIStatusError) as exc:
        claude.post("/v1/models", cast_to=object)  # the SDK sends anthropic-version
    body = exc.value.body
    assert exc.value.status_code == 405 and body["type"] == "error", body
    assert body["error"]["type"] == "invalid_request_error" and "POST is not allowed" in body["error"]["message"]
    with pytest.raises(openai.APIStatusError) as exc:
        stack.openai().post("/models", cast_to=object)
    assert exc.value.status_code == 405 and "POST is not allowed" in exc.value.body["message"], exc.value.body


def test_a_body_over_the_limit_under_messages_is_anthropics_request_too_large(claude, stack):
    with pytest.raises(anthropic.APIStatusError) as exc:
        claude.messages.create(model="tiny", max_tokens=1,
                               messages=[{"role": "user", "content": "x" * stack.settings.max_body_bytes}])
    assert exc.value.status_code == 413 and exc.value.body["type"] == "error", exc.value.body
    assert exc.value.body["error"]["type"] == "request_too_large" and "bytes" in exc.value.body["error"]["message"]
    assert exc.value.request_id == exc.value.body["request_id"]


def test_a_tool_result_that_is_an_error_says_so_to_the_model(claude, stack):
    turns = [{"role": "user", "content": "Weather?"},
             {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                "input": {"city": "Oslo"}}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                                           "content": "city not found"}]}]
    message = claude.messages.create(model="tiny", max_tokens=1, messages=turns, extra_body={"ignore_eos": True})
    ran = _job(stack.settings, message.id).messages
    assert ran[2] == {"role": "tool", "tool_call_id": "toolu_1", "content": "Error: city not found"}
    fine = [*turns[:2], {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                       "content": "city not found"}]}]
    assert claude.messages.count_tokens(model="tiny", messages=turns).input_tokens > \
        claude.messages.count_tokens(model="tiny", messages=fine).input_tokens


def test_a_thinking_budget_the_server_cannot_keep_is_refused(claude, stack, monkeypatch):
    ask = dict(model="tiny", max_tokens=2048, messages=[{"role": "user", "content": "x"}],
               thinking={"type": "enabled", "budget_tokens": 1024})
    with pytest.raises(anthropic.BadRequestError) as exc:
        claude.messages.create(**ask)
    assert exc.value.body["error"]["type"] == "invalid_request_error"
    assert "own torch engine" in exc.value.body["error"]["message"], exc.value.body
    monkeypatch.setattr(stack.settings, "backend", "vllm")  # vLLM keeps it, given a parser for where thinking ends
    with pytest.raises(anthropic.BadRequestError) as exc:
        claude.messages.create(**ask)
    assert exc.value.body["error"]["message"].startswith("thinking.budget_tokens needs a reasoning parser")
    monkeypatch.setattr(stack.settings, "reasoning_parser", "qwen3")  # and a tokenizer with think tokens to end it
    with pytest.raises(anthropic.BadRequestError) as exc:
        claude.messages.create(**ask)
    assert exc.value.body["error"]["message"].startswith(
        "thinking.budget_tokens needs a model whose tokenizer has <think> and </think>"), exc.value.body


def test_a_conversation_with_system_reminders_and_thinking_given_back_runs_as_vllm_takes_it(claude, stack):
    # Claude Code's per-turn reminders (system messages in the conversation) and an assistant turn's thinking, sent
    # back: vLLM takes both; the model's template takes a system message anywhere, so each stays where it is
    turns = [{"role": "user", "content": "Weather?"},
             {"role": "assistant", "content": [{"type": "thinking", "thinking": "Look it up.", "signature": "s"},
                                               {"type": "text", "text": "Sunny."}]},
             {"role": "system", "content": "Reminder: be brief."}, {"role": "user", "content": "Tomorrow?"}]
    message = claude.messages.create(model="tiny", max_tokens=1, system="You are terse.", messages=turns,
                                     extra_body={"ignore_eos": True})
    ran = _job(stack.settings, message.id).messages
    assert [m["role"] for m in ran] == ["system", "user", "assistant", "system", "user"]
    assert ran[2] == {"role": "assistant", "content": "Sunny.", "reasoning": "Look it up."}
    assert ran[3] == {"role": "system", "content": "Reminder: be brief."}
    counted = claude.messages.count_tokens(model="tiny", system="You are terse.", messages=turns)
    assert counted.input_tokens == message.usage.input_tokens
