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
