"""jobs.request_id indexed alone: an operator finds any tenant's jobs by the X-Request-Id a client reports

Revision ID: 0033
Revises: 0032
Create Date: 2026-11-29 04:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = '0033'
down_revision: str | Sequence[str] | None = '0032'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index('ix_jobs_request', 'jobs', ['request_id'])


def downgrade() -> None:
    op.drop_index('ix_jobs_request', table_name='jobs')
