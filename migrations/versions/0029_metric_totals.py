"""metric_totals: the finished jobs' series /metrics summed up to a horizon, so a scrape reads only later jobs

Revision ID: 0029
Revises: 0028
Create Date: 2026-11-29 02:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0029'
down_revision: str | Sequence[str] | None = '0028'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        'metric_totals',
        sa.Column('scope', sa.String(length=40), nullable=False),
        sa.Column('horizon', sa.DateTime(timezone=True), nullable=False),
        sa.Column('totals', sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint('scope'),
    )


def downgrade() -> None:
    op.drop_table('metric_totals')
