"""webhook_endpoints, webhook_deliveries: OpenAI's Webhook Endpoints API and its signed deliveries

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-26 23:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0015'
down_revision: str | Sequence[str] | None = '0014'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        'webhook_endpoints',
        sa.Column('id', sa.String(length=40), nullable=False),
        sa.Column('tenant_id', sa.String(length=40), nullable=False),
        sa.Column('name', sa.String(length=200), nullable=False),
        sa.Column('url', sa.String(length=2000), nullable=False),
        sa.Column('event_types', sa.JSON(), nullable=False),
        sa.Column('secret', sa.String(length=100), nullable=False),
        sa.Column('old_secret', sa.String(length=100), nullable=True),
        sa.Column('old_secret_until', sa.DateTime(timezone=True), nullable=True),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id'),
    )
    op.create_index('ix_webhook_endpoints_tenant_id', 'webhook_endpoints', ['tenant_id'])
    op.create_table(
        'webhook_deliveries',
        sa.Column('id', sa.String(length=40), nullable=False),
        sa.Column('endpoint_id', sa.String(length=40), nullable=False),
        sa.Column('event_id', sa.String(length=40), nullable=False),
        sa.Column('type', sa.String(length=64), nullable=False),
        sa.Column('body', sa.Text(), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('attempts', sa.Integer(), nullable=False),
        sa.Column('next_attempt_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('delivered_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('failed_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('last_status', sa.Integer(), nullable=True),
        sa.Column('last_error', sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(['endpoint_id'], ['webhook_endpoints.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id'),
    )
    op.create_index('ix_webhook_deliveries_endpoint_id', 'webhook_deliveries', ['endpoint_id'])
    op.create_index('ix_webhook_deliveries_due', 'webhook_deliveries', ['delivered_at', 'next_attempt_at'])


def downgrade() -> None:
    op.drop_index('ix_webhook_deliveries_due', table_name='webhook_deliveries')
    op.drop_index('ix_webhook_deliveries_endpoint_id', table_name='webhook_deliveries')
    op.drop_table('webhook_deliveries')
    op.drop_index('ix_webhook_endpoints_tenant_id', table_name='webhook_endpoints')
    op.drop_table('webhook_endpoints')
