"""files.expires_at (the Files API's expires_after), batches.output_expires_after_s (the Batch API's
output_expires_after)

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-26 22:30:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0014'
down_revision: str | Sequence[str] | None = '0013'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('files') as batch:
        batch.add_column(sa.Column('expires_at', sa.DateTime(timezone=True), nullable=True))
        batch.create_index('ix_files_expires_at', ['expires_at'])
    with op.batch_alter_table('batches') as batch:
        batch.add_column(sa.Column('output_expires_after_s', sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('batches') as batch:
        batch.drop_column('output_expires_after_s')
    with op.batch_alter_table('files') as batch:
        batch.drop_index('ix_files_expires_at')
        batch.drop_column('expires_at')
