"""Alembic owns the schema: upgrade from empty, no drift from the models, downgrade to empty."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect

from app.db.migrate import downgrade, upgrade
from app.db.models import Base

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


def test_expired_jobs_of_older_databases_count_as_missed_slos(tmp_path):
    """0023: a job a batch's window expired before it finished was written without ``slo_met``; it missed."""
    from sqlalchemy.orm import Session

    from app.db.models import Job, Tenant

    url = f"sqlite:///{tmp_path / 'm.db'}"
    upgrade(url, "0022")
    engine = create_engine(url)
    with Session(engine) as s:
        tenant = Tenant(name="t")
        s.add(tenant)
        s.flush()
        s.add_all([Job(id=f"job_{st}", tenant_id=tenant.id, tier="paid", model="m", kind="batch", sampling={},
                       status=st) for st in ("expired", "cancelled", "succeeded")])
        s.commit()
    upgrade(url)
    with Session(engine) as s:
        assert {j.id: j.slo_met for j in s.query(Job)} == {"job_expired": False, "job_cancelled": None,
                                                           "job_succeeded": None}
    engine.dispose()
