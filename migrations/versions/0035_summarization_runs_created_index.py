"""summarization_runs.created_at indexed alone: the admin dashboard lists every tenant's runs newest first

Revision ID: 0035
Revises: 0034
Create Date: 2026-11-29 05:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = '0035'
down_revision: str | Sequence[str] | None = '0034'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index('ix_summarization_runs_created', 'summarization_runs', ['created_at'])


def downgrade() -> None:
    op.drop_index('ix_summarization_runs_created', table_name='summarization_runs')
