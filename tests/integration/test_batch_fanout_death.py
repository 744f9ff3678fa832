"""A batch's fan-out killed midway (SIGKILL: no clean-up runs) loses no line, runs none twice and leaves none of its
part files behind; a cancel that comes between its chunks runs no line."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import func, select, update

from app.batch import fanout
from app.db.models import STAGED, Batch, Job, JobEvent, new_id
from app.db.session import session_scope
from app.services.transitions import utcnow
from tests.conftest import ROOT, Keys, wait_for, worker_env
from workers.batch_tasks import restart_stalled_validation

pytestmark = pytest.mark.integration

LINES = 5  # with one refused: four jobs, two chunks of the dying fan-out's two


def _validating_batch(client, keys, settings) -> str:
    """A batch of ``LINES`` lines (the last refused), committed validating as its create left it: its id."""
    good = [json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                        "body": {"model": "tiny", "prompt": f"Line {i}", "max_tokens": 2}}) for i in range(LINES - 1)]
    f = client.post("/v1/files", headers=Keys.header(keys.paid), data={"purpose": "batch"},
                    files={"file": ("in.jsonl", "\n".join([*good, "{not json"]).encode())}).json()
    batch_id = new_id("batch")
    with session_scope(settings.sqlalchemy_url) as s:
        s.add(Batch(id=batch_id, tenant_id=keys.tenant_id, endpoint="/v1/completions", input_file_id=f["id"],
                    completion_window="24h", status="validating", tier="paid"))
    return batch_id


def _fan_out_dying_at(settings, batch_id: str, point: str) -> None:
    """The batch's fan-out in its own process, SIGKILLed at ``point`` (tests/integration/dying_fanout.py)."""
    run = subprocess.run([sys.executable, "-m", "tests.integration.dying_fanout", batch_id, point], cwd=ROOT,
                         env=worker_env(settings, "fanout"), capture_output=True, text=True, check=False)
    assert run.returncode == -signal.SIGKILL, run.stderr[-3000:]


def _parts(settings, batch_id: str) -> list[str]:
    return sorted(p.name for p in (Path(settings.data_dir) / "batches" / batch_id).glob("*.part*"))


def test_a_fan_out_killed_before_sending_its_jobs_has_each_line_run_once_by_the_sweeper(client, keys, settings,
                                                                                          start_worker):
    """Killed after its jobs were committed dispatched, before their messages were sent: no message exists, and the
    sweeper's lost-message rule (``_resend_lost``: dispatched, unheld, not on the queue) sends each once; the batch
    completes with every line run once."""
    batch_id = _validating_batch(client, keys, settings)
    _fan_out_dying_at(settings, batch_id, "before_sending")
    with session_scope(settings.sqlalchemy_url) as s:
        jobs = s.scalars(select(Job.id).where(Job.batch_id == batch_id, Job.status == "dispatched")).all()
        assert len(jobs) == LINES - 1 and s.get(Batch, batch_id).status == "in_progress"
        # the resend age past (max(30, 5 x lease) s): the sweeper takes them as lost at once
        s.execute(update(Job).where(Job.batch_id == batch_id).values(dispatched_at=utcnow() - timedelta(seconds=60)))
    start_worker("w1")

    def ended() -> dict | None:
        batch = client.get(f"/v1/batches/{batch_id}", headers=Keys.header(keys.paid)).json()
        return batch if batch["status"] not in ("in_progress", "finalizing") else None
    batch = wait_for(ended, 120, "the batch to end")
    assert (batch["status"], batch["request_counts"]) == ("completed", {"total": LINES, "completed": LINES - 1,
                                                                        "failed": 1})
    with session_scope(settings.sqlalchemy_url) as s:
        runs = dict(s.execute(select(Job.id, Job.attempt).where(Job.batch_id == batch_id)).all())
        leased = dict(s.execute(select(JobEvent.job_id, func.count()).where(
            JobEvent.job_id.in_(jobs), JobEvent.detail == "leased").group_by(JobEvent.job_id)).all())
    assert runs == {j: 1 for j in jobs}  # the same jobs, each on its first attempt
    assert leased == {j: 1 for j in jobs}  # each run once
    assert _parts(settings, batch_id) == []


def test_fan_outs_killed_midway_leave_no_part_files_once_a_restart_starts_the_batch(client, keys, settings):
    """Each killed run left its own part file (the refused lines it had read; its line numbers' table half written),
    which nothing removed: they piled up a run at a time. The run that starts the batch removes them, and the
    batch's jobs are its own (the dead runs' staged ones deleted)."""
    batch_id = _validating_batch(client, keys, settings)
    _fan_out_dying_at(settings, batch_id, "between_chunks")
    _fan_out_dying_at(settings, batch_id, "keeping_line_numbers")
    assert len(_parts(settings, batch_id)) >= 2
    assert restart_stalled_validation(settings, stale_after_s=0) == [batch_id]
    assert _parts(settings, batch_id) == []
    with session_scope(settings.sqlalchemy_url) as s:
        batch = s.get(Batch, batch_id)
        assert (batch.status, batch.total, batch.failed) == ("in_progress", LINES, 1)
        statuses = s.scalars(select(Job.status).where(Job.batch_id == batch_id)).all()
    assert sorted(statuses) == ["dispatched"] * (LINES - 1)


def test_a_batch_cancelled_between_its_fan_outs_chunks_ends_cancelled_having_run_no_line(client, keys, settings,
                                                                                           monkeypatch):
    """The cancel comes after the fan-out wrote its first chunk (staged: not runnable): the fan-out writes no more,
    counts every line (the valid ones stopped unrun, the refused one refused) and ends the batch cancelled; no job is
    left to run."""
    batch_id = _validating_batch(client, keys, settings)
    write_staged, cancelled = fanout.write_staged, []

    def cancel_after_first(chunks):
        for i, chunk in enumerate(chunks):
            if i == 1:
                r = client.post(f"/v1/batches/{batch_id}/cancel", headers=Keys.header(keys.paid))
                cancelled.append(r.status_code)
            yield chunk

    monkeypatch.setattr(fanout, "STAGE_CHUNK", 2)
    monkeypatch.setattr(fanout, "write_staged", lambda url, chunks, *rest: write_staged(
        url, cancel_after_first(chunks), *rest))
    fanout.start_batch(settings, batch_id)
    assert cancelled == [200]
    batch = client.get(f"/v1/batches/{batch_id}", headers=Keys.header(keys.paid)).json()
    assert (batch["status"], batch["request_counts"]) == ("cancelled", {"total": LINES, "completed": 0,
                                                                        "failed": LINES})
    with session_scope(settings.sqlalchemy_url) as s:
        assert s.scalar(select(func.count()).select_from(Job).where(Job.batch_id == batch_id)) == 0
    assert _parts(settings, batch_id) == []


def test_a_fan_out_that_another_run_finished_meanwhile_stops_quietly(client, keys, settings, monkeypatch, caplog):
    """Two runs of a batch's fan-out (the API's, slow, and the sweeper's restart): the one that ends the validation
    deletes every run's part files, the other's among them. That one, finding its part gone, has lost the start: it
    stops, where it logged the batch as failed during validation (a traceback, FileNotFoundError) though it ran."""
    batch_id = _validating_batch(client, keys, settings)
    write_staged, other = fanout.write_staged, []

    def other_run_after_first(chunks):
        for i, chunk in enumerate(chunks):
            if i == 1 and not other:
                other.append(batch_id)
                fanout.start_batch(settings, batch_id)  # the other run, to its end
            yield chunk

    monkeypatch.setattr(fanout, "STAGE_CHUNK", 2)
    monkeypatch.setattr(fanout, "write_staged", lambda url, chunks, *rest: write_staged(
        url, other_run_after_first(chunks), *rest))
    fanout.start_batch(settings, batch_id)
    assert other == [batch_id]
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == []
    with session_scope(settings.sqlalchemy_url) as s:
        batch = s.get(Batch, batch_id)
        assert (batch.status, batch.total, batch.failed) == ("in_progress", LINES, 1)
        statuses = s.scalars(select(Job.status).where(Job.batch_id == batch_id)).all()
    assert sorted(statuses) == ["dispatched"] * (LINES - 1)
    assert _parts(settings, batch_id) == []


def _staged(settings, batch_id: str) -> int:
    with session_scope(settings.sqlalchemy_url) as s:
        return s.scalar(select(func.count()).select_from(Job).where(Job.batch_id == batch_id,
                                                                     Job.status.startswith(STAGED)))


def test_a_batch_cancelled_after_its_fan_out_died_ends_with_its_lines_counted_and_nothing_left(client, keys,
                                                                                                settings):
    """The fan-out killed between its chunks (its first staged, its part file written), then the user's cancel,
    before the sweeper's restart: the batch ended cancelled with ``total`` 0, and the dead run's staged jobs and part
    files stayed for good (the sweeper restarts only batches still validating). The cancel finds no fan-out alive
    and counts the lines itself, as a live fan-out would: every line failed (the refused one refused, the others
    stopped unrun), each in the error file; nothing staged or part left."""
    batch_id = _validating_batch(client, keys, settings)
    _fan_out_dying_at(settings, batch_id, "between_chunks")
    assert _staged(settings, batch_id) == 2 and _parts(settings, batch_id)
    cancelled = client.post(f"/v1/batches/{batch_id}/cancel", headers=Keys.header(keys.paid))
    assert cancelled.status_code == 200, cancelled.text
    batch = client.get(f"/v1/batches/{batch_id}", headers=Keys.header(keys.paid)).json()
    assert (batch["status"], batch["request_counts"]) == ("cancelled", {"total": LINES, "completed": 0,
                                                                        "failed": LINES})
    errors = client.get(f"/v1/files/{batch['error_file_id']}/content", headers=Keys.header(keys.paid)).text
    codes = [json.loads(line)["error"]["code"] for line in errors.splitlines()]
    assert codes == ["batch_cancelled"] * (LINES - 1) + ["invalid_json"], codes
    assert _staged(settings, batch_id) == 0
    assert _parts(settings, batch_id) == []


def test_a_message_batch_cancelled_after_its_fan_out_died_leaves_nothing_staged(client, keys, settings,
                                                                                 monkeypatch):
    """Anthropic's cancel of a message batch whose fan-out died (the create's never ran, the one after it was killed
    between its chunks): every request canceled, as its counts and results say, and the dead run's staged jobs and
    part files deleted."""
    from app.api import message_batches as api

    monkeypatch.setattr(api, "start_batch", lambda *args: None)  # the create's API died before its fan-out
    headers = {"x-api-key": keys.paid}
    made = client.post("/v1/messages/batches", headers=headers, json={"requests": [
        {"custom_id": f"r{i}", "params": {"model": "tiny", "max_tokens": 2,
                                           "messages": [{"role": "user", "content": "Hi"}]}} for i in range(LINES)]})
    assert made.status_code == 200, made.text
    batch_id = made.json()["id"]
    _fan_out_dying_at(settings, batch_id, "between_chunks")
    assert _staged(settings, batch_id) == 2 and _parts(settings, batch_id)
    done = client.post(f"/v1/messages/batches/{batch_id}/cancel", headers=headers)
    assert done.status_code == 200, done.text
    batch = client.get(f"/v1/messages/batches/{batch_id}", headers=headers).json()
    assert (batch["processing_status"], batch["request_counts"]) == ("ended", {
        "processing": 0, "succeeded": 0, "errored": 0, "canceled": LINES, "expired": 0})
    results = client.get(f"/v1/messages/batches/{batch_id}/results", headers=headers).text
    assert [json.loads(line)["result"]["type"] for line in results.splitlines()] == ["canceled"] * LINES
    assert _staged(settings, batch_id) == 0
    assert _parts(settings, batch_id) == []


def test_the_sweeper_counts_a_cancelled_batch_whose_fan_out_died_and_whose_api_died_before_counting(
        client, keys, settings, monkeypatch):
    """The fan-out killed between its chunks, then the user's cancel, whose API died before its background count
    (``count_if_abandoned``) ran: the batch stayed cancelled with ``total`` 0, the dead run's staged jobs and part
    files kept, for good (the sweeper restarted only batches still validating). The workers' sweeper finds the
    cancelled batch's working folder whose lock no run holds and counts its lines, as the cancel would have."""
    from workers.batch_tasks import count_abandoned_cancels

    batch_id = _validating_batch(client, keys, settings)
    _fan_out_dying_at(settings, batch_id, "between_chunks")
    monkeypatch.setattr(fanout, "count_if_abandoned", lambda *args: None)  # the API died before it ran
    assert client.post(f"/v1/batches/{batch_id}/cancel", headers=Keys.header(keys.paid)).status_code == 200
    monkeypatch.undo()
    assert count_abandoned_cancels(settings) == [batch_id]
    batch = client.get(f"/v1/batches/{batch_id}", headers=Keys.header(keys.paid)).json()
    assert (batch["status"], batch["request_counts"]) == ("cancelled", {"total": LINES, "completed": 0,
                                                                        "failed": LINES})
    assert _staged(settings, batch_id) == 0
    assert not (Path(settings.data_dir) / "batches" / batch_id).exists()
    assert count_abandoned_cancels(settings) == []  # counted: not again


def test_the_sweeper_leaves_a_cancelled_batch_whose_fan_out_is_still_running(client, keys, settings, monkeypatch):
    """A cancelled batch whose fan-out run still holds its lock is that run's to count: the sweeper starts none."""
    from workers.batch_tasks import count_abandoned_cancels

    batch_id = _validating_batch(client, keys, settings)
    monkeypatch.setattr(fanout, "count_if_abandoned", lambda *args: None)
    with fanout._alive(settings.data_dir, batch_id):
        assert client.post(f"/v1/batches/{batch_id}/cancel", headers=Keys.header(keys.paid)).status_code == 200
        assert count_abandoned_cancels(settings) == []


def _ended_cancelled_with_every_line_failed(client, keys, settings, batch_id: str) -> None:
    """Every line counted failed (the valid ones stopped unrun, the last refused) and the working folder gone."""
    batch = client.get(f"/v1/batches/{batch_id}", headers=Keys.header(keys.paid)).json()
    assert (batch["status"], batch["request_counts"]) == ("cancelled", {"total": LINES, "completed": 0,
                                                                        "failed": LINES})
    errors = client.get(f"/v1/files/{batch['error_file_id']}/content", headers=Keys.header(keys.paid)).text
    assert [json.loads(line)["error"]["code"] for line in errors.splitlines()] == [
        "batch_cancelled"] * (LINES - 1) + ["invalid_json"]
    assert not (Path(settings.data_dir) / "batches" / batch_id).exists()


def test_a_batch_cancelled_before_any_fan_out_ran_ends_with_its_lines_counted(client, keys, settings):
    """The create's API died before its fan-out ran (no working folder), then the user's cancel: its count took the
    missing folder for a run that had counted the lines and deleted it, so the batch ended cancelled with ``total``
    0 and no error file, its lines never counted. Nothing counted them: the cancel's count does, as for a fan-out
    that died (every line failed, the valid ones stopped unrun)."""
    batch_id = _validating_batch(client, keys, settings)
    assert client.post(f"/v1/batches/{batch_id}/cancel", headers=Keys.header(keys.paid)).status_code == 200
    _ended_cancelled_with_every_line_failed(client, keys, settings, batch_id)


@pytest.mark.parametrize(("content", "code"), [(b"\n \n", "empty_file"), (b"\xff\xfe{}\n", "invalid_file")])
def test_a_batch_cancelled_while_its_file_was_refused_whole_says_why(client, keys, settings, content, code):
    """A file refused as a whole (no requests, not UTF-8) of a batch cancelled while it was read: the refusal was
    dropped (written only to a batch still validating), so the batch ended cancelled with nothing saying its file
    was bad (``errors`` null), and a count after it read the file again for nothing. It keeps the refusal in
    ``errors`` as a failed validation does, its counts 0 as that one's (no line was taken as a request)."""
    f = client.post("/v1/files", headers=Keys.header(keys.paid), data={"purpose": "batch"},
                    files={"file": ("in.jsonl", content)}).json()
    batch_id = new_id("batch")
    with session_scope(settings.sqlalchemy_url) as s:
        s.add(Batch(id=batch_id, tenant_id=keys.tenant_id, endpoint="/v1/completions", input_file_id=f["id"],
                    completion_window="24h", status="validating", tier="paid"))
    assert client.post(f"/v1/batches/{batch_id}/cancel", headers=Keys.header(keys.paid)).status_code == 200
    batch = client.get(f"/v1/batches/{batch_id}", headers=Keys.header(keys.paid)).json()
    assert batch["status"] == "cancelled" and batch["request_counts"] == {"total": 0, "completed": 0, "failed": 0}
    assert [e["code"] for e in (batch["errors"] or {}).get("data", [])] == [code], batch
    assert not (Path(settings.data_dir) / "batches" / batch_id).exists()


def test_of_two_fan_outs_of_a_cancelled_batch_the_last_to_end_keeps_the_refused_lines_in_its_error_file(
        client, keys, settings, monkeypatch):
    """Two live runs of a cancelled batch's fan-out (the API's, and a restart's beside it): the first to end deleted
    the batch's working folder though the other was still going, which then wrote the batch's error file with no
    refused line (their invalid.jsonl gone) over the first's: the refused line was counted failed yet missing from
    the error file. The folder is deleted by the last run to end; every line is in the error file."""
    batch_id = _validating_batch(client, keys, settings)
    monkeypatch.setattr(fanout, "count_if_abandoned", lambda *args: None)  # the runs below count it
    assert client.post(f"/v1/batches/{batch_id}/cancel", headers=Keys.header(keys.paid)).status_code == 200
    end_cancelled, other = fanout._end_cancelled, []

    def other_run_first(*args):
        if not other:
            other.append(batch_id)
            fanout.start_batch(settings, batch_id)  # the other run, to its end
        end_cancelled(*args)

    monkeypatch.setattr(fanout, "_end_cancelled", other_run_first)
    fanout.start_batch(settings, batch_id)
    assert other == [batch_id]
    _ended_cancelled_with_every_line_failed(client, keys, settings, batch_id)
