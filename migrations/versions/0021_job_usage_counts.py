"""jobs.counts_request, jobs.counts_prompt: what usage counts of a job of a request with n choices or several prompts

Revision ID: 0021
Revises: 0020
Create Date: 2026-11-28 14:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0021'
down_revision: str | Sequence[str] | None = '0020'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.add_column(sa.Column('counts_request', sa.Boolean(), nullable=False, server_default=sa.true()))
        batch.add_column(sa.Column('counts_prompt', sa.Boolean(), nullable=False, server_default=sa.true()))


def downgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.drop_column('counts_prompt')
        batch.drop_column('counts_request')
