"""api_key_id on jobs, batches and summarization runs (usage by key), tenants.batch_queue_tokens (the Batch API's
queue limit), an index of jobs by submission time (every tenant's usage)

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-27 01:45:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0016'
down_revision: str | Sequence[str] | None = '0015'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# the key that submitted them (no foreign key: keys are revoked, never deleted)
_BY_KEY = ('jobs', 'batches', 'summarization_runs')


def upgrade() -> None:
    for table in _BY_KEY:
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column('api_key_id', sa.String(length=40), nullable=True))
    with op.batch_alter_table('tenants') as batch:
        batch.add_column(sa.Column('batch_queue_tokens', sa.Integer(), nullable=True))
    op.create_index('ix_jobs_created', 'jobs', ['created_at'])


def downgrade() -> None:
    op.drop_index('ix_jobs_created', table_name='jobs')
    with op.batch_alter_table('tenants') as batch:
        batch.drop_column('batch_queue_tokens')
    for table in reversed(_BY_KEY):
        with op.batch_alter_table(table) as batch:
            batch.drop_column('api_key_id')
