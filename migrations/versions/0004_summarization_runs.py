"""summarization_runs and summarization_documents: summarization runs live in SQL, so any
process (an API or a worker's sweeper) can advance one after the process driving it died

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-24 12:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0004'
down_revision: str | Sequence[str] | None = '0003'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        'summarization_runs',
        sa.Column('id', sa.String(length=40), nullable=False),
        sa.Column('tenant_id', sa.String(length=40), nullable=False),
        sa.Column('model', sa.String(length=200), nullable=False),
        sa.Column('tier', sa.String(length=32), nullable=False),
        sa.Column('status', sa.String(length=16), nullable=False),
        sa.Column('deadline_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('max_summary_tokens', sa.Integer(), nullable=False),
        sa.Column('chunk_tokens', sa.Integer(), nullable=False),
        sa.Column('overlap_tokens', sa.Integer(), nullable=False),
        sa.Column('documents', sa.Integer(), nullable=False),
        sa.Column('documents_done', sa.Integer(), nullable=False),
        sa.Column('documents_failed', sa.Integer(), nullable=False),
        sa.Column('jobs_submitted', sa.Integer(), nullable=False),
        sa.Column('jobs_done', sa.Integer(), nullable=False),
        sa.Column('version', sa.Integer(), nullable=False),
        sa.Column('lease_owner', sa.String(length=200), nullable=True),
        sa.Column('lease_expires_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id'),
    )
    with op.batch_alter_table('summarization_runs') as batch:
        batch.create_index(batch.f('ix_summarization_runs_status'), ['status'], unique=False)
        batch.create_index(batch.f('ix_summarization_runs_tenant_id'), ['tenant_id'], unique=False)
    op.create_table(
        'summarization_documents',
        sa.Column('run_id', sa.String(length=40), nullable=False),
        sa.Column('position', sa.Integer(), nullable=False),
        sa.Column('doc_id', sa.String(length=200), nullable=False),
        sa.Column('level', sa.Integer(), nullable=False),
        sa.Column('text', sa.Text(), nullable=False),
        sa.Column('pending', sa.JSON(), nullable=False),
        sa.Column('final', sa.Boolean(), nullable=False),
        sa.Column('chunks', sa.Integer(), nullable=False),
        sa.Column('jobs', sa.Integer(), nullable=False),
        sa.Column('summary', sa.Text(), nullable=True),
        sa.Column('error', sa.Text(), nullable=True),
        sa.Column('done', sa.Boolean(), nullable=False),
        sa.ForeignKeyConstraint(['run_id'], ['summarization_runs.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('run_id', 'position'),
    )


def downgrade() -> None:
    op.drop_table('summarization_documents')
    with op.batch_alter_table('summarization_runs') as batch:
        batch.drop_index(batch.f('ix_summarization_runs_tenant_id'))
        batch.drop_index(batch.f('ix_summarization_runs_status'))
    op.drop_table('summarization_runs')
