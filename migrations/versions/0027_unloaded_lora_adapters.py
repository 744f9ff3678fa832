"""unloaded_lora_adapters: the runtime LoRA adapters unloaded, so their waiting jobs still find their model's queue

Revision ID: 0027
Revises: 0026
Create Date: 2026-11-28 23:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0027'
down_revision: str | Sequence[str] | None = '0026'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        'unloaded_lora_adapters',
        sa.Column('name', sa.String(length=128), nullable=False),
        sa.Column('model', sa.String(length=200), nullable=False),
        sa.Column('unloaded_at', sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint('name'),
    )


def downgrade() -> None:
    op.drop_table('unloaded_lora_adapters')
