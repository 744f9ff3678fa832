"""jobs.settled_at: when a job's end stopped changing, the order /metrics keeps the finished jobs' totals in

A job an engine held when the API cancelled it gets its token counts from its worker later (workers/lease.py
keep_cancelled), so its end settles then, not at finished_at. The ended jobs' settled_at starts at finished_at.

Revision ID: 0036
Revises: 0035
Create Date: 2026-11-29 06:50:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0036'
down_revision: str | Sequence[str] | None = '0035'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.add_column(sa.Column('settled_at', sa.DateTime(timezone=True), nullable=True))
    op.execute("UPDATE jobs SET settled_at = finished_at WHERE finished_at IS NOT NULL")
    op.create_index('ix_jobs_settled', 'jobs', ['model', 'settled_at', 'finished_at'])


def downgrade() -> None:
    op.drop_index('ix_jobs_settled', table_name='jobs')
    with op.batch_alter_table('jobs') as batch:
        batch.drop_column('settled_at')
