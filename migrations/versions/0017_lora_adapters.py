"""lora_adapters: LoRA adapters loaded while coserve runs (/v1/load_lora_adapter)

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-27 14:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0017'
down_revision: str | Sequence[str] | None = '0016'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        'lora_adapters',
        sa.Column('name', sa.String(length=128), nullable=False),
        sa.Column('model', sa.String(length=200), nullable=False),
        sa.Column('path', sa.Text(), nullable=False),
        sa.Column('rank', sa.Integer(), nullable=False),
        sa.Column('loaded_at', sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint('name'),
    )


def downgrade() -> None:
    op.drop_table('lora_adapters')
