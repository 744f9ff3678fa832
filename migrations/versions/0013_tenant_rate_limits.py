"""tenants.requests_per_minute, tenants.tokens_per_minute: a tenant's rate limits (null: none)

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-26 19:20:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0013'
down_revision: str | Sequence[str] | None = '0012'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('tenants') as batch:
        batch.add_column(sa.Column('requests_per_minute', sa.Integer(), nullable=True))
        batch.add_column(sa.Column('tokens_per_minute', sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('tenants') as batch:
        batch.drop_column('tokens_per_minute')
        batch.drop_column('requests_per_minute')
