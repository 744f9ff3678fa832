"""OpenAI's Responses API with the official ``openai`` client against the real app (HTTP), Redis, Celery
worker and DB: plain, streamed and background answers, retrieval, continuing a conversation, cancelling,
deleting, and errors."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import redis

from app.db.models import Job
from app.db.session import session_scope
from app.services.streaming import stream_key
from tests.conftest import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.integration]


@pytest.fixture
def oai(stack) -> openai.OpenAI:
    """The paid key's client of the module's shared stack (its plain worker ``w1``)."""
    return stack.openai()


def _job(live_server: str, key: str, resp_id: str) -> dict:
    return httpx.get(f"{live_server}/v1/jobs/job_{resp_id.removeprefix('resp_')}",
                     headers={"Authorization": f"Bearer {key}"}).json()


def _messages(settings, resp_id: str) -> list[dict]:
    """The chat messages the response's job ran on (SQL)."""
    with session_scope(settings.sqlalchemy_url) as s:
        return s.get(Job, "job_" + resp_id.removeprefix("resp_")).messages


def test_a_response_is_a_chat_job_retrieved_and_continued(oai, stack):
    first = oai.responses.create(model="tiny", input="Say hi", instructions="Be brief", max_output_tokens=6,
                                 temperature=0, metadata={"run": "a"}, extra_body={"ignore_eos": True, "tier": "free"})
    assert first.object == "response" and first.id.startswith("resp_")
    assert first.status == "incomplete" and first.incomplete_details.reason == "max_output_tokens"
    assert first.output_text and first.output[0].type == "message" and first.output[0].role == "assistant"
    assert first.usage.output_tokens == 6 and first.usage.total_tokens == first.usage.input_tokens + 6
    assert first.instructions == "Be brief" and first.metadata == {"run": "a"} and first.service_tier == "flex"
    job = _job(stack.url, stack.keys.paid, first.id)
    assert _messages(stack.settings, first.id) == [{"role": "system", "content": "Be brief"},
                                                   {"role": "user", "content": "Say hi"}]
    assert job["tier"] == "free" and job["ttft_ms"] and job["tbt_ms"]

    again = oai.responses.retrieve(first.id)
    assert again.output_text == first.output_text and again.status == "incomplete"
    # the usage holds every field the API's types require (cache_write_tokens was missing): strict validation passes
    from openai.types.responses import Response

    raw = httpx.get(f"{stack.url}/v1/responses/{first.id}",
                    headers={"Authorization": f"Bearer {stack.keys.paid}"}).json()
    assert Response.model_validate(raw, strict=True).usage.input_tokens_details.cache_write_tokens == 0  # no cache

    # the next turn: the first's input and answer, not its instructions, then the new input; its input tokens
    # counted before it runs are the ones it is billed for
    turn = [{"role": "user", "content": [{"type": "input_text", "text": "Again"}]}]
    counted = oai.responses.input_tokens.count(model="tiny", previous_response_id=first.id, input=turn)
    assert counted.object == "response.input_tokens"
    assert oai.responses.input_tokens.count(input="Say hi", instructions="Be brief").input_tokens == \
        first.usage.input_tokens
    second = oai.responses.create(model="tiny", previous_response_id=first.id, max_output_tokens=3, input=turn,
                                  extra_body={"ignore_eos": True})
    assert second.usage.input_tokens == counted.input_tokens
    assert second.previous_response_id == first.id and second.instructions is None
    assert _messages(stack.settings, second.id) == [
        {"role": "user", "content": "Say hi"}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Again"}]

    # each response's own input, as items (newest first): not the conversation it continued, nor instructions
    assert [(i.type, i.role, i.content[0].text) for i in oai.responses.input_items.list(second.id).data] == [
        ("message", "user", "Again")]
    assert [i.content[0].text for i in oai.responses.input_items.list(first.id, order="asc").data] == ["Say hi"]

    # another tenant sees none of it; deleted, it can be neither retrieved nor continued
    other = openai.OpenAI(base_url=stack.url + "/v1", api_key=stack.keys.other, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(first.id)
    assert oai.responses.delete(first.id) is None
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as exc:
        oai.responses.create(model="tiny", input="x", previous_response_id=first.id)
    assert exc.value.body["param"] == "previous_response_id"
    unstored = oai.responses.create(model="tiny", input="x", max_output_tokens=1, store=False)
    assert unstored.store is False and unstored.output_text is not None
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(unstored.id)


def test_a_streamed_response_sends_the_text_as_typed_events(oai):
    stream = oai.responses.create(model="tiny", input="Tell me a story", max_output_tokens=8, stream=True,
                                  extra_body={"ignore_eos": True})
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text and final.output_text == text == events[-4].text
    assert final.usage.output_tokens == 8 and events[0].response.status == "in_progress"  # (background: queued)
    assert oai.responses.retrieve(final.id).output_text == text


def test_the_sdks_stream_helper_accumulates_the_typed_events(oai):
    # the helper's state follows each item and part by its index and id, and refuses events it cannot place
    with oai.responses.stream(model="tiny", input="Hi", max_output_tokens=6, extra_body={"ignore_eos": True}) as stream:
        events = list(stream)
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    last = events[-1]  # cut by max_output_tokens: incomplete (get_final_response waits for response.completed)
    assert events[0].type == "response.created" and last.type == "response.incomplete"
    assert deltas[-1].snapshot == "".join(e.delta for e in deltas) == last.response.output_text
    assert oai.responses.retrieve(last.response.id).output_text == deltas[-1].snapshot
    with oai.responses.stream(response_id=last.response.id) as again:  # a stored response's events, replayed
        assert [e.type for e in again] == [e.type for e in events]


def test_a_background_response_is_polled_and_can_be_cancelled(live_server, keys, start_worker):
    start_worker("w1", COSERVE_ENGINE_FACTORY="tests.e2e.slow_engine:build", COSERVE_STEP_DELAY_S="0.05")
    oai = openai.OpenAI(base_url=live_server + "/v1", api_key=keys.paid, max_retries=0, timeout=60)
    quick = oai.responses.create(model="tiny", input="Hi", max_output_tokens=4, background=True,
                                 extra_body={"ignore_eos": True})
    assert quick.background is True and quick.status == "queued" and quick.output == []  # answered at once
    done = wait_for(lambda: (r := oai.responses.retrieve(quick.id)).status not in ("queued", "in_progress") and r,
                    60, "the background response to end", interval=0.2)
    assert done.status == "incomplete" and done.output_text and done.usage.output_tokens == 4
    with pytest.raises(openai.BadRequestError) as exc:  # ended already: nothing to cancel, as vLLM answers
        oai.responses.cancel(quick.id)
    assert "already ended (incomplete)" in exc.value.body["message"]
    assert oai.responses.retrieve(quick.id).status == "incomplete"

    slow = oai.responses.create(model="tiny", input="Tell me a long story", max_output_tokens=400,
                                background=True, extra_body={"ignore_eos": True})
    stopped = oai.responses.cancel(slow.id)
    assert stopped.status == "cancelled" and oai.responses.retrieve(slow.id).status == "cancelled"
    assert stopped.error is None and oai.responses.retrieve(slow.id).error is None  # cancelled is no error
    plain = oai.responses.create(model="tiny", input="x", max_output_tokens=1)
    with pytest.raises(openai.BadRequestError) as exc:
        oai.responses.cancel(plain.id)
    assert "only a background response" in exc.value.body["message"]


def test_a_discounted_background_response_runs_as_a_batch_job_due_when_its_window_ends(oai, stack):
    """``background_options.completion_window`` "2h": a worker runs the response as the batch job it is."""
    options = {"completion_window": "2h", "continuation_id": "chain-1"}
    resp = oai.responses.create(model="tiny", input="Hi", max_output_tokens=4, background=True,
                                background_options=options, extra_body={"ignore_eos": True})
    done = wait_for(lambda: (r := oai.responses.retrieve(resp.id)).status not in ("queued", "in_progress") and r,
                    60, "the background response to end", interval=0.2)
    assert done.status == "incomplete" and done.output_text and done.background_options == options
    job = _job(stack.url, stack.keys.paid, resp.id)
    assert job["kind"] == "batch" and job["status"] == "succeeded" and job["ttft_ms"] is None, job
    assert job["deadline_at"] and job["metrics"]["slo_met"] is True, job  # judged by its two hours: met


def test_a_cancelled_stream_ends_with_the_output_so_far(live_server, keys, start_worker):
    start_worker("w1", COSERVE_ENGINE_FACTORY="tests.e2e.slow_engine:build", COSERVE_STEP_DELAY_S="0.05")
    oai = openai.OpenAI(base_url=live_server + "/v1", api_key=keys.paid, max_retries=0, timeout=60)
    events, cancelled = [], False
    with httpx.stream("POST", f"{live_server}/v1/responses", headers={"Authorization": f"Bearer {keys.paid}"},
                      json={"model": "tiny", "input": "Tell me a story", "max_output_tokens": 400, "background": True,
                            "stream": True, "ignore_eos": True}, timeout=60) as resp:
        for line in resp.iter_lines():  # cancelled after a few deltas; the stream then ends on its own
            events += _sse_events([line])
            if not cancelled and sum(e["type"] == "response.output_text.delta" for e in events) == 3:
                cancelled = bool(oai.responses.cancel(events[0]["response"]["id"]))
    last = events[-1]["response"]
    assert events[-1]["type"] == "response.failed" and last["status"] == "cancelled" and last["error"] is None
    added = [e["item"]["id"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert added and [i["id"] for i in done] == added and {i["status"] for i in done} == {"incomplete"}
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert last["output"] == done and last["output"][0]["content"][0]["text"] == text
    assert last["usage"]["output_tokens"] >= 3 and last["usage"]["input_tokens"] > 0


def test_truncation_auto_drops_the_oldest_turns_that_outgrow_the_context(oai, stack):
    words = " ".join(f"word{i}" for i in range(40))
    turns = [m for i in range(4) for m in ({"role": "user", "content": f"question {i}: {words}"},
                                           {"role": "assistant", "content": words})]
    body = {"model": "tiny", "input": [*turns, {"role": "user", "content": "And now?"}], "instructions": "Be brief",
            "max_output_tokens": 64}
    with pytest.raises(openai.BadRequestError) as exc:  # ~650 tokens and 64 to answer: over the context of 512
        oai.responses.create(**body)
    assert exc.value.body["code"] == "context_length_exceeded" and exc.value.body["param"] == "input"
    fitted = oai.responses.create(**body, truncation="auto")
    assert fitted.truncation == "auto" and fitted.usage.input_tokens + 64 <= 512
    read = _messages(stack.settings, fitted.id)[1:]  # the prompt, after the instructions
    assert 1 < len(read) < len(turns) + 1 and read[-1]["content"] == "And now?"
    assert read[0]["content"] != turns[0]["content"]  # the oldest went first
    # the response's input is what was sent, the turns the engine did not read too
    items = oai.responses.input_items.list(fitted.id, order="asc", limit=100).data
    assert [i.content[0].text for i in items] == [m["content"] for m in body["input"]]
    assert oai.responses.retrieve(fitted.id).instructions == "Be brief"


def _sse_events(lines) -> list[dict]:
    return [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]


def test_a_background_stream_runs_on_without_its_client_and_is_resumed(live_server, keys, start_worker, settings):
    start_worker("w1", COSERVE_ENGINE_FACTORY="tests.e2e.slow_engine:build", COSERVE_STEP_DELAY_S="0.05")
    oai = openai.OpenAI(base_url=live_server + "/v1", api_key=keys.paid, max_retries=0, timeout=60)
    seen: list[dict] = []
    with httpx.stream("POST", f"{live_server}/v1/responses", headers={"Authorization": f"Bearer {keys.paid}"},
                      json={"model": "tiny", "input": "Tell me a story", "max_output_tokens": 40, "background": True,
                            "stream": True, "ignore_eos": True}, timeout=60) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():  # the client leaves after a few deltas
            seen += _sse_events([line])
            if sum(e["type"] == "response.output_text.delta" for e in seen) == 3:
                break
    assert seen[0]["type"] == "response.created" and seen[0]["response"]["background"] is True
    resp_id, last = seen[0]["response"]["id"], seen[-1]["sequence_number"]

    # it runs on (a plain stream's job would be cancelled), and GET resumes the stream after the last event read
    resumed = list(oai.responses.retrieve(resp_id, stream=True, starting_after=last))
    assert resumed[0].sequence_number == last + 1 and resumed[-1].type == "response.incomplete"
    final = resumed[-1].response
    assert final.usage.output_tokens == 40 and oai.responses.retrieve(resp_id).status == "incomplete"
    deltas = [e["delta"] for e in seen if e["type"] == "response.output_text.delta"]
    assert "".join(deltas + [e.delta for e in resumed if e.type == "response.output_text.delta"]) == final.output_text

    # read again from the start, the stream is the same events with the same numbers
    whole = list(oai.responses.retrieve(resp_id, stream=True))
    assert [(e.sequence_number, e.type) for e in whole] == (
        [(e["sequence_number"], e["type"]) for e in seen] + [(e.sequence_number, e.type) for e in resumed])

    # a stream that lost its first events (a Redis restart) is rebuilt from the stored response, in fewer events: a
    # resume past its end says so (it answered nothing, which a client took for the rest of the response)
    key = stream_key("job_" + resp_id.removeprefix("resp_"))
    redis.Redis.from_url(settings.redis_url).xtrim(key, maxlen=3, approximate=False)
    with httpx.stream("GET", f"{live_server}/v1/responses/{resp_id}", params={"stream": "true",
                      "starting_after": len(whole) - 2}, headers={"Authorization": f"Bearer {keys.paid}"}) as resp:
        rebuilt = _sse_events(resp.iter_lines())
    assert [e["type"] for e in rebuilt] == ["error"] and rebuilt[0]["code"] == "stream_rebuilt", rebuilt

    # once the job's stream has expired, a replay is the whole answer at once, and resuming it is refused
    redis.Redis.from_url(settings.redis_url).delete(key)
    with pytest.raises(openai.BadRequestError) as exc:
        oai.responses.retrieve(resp_id, stream=True, starting_after=last)
    assert exc.value.body["param"] == "starting_after" and "expired" in exc.value.body["message"]
    condensed = list(oai.responses.retrieve(resp_id, stream=True))
    assert "".join(e.delta for e in condensed if e.type == "response.output_text.delta") == final.output_text
    assert condensed[-1].type == "response.incomplete"


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
    ({"input": [{"type": "input_image", "image_url": "http://x"}]}, "input.0.type", "not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input.0.content.0", "input_text"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0", "only function tools"),
    ({"input": "x", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function"}},
     "tool_choice.name", "needs the \"name\""),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}},
     "text.format", "structured outputs need the vLLM backend"),  # chat's structured_outputs, in its words
    ({"input": "x", "tools": [{"type": "function", "name": "f"}], "tool_choice": "auto"}, "tool_choice",
     """'required', tool_choice {"type": "function", "name": ...} or tool_choice 'none'"""),  # this API's forms
    # a forced choice needs vLLM's structured outputs (this stack runs the own engine): each choice in this API's form
    ({"input": "x", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "f"}},
     "tool_choice", """tool_choice 'required' or {"type": "function", "name": ...}) is generated"""),
    # a function tool is flat in this API: its field as the client wrote it (chat's tools.0.function.name)
    ({"input": "x", "tools": [{"type": "function", "description": "no name"}]}, "tools.0.name", "tools.0.name:"),
    ({"input": "x", "background": True, "store": False}, "store", "must be stored"),
    ({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id", "no stored response"),
    ({"input": "x", "temperature": 3}, "temperature", "less than or equal to 2"),
    ({"input": "x", "truncation": "sometimes"}, "truncation", "'auto' or 'disabled'"),
    ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include", "includes only"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, "include", "vLLM"),  # the own engine has none
    ({"input": []}, "input", "must not be empty"),
    # vLLM's thinking budget, taken as chat takes it: the own engine cannot cut the thinking short
    ({"input": "x", "reasoning": {"effort": "low"}, "thinking_token_budget": 8}, "thinking_token_budget",
     "own torch engine"),
    ({}, "input", "input"),
    # vLLM's request_id names its Response (its id, verbatim), where coserve's id is its job's, which GET finds
    ({"input": "x", "request_id": "trace-7"}, "request_id", "X-Request-Id"),
    # disaggregated prefill and multimodal options (vLLM's Responses request takes them): text only, no connector
    ({"input": "x", "kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params", "KV connector"),
    ({"input": "x", "mm_processor_kwargs": {"num_crops": 4}}, "mm_processor_kwargs", "text only"),
])
def test_bad_requests_name_the_responses_field(body, param, says, stack):
    resp = httpx.post(f"{stack.url}/v1/responses", headers={"Authorization": f"Bearer {stack.keys.paid}"},
                      json={"model": "tiny", **body})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and says in error["message"], error
