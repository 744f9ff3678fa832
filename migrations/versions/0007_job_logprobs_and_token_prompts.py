"""jobs.output_logprobs, jobs.prompt_logprobs: each token's log-probability and alternatives, for jobs that asked;
jobs.prompt_token_ids: a prompt given as token ids (what evaluation harnesses send)

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-26 02:30:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0007'
down_revision: str | Sequence[str] | None = '0006'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.add_column(sa.Column('output_logprobs', sa.JSON(), nullable=True))
        batch.add_column(sa.Column('prompt_logprobs', sa.JSON(), nullable=True))
        batch.add_column(sa.Column('prompt_token_ids', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.drop_column('prompt_token_ids')
        batch.drop_column('prompt_logprobs')
        batch.drop_column('output_logprobs')
