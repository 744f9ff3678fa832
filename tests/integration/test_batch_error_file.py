"""A batch's error file (``invalid.jsonl``) is pinned byte for byte for an input mixing good lines with every kind of
line the validation refuses: a change that makes validation cheaper must not change what is refused, nor how."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sqlalchemy import func, select

from app.batch.fanout import invalid_path
from app.db.models import Job
from app.db.session import session_scope
from tests.conftest import Keys

pytestmark = pytest.mark.integration

URL = "/v1/completions"


def _line(custom_id, body, **over) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": URL, "body": body, **over})


GOOD = {"model": "tiny", "prompt": "Say hi", "max_tokens": 2}
# one line per way a line is refused (and good ones between them); blank lines count in the line numbers
LINES = [
    _line("good-1", GOOD),
    "{not json",
    "[1, 2]",
    "",
    _line("surrogate-body", {**GOOD, "prompt": "a\\ud800b"}).replace("\\\\ud800", "\\ud800"),
    _line("nul-id\\u0000", GOOD).replace("\\\\u0000", "\\u0000"),
    _line("key", {**GOOD, "stop\\udc00": "x"}).replace("\\\\udc00", "\\udc00"),
    _line("nul-prompt", {**GOOD, "prompt": ["ok", "no\\u0000"]}).replace("\\\\u0000", "\\u0000"),
    json.dumps({"method": "POST", "url": URL, "body": GOOD}),
    _line(7, GOOD),
    _line("", GOOD),
    _line("x" * 300, GOOD),
    _line("get", GOOD, method="GET"),
    _line("url", GOOD, url="/v1/chat/completions"),
    _line("body-list", [GOOD]),
    _line("stream", {**GOOD, "stream": True}),
    _line("no-prompt", {"model": "tiny"}),
    _line("bad-type", {**GOOD, "max_tokens": "two"}),
    _line("negative", {**GOOD, "max_tokens": -1}),
    _line("nan", {**GOOD, "temperature": float("nan")}),
    _line("best-of", {**GOOD, "best_of": 2}),
    _line("beam", {**GOOD, "use_beam_search": True}),
    _line("vllm-xargs", {**GOOD, "vllm_xargs": {"a": 1}}),
    _line("n", {**GOOD, "n": 17}),
    _line("stream-options", {**GOOD, "stream_options": {"include_usage": True}}),
    _line("echo-0", {**GOOD, "max_tokens": 0}),
    _line("qos", {**GOOD, "ttft_ms": 100}),
    _line("deadline", {**GOOD, "deadline": "1h"}),
    _line("tier-clash", {**GOOD, "tier": "free", "service_tier": "priority"}),
    _line("five-stops", {**GOOD, "stop": ["a", "b", "c", "d", "e"]}),
    _line("stop-ids", {**GOOD, "stop_token_ids": list(range(300))}),
    _line("empty-prompt", {**GOOD, "prompt": []}),
    _line("min-over-max", {**GOOD, "min_tokens": 5}),
    _line("format", {**GOOD, "response_format": {"type": "xml"}}),
    _line("logprobs", {**GOOD, "logprobs": 99}),
    _line("good-2", {**GOOD, "n": 2, "seed": 3}),
    _line("too-long", {**GOOD, "prompt": "word " * 4000}),
    _line("logit-bias", {**GOOD, "logit_bias": {"5": 1}}),
    _line("vocab", {**GOOD, "stop_token_ids": [999999]}),
    _line("echo-min", {**GOOD, "max_tokens": 0, "echo": True, "min_tokens": 1}),
    _line("good-3", {**GOOD, "prompt": ["one", "two"]}),
    _line("anchor", {**GOOD, "tbt_anchor": "first-token"}),
    _line("job-window", {**GOOD, "deadline_window_s": 60}),
    _line("priority", {**GOOD, "priority": 5}),
]

# what the validation writes for LINES, pinned before it was made cheaper: a change here is a refusal's message
# changed on purpose (logprobs' range message since vLLM's prompt_logprobs joined it; response_format's types since
# vLLM's structural_tag joined them; every line's custom_id a string and its error code and message alone, as
# OpenAI's and vLLM's error lines are, since the line number moved to the id and message only; a QoS field's
# refusal names it, since each line kind's does alike; vllm_xargs' and priority's say what a batch's request takes,
# since they pointed to the QoS fields a line refuses), never by a speed-up
EXPECTED = Path(__file__).with_name("batch_error_file.expected.jsonl")


def test_the_error_file_is_the_same_byte_for_byte(client, keys, settings):
    content = ("\n".join(LINES) + "\n").encode()
    f = client.post("/v1/files", headers=Keys.header(keys.paid), data={"purpose": "batch"},
                    files={"file": ("in.jsonl", content)}).json()
    batch = client.post("/v1/batches", headers=Keys.header(keys.paid), json={  # validated before it answers
        "input_file_id": f["id"], "endpoint": URL, "completion_window": "24h"}).json()
    got = client.get(f"/v1/batches/{batch['id']}", headers=Keys.header(keys.paid)).json()
    assert got["status"] == "in_progress", got
    written = invalid_path(settings.data_dir, batch["id"]).read_bytes()
    assert written == EXPECTED.read_bytes()
    with session_scope(settings.sqlalchemy_url) as s:  # good-1, good-2's two choices, good-3's two prompts
        assert s.scalar(select(func.count()).select_from(Job).where(Job.batch_id == batch["id"])) == 5
    assert got["request_counts"]["total"] == len([t for t in LINES if t.strip()])


def test_a_lines_vllm_ordering_fields_are_not_pointed_to_the_qos_fields_a_line_refuses():
    """``vllm_xargs`` and ``priority`` on a batch's line were refused with the online hint, to give ttft_ms, tbt_ms
    and deadline in the body: fields a batch's line refuses too (``refuse_qos``)."""
    from app.batch.lines import parse_line
    from app.openai_schemas import BATCH_QOS

    for field, value in (("vllm_xargs", {"a": 1}), ("priority", 5)):
        refused = parse_line(1, _line(field, {**GOOD, field: value}), URL, 3600.0)
        assert refused.code == "invalid_body" and f"leave {field} unset" in refused.message, refused
        assert not [name for name in BATCH_QOS if name in refused.message], refused.message


def test_a_lines_error_message_is_bounded_whatever_its_lists_length():
    """A line whose ``stop`` list of 1,300 numbers fails every item was refused with a message listing each failure
    (54 KB for a 7 KB line: a 200 MiB input file could make a multi-GB error file). It lists the first few and how
    many more now: the same few, so the same size, however long the list; the first error as before."""
    from app.batch.lines import parse_line

    messages = [parse_line(1, _line("a", {**GOOD, "stop": list(range(items))}), URL, 3600.0).message
                for items in (1300, 13000)]
    assert all(m.startswith("line 1: invalid body: stop: Input should be a valid string; stop.0: ") for m in messages)
    assert len(messages[0]) < 1000 and len(messages[1]) <= len(messages[0]) + 1, [len(m) for m in messages]
