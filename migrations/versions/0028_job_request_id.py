"""jobs.request_id: the X-Request-Id of the request that submitted the job, so a client's report finds it

Revision ID: 0028
Revises: 0027
Create Date: 2026-11-29 01:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0028'
down_revision: str | Sequence[str] | None = '0027'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column('jobs', sa.Column('request_id', sa.String(length=256), nullable=True))
    op.create_index('ix_jobs_tenant_request', 'jobs', ['tenant_id', 'request_id'])


def downgrade() -> None:
    op.drop_index('ix_jobs_tenant_request', table_name='jobs')
    op.drop_column('jobs', 'request_id')
