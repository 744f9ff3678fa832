"""Fuzzing over the app's own OpenAPI document, against the real app served by uvicorn on
loopback (migrated SQLite, real Redis): every answer must come without a 5xx and as
documented (status code, content type, headers, body schema).

Two passes:

- schemathesis generates each operation's inputs from the document, schema-valid and
  schema-breaking alike; a path parameter is half the time the id of a resource that
  exists (a job, file, batch, summarization, tenant, key), so the routes behind the 404
  run too;
- hypothesis sends the generating endpoints bodies that pass the schema's shape but carry
  what it cannot express: NaN and infinities, integers past 64 bits, lone surrogates,
  control characters, far dates, texts over the context.

A stand-in worker finishes every job at once, so a completion that passes validation is
answered instead of waiting for an engine. Bounded to about two and a half minutes on a 2-core
machine by the examples per operation (``COSERVE_FUZZ_EXAMPLES``, default 100; raise it to
hunt longer).
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, response_headers_conformance,
                                                response_schema_conformance, status_code_conformance)
from sqlalchemy import select

from tests.conftest import make_keys, make_settings, served_by_uvicorn

pytestmark = pytest.mark.integration

EXAMPLES = int(os.environ.get("COSERVE_FUZZ_EXAMPLES", "100"))
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance]
FUZZ_SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, print_blob=True,
                         suppress_health_check=list(HealthCheck))


class StandInWorker:
    """Finishes every queued or dispatched job as a worker would report it: SQL first, then
    the job's stream (one delta and the end event), so followers return at once. Its
    heartbeat row makes /readyz ready."""

    def __init__(self, settings) -> None:
        self.settings, self.stop = settings, threading.Event()
        self.thread = threading.Thread(target=self._run, name="stand-in-worker", daemon=True)

    def _run(self) -> None:
        import redis

        from app.db.models import Job, JobStatus, WorkerState
        from app.db.session import session_scope, write_guard
        from app.services.streaming import StreamEvent, publish
        from app.services.transitions import PENDING, transition, utcnow

        client = redis.Redis.from_url(self.settings.redis_url)
        url = self.settings.sqlalchemy_url
        beat = 0.0
        while not self.stop.wait(0.02):
            if time.monotonic() - beat > 0.5:
                with session_scope(url, immediate=True) as s, write_guard(s):  # read-then-write: immediate
                    s.merge(WorkerState(id="stand-in", model=self.settings.model_name, queue="none",
                                        device="none", heartbeat_at=utcnow(), draining=False))
                beat = time.monotonic()
            with session_scope(url) as s:
                todo = s.execute(select(Job.id, Job.prompt_tokens).where(
                    Job.status.in_([p.value for p in PENDING]))).all()
            for job_id, prompt_tokens in todo:
                now = utcnow()
                with session_scope(url) as s, write_guard(s):
                    done = transition(s, job_id, PENDING, JobStatus.SUCCEEDED, detail="stand-in worker", values={
                        "output_text": "ok", "finish_reason": "stop", "completion_tokens": 1, "started_at": now,
                        "first_token_at": now, "finished_at": now, "ttft_s": 0.0, "ttlt_s": 0.0, "slo_met": True})
                if done:
                    pipe = client.pipeline()
                    publish(pipe, job_id, StreamEvent("delta", text="ok", token_ids=[1]))
                    publish(pipe, job_id, StreamEvent("end", status=JobStatus.SUCCEEDED.value, finish_reason="stop",
                                                      data={"prompt_tokens": prompt_tokens, "completion_tokens": 1}))
                    pipe.execute()

    def __enter__(self) -> StandInWorker:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(10)


def _resources(base: str, session: requests.Session, model: str) -> dict[str, str]:
    """One resource of each kind, named by the path parameter that addresses it."""
    def ok(r: requests.Response) -> dict:
        assert r.status_code < 300, r.text
        return r.json()

    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}
    file_id = ok(session.post(f"{base}/v1/files", data={"purpose": "batch"},
                              files={"file": ("in.jsonl", json.dumps(line).encode())}))["id"]
    tenant = ok(session.post(f"{base}/v1/admin/tenants", json={"name": "fuzzed"}))
    conversation = ok(session.post(f"{base}/v1/conversations", json={"items": [{"role": "user", "content": "hi"}]}))
    return {
        "conversation_id": conversation["id"],
        "item_id": ok(session.get(f"{base}/v1/conversations/{conversation['id']}/items"))["data"][0]["id"],
        "job_id": ok(session.post(f"{base}/v1/jobs", json={"prompt": "hi", "max_tokens": 2}))["id"],
        "file_id": file_id,
        "batch_id": ok(session.post(f"{base}/v1/batches", json={"input_file_id": file_id,
                                                               "endpoint": "/v1/chat/completions"}))["id"],
        "message_batch_id": ok(session.post(f"{base}/v1/messages/batches", json={"requests": [
            {"custom_id": "a", "params": {"model": model, "max_tokens": 2,
                                          "messages": line["body"]["messages"]}}]}))["id"],
        "run_id": ok(session.post(f"{base}/v1/summarize", json={"documents": [{"id": "d", "text": "x y z"}]}))["id"],
        "tenant_id": tenant["tenant_id"], "key_id": tenant["key_id"],  # not the caller's key: revoking it is fine
        "worker_id": "stand-in", "model_id": model,
        "response_id": ok(session.post(f"{base}/v1/responses", json={"model": model, "input": "hi",
                                                                     "max_output_tokens": 2}))["id"],
    }


@pytest.fixture(scope="module")
def served(tmp_path_factory, redis_server, tiny_model_dir) -> Iterator[tuple[str, requests.Session, dict]]:
    """The app behind uvicorn for the whole module: its base URL, a session carrying the admin
    key (it reaches every operation; auth has its own tests, and a random key would stop every
    case at the 401) and the ids of existing resources."""
    import redis

    from app.auth import clear_cache
    from app.db.migrate import upgrade
    from app.main import create_app

    redis.Redis.from_url(redis_server).flushall()
    data = tmp_path_factory.mktemp("fuzz")
    db_url = f"sqlite:///{data / 'coserve.db'}"
    upgrade(db_url)
    settings = make_settings(data, db_url, redis_server, tiny_model_dir)
    settings.runtime_lora = True  # the adapter routes check what they are given instead of refusing it all
    keys = make_keys(db_url)
    clear_cache()
    with (StandInWorker(settings), requests.Session() as session,
          served_by_uvicorn(create_app(settings), "uvicorn-fuzz") as base):
        session.headers["Authorization"] = f"Bearer {keys.admin}"
        yield base, session, _resources(base, session, settings.model_name)


def _document() -> dict:
    """The OpenAPI document as served (it depends on the routes, not on the settings)."""
    from app.main import create_app
    from app.settings import Settings

    return create_app(Settings(data_dir=Path(tempfile.gettempdir()) / "coserve-openapi")).openapi()


DOCUMENT = _document()
SCHEMA = schemathesis.openapi.from_dict(DOCUMENT)
OPERATIONS = [(method.upper(), path) for path, item in DOCUMENT["paths"].items() for method in item]


@pytest.mark.parametrize("method, path", OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_every_operation_answers_as_documented(method, path, served):
    base, session, known = served
    operation = SCHEMA[path][method]
    # schema-valid inputs and inputs that break the schema (wrong types, bounds, missing fields)
    cases = st.one_of(operation.as_strategy(GenerationMode.POSITIVE), operation.as_strategy(GenerationMode.NEGATIVE))

    @given(case=cases, existing=st.booleans())
    @FUZZ_SETTINGS
    def answers_as_documented(case, existing):
        case.headers = {k: v for k, v in (case.headers or {}).items() if k.lower() != "authorization"}
        if existing and case.path_parameters:
            case.path_parameters = {k: known.get(k, v) for k, v in case.path_parameters.items()}
        case.call_and_validate(base_url=base, session=session, checks=CHECKS, timeout=30)

    answers_as_documented()


# ---------------------------------------------------------------- what the schema cannot say
ODD_TEXT = st.one_of(
    st.text(max_size=30),
    st.sampled_from(["\ud800", "a\udfffb", "\ud83d", "\ud83d\ude00", "résumé_✓", "\x00", "\u202e", "word " * 700,
                     "", " ", "2h", "0s", "-1h", "1e12s", "9999-12-31T23:59:59-12:00", "0001-01-01T00:00:00+14:00",
                     "2030-01-01T00:00:00"]),
)
ODD_NUMBER = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 2**31, 2**63, 2**64, 1e12, 1e-300, float("nan"), float("inf"), float("-inf")]),
)
ODD_VALUE = st.one_of(ODD_TEXT, ODD_NUMBER, st.none(), st.booleans(), st.lists(ODD_TEXT, max_size=3),
                      st.dictionaries(ODD_TEXT, ODD_TEXT, max_size=2))
TEXT = st.text(min_size=1, max_size=80)  # valid Unicode, any code point: what the tokenizer must take
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]), "content": TEXT}),
                    min_size=1, max_size=3)
ODD_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "developer", "robot", "\ud800"])},
    optional={"content": st.one_of(ODD_VALUE, st.lists(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "image"]), "text": ODD_VALUE}), max_size=2))})
ODD_SAMPLING = {"max_tokens": ODD_NUMBER, "temperature": ODD_NUMBER, "top_p": ODD_NUMBER, "seed": ODD_NUMBER,
                "stop": st.one_of(ODD_TEXT, st.lists(ODD_TEXT, max_size=5)), "app_id": ODD_TEXT, "tier": ODD_TEXT,
                "ttft_ms": ODD_NUMBER, "tbt_ms": ODD_NUMBER, "tbt_anchor": ODD_TEXT, "model": ODD_TEXT,
                "messages": st.lists(ODD_MESSAGE, max_size=2), "prompt_cache_key": ODD_TEXT,
                "allowed_token_ids": st.one_of(ODD_VALUE, st.lists(ODD_NUMBER, max_size=3)),
                "bad_words": st.one_of(ODD_VALUE, st.lists(ODD_TEXT, max_size=3)),
                "include_stop_str_in_output": ODD_VALUE, "truncate_prompt_tokens": ODD_NUMBER, "cache_salt": ODD_TEXT}


def odd(valid: st.SearchStrategy[dict], odd_fields: dict[str, st.SearchStrategy]) -> st.SearchStrategy[dict]:
    """A valid body with up to two of its fields set to odd values: one odd field at a time
    reaches the code behind validation, where a body full of them stops at the first check."""
    names = st.lists(st.sampled_from(sorted(odd_fields)), max_size=2, unique=True)
    overrides = names.flatmap(lambda ns: st.fixed_dictionaries({n: odd_fields[n] for n in ns}))
    return st.tuples(valid, overrides).map(lambda pair: {**pair[0], **pair[1]})


BODIES = {
    ("POST", "/v1/jobs"): odd(
        st.one_of(st.fixed_dictionaries({"prompt": TEXT, "max_tokens": st.integers(1, 8)}),
                  st.fixed_dictionaries({"messages": MESSAGES, "kind": st.just("batch"),
                                         "deadline_window_s": st.floats(1, 3600)})),
        {**ODD_SAMPLING, "prompt": ODD_TEXT, "kind": ODD_TEXT, "deadline_window_s": ODD_NUMBER,
         "deadline_at": ODD_TEXT}),
    ("POST", "/v1/chat/completions"): odd(
        st.fixed_dictionaries({"model": st.just("tiny"), "messages": MESSAGES, "max_tokens": st.integers(1, 4),
                               "stream": st.booleans()}),
        {**ODD_SAMPLING, "deadline": st.one_of(ODD_NUMBER, ODD_TEXT), "n": ODD_NUMBER, "user": ODD_TEXT,
         "max_completion_tokens": ODD_NUMBER, "presence_penalty": ODD_NUMBER, "stream": ODD_VALUE,
         "stream_options": ODD_VALUE, "logit_bias": st.dictionaries(ODD_TEXT, ODD_NUMBER, max_size=2)}),
    ("POST", "/v1/chat/completions/batch"): odd(
        st.fixed_dictionaries({"model": st.just("tiny"), "messages": st.lists(MESSAGES, min_size=1, max_size=3),
                               "max_tokens": st.integers(1, 4)}),
        {**ODD_SAMPLING, "messages": st.lists(st.one_of(st.lists(ODD_MESSAGE, max_size=2), ODD_VALUE), max_size=3),
         "n": ODD_NUMBER, "stream": ODD_VALUE, "tools": ODD_VALUE, "store": ODD_VALUE,
         "deadline": st.one_of(ODD_NUMBER, ODD_TEXT)}),
    ("POST", "/v1/completions"): odd(
        st.fixed_dictionaries({"model": st.just("tiny"), "prompt": st.one_of(TEXT, st.lists(TEXT, min_size=1,
                                                                                           max_size=1)),
                               "max_tokens": st.integers(1, 4), "stream": st.booleans()}),
        {**ODD_SAMPLING, "prompt": st.one_of(ODD_TEXT, st.lists(ODD_TEXT, max_size=2)),
         "deadline": st.one_of(ODD_NUMBER, ODD_TEXT), "echo": ODD_VALUE, "best_of": ODD_NUMBER}),
    ("POST", "/v1/responses"): odd(
        st.fixed_dictionaries({"model": st.just("tiny"), "input": st.one_of(TEXT, MESSAGES),
                               "max_output_tokens": st.integers(1, 4), "stream": st.booleans()}),
        {**{k: v for k, v in ODD_SAMPLING.items() if k not in ("messages", "max_tokens")},
         "input": st.one_of(ODD_TEXT, st.lists(st.one_of(ODD_MESSAGE, st.dictionaries(ODD_TEXT, ODD_VALUE,
                                                                                         max_size=3)), max_size=2)),
         "instructions": ODD_VALUE, "max_output_tokens": ODD_NUMBER, "previous_response_id": ODD_TEXT,
         "text": st.one_of(ODD_VALUE, st.fixed_dictionaries({"format": ODD_VALUE})),
         "tools": st.one_of(ODD_VALUE, st.lists(st.dictionaries(ODD_TEXT, ODD_VALUE, max_size=3), max_size=2)),
         "tool_choice": ODD_VALUE, "metadata": ODD_VALUE, "store": ODD_VALUE, "reasoning": ODD_VALUE,
         "deadline": st.one_of(ODD_NUMBER, ODD_TEXT), "conversation": ODD_VALUE, "truncation": ODD_VALUE,
         "background": ODD_VALUE}),
    ("POST", "/v1/conversations"): odd(
        st.fixed_dictionaries({"items": MESSAGES}),
        {"items": st.lists(st.one_of(ODD_MESSAGE, st.dictionaries(ODD_TEXT, ODD_VALUE, max_size=3)), max_size=2),
         "metadata": st.one_of(ODD_VALUE, st.dictionaries(ODD_TEXT, ODD_TEXT, max_size=2))}),
    ("POST", "/v1/summarize"): odd(
        st.fixed_dictionaries({"documents": st.lists(st.fixed_dictionaries({"id": TEXT, "text": TEXT}), min_size=1,
                                                     max_size=2, unique_by=lambda d: d["id"]),
                               "deadline": st.sampled_from(["1h", 600])}),
        {"documents": st.lists(st.fixed_dictionaries({"id": ODD_TEXT, "text": ODD_TEXT}), min_size=1, max_size=2),
         "deadline": st.one_of(ODD_NUMBER, ODD_TEXT), "max_summary_tokens": ODD_NUMBER, "chunk_tokens": ODD_NUMBER,
         "overlap_tokens": ODD_NUMBER, "tier": ODD_TEXT}),
    ("POST", "/v1/batches"): odd(
        st.fixed_dictionaries({"input_file_id": st.just("FILE"), "endpoint": st.just("/v1/chat/completions")}),
        {"input_file_id": ODD_TEXT, "endpoint": ODD_TEXT, "completion_window": ODD_TEXT,
         "metadata": st.dictionaries(ODD_TEXT, ODD_VALUE, max_size=2), "tier": ODD_TEXT}),
}


def _raw_json(body: Any) -> bytes:
    """What a client's encoder may write: NaN and Infinity, and a lone surrogate as its \\u escape."""
    return json.dumps(body, allow_nan=True).encode()


@pytest.mark.parametrize("method, path", list(BODIES), ids=[f"{m} {p}" for m, p in BODIES])
def test_odd_values_the_schema_cannot_express(method, path, served):
    base, session, known = served
    operation = SCHEMA[path][method]

    @given(body=BODIES[method, path])
    @FUZZ_SETTINGS
    def answers_as_documented(body):
        if body.get("input_file_id") == "FILE":
            body["input_file_id"] = known["file_id"]
        r = session.post(base + path, data=_raw_json(body), headers={"Content-Type": "application/json"}, timeout=30)
        operation.Case(body=body, media_type="application/json").validate_response(r, checks=CHECKS)

    answers_as_documented()
