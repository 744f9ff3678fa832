"""Run Alembic migrations programmatically (``coserve up``, workers, test fixtures)."""

from __future__ import annotations

import logging
from functools import lru_cache
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]


def alembic_config(url: str) -> Config:
    cfg = Config(str(ROOT / "alembic.ini"))
    cfg.set_main_option("script_location", str(ROOT / "migrations"))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    cfg.attributes["configure_logging"] = False
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str = "base") -> None:
    command.downgrade(alembic_config(url), revision)


@lru_cache(maxsize=1)
def head_revision() -> str | None:
    """The newest revision this coserve's migrations know."""
    return ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()


def schema_problem(conn: Connection) -> str | None:
    """What keeps this coserve from using the database's schema (None: it is at this coserve's head)."""
    current, head = MigrationContext.configure(conn).get_current_revision(), head_revision()
    if current == head:
        return None
    if current is None or current < head:  # revisions are numbered in order
        return (f"the database's schema is at revision {current or 'none'}, this coserve needs {head}: migrate it "
                "(`coserve up`, the API and the workers do at start; the compose file's migrate service; "
                "`alembic upgrade head`)")
    return f"the database's schema is at revision {current}, newer than this coserve knows ({head}): upgrade coserve"
