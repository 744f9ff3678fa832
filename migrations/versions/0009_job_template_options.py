"""jobs.template_options: how a chat job's messages go through the chat template (vLLM's add_generation_prompt,
continue_final_message and chat_template_kwargs; null where all are the defaults)

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-26 11:20:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0009'
down_revision: str | Sequence[str] | None = '0008'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.add_column(sa.Column('template_options', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.drop_column('template_options')
