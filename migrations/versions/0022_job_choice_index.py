"""jobs.choice_index: a Batch API line's choice (a line of n choices or several prompts runs one job per choice);
jobs.cache_write_tokens: the prompt tokens the engine wrote to its prefix cache (the Responses API's usage)

Revision ID: 0022
Revises: 0021
Create Date: 2026-11-28 17:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0022'
down_revision: str | Sequence[str] | None = '0021'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.add_column(sa.Column('choice_index', sa.Integer(), nullable=True))
        batch.add_column(sa.Column('cache_write_tokens', sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.drop_column('cache_write_tokens')
        batch.drop_column('choice_index')
