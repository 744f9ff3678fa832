"""batches.deleted_at: when a message batch was deleted, beside the status it ended with

DELETE /v1/messages/batches/{id} used to overwrite the batch's status with 'deleted', so the row no longer said
whether it had completed, expired, failed or been cancelled. Those rows get their status back from the time each
end left (completed_at, cancelled_at, expired_at, failed_at); their deleted_at, which was not kept, becomes that
end's time (the earliest they can have been deleted). A downgrade writes 'deleted' over the status again.

Revision ID: 0038
Revises: 0036
Create Date: 2026-11-29 07:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0038'
down_revision: str | Sequence[str] | None = '0037'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('batches') as batch:
        batch.add_column(sa.Column('deleted_at', sa.DateTime(timezone=True), nullable=True))
    op.execute("UPDATE batches SET deleted_at = COALESCE(completed_at, cancelled_at, expired_at, failed_at, "
               "created_at), status = CASE WHEN completed_at IS NOT NULL THEN 'completed' "
               "WHEN cancelled_at IS NOT NULL THEN 'cancelled' WHEN expired_at IS NOT NULL THEN 'expired' "
               "ELSE 'failed' END WHERE status = 'deleted'")


def downgrade() -> None:
    op.execute("UPDATE batches SET status = 'deleted' WHERE deleted_at IS NOT NULL")
    with op.batch_alter_table('batches') as batch:
        batch.drop_column('deleted_at')
