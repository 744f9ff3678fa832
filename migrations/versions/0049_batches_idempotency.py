"""batches.idempotency_key and request_digest: POST /v1/batches and POST /v1/messages/batches honour Idempotency-Key
per tenant, as /v1/jobs and /v1/summarize do (a retried create made a second batch, which ran every line again)

Revision ID: 0049
Revises: 0048
Create Date: 2026-12-01 01:30:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0049'
down_revision: str | Sequence[str] | None = '0048'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column('batches', sa.Column('idempotency_key', sa.String(length=200), nullable=True))
    op.add_column('batches', sa.Column('request_digest', sa.String(length=64), nullable=True))
    op.create_index('uq_batches_tenant_idempotency', 'batches', ['tenant_id', 'idempotency_key'], unique=True)


def downgrade() -> None:
    op.drop_index('uq_batches_tenant_idempotency', table_name='batches')
    with op.batch_alter_table('batches') as batch:  # SQLite drops columns by copying the table
        batch.drop_column('request_digest')
        batch.drop_column('idempotency_key')
