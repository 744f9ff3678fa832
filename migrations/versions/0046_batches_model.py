"""batches.model: the model a batch's lines run on, which OpenAI's Batch object names

The Batch object left ``model`` out, so OpenAI's client read None. The fan-out now keeps the one model its jobs run
on (none where they name several). A batch fanned out before this revision gets it from its jobs: their model where
they all share one, else none; a batch without jobs (failed before its fan-out, no valid line) has none.

Revision ID: 0046
Revises: 0045
Create Date: 2026-11-30 10:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0046'
down_revision: str | Sequence[str] | None = '0045'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('batches') as batch:
        batch.add_column(sa.Column('model', sa.String(length=200), nullable=True))
    # over the jobs' batch_id index: a batch's one model, or none where its jobs name several; a fan-out's staged
    # jobs (app/db/models.py STAGED) are not the batch's until it starts
    op.execute("UPDATE batches SET model = (SELECT MIN(jobs.model) FROM jobs WHERE jobs.batch_id = batches.id "
               "AND jobs.status NOT LIKE 'staged%' HAVING COUNT(DISTINCT jobs.model) = 1)")


def downgrade() -> None:
    with op.batch_alter_table('batches') as batch:
        batch.drop_column('model')
