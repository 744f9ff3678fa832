"""summarization_retries: a summarization document's failed jobs are submitted again (their attempts, the retries,
when the next goes, why they failed), and a run keeps why it failed or was cancelled

Revision ID: 0034
Revises: 0033
Create Date: 2026-11-29 04:10:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0034'
down_revision: str | Sequence[str] | None = '0033'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('summarization_documents') as batch:
        batch.add_column(sa.Column('attempts', sa.JSON(), server_default='[]', nullable=False))
        batch.add_column(sa.Column('retries', sa.Integer(), server_default='0', nullable=False))
        batch.add_column(sa.Column('retry_at', sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column('retry_errors', sa.JSON(), server_default='[]', nullable=False))
    with op.batch_alter_table('summarization_runs') as batch:
        batch.add_column(sa.Column('reason', sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('summarization_runs') as batch:
        batch.drop_column('reason')
    with op.batch_alter_table('summarization_documents') as batch:
        batch.drop_column('retry_errors')
        batch.drop_column('retry_at')
        batch.drop_column('retries')
        batch.drop_column('attempts')
