"""tenant_disabled: an operator may disable a tenant (its keys refused, its open jobs and batches cancelled)

Revision ID: 0032
Revises: 0031
Create Date: 2026-11-29 02:10:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0032'
down_revision: str | Sequence[str] | None = '0031'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('tenants') as batch:
        batch.add_column(sa.Column('disabled', sa.Boolean(), server_default=sa.false(), nullable=False))


def downgrade() -> None:
    with op.batch_alter_table('tenants') as batch:
        batch.drop_column('disabled')
