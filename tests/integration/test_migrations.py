"""Alembic owns the schema: upgrade from empty, no drift from the models, downgrade to empty."""

from __future__ import annotations

import json
import shutil
import subprocess
from types import SimpleNamespace

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, insert, inspect, text

from app.db.migrate import downgrade, upgrade
from app.db.models import Base
from tests.conftest import ROOT

pytestmark = pytest.mark.integration


def test_upgrade_matches_models_and_downgrade_empties(tmp_path):
    url = f"sqlite:///{tmp_path / 'm.db'}"
    upgrade(url)
    engine = create_engine(url)
    with engine.connect() as conn:
        tables = set(inspect(conn).get_table_names())
        assert {"tenants", "api_keys", "jobs", "job_events", "files", "batches", "workers"} <= tables
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
        assert diff == [], f"models and migrations drifted apart: {diff}"
    downgrade(url, "base")
    with engine.connect() as conn:
        assert set(inspect(conn).get_table_names()) <= {"alembic_version"}
    upgrade(url)  # and back up again: the downgrade left nothing behind that blocks it
    with engine.connect() as conn:
        assert "jobs" in inspect(conn).get_table_names()
    engine.dispose()


def _old_tenant(session, name: str) -> SimpleNamespace:
    """A tenant row in an older schema: the columns every revision has (the model's may have more)."""
    tenant_id = f"ten_{name}"
    session.execute(text("INSERT INTO tenants (id, name, default_tier, created_at) VALUES (:id, :name, 'paid', "
                         "CURRENT_TIMESTAMP)"), {"id": tenant_id, "name": name})
    return SimpleNamespace(id=tenant_id)


def test_expired_jobs_of_older_databases_count_as_missed_slos(tmp_path):
    """0023: a job a batch's window expired before it finished was written without ``slo_met``; it missed."""
    from sqlalchemy.orm import Session

    from app.db.models import Job

    url = f"sqlite:///{tmp_path / 'm.db'}"
    upgrade(url, "0022")
    engine = create_engine(url)
    with Session(engine) as s:
        tenant = _old_tenant(s, "t")
        # the columns 0022 had, not the model's all: later revisions add some
        s.execute(insert(Job), [dict(id=f"job_{st}", tenant_id=tenant.id, tier="paid", model="m", kind="batch",
                                     sampling={}, status=st) for st in ("expired", "cancelled", "succeeded")])
        s.commit()
    upgrade(url)
    with Session(engine) as s:
        assert {j.id: j.slo_met for j in s.query(Job)} == {"job_expired": False, "job_cancelled": None,
                                                           "job_succeeded": None}
    engine.dispose()


def test_message_batches_deleted_by_older_coserve_get_back_how_they_ended(tmp_path):
    """0038: DELETE /v1/messages/batches/{id} wrote 'deleted' over the status; the time each end left says it."""
    url = f"sqlite:///{tmp_path / 'm.db'}"
    upgrade(url, "0037")
    engine = create_engine(url)
    ended = {"msgbatch_done": "completed_at", "msgbatch_stopped": "cancelled_at", "msgbatch_refused": "failed_at"}
    with engine.begin() as conn:
        tenant = _old_tenant(conn, "t")
        conn.execute(text("INSERT INTO files (id, tenant_id, filename, purpose, bytes, path, created_at, deleted) "
                          "VALUES ('file_in', :t, 'in', 'batch', 1, '/x', CURRENT_TIMESTAMP, 1)"), {"t": tenant.id})
        for batch_id, column in [*ended.items(), ("batch_kept", "completed_at")]:
            conn.execute(text(
                "INSERT INTO batches (id, tenant_id, endpoint, input_file_id, completion_window, status, tier, total, "
                f"completed, failed, created_at, {column}) VALUES (:id, :t, '/v1/messages', 'file_in', '24h', :st, "
                "'paid', 1, 0, 0, '2026-11-01 00:00:00', '2026-11-02 00:00:00')"),
                {"id": batch_id, "t": tenant.id, "st": "completed" if batch_id == "batch_kept" else "deleted"})
    upgrade(url)
    with engine.connect() as conn:
        rows = {r.id: (r.status, r.deleted_at) for r in conn.execute(text("SELECT id, status, deleted_at FROM "
                                                                           "batches"))}
    ended_at = "2026-11-02 00:00:00"  # as written (raw SQL): the deleted_at not kept is the end's time
    assert rows == {"msgbatch_done": ("completed", ended_at), "msgbatch_stopped": ("cancelled", ended_at),
                    "msgbatch_refused": ("failed", ended_at), "batch_kept": ("completed", None)}
    downgrade(url, "0037")  # the older coserve's way again
    with engine.connect() as conn:
        assert dict(conn.execute(text("SELECT id, status FROM batches")).all()) == {
            **dict.fromkeys(ended, "deleted"), "batch_kept": "completed"}
    engine.dispose()


def test_jobs_of_summarization_runs_going_on_at_the_upgrade_name_their_run(tmp_path):
    """0042: a poll counts a run's open jobs by jobs.summarization_run_id; a run going on at the upgrade (its
    documents name its jobs) gets it on them, so its progress stays right; other jobs name no run."""
    url = f"sqlite:///{tmp_path / 'm.db'}"
    upgrade(url, "0038")
    engine = create_engine(url)
    with engine.begin() as conn:
        tenant = _old_tenant(conn, "t")
        for job_id in ("job_a", "job_b", "job_c", "job_other"):
            conn.execute(text("INSERT INTO jobs (id, tenant_id, kind, tier, model, sampling, endpoint, stream, status, "
                              "created_at, relegation_count, attempt) VALUES (:id, :t, 'batch', 'paid', 'm', '{}', "
                              "'/v1/summarize', 0, 'queued', CURRENT_TIMESTAMP, 0, 0)"), {"id": job_id, "t": tenant.id})
        for run_id, status, pending in [("sum_live", "running", ["job_a", "job_b"]), ("sum_over", "failed", ["job_c"])]:
            conn.execute(text(
                "INSERT INTO summarization_runs (id, tenant_id, model, tier, status, deadline_at, max_summary_tokens, "
                "chunk_tokens, overlap_tokens, documents, documents_done, documents_failed, jobs_submitted, jobs_done, "
                "version, created_at) VALUES (:id, :t, 'm', 'paid', :st, CURRENT_TIMESTAMP, 32, 512, 16, 1, 0, 0, "
                ":n, 0, 1, CURRENT_TIMESTAMP)"), {"id": run_id, "t": tenant.id, "st": status, "n": len(pending)})
            conn.execute(text(
                "INSERT INTO summarization_documents (run_id, position, doc_id, level, text, pending, final, chunks, "
                "jobs, done) VALUES (:id, 0, 'd', 0, 'x', :pending, 0, 2, 2, 0)"),
                {"id": run_id, "pending": json.dumps(pending)})
    upgrade(url)
    with engine.connect() as conn:
        named = dict(conn.execute(text("SELECT id, summarization_run_id FROM jobs")).all())
    assert named == {"job_a": "sum_live", "job_b": "sum_live", "job_c": None, "job_other": None}
    engine.dispose()


def test_jobs_stopped_under_a_worker_that_an_older_coserve_left_unsettled_settle_at_the_upgrade(tmp_path):
    """0044: a job the API stopped while a worker held it, left with neither ``settled_at`` nor a lease (the worker
    died before its write), settles at the upgrade's time, so /metrics stops re-reading it and counts it on; a
    stopped job a worker holds now (its lease kept) and every other job are left as they are."""
    url = f"sqlite:///{tmp_path / 'm.db'}"
    upgrade(url, "0042")
    engine = create_engine(url)
    past = "2026-11-01 00:00:00.000000"
    rows = {  # id: (status, finished_at, settled_at, lease_expires_at)
        "job_cancelled": ("cancelled", past, None, None), "job_expired": ("expired", None, None, None),
        "job_held": ("cancelled", past, None, "2099-01-01 00:00:00.000000"),
        "job_settled": ("cancelled", past, past, None), "job_running": ("running", None, None, None),
        "job_failed": ("failed", past, None, None)}
    with engine.begin() as conn:
        tenant = _old_tenant(conn, "t")
        for job_id, (status, finished, settled, lease) in rows.items():
            conn.execute(text("INSERT INTO jobs (id, tenant_id, kind, tier, model, sampling, endpoint, stream, status, "
                              "created_at, relegation_count, attempt, finished_at, settled_at, lease_expires_at) "
                              "VALUES (:id, :t, 'batch', 'paid', 'm', '{}', '/v1/jobs', 0, :st, CURRENT_TIMESTAMP, 0, "
                              "0, :fin, :settled, :lease)"),
                         {"id": job_id, "t": tenant.id, "st": status, "fin": finished, "settled": settled,
                          "lease": lease})
        before = conn.scalar(text("SELECT strftime('%Y-%m-%d %H:%M:%f', 'now')"))
    upgrade(url)
    with engine.connect() as conn:
        settled = dict(conn.execute(text("SELECT id, settled_at FROM jobs")).all())
    assert {job_id for job_id, at in settled.items() if at is None} == {"job_held", "job_running", "job_failed"}
    assert settled["job_settled"] == past
    for job_id in ("job_cancelled", "job_expired"):  # at the upgrade: after the totals' horizon, so counted on
        assert settled[job_id] >= before, settled
    engine.dispose()


def test_batches_of_older_databases_name_the_one_model_their_jobs_run_on(tmp_path):
    """0046: a batch fanned out before ``batches.model`` gets its jobs' model where they all share one; one whose
    jobs name several, or that has none (only a fan-out's staged jobs, or no job), names none."""
    url = f"sqlite:///{tmp_path / 'm.db'}"
    upgrade(url, "0045")
    engine = create_engine(url)
    jobs = {"batch_one": ["m", "m"], "batch_several": ["m", "lora"], "batch_none": [], "batch_staged": ["m"]}
    with engine.begin() as conn:
        tenant = _old_tenant(conn, "t")
        conn.execute(text("INSERT INTO files (id, tenant_id, filename, purpose, bytes, path, created_at, deleted) "
                          "VALUES ('file_in', :t, 'in', 'batch', 1, '/x', CURRENT_TIMESTAMP, 0)"), {"t": tenant.id})
        for batch_id, models in jobs.items():
            conn.execute(text(
                "INSERT INTO batches (id, tenant_id, endpoint, input_file_id, completion_window, status, tier, total, "
                "completed, failed, created_at) VALUES (:id, :t, '/v1/completions', 'file_in', '24h', 'in_progress', "
                "'paid', 2, 0, 0, CURRENT_TIMESTAMP)"), {"id": batch_id, "t": tenant.id})
            status = "staged-run1" if batch_id == "batch_staged" else "queued"
            for i, model in enumerate(models):
                conn.execute(text(
                    "INSERT INTO jobs (id, tenant_id, kind, tier, model, sampling, endpoint, stream, status, "
                    "created_at, relegation_count, attempt, batch_id) VALUES (:id, :t, 'batch', 'paid', :m, '{}', "
                    "'/v1/completions', 0, :st, CURRENT_TIMESTAMP, 0, 0, :b)"),
                    {"id": f"job_{batch_id}_{i}", "t": tenant.id, "m": model, "st": status, "b": batch_id})
    upgrade(url)
    with engine.connect() as conn:
        named = dict(conn.execute(text("SELECT id, model FROM batches")).all())
    assert named == {"batch_one": "m", "batch_several": None, "batch_none": None, "batch_staged": None}
    downgrade(url, "0045")
    with engine.connect() as conn:
        assert "model" not in {c["name"] for c in inspect(conn).get_columns("batches")}
    engine.dispose()


def test_jobs_of_older_databases_keep_the_first_jobs_usage_rule(tmp_path):
    """0047: jobs written before a request's jobs were linked name no request or prompt job, so usage counts them
    as it did (the request and prompt on the first job, where it ran: no backfill); downgrade takes the links out."""
    from datetime import UTC, datetime

    from sqlalchemy.orm import Session

    from app.services.usage import UsageQuery, completions_usage

    url = f"sqlite:///{tmp_path / 'm.db'}"
    upgrade(url, "0046")
    engine = create_engine(url)
    t0 = int(datetime(2026, 11, 1, tzinfo=UTC).timestamp())
    with engine.begin() as conn:
        tenant = _old_tenant(conn, "t")
        for i, (status, out) in enumerate((("cancelled", None), ("succeeded", 4))):  # n=2, its first never ran
            conn.execute(text(
                "INSERT INTO jobs (id, tenant_id, kind, tier, model, sampling, endpoint, stream, status, created_at, "
                "relegation_count, attempt, prompt_tokens, completion_tokens, counts_request, counts_prompt) VALUES "
                "(:id, :t, 'interactive', 'paid', 'm', '{}', '/v1/completions', 0, :st, :at, 0, 0, 7, :out, :first, "
                ":first)"), {"id": f"job_{i}", "t": tenant.id, "st": status, "out": out, "first": i == 0,
                             "at": datetime.fromtimestamp(t0 + 5, UTC).replace(tzinfo=None)})
    upgrade(url)
    with Session(engine) as s:
        page = completions_usage(s, UsageQuery(t0, t0 + 60, "1m", 1, tenant_ids=(tenant.id,)), str)
    (result,) = page["data"][0]["results"]
    assert (result["num_model_requests"], result["input_tokens"], result["output_tokens"]) == (0, 0, 4)
    downgrade(url, "0046")
    with engine.connect() as conn:
        assert not {"request_job_id", "prompt_job_id"} & {c["name"] for c in inspect(conn).get_columns("jobs")}
    engine.dispose()


def as_first_written(url: str) -> None:
    """Migrates ``url`` to 0023 and takes out what revisions 0002, 0007, 0016, 0017 and 0022 gained after they were
    first written: a database an earlier coserve built (Alembic does not run a revision twice)."""
    from alembic.operations import Operations

    upgrade(url, "0023")
    engine = create_engine(url)
    with engine.begin() as conn:
        op = Operations(MigrationContext.configure(conn))
        op.drop_index("ix_jobs_model_finished", table_name="jobs")
        op.drop_index("ix_jobs_created", table_name="jobs")
        with op.batch_alter_table("jobs") as batch:
            for column in ("prompt_logprobs", "prompt_token_ids", "cache_write_tokens"):
                batch.drop_column(column)
        with op.batch_alter_table("lora_adapters") as batch:
            batch.alter_column("loaded_at", new_column_name="created_at")
        conn.execute(text("INSERT INTO lora_adapters (name, model, path, rank, created_at) "
                          "VALUES ('a', 'm', '/a', 8, CURRENT_TIMESTAMP)"))
    engine.dispose()


def assert_schema_is_the_models(url: str) -> None:
    engine = create_engine(url)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
        assert diff == [], f"models and migrations drifted apart: {diff}"
        assert conn.execute(text("SELECT name, loaded_at IS NOT NULL FROM lora_adapters")).all() == [("a", True)]
    engine.dispose()


def test_a_database_built_by_revisions_as_first_written_is_repaired(tmp_path):
    url = f"sqlite:///{tmp_path / 'm.db'}"
    as_first_written(url)
    upgrade(url)
    assert_schema_is_the_models(url)


EDITED_AFTER_COMMIT = {"0002", "0007", "0016", "0017", "0022"}  # 0024 adds what their edits added


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                    reason="needs the git history of the checkout (a clone has it)")
def test_a_committed_revision_is_never_edited():
    """A database migrated with a revision never runs it again, so a change after its commit never reaches it:
    the change goes into a new revision."""
    edited = []
    for path in sorted((ROOT / "migrations" / "versions").glob("0*.py")):
        commits = subprocess.run(["git", "log", "--format=%H", "--", str(path.relative_to(ROOT))], cwd=ROOT,
                                 capture_output=True, text=True, check=True).stdout.split()
        if len(commits) > 1 and path.name[:4] not in EDITED_AFTER_COMMIT:
            edited.append(path.name)
    assert edited == [], f"{edited} changed after their first commit; put the change in a new revision"


def test_admin_keys_of_older_databases_show_no_characters_of_an_operators_key(tmp_path):
    """0031: an admin key from COSERVE_ADMIN_KEY kept its first 10 characters as its prefix (all of "hunter2");
    it shows a label of its hash now, which marks it as the variable's; a generated key keeps its prefix."""
    from sqlalchemy.orm import Session

    from app.auth import hash_key
    from app.db.models import ApiKey

    url = f"sqlite:///{tmp_path / 'm.db'}"
    upgrade(url, "0030")
    engine = create_engine(url)
    with Session(engine) as s:
        tenant = _old_tenant(s, "admin")
        s.add_all([ApiKey(id="key_env", tenant_id=tenant.id, key_hash=hash_key("hunter2"), prefix="hunter2",
                          is_admin=True),
                   ApiKey(id="key_gen", tenant_id=tenant.id, key_hash=hash_key("cs-abcdefgh"), prefix="cs-abcdefg",
                          is_admin=True)])
        s.commit()
    upgrade(url)
    with Session(engine) as s:
        assert {k.id: k.prefix for k in s.query(ApiKey)} == {"key_env": "env:" + hash_key("hunter2")[:4],
                                                             "key_gen": "cs-abcdefg"}
    engine.dispose()
