"""summarization_runs.idempotency_key and request_digest: POST /v1/summarize honours Idempotency-Key per tenant, as
/v1/jobs does; an index on (tenant_id, created_at) for GET /v1/summarize, a tenant's runs newest first

Revision ID: 0030
Revises: 0029
Create Date: 2026-11-29 03:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0030'
down_revision: str | Sequence[str] | None = '0029'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column('summarization_runs', sa.Column('idempotency_key', sa.String(length=200), nullable=True))
    op.add_column('summarization_runs', sa.Column('request_digest', sa.String(length=64), nullable=True))
    op.create_index('uq_summarization_runs_tenant_idempotency', 'summarization_runs',
                    ['tenant_id', 'idempotency_key'], unique=True)
    op.create_index('ix_summarization_runs_tenant_created', 'summarization_runs', ['tenant_id', 'created_at'])


def downgrade() -> None:
    op.drop_index('ix_summarization_runs_tenant_created', table_name='summarization_runs')
    op.drop_index('uq_summarization_runs_tenant_idempotency', table_name='summarization_runs')
    with op.batch_alter_table('summarization_runs') as batch:  # SQLite drops columns by copying the table
        batch.drop_column('request_digest')
        batch.drop_column('idempotency_key')
