"""A Batch API line of several choices (``n``, or several prompts on completions): a job per choice, one request in
the batch's counts, and one answer in the output file, or one error where a choice failed (the real app and SQLite;
no worker: the test ends the jobs in SQL)."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import select, update

from app.db.models import Job
from app.db.session import session_scope, write_guard
from tests.conftest import Keys

pytestmark = pytest.mark.integration


def _end(settings, job_ids: list[str], status: str, **values) -> None:
    with session_scope(settings.sqlalchemy_url) as s, write_guard(s):
        s.execute(update(Job).where(Job.id.in_(job_ids)).values(
            status=status, output_text="ok", completion_tokens=1, prompt_tokens=3, finish_reason="stop", **values))
        s.commit()


def test_a_line_of_several_choices_answers_whole_or_fails_whole(client, keys, settings):
    auth = Keys.header(keys.paid)
    lines = [{"custom_id": "many", "body": {"prompt": ["p", "q"], "n": 2, "max_tokens": 2}},
             {"custom_id": "one", "body": {"prompt": "r", "max_tokens": 2}},
             {"custom_id": "whole", "body": {"prompt": "s", "n": 2, "max_tokens": 2}}]
    text = "\n".join(json.dumps({**line, "method": "POST", "url": "/v1/completions"}) for line in lines)
    f = client.post("/v1/files", headers=auth, data={"purpose": "batch"}, files={"file": ("in.jsonl", text)}).json()
    batch_id = client.post("/v1/batches", headers=auth, json={"input_file_id": f["id"], "endpoint": "/v1/completions",
                                                              "completion_window": "1h"}).json()["id"]
    with session_scope(settings.sqlalchemy_url) as s:
        jobs = {cid: list(s.execute(select(Job.id, Job.prompt, Job.choice_index, Job.counts_request, Job.counts_prompt)
                                    .where(Job.batch_id == batch_id, Job.custom_id == cid).order_by(Job.choice_index)))
                for cid in ("many", "one", "whole")}
    # OpenAI's choice index (prompt x n + choice); usage counts the request once and each prompt once
    assert [tuple(r[1:]) for r in jobs["many"]] == [("p", 0, True, True), ("p", 1, False, False),
                                                     ("q", 2, False, True), ("q", 3, False, False)]
    assert [tuple(r[1:]) for r in jobs["one"]] == [("r", None, True, True)]
    many = [r.id for r in jobs["many"]]

    _end(settings, many[:3] + [jobs["one"][0].id] + [r.id for r in jobs["whole"]], "succeeded")
    batch = client.get(f"/v1/batches/{batch_id}", headers=auth).json()
    assert batch["status"] == "in_progress"  # one choice of "many" is still to run
    assert batch["request_counts"] == {"total": 3, "completed": 2, "failed": 0}
    assert batch["usage"]["input_tokens"] == 3 * 4  # "p" and "q" of the running line once each, "r", "s" once

    _end(settings, many[3:], "failed", error="engine error")
    batch = client.get(f"/v1/batches/{batch_id}", headers=auth).json()
    assert batch["status"] == "completed" and batch["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    out = [json.loads(t) for t in client.get(f"/v1/files/{batch['output_file_id']}/content", headers=auth).text
           .splitlines()]
    assert sorted(r["custom_id"] for r in out) == ["one", "whole"]
    whole = next(r for r in out if r["custom_id"] == "whole")["response"]["body"]
    assert [c["index"] for c in whole["choices"]] == [0, 1]
    assert whole["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    (error,) = [json.loads(t) for t in client.get(f"/v1/files/{batch['error_file_id']}/content", headers=auth)
                .text.splitlines()]
    assert error["custom_id"] == "many" and error["error"]["message"] == "generation failed: engine error"


def _first_choice_expired(client, auth, settings) -> tuple[str, int, str]:
    """A batch of one n=2 line whose first choice expired before it ran: its id, the line's prompt tokens and the
    second choice's job (left for the test to end)."""
    line = {"custom_id": "whole", "method": "POST", "url": "/v1/completions",
            "body": {"prompt": "s", "n": 2, "max_tokens": 2}}
    f = client.post("/v1/files", headers=auth, data={"purpose": "batch"},
                    files={"file": ("in.jsonl", json.dumps(line))}).json()
    batch_id = client.post("/v1/batches", headers=auth, json={"input_file_id": f["id"], "endpoint": "/v1/completions",
                                                              "completion_window": "1h"}).json()["id"]
    with session_scope(settings.sqlalchemy_url) as s:
        (first, prompt_tokens), (second, _) = s.execute(select(Job.id, Job.prompt_tokens)
                                                        .where(Job.batch_id == batch_id).order_by(Job.choice_index))
    with session_scope(settings.sqlalchemy_url) as s, write_guard(s):
        s.execute(update(Job).where(Job.id == first).values(status="expired", slo_met=False))
        s.commit()
    return batch_id, prompt_tokens, second


def test_a_lines_request_and_prompt_count_in_usage_where_only_a_later_choice_ran(client, keys, settings):
    """A line of n=2 whose first choice expired before it ran and whose second ran: the Usage API counts the line's
    request and its prompt once (the fan-out links a line's jobs to its first), not 0 requests and 0 input tokens
    beside the second choice's output."""
    from datetime import UTC, datetime

    auth = Keys.header(keys.paid)
    batch_id, prompt_tokens, second = _first_choice_expired(client, auth, settings)
    _end(settings, [second], "succeeded")
    now = int(datetime.now(UTC).timestamp())
    r = client.get("/v1/organization/usage/completions", headers=auth,
                   params={"start_time": now - 3600, "end_time": now + 60})
    (result,) = [x for b in r.json()["data"] for x in b["results"]]
    assert (result["num_model_requests"], result["input_tokens"], result["output_tokens"]) == (1, prompt_tokens, 1)


def test_a_lines_prompt_counts_in_the_batch_usage_where_only_a_later_choice_ran(client, keys, settings):
    """The Batch object's ``usage`` counts a line's prompt as the Usage API does: a line of n=2 whose first choice
    expired before it ran and whose second ran counts the prompt's input tokens once, and the cached tokens of the
    choice that ran, not 0 input tokens beside the second choice's output."""
    auth = Keys.header(keys.paid)
    batch_id, prompt_tokens, second = _first_choice_expired(client, auth, settings)
    _end(settings, [second], "succeeded", cached_tokens=2)
    usage = client.get(f"/v1/batches/{batch_id}", headers=auth).json()["usage"]
    assert (usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"], usage["output_tokens"],
            usage["total_tokens"]) == (prompt_tokens, 2, 1, prompt_tokens + 1)


def test_a_chat_lines_echo_asks_for_the_prompts_logprobs_on_vllm_as_online(client, keys, settings):
    """vLLM's run_batch answers a chat line's echo with the prompt's logprobs (top_logprobs alternatives, 0 unset), as
    the online chat route does since 4463d7a; a line's job asked for none (prompt_logprobs: null in its answer)."""
    settings.backend = "vllm"  # the own engine reports no prompt logprobs: online and in a batch, none asked there
    auth = Keys.header(keys.paid)
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue"}]
    bodies = {"echo": {"echo": True}, "top": {"echo": True, "logprobs": True, "top_logprobs": 2}, "plain": {}}
    text = "\n".join(json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                                 "body": {"messages": messages, "max_tokens": 2, **extra}})
                     for cid, extra in bodies.items())
    f = client.post("/v1/files", headers=auth, data={"purpose": "batch"}, files={"file": ("in.jsonl", text)}).json()
    batch_id = client.post("/v1/batches", headers=auth, json={"input_file_id": f["id"], "completion_window": "1h",
                                                              "endpoint": "/v1/chat/completions"}).json()["id"]
    with session_scope(settings.sqlalchemy_url) as s:
        jobs = {job.custom_id: (job.id, job.sampling["prompt_logprobs"])
                for job in s.scalars(select(Job).where(Job.batch_id == batch_id))}
    assert {cid: asked for cid, (_, asked) in jobs.items()} == {"echo": 0, "top": 2, "plain": None}
    steps = [{"token": "Name", "logprob": None, "top": [], "id": 5, "rank": None, "top_ids": []},  # as a worker keeps
             {"token": " a", "logprob": -1.5, "top": [[" a", -1.5]], "id": 42, "rank": 1, "top_ids": [42]}]
    _end(settings, [jobs["echo"][0]], "succeeded", prompt_logprobs=steps)
    _end(settings, [jobs["top"][0], jobs["plain"][0]], "succeeded")
    batch = client.get(f"/v1/batches/{batch_id}", headers=auth).json()
    out = {r["custom_id"]: r["response"]["body"] for r in map(
        json.loads, client.get(f"/v1/files/{batch['output_file_id']}/content", headers=auth).text.splitlines())}
    assert out["echo"]["prompt_logprobs"] == [None, {"42": {"logprob": -1.5, "rank": 1, "decoded_token": " a"}}], out
    assert out["plain"]["prompt_logprobs"] is None, out
