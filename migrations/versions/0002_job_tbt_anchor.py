"""jobs.tbt_anchor (where an interactive job's TBT deadlines start); an index for the decode-length
history the workers read (a model's jobs by finish time)

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23 22:05:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0002'
down_revision: str | Sequence[str] | None = '0001'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.add_column(sa.Column('tbt_anchor', sa.String(length=16), nullable=True))
    op.create_index('ix_jobs_model_finished', 'jobs', ['model', 'finished_at'], unique=False)


def downgrade() -> None:
    op.drop_index('ix_jobs_model_finished', table_name='jobs')
    with op.batch_alter_table('jobs') as batch:
        batch.drop_column('tbt_anchor')
