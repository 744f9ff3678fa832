"""jobs.response: what a Responses API request (POST /v1/responses) said beyond its chat form (instructions,
previous_response_id, metadata, store, its tools and text format as written); null for other jobs

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-26 14:20:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0010'
down_revision: str | Sequence[str] | None = '0009'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.add_column(sa.Column('response', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.drop_column('response')
