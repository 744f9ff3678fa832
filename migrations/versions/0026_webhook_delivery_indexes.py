"""webhook_deliveries: the due index holds pending deliveries only (given-up ones filled its range and slowed every
poll), and one on created_at for the sweeper's retention

Revision ID: 0026
Revises: 0025
Create Date: 2026-11-28 22:45:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0026'
down_revision: str | Sequence[str] | None = '0025'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

PENDING = sa.text('delivered_at IS NULL AND failed_at IS NULL')


def upgrade() -> None:
    op.drop_index('ix_webhook_deliveries_due', table_name='webhook_deliveries')
    op.create_index('ix_webhook_deliveries_pending', 'webhook_deliveries', ['next_attempt_at'],
                    sqlite_where=PENDING, postgresql_where=PENDING)
    op.create_index('ix_webhook_deliveries_created_at', 'webhook_deliveries', ['created_at'])


def downgrade() -> None:
    op.drop_index('ix_webhook_deliveries_created_at', table_name='webhook_deliveries')
    op.drop_index('ix_webhook_deliveries_pending', table_name='webhook_deliveries')
    op.create_index('ix_webhook_deliveries_due', 'webhook_deliveries', ['delivered_at', 'next_attempt_at'])
