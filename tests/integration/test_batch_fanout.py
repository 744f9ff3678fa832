"""A batch's jobs are written in short transactions (staged) and become runnable all at once when the batch starts:
SQLite's write lock is let go between chunks, so interactive submissions go on during a large fan-out, and a
failure midway leaves no job of the batch."""

from __future__ import annotations

import json
import threading
from collections import Counter

import pytest
import redis
from sqlalchemy import func, select, text, update

from app.batch import fanout
from app.db.models import STAGED, Batch, Job, JobEvent
from app.db.session import session_scope
from tests.conftest import Keys
from workers.celery_app import queue_lists, queue_name
from workers.sweeper import _JOB_ID

pytestmark = pytest.mark.integration


def _create(client, keys, lines: int, request_id: str | None = None) -> dict:
    body = "\n".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                                 "body": {"model": "tiny", "prompt": "Hi", "max_tokens": 2}}) for i in range(lines))
    f = client.post("/v1/files", headers=Keys.header(keys.paid), data={"purpose": "batch"},
                    files={"file": ("in.jsonl", body.encode())}).json()
    headers = Keys.header(keys.paid) | ({"X-Request-Id": request_id} if request_id else {})
    return client.post("/v1/batches", headers=headers, json={  # fans out before it answers
        "input_file_id": f["id"], "endpoint": "/v1/completions", "completion_window": "24h"}).json()


def _messages(settings) -> Counter:
    """How many messages on the model's queues name each job."""
    r = redis.Redis.from_url(settings.redis_url)
    return Counter(i.decode() for key in queue_lists(queue_name("tiny")) for raw in r.lrange(key, 0, -1)
                   for i in set(_JOB_ID.findall(raw)))


def _jobs(settings, batch_id: str) -> list[tuple[str, str]]:
    with session_scope(settings.sqlalchemy_url) as s:
        return [tuple(r) for r in s.execute(select(Job.id, Job.status).where(Job.batch_id == batch_id))]


def test_every_job_is_dispatched_once_when_written_in_chunks(client, keys, settings, monkeypatch):
    monkeypatch.setattr(fanout, "STAGE_CHUNK", 2)
    batch = _create(client, keys, 5)
    assert batch["status"] == "validating"
    jobs = _jobs(settings, batch["id"])
    assert len(jobs) == 5 and {status for _, status in jobs} == {"dispatched"}
    assert _messages(settings) == Counter({job_id: 1 for job_id, _ in jobs})
    with session_scope(settings.sqlalchemy_url) as s:
        assert s.get(Batch, batch["id"]).status == "in_progress"
        events = s.execute(select(JobEvent.job_id, JobEvent.from_status, JobEvent.to_status)
                           .where(JobEvent.job_id.in_([j for j, _ in jobs]))).all()
    assert Counter((f, t) for _, f, t in events) == {(None, "queued"): 5, ("queued", "dispatched"): 5}


# a trigger that fails the insert of the job of custom_id c4, as a disk error would, in each database's dialect
REFUSE_C4 = {
    "sqlite": ["CREATE TRIGGER refuse_c4 BEFORE INSERT ON jobs WHEN NEW.custom_id = 'c4' "
               "BEGIN SELECT RAISE(ABORT, 'disk I/O error'); END"],
    "postgresql": ["CREATE FUNCTION refuse_c4() RETURNS trigger LANGUAGE plpgsql AS "
                   "$$ BEGIN RAISE EXCEPTION 'disk I/O error'; END $$",
                   "CREATE TRIGGER refuse_c4 BEFORE INSERT ON jobs FOR EACH ROW WHEN (NEW.custom_id = 'c4') "
                   "EXECUTE FUNCTION refuse_c4()"],
}


def test_a_failure_midway_leaves_no_job_of_the_batch(client, keys, settings, monkeypatch):
    monkeypatch.setattr(fanout, "STAGE_CHUNK", 2)
    with session_scope(settings.sqlalchemy_url) as s:  # the database refuses the third chunk's first row
        for statement in REFUSE_C4[s.get_bind().dialect.name]:
            s.execute(text(statement))
    batch = _create(client, keys, 6)
    got = client.get(f"/v1/batches/{batch['id']}", headers=Keys.header(keys.paid)).json()
    assert got["status"] == "failed" and got["errors"]["data"][0]["code"] == "internal_error"
    assert "can be sent again" in got["errors"]["data"][0]["message"]
    assert _jobs(settings, batch["id"]) == []  # the two chunks written before it are gone too
    with session_scope(settings.sqlalchemy_url) as s:
        events = select(func.count()).select_from(JobEvent).where(JobEvent.detail == f"batch {batch['id']}")
        assert s.scalar(events) == 0
    assert _messages(settings) == Counter()


def _between_chunks(monkeypatch, action) -> None:
    """Runs ``action()`` on another thread (as another request would) once the fan-out has written its first chunk
    of 2 jobs and before it writes the next, and waits for it."""
    monkeypatch.setattr(fanout, "STAGE_CHUNK", 2)
    real_rows = fanout.FanOut.job_rows

    def job_rows(self, lines, dispatched_at):
        for i, chunk in enumerate(real_rows(self, lines, dispatched_at)):
            if i == 1:
                t = threading.Thread(target=action)
                t.start()
                t.join(60)
            yield chunk

    monkeypatch.setattr(fanout.FanOut, "job_rows", job_rows)


def _only_batch(settings) -> tuple[str, int]:
    """The batch's id, and how many jobs are staged."""
    with session_scope(settings.sqlalchemy_url) as s:
        staged = select(func.count()).select_from(Job).where(Job.status.startswith(STAGED))
        return s.scalar(select(Batch.id)), s.scalar(staged)


def test_an_interactive_submission_goes_through_while_a_batch_fans_out(client, keys, settings, monkeypatch):
    seen: dict = {}

    def submit():
        seen["batch_id"], seen["staged"] = _only_batch(settings)
        seen["submit"] = client.post("/v1/jobs", headers=Keys.header(keys.paid), json={"prompt": "Hi", "max_tokens": 2})
        seen["listed"] = client.get("/v1/jobs", headers=Keys.header(keys.paid)).json()["data"]
        seen["batch"] = client.get(f"/v1/batches/{seen['batch_id']}", headers=Keys.header(keys.paid)).json()["status"]
        seen["messages"] = _messages(settings)
        seen["admin"] = client.get("/admin/api/jobs", params={"request_id": "fan-out-1"},
                                   headers=Keys.header(keys.admin)).json()["data"]

    _between_chunks(monkeypatch, submit)
    batch = _create(client, keys, 5, request_id="fan-out-1")
    assert seen["admin"] == []  # an operator's search by the request's id does not show them staged either
    found = client.get("/admin/api/jobs", params={"request_id": "fan-out-1"}, headers=Keys.header(keys.admin))
    assert len(found.json()["data"]) == 5  # once started it does
    assert seen["staged"] == 2
    assert seen["submit"].status_code == 201, seen["submit"].text
    interactive = seen["submit"].json()["id"]
    assert [j["id"] for j in seen["listed"]] == [interactive]  # the staged jobs are not listed
    jobs = {job_id for job_id, _ in _jobs(settings, batch["id"])}
    assert seen["batch"] == "validating" and not jobs & set(seen["messages"])  # nor sent
    assert len(jobs) == 5 and {i: n for i, n in _messages(settings).items() if i in jobs} == dict.fromkeys(jobs, 1)


def test_a_batch_cancelled_while_it_fans_out_ends_cancelled_without_jobs(client, keys, settings, monkeypatch):
    seen: dict = {}

    def cancel():
        batch_id, _ = _only_batch(settings)
        seen["cancel"] = client.post(f"/v1/batches/{batch_id}/cancel", headers=Keys.header(keys.paid))

    _between_chunks(monkeypatch, cancel)
    batch = _create(client, keys, 5)
    assert seen["cancel"].json()["status"] == "cancelled"  # its staged jobs are not the batch's: nothing to wait for
    got = client.get(f"/v1/batches/{batch['id']}", headers=Keys.header(keys.paid)).json()
    assert got["status"] == "cancelled" and got["output_file_id"] is None
    # its unrun lines fail as cancelled (total = completed + failed, as a cancel of a running batch counts its jobs)
    assert got["request_counts"] == {"total": 5, "completed": 0, "failed": 5}
    errors = client.get(f"/v1/files/{got['error_file_id']}/content", headers=Keys.header(keys.paid)).text
    assert [json.loads(line)["error"]["code"] for line in errors.splitlines()] == ["batch_cancelled"] * 5
    assert _jobs(settings, batch["id"]) == [] and _messages(settings) == Counter()


def test_a_batch_whose_fan_out_died_midway_can_be_cancelled(client, keys, settings):
    batch = _create(client, keys, 3)  # as if its run had died after writing its jobs staged
    with session_scope(settings.sqlalchemy_url) as s:
        s.execute(update(Job).where(Job.batch_id == batch["id"]).values(status=f"{STAGED}-deadbeef"))
        s.execute(update(Batch).where(Batch.id == batch["id"]).values(status="validating"))
    got = client.post(f"/v1/batches/{batch['id']}/cancel", headers=Keys.header(keys.paid)).json()
    assert got["status"] == "cancelled" and got["output_file_id"] is None and got["error_file_id"] is None


def test_a_restarted_fan_out_starts_only_its_own_jobs_and_drops_a_dead_runs(client, keys, settings):
    batch = _create(client, keys, 3)  # run 1 fans out; then, as if it had died before the start, it is undone
    with session_scope(settings.sqlalchemy_url) as s:
        s.execute(update(Job).where(Job.batch_id == batch["id"]).values(status=f"{STAGED}-deadbeef"))
        s.execute(update(Batch).where(Batch.id == batch["id"]).values(status="validating"))
    dead = {job_id for job_id, _ in _jobs(settings, batch["id"])}
    redis.Redis.from_url(settings.redis_url).flushall()
    fanout.start_batch(settings, batch["id"])  # what restart_stalled_validation runs
    jobs = _jobs(settings, batch["id"])
    assert len(jobs) == 3 and {status for _, status in jobs} == {"dispatched"} and not dead & {j for j, _ in jobs}
    assert _messages(settings) == Counter({job_id: 1 for job_id, _ in jobs})


def test_a_fan_out_writes_its_rows_without_building_an_orm_job_for_each(client, keys, settings):
    from sqlalchemy import event

    built = []
    listener = lambda target, args, kwargs: built.append(target)  # noqa: E731 - an ORM Job constructed
    event.listen(Job, "init", listener)
    try:
        batch = _create(client, keys, 12)
    finally:
        event.remove(Job, "init", listener)
    jobs = _jobs(settings, batch["id"])
    assert len(jobs) == 12 and {status for _, status in jobs} == {"dispatched"}
    assert built == []  # its rows are the jobs' column values (jobs.job_values), inserted as they are
    assert _messages(settings) == Counter({job_id: 1 for job_id, _ in jobs})


def test_a_fan_out_reads_the_held_context_once_not_once_a_line(client, keys, settings, monkeypatch):
    """The context a batch's jobs are held to (the workers as this process last read them) is read at the fan-out's
    start and holds every line."""
    from app.batch import fanout
    from app.services import jobs as job_service
    from app.services.workers import held_context_length

    reads = []
    counted = lambda s: reads.append(1) or held_context_length(s)  # noqa: E731
    monkeypatch.setattr(fanout, "held_context_length", counted, raising=False)
    monkeypatch.setattr(job_service, "held_context_length", counted)
    batch = _create(client, keys, 12)
    assert len(_jobs(settings, batch["id"])) == 12 and len(reads) == 1


def test_a_fan_out_holds_off_full_collections_while_it_runs_and_gives_them_back(client, keys, settings):
    import gc

    from app.gc_pause import NEVER

    seen = []
    record = lambda phase, info: phase == "start" and seen.append(gc.get_threshold()[2])  # noqa: E731
    before = gc.get_threshold()
    gc.callbacks.append(record)
    try:
        batch = _create(client, keys, 40)
    finally:
        gc.callbacks.remove(record)
    assert len(_jobs(settings, batch["id"])) == 40
    assert NEVER in seen  # young collections ran during the fan-out, with the oldest generation's held off
    assert gc.get_threshold() == before


def test_a_line_whose_max_tokens_reaches_the_context_fails_at_validation_with_no_job(client, keys, settings):
    """OpenAI's batch checks its lines while it validates, before any job exists: a max_tokens of the whole context
    (512 tokens in tests), which no prompt fits beside, is the line's own error, and the other lines run."""
    lines = [{"custom_id": "fits", "method": "POST", "url": "/v1/completions",
              "body": {"model": "tiny", "prompt": "Hi", "max_tokens": 2}},
             {"custom_id": "whole", "method": "POST", "url": "/v1/completions",
              "body": {"model": "tiny", "prompt": "Hi", "max_tokens": 512}}]
    f = client.post("/v1/files", headers=Keys.header(keys.paid), data={"purpose": "batch"},
                    files={"file": ("in.jsonl", "\n".join(map(json.dumps, lines)).encode())}).json()
    batch = client.post("/v1/batches", headers=Keys.header(keys.paid), json={
        "input_file_id": f["id"], "endpoint": "/v1/completions", "completion_window": "24h"}).json()
    assert len(_jobs(settings, batch["id"])) == 1  # the line that fits
    path = fanout.invalid_path(settings.data_dir, batch["id"])  # its invalid lines, the error file's start
    refused = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["custom_id"] for r in refused] == ["whole"] and refused[0]["error"]["code"] == "invalid_body", refused
    assert "maximum context length is 512 tokens" in refused[0]["error"]["message"], refused


def test_a_fan_out_never_holds_its_input_file_whole_in_memory(client, keys, settings, monkeypatch):
    """The fan-out read the batch's input file whole (its bytes, their text and a list of its lines: about three
    copies of a file that may be 200 MiB), then built every line's jobs before writing any. It reads the file a line
    at a time now, builds, writes and sends the jobs ``STAGE_CHUNK`` at a time, and keeps only a few hundred bytes a
    line (their numbers, custom_ids, what is sent of each job): its peak is under one copy of the file (it was about
    nine). Every line still becomes its job, in order, started with the batch."""
    from app.api import batches as api

    held = []
    monkeypatch.setattr(api, "start_batch", lambda *args: held.append(args))  # run below, measured
    # 50 rows a chunk: a chunk's insert is transiently held whole (on PostgreSQL as its one statement, mogrified:
    # 100 rows of this prompt peaked at 5.0 MB there), a bound of the chunk, not of the file
    monkeypatch.setattr(fanout, "STAGE_CHUNK", 50)
    count, prompt = 3000, "word " * 300  # about 4.5 MiB, each line's prompt within tiny's context

    def create(lines: int) -> tuple[dict, int]:
        return _completions_batch(client, keys, [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                                                  "body": {"model": "tiny", "prompt": prompt, "max_tokens": 2}}
                                                 for i in range(lines)])

    batch, size, peak = _fan_out_peak(held, create, count)
    with session_scope(settings.sqlalchemy_url) as s:
        started = s.get(Batch, batch["id"])
        assert (started.status, started.total, started.failed) == ("in_progress", count, 0)
        assert s.scalars(select(Job.custom_id).where(Job.batch_id == batch["id"]).order_by(Job.created_at)).all() \
            == [f"c{i}" for i in range(count)]
    assert peak < size, f"{peak} bytes allocated at the peak of a {size}-byte input file's fan-out"


def test_a_batch_cancelled_while_it_fans_out_counts_its_remaining_lines_without_building_their_jobs(
        client, keys, settings, monkeypatch):
    """The fan-out built the jobs of every line left after a cancel (each tokenized, its row's values and what is
    sent of it), only to count them. It counts them now as read, each a refused line or one stopped unrun, as
    before: the batch's counts and error file say the same, in input order."""
    built = []
    real_line_jobs = fanout._line_jobs
    monkeypatch.setattr(fanout, "_line_jobs", lambda *args: built.append(args[2].custom_id) or real_line_jobs(*args))

    def cancel():
        batch_id, _ = _only_batch(settings)
        client.post(f"/v1/batches/{batch_id}/cancel", headers=Keys.header(keys.paid))

    _between_chunks(monkeypatch, cancel)  # chunks of 2 jobs: cancelled once the first is written
    good = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}
    lines = [json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions", "body": good})
             for i in range(8)]
    lines[5] = "{not json"
    f = client.post("/v1/files", headers=Keys.header(keys.paid), data={"purpose": "batch"},
                    files={"file": ("in.jsonl", "\n".join(lines).encode())}).json()
    batch = client.post("/v1/batches", headers=Keys.header(keys.paid), json={
        "input_file_id": f["id"], "endpoint": "/v1/completions", "completion_window": "24h"}).json()
    got = client.get(f"/v1/batches/{batch['id']}", headers=Keys.header(keys.paid)).json()
    assert (got["status"], got["request_counts"]) == ("cancelled", {"total": 8, "completed": 0, "failed": 8}), got
    errors = client.get(f"/v1/files/{got['error_file_id']}/content", headers=Keys.header(keys.paid)).text
    assert [(line["id"], line["error"]["code"]) for line in map(json.loads, errors.splitlines())] == [
        (f"batch_req_line_{n}", "invalid_json" if n == 6 else "batch_cancelled") for n in range(1, 9)], errors
    assert built == ["c0", "c1", "c2", "c3"], built  # the two chunks read before the cancel was seen


def test_a_batch_whose_fan_out_died_before_it_started_is_cancelled_with_counts_that_add_up(client, keys, settings):
    """A fan-out that died after it had written its jobs staged and its refused lines, before it started the batch
    (which took its counts with it), then a cancel: the cancel's fan-in counted the refused line failed and left
    ``total`` as the dead run left it (0): 1 failed of 0 requests. The cancel answers what it ended: total =
    completed + failed, as every ended batch's (OpenAI's client reads them); after its answer it finds no fan-out
    alive and counts the file's lines (``count_if_abandoned``): both failed, the unrun one and the refused one."""
    from openai.types import Batch as OpenAIBatch

    good = json.dumps({"custom_id": "ok", "method": "POST", "url": "/v1/completions",
                       "body": {"model": "tiny", "prompt": "Hi", "max_tokens": 2}})
    f = client.post("/v1/files", headers=Keys.header(keys.paid), data={"purpose": "batch"},
                    files={"file": ("in.jsonl", f"{good}\n{{not json\n".encode())}).json()
    batch = client.post("/v1/batches", headers=Keys.header(keys.paid), json={
        "input_file_id": f["id"], "endpoint": "/v1/completions", "completion_window": "24h"}).json()
    with session_scope(settings.sqlalchemy_url) as s:  # as its run left it, dead before _start_staged committed
        s.execute(update(Job).where(Job.batch_id == batch["id"]).values(status=f"{STAGED}-deadbeef"))
        s.execute(update(Batch).where(Batch.id == batch["id"]).values(
            status="validating", in_progress_at=None, total=0, completed=0, failed=0, model=None))
    got = OpenAIBatch.model_validate(client.post(f"/v1/batches/{batch['id']}/cancel",
                                                 headers=Keys.header(keys.paid)).json())
    counts = got.request_counts
    assert got.status == "cancelled" and counts.failed == 1, got  # its refused line, in its error file
    assert counts.total == counts.completed + counts.failed, counts
    again = OpenAIBatch.model_validate(client.get(f"/v1/batches/{batch['id']}", headers=Keys.header(keys.paid)).json())
    assert (again.request_counts.total, again.request_counts.completed, again.request_counts.failed) == (2, 0, 2)


def test_a_fan_out_never_holds_its_refused_lines_whole_in_memory(client, keys, settings, monkeypatch):
    """The fan-out kept every refused line (its message with it) until the batch started, then wrote them to
    invalid.jsonl: a file of refused lines whose messages are long (a ``stop`` of 150 numbers: each named, about
    6 KB of message from a line of under 1 KB) was held whole, several times the input file. It writes each to
    invalid.jsonl as it is read now, and keeps their count: its peak is under one copy of the input file. The counts
    and the error lines, in input order, are as before."""
    from app import openai_schemas
    from app.api import batches as api

    held = []
    monkeypatch.setattr(api, "start_batch", lambda *args: held.append(args))  # run below, measured
    monkeypatch.setattr(fanout, "STAGE_CHUNK", 100)
    # every error named: long messages, as a refusal's may still be (a message lists LISTED_ERRORS of them now)
    monkeypatch.setattr(openai_schemas, "LISTED_ERRORS", 1000)
    count = 1500

    def create(refused: int) -> tuple[dict, int]:
        good = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}
        lines = [{"custom_id": "ok", "method": "POST", "url": "/v1/completions", "body": good}] + [
            {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": good | {"stop": [1] * 150}}
            for i in range(refused)]
        return _completions_batch(client, keys, lines)

    batch, size, peak = _fan_out_peak(held, create, count)
    with session_scope(settings.sqlalchemy_url) as s:
        started = s.get(Batch, batch["id"])
        assert (started.status, started.total, started.failed) == ("in_progress", count + 1, count)
    errors = [json.loads(line) for line in fanout.invalid_path(settings.data_dir, batch["id"]).read_text().splitlines()]
    assert [(e["id"], e["custom_id"], e["error"]["code"]) for e in errors] == [
        (f"batch_req_line_{i + 2}", f"r{i}", "invalid_body") for i in range(count)], errors[:3]
    assert all(len(e["error"]["message"]) > 5000 for e in errors), errors[0]
    assert peak < size, f"{peak} bytes allocated at the peak of a {size}-byte input file's fan-out"


def test_a_message_batchs_input_file_is_written_a_request_at_a_time(client, keys, settings, monkeypatch):
    """POST /v1/messages/batches built its input file whole before writing it (every request's line joined in one
    string, then its bytes: two copies of the file on top of the parsed body, about 16 MB for 20,000 requests). It
    writes a request's line at a time now: what the create allocates after its checks is a small part of the file.
    (The parsed body itself is FastAPI's, held whole before the route runs.)"""
    import tracemalloc

    from app.api import message_batches as api
    from app.db.models import File

    measured, held = {}, []
    checked = api._checked

    def checked_then_measured(*args):  # the peak from here on: the input file's writing, the batch's row
        parsed = checked(*args)
        tracemalloc.reset_peak()
        measured["base"] = tracemalloc.get_traced_memory()[0]
        return parsed

    def start_held(*args):  # the route's last step: its answer is built
        measured["peak"] = tracemalloc.get_traced_memory()[1]
        held.append(args)

    monkeypatch.setattr(api, "_checked", checked_then_measured)
    monkeypatch.setattr(api, "start_batch", start_held)
    params = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi " * 500}]}
    body = {"requests": [{"custom_id": f"r{i}", "params": params} for i in range(3000)]}  # about 4.6 MB
    tracemalloc.start()
    try:
        made = client.post("/v1/messages/batches", headers={"x-api-key": keys.paid}, json=body)
    finally:
        tracemalloc.stop()
    assert made.status_code == 200 and len(held) == 1, made.text
    with session_scope(settings.sqlalchemy_url) as s:
        batch = s.get(Batch, made.json()["id"])
        size = s.get(File, batch.input_file_id).bytes
        assert batch.total == 3000 and size > 4_000_000, (batch.total, size)
    grown = measured["peak"] - measured["base"]
    assert grown < size // 4, f"{grown} bytes allocated at the peak of writing a {size}-byte input file"


def _completions_batch(client, keys, lines: list[dict]) -> tuple[dict, int]:
    """A /v1/completions batch of ``lines`` created (its start held by the test) and its input file's size."""
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    f = client.post("/v1/files", headers=Keys.header(keys.paid), data={"purpose": "batch"},
                    files={"file": ("in.jsonl", content)}).json()
    return client.post("/v1/batches", headers=Keys.header(keys.paid), json={
        "input_file_id": f["id"], "endpoint": "/v1/completions", "completion_window": "24h"}).json(), len(content)


def _fan_out_peak(held: list, create, count: int) -> tuple[dict, int, int]:
    """A batch of ``count`` lines (``create``'s), its input's size and the bytes allocated at the peak of its fan-out,
    after a two-line batch's (its tokenizer loaded, its statements compiled)."""
    import tracemalloc

    create(2)
    fanout.start_batch(*held.pop())
    batch, size = create(count)
    tracemalloc.start()
    try:
        fanout.start_batch(*held.pop())
        return batch, size, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


class Killed(BaseException):
    """The API process killed: nothing of the fan-out's own clean-up runs (no ``except Exception`` catches it)."""


def test_a_fan_out_killed_midway_is_finished_by_the_sweeper_with_each_line_run_once(client, keys, settings,
                                                                                     monkeypatch):
    from workers.batch_tasks import restart_stalled_validation

    monkeypatch.setattr(fanout, "STAGE_CHUNK", 2)
    batch_id = _created_then_killed(client, keys, settings, monkeypatch)
    _, staged = _only_batch(settings)
    dead = {job_id for job_id, _ in _jobs(settings, batch_id)}
    assert staged == 2 and len(dead) == 2  # the dead run's first chunk, left staged
    assert restart_stalled_validation(settings, stale_after_s=0) == [batch_id]
    jobs = _jobs(settings, batch_id)
    assert len(jobs) == 5 and {status for _, status in jobs} == {"dispatched"} and not dead & {j for j, _ in jobs}
    assert _messages(settings) == Counter({job_id: 1 for job_id, _ in jobs})
    with session_scope(settings.sqlalchemy_url) as s:
        batch = s.get(Batch, batch_id)
        assert (batch.status, batch.total, batch.failed) == ("in_progress", 5, 0)
        customs = s.scalars(select(Job.custom_id).where(Job.batch_id == batch_id)).all()
    assert sorted(customs) == [f"c{i}" for i in range(5)]


def _created_then_killed(client, keys, settings, monkeypatch) -> str:
    """A batch of 5 lines whose fan-out was killed after its first chunk (its API process gone): its id."""
    from datetime import timedelta

    from app.batch.fanout import expires_at_for
    from app.db.models import new_id
    from app.services.transitions import utcnow

    body = "\n".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                                 "body": {"model": "tiny", "prompt": "Hi", "max_tokens": 2}}) for i in range(5))
    f = client.post("/v1/files", headers=Keys.header(keys.paid), data={"purpose": "batch"},
                    files={"file": ("in.jsonl", body.encode())}).json()
    created, batch_id = utcnow() - timedelta(minutes=10), new_id("batch")
    with session_scope(settings.sqlalchemy_url) as s:
        s.add(Batch(id=batch_id, tenant_id=keys.tenant_id, endpoint="/v1/completions", input_file_id=f["id"],
                    completion_window="1h", status="validating", tier="paid", created_at=created,
                    expires_at=expires_at_for(created, "1h")))
    real_rows = fanout.FanOut.job_rows

    def killed_after_first_chunk(self, lines, dispatched_at):
        for i, chunk in enumerate(real_rows(self, lines, dispatched_at)):
            if i == 1:
                raise Killed
            yield chunk

    with monkeypatch.context() as patched:
        patched.setattr(fanout.FanOut, "job_rows", killed_after_first_chunk)
        with pytest.raises(Killed):
            fanout.start_batch(settings, batch_id)
    return batch_id
