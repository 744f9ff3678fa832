"""jobs.cached_tokens: the prompt tokens the engine found in its prefix cache (usage's cached_tokens)

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-26 19:10:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0012'
down_revision: str | Sequence[str] | None = '0011'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.add_column(sa.Column('cached_tokens', sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.drop_column('cached_tokens')
