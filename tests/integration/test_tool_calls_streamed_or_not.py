"""Tool calls a model wrote, answered streamed and plain through the real HTTP app (a real Redis, a real migrated
SQL database) on the Chat, Responses and Messages routes: a scripted worker takes each job and publishes a given
text as a worker does (its deltas on the job's Redis stream, its end in SQL and on the stream), so each route's
stream and plain answer read the same text; they must give the same calls, in the same order, with the same
indexes, and end the same way."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime

import pytest
import redis
from sqlalchemy import select

from app.db.models import Job, JobStatus
from app.db.session import session_scope
from app.services.streaming import StreamEvent, publish

pytestmark = pytest.mark.integration

WAITING = (JobStatus.QUEUED, JobStatus.DISPATCHED)  # a job no worker took yet
PIECE = 4  # characters a delta: a tag or a call's name split across deltas


@contextmanager
def taking_jobs(settings, run: Callable[[redis.Redis, Job], None]) -> Iterator[None]:
    """A worker thread that hands each job not yet taken to ``run`` (with a Redis client to publish its stream on)."""
    stop = threading.Event()
    rds = redis.Redis.from_url(settings.redis_url)

    def loop() -> None:
        while not stop.wait(0.05):
            with session_scope(settings.database_url) as s:
                queued = s.scalars(select(Job).where(Job.status.in_(WAITING))).all()
                s.expunge_all()
            for job in queued:
                run(rds, job)

    worker = threading.Thread(target=loop, daemon=True)
    worker.start()
    try:
        yield
    finally:
        stop.set()
        worker.join()


@contextmanager
def scripted_worker(settings, text_of: dict[str, tuple[str, str, str | None]]) -> Iterator[None]:
    """A worker that runs every job not yet taken by publishing ``text_of[its last user text]``: (the text, its finish
    reason, its stop_reason), in deltas of ``PIECE`` characters, then its end."""

    def run(rds: redis.Redis, job: Job) -> None:
        text, reason, stop_reason = text_of[job.messages[-1]["content"]]
        for at in range(0, len(text), PIECE):
            publish(rds, job.id, StreamEvent("delta", attempt=1, text=text[at:at + PIECE], token_ids=[at],
                                             offset=at, data={"token_offset": at // PIECE}))
        with session_scope(settings.database_url) as s:
            row = s.get(Job, job.id)
            row.status, row.attempt, row.finished_at = JobStatus.SUCCEEDED, 1, datetime.now(UTC)
            row.output_text, row.finish_reason, row.stop_reason = text, reason, stop_reason
            row.prompt_tokens, row.completion_tokens = 9, -(-len(text) // PIECE)
        publish(rds, job.id, StreamEvent("end", attempt=1, status="succeeded", finish_reason=reason,
                                         data={"prompt_tokens": 9, "completion_tokens": -(-len(text) // PIECE),
                                               "stop_reason": stop_reason}))

    with taking_jobs(settings, run):
        yield


TOOLS = [("get_time", {"type": "object", "properties": {"tz": {"type": "string"}}}),
         ("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}}),
         ("f", {"type": "object", "properties": {}})]


REQUESTS = {  # each route's request of a case (the user's text names the worker's script), tool_choice auto
    "chat": lambda case: ("/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": case}], "tool_choice": "auto",
        "tools": [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in TOOLS]}),
    "responses": lambda case: ("/v1/responses", {
        "model": "tiny", "input": case, "tool_choice": "auto",
        "tools": [{"type": "function", "name": n, "parameters": p} for n, p in TOOLS]}),
    "messages": lambda case: ("/v1/messages", {
        "model": "tiny", "max_tokens": 64, "messages": [{"role": "user", "content": case}],
        "tool_choice": {"type": "auto"}, "tools": [{"name": n, "input_schema": p} for n, p in TOOLS]}),
}


def sse_data(response) -> list[dict]:
    """The JSON of each ``data:`` line of an event stream (less ``[DONE]``)."""
    return [json.loads(line[6:]) for line in response.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def chat_answer(body: dict) -> tuple:
    choice = body["choices"][0]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"].get("tool_calls") or ()]
    return choice["message"]["content"] or "", calls, choice["finish_reason"]


def chat_streamed(chunks: list[dict]) -> tuple:
    """What a client puts together of a Chat stream: the content, each call by its index, the finish reason."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for d in delta.get("tool_calls") or ():
                call = calls.setdefault(d["index"], ["", ""])
                call[0] += d.get("function", {}).get("name") or ""
                call[1] += d.get("function", {}).get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    assert sorted(calls) == list(range(len(calls))), calls  # indexes 0, 1, ... with none left out
    return content, [tuple(calls[k]) for k in sorted(calls)], finish


def responses_answer(body: dict) -> tuple:
    """A response's output items (their ids apart: each job its own) and its status."""
    return [item_of(i) for i in body["output"]], body["status"]


def item_of(item: dict) -> tuple:
    if item["type"] == "function_call":
        return "function_call", item["name"], item["arguments"], item["status"]
    if item["type"] == "message":
        return "message", "".join(part.get("text", "") for part in item["content"]), item["status"]
    return (item["type"],)


def responses_streamed(events: list[dict]) -> tuple:
    """A Responses stream's items as each was done, checked against its last event's response, and its status."""
    done = [item_of(e["item"]) for e in events if e["type"] == "response.output_item.done"]
    final = events[-1]["response"]
    assert done == responses_answer(final)[0], (done, final)
    deltas: dict[int, str] = {}  # each function call's arguments as its deltas add them, by output index
    for e in events:
        if e["type"] == "response.function_call_arguments.delta":
            deltas[e["output_index"]] = deltas.get(e["output_index"], "") + e["delta"]
    calls = [i for i in final["output"] if i["type"] == "function_call"]
    assert [deltas.get(k, "") for k, i in enumerate(final["output"]) if i["type"] == "function_call"] == [
        i["arguments"] for i in calls]
    return responses_answer(final)


def messages_answer(body: dict) -> tuple:
    """A message's content blocks (ids apart) and how it stopped."""
    return [block_of(b) for b in body["content"]], body["stop_reason"], body["stop_sequence"]


def block_of(block: dict) -> tuple:
    if block["type"] == "tool_use":
        return "tool_use", block["name"], block["input"]
    return block["type"], block.get("text", block.get("thinking"))


def messages_streamed(events: list[dict]) -> tuple:
    """A Messages stream as the ``anthropic`` SDK's accumulator puts it together."""
    from anthropic.lib.streaming._messages import accumulate_event

    snapshot, json_bufs = None, {}  # each tool_use block's partial JSON so far, as the SDK's stream keeps it
    for event in events:
        if event["type"] != "ping":
            snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=json_bufs)
    return messages_answer(snapshot.model_dump())


ANSWERS = {"chat": (chat_answer, chat_streamed), "responses": (responses_answer, responses_streamed),
           "messages": (messages_answer, messages_streamed)}

G = '{"name": "get_time", "arguments": {"tz": "UTC"}}'
W = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
GP, WP = G.replace("arguments", "parameters"), W.replace("arguments", "parameters")
# numbers Python's JSON reads that no JSON answer can write: NaN, Infinity and -Infinity (not JSON), and 1e999 (inf)
NOT_JSON = {"nan": "NaN", "inf": "Infinity", "neg_inf": "-Infinity", "overflow": "1e999"}
# per syntax: (case, the model's text, its finish reason, vLLM's stop_reason, the reasoning parser)
OUTPUTS = {
    "hermes": [
        ("good", f"<tool_call>{G}</tool_call>", "stop", None, None),
        ("two", f"Sure. <tool_call>{G}</tool_call>\n<tool_call>{W}</tool_call>", "stop", None, None),
        ("after", f"<tool_call>{G}</tool_call> Done.", "stop", None, None),
        ("cut", f'<tool_call>{G}</tool_call><tool_call>{{"name": "get_weather", "arguments": {{"ci', "length",
         None, None),
        ("stop_cut", f'<tool_call>{G}</tool_call><tool_call>{{"name": "get_weather", "arguments": {{"ci', "stop",
         "ty", None),
        ("broken", f'<tool_call>{{"name": "f", "arguments": {{"a": 1,}}}}</tool_call><tool_call>{W}</tool_call>',
         "stop", None, None),
        ("lost_brace", f'<tool_call>{{"name": "f", "arguments": {{}}</tool_call><tool_call>{W}</tool_call>',
         "stop", None, None),
        ("no_call", "<tool_call>oops</tool_call> and text", "stop", None, None),
        ("thinking", f"<think>maybe <tool_call>{G}</tool_call></think>Fine. <tool_call>{W}</tool_call>", "stop",
         None, "qwen3"),
        *((case, f'<tool_call>{{"name": "f", "arguments": {{"a": {v}}}}}</tool_call><tool_call>{W}</tool_call>',
           "stop", None, None) for case, v in NOT_JSON.items()),
    ],
    "llama3_json": [
        ("good", GP, "stop", None, None),
        ("two", f"<|python_tag|>{GP}; {WP}", "stop", None, None),
        ("text", f"Sure. {GP}", "stop", None, None),
        ("after", f"{GP} Done.", "stop", None, None),
        ("cut", f'{GP}; {{"name": "get_weather", "parameters": {{"ci', "length", None, None),
        ("broken", '{"name": "f", "parameters": {"a": 1,}}', "stop", None, None),
        ("thinking", f"<think>{GP}</think>{WP}", "stop", None, "qwen3"),
        *((case, f'{{"name": "f", "parameters": {{"a": {v}}}}}; {WP}', "stop", None, None)
          for case, v in NOT_JSON.items()),
    ],
    "mistral": [
        ("good", f"[TOOL_CALLS][{G}]", "stop", None, None),
        ("two", f"Sure. [TOOL_CALLS][{G}, {W}]", "stop", None, None),
        ("named", '[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}', "stop",
         None, None),
        ("after", f"[TOOL_CALLS][{G}] Done.", "stop", None, None),
        ("cut", f'[TOOL_CALLS][{G}, {{"name": "get_weather", "arguments": {{"ci', "length", None, None),
        ("broken", '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1,}}]', "stop", None, None),
        ("thinking", f"<think>[TOOL_CALLS][{G}]</think>Fine.", "stop", None, "qwen3"),
        *((case, f'[TOOL_CALLS][{{"name": "f", "arguments": {{"a": {v}}}}}, {W}]', "stop", None, None)
          for case, v in NOT_JSON.items()),
        *((f"named_{case}", f'[TOOL_CALLS]f[ARGS]{{"a": {v}}}[TOOL_CALLS]get_weather[ARGS]{{"city": "Oslo"}}', "stop",
           None, None) for case, v in NOT_JSON.items()),
    ],
}


@pytest.mark.parametrize("parser", sorted(OUTPUTS))
def test_each_route_answers_a_models_calls_the_same_streamed_or_not(settings, client, keys, parser):
    settings.tool_call_parser = parser
    script = {f"{parser}:{case}": (text, reason, stop_reason) for case, text, reason, stop_reason, _ in OUTPUTS[parser]}
    differ = []
    with scripted_worker(settings, script):
        for case, _text, _reason, _stop, thinking in OUTPUTS[parser]:
            settings.reasoning_parser = thinking
            for route, request in REQUESTS.items():
                path, body = request(f"{parser}:{case}")
                plain = client.post(path, json=body, headers=keys.header(keys.paid))
                streamed = client.post(path, json={**body, "stream": True}, headers=keys.header(keys.paid))
                assert plain.status_code == streamed.status_code == 200, (case, route, plain.text, streamed.text)
                read_plain, read_stream = ANSWERS[route]
                if (answer := read_plain(plain.json())) != (got := read_stream(sse_data(streamed))):
                    differ.append(f"{case} on {route}: plain {answer}, streamed {got}")
    assert not differ, "\n".join(differ)


STORED = {  # each route's read of a stored answer, by the plain answer's id
    "chat": lambda body: f"/v1/chat/completions/{body['id']}",
    "responses": lambda body: f"/v1/responses/{body['id']}",
}
BROKEN_CALL = {  # how each route answers a call whose arguments are no JSON: its call not to run
    "chat": lambda body: body["choices"][0]["finish_reason"] == "stop",
    "responses": lambda body: [i["status"] for i in body["output"] if i["type"] == "function_call"][0] == "incomplete",
    "messages": lambda body: body["stop_reason"] != "tool_use" and body["content"][0]["type"] == "tool_use",
}


@pytest.mark.parametrize("parser", sorted(OUTPUTS))
def test_a_call_whose_arguments_hold_nan_or_infinity_is_a_broken_call_on_each_route(settings, client, keys, parser):
    """Python's JSON reads NaN, Infinity and -Infinity (and 1e999 as inf), which no JSON answer can write: such
    arguments are no JSON, answered (and stored, and read back) as a broken call's, never a 500."""
    settings.tool_call_parser, settings.reasoning_parser = parser, None
    texts = {"hermes": '<tool_call>{{"name": "f", "arguments": {{"a": {}}}}}</tool_call>',
             "llama3_json": '{{"name": "f", "parameters": {{"a": {}}}}}',
             "mistral": '[TOOL_CALLS][{{"name": "f", "arguments": {{"a": {}}}}}]'}
    script = {f"{parser}:{case}": (texts[parser].format(v), "stop", None) for case, v in NOT_JSON.items()}
    wrong = []
    with scripted_worker(settings, script):
        for case in NOT_JSON:
            for route, request in REQUESTS.items():
                path, body = request(f"{parser}:{case}")
                plain = client.post(path, json={**body, "store": True}, headers=keys.header(keys.paid))
                assert plain.status_code == 200, (case, route, plain.text)
                if not BROKEN_CALL[route](answer := plain.json()):
                    wrong.append(f"{case} on {route}: {answer}")
                if route in STORED:
                    stored = client.get(STORED[route](answer), headers=keys.header(keys.paid))
                    assert stored.status_code == 200, (case, route, stored.text)
    assert not wrong, "\n".join(wrong)
