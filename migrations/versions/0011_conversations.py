"""conversations and conversation_entries: OpenAI's Conversations API (a conversation's own items, and the
turns of the responses given it)

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-26 16:40:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0011'
down_revision: str | Sequence[str] | None = '0010'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        'conversations',
        sa.Column('id', sa.String(length=40), nullable=False),
        sa.Column('tenant_id', sa.String(length=40), nullable=False),
        sa.Column('metadata', sa.JSON(), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id'),
    )
    with op.batch_alter_table('conversations') as batch:
        batch.create_index(batch.f('ix_conversations_tenant_id'), ['tenant_id'], unique=False)
    op.create_table(
        'conversation_entries',
        sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
        sa.Column('conversation_id', sa.String(length=40), nullable=False),
        sa.Column('item', sa.JSON(), nullable=True),
        sa.Column('job_id', sa.String(length=40), nullable=True),
        sa.Column('deleted', sa.JSON(), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(['conversation_id'], ['conversations.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id'),
    )
    with op.batch_alter_table('conversation_entries') as batch:
        batch.create_index(batch.f('ix_conversation_entries_conversation_id'), ['conversation_id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('conversation_entries') as batch:
        batch.drop_index(batch.f('ix_conversation_entries_conversation_id'))
    op.drop_table('conversation_entries')
    with op.batch_alter_table('conversations') as batch:
        batch.drop_index(batch.f('ix_conversations_tenant_id'))
    op.drop_table('conversations')
