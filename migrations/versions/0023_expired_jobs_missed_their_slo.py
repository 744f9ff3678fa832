"""An expired job missed its SLO: jobs a batch's window ended before they finished get slo_met = false, as the worker
has always written for the jobs it expires

Revision ID: 0023
Revises: 0022
Create Date: 2026-11-28 19:20:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = '0023'
down_revision: str | Sequence[str] | None = '0022'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.execute("UPDATE jobs SET slo_met = false WHERE status = 'expired' AND slo_met IS NULL")


def downgrade() -> None:
    pass  # the readers before 0023 counted an expired job as missed whatever slo_met said
