"""files.bytes: a 64-bit integer, for a batch's output or error file of 2 GiB or more

PostgreSQL's INTEGER holds at most 2**31 - 1, so the row of a batch output file of 2 GiB or more (50,000 long
answers with their logprobs) could not be written, and the batch's fan-in failed. SQLite's integers are 64-bit
already; there the column's declared type changes alone.

Revision ID: 0048
Revises: 0047
Create Date: 2026-11-30 17:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0048'
down_revision: str | Sequence[str] | None = '0047'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('files') as batch:
        batch.alter_column('bytes', existing_type=sa.Integer(), type_=sa.BigInteger(), existing_nullable=False)


def downgrade() -> None:
    with op.batch_alter_table('files') as batch:
        batch.alter_column('bytes', existing_type=sa.BigInteger(), type_=sa.Integer(), existing_nullable=False)
