"""jobs.user_id: the request's end user (OpenAI's safety_identifier or user, Anthropic's metadata.user_id)

The Usage API groups and filters by it (``group_by=user_id``, ``user_ids``); indexed with created_at for that filter
over a time range. Jobs submitted before this revision have none (``user_id: null``, as OpenAI answers).

Revision ID: 0037
Revises: 0036
Create Date: 2026-11-29 07:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0037'
down_revision: str | Sequence[str] | None = '0036'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.add_column(sa.Column('user_id', sa.String(length=256), nullable=True))
    op.create_index('ix_jobs_user_created', 'jobs', ['user_id', 'created_at'])


def downgrade() -> None:
    op.drop_index('ix_jobs_user_created', table_name='jobs')
    with op.batch_alter_table('jobs') as batch:
        batch.drop_column('user_id')
