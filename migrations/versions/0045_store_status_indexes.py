"""jobs by status in creation order (ix_jobs_status_created, in place of ix_jobs_status) and batches by status

The sweeper's scan for the jobs left queued (workers/sweeper.py: status = 'queued', oldest first, a page at a time)
had no index in that order: PostgreSQL walked ix_jobs_created from the oldest job, through every ended one, to
reach the queued jobs at its newest end (84 ms at 200,000 jobs, each sweep of each worker; ops/bench_store_queries.py).
(status, created_at) serves it as a range, and the lookups by status alone that ix_jobs_status served (its first
column, as ix_jobs_status_lease's is), so it replaces that index: the jobs' writes keep one index on status, not two.
The batches' status is indexed for the scans each sweep makes of every batch ever created (the open ones to
finalize, those left validating).

Revision ID: 0045
Revises: 0044
Create Date: 2026-11-29 15:40:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = '0045'
down_revision: str | Sequence[str] | None = '0044'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index('ix_jobs_status_created', 'jobs', ['status', 'created_at'])
    op.drop_index('ix_jobs_status', table_name='jobs')
    op.create_index('ix_batches_status', 'batches', ['status'])


def downgrade() -> None:
    op.drop_index('ix_batches_status', table_name='batches')
    op.create_index('ix_jobs_status', 'jobs', ['status'])
    op.drop_index('ix_jobs_status_created', table_name='jobs')
