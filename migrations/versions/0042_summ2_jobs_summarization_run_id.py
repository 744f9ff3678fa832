"""jobs.summarization_run_id: the summarization run whose step submitted the job

A poll of a run's progress counts its jobs not ended on ``ix_jobs_summarization_run_status`` (one statement), where it
read the status of every job its documents waited for. The jobs of runs still going on at the upgrade (their
documents name them) get their run here; jobs of runs that ended need none (an ended run counts no open job).

Revision ID: 0042
Revises: 0038
Create Date: 2026-11-29 07:40:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0042'
down_revision: str | Sequence[str] | None = '0038'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

LIVE = ('validating', 'running', 'cancelling')
runs = sa.table('summarization_runs', sa.column('id', sa.String), sa.column('status', sa.String))
documents = sa.table('summarization_documents', sa.column('run_id', sa.String), sa.column('pending', sa.JSON))
jobs = sa.table('jobs', sa.column('id', sa.String), sa.column('summarization_run_id', sa.String))


def upgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.add_column(sa.Column('summarization_run_id', sa.String(length=40), nullable=True))
    op.create_index('ix_jobs_summarization_run_status', 'jobs', ['summarization_run_id', 'status'])
    bind = op.get_bind()
    rows = bind.execute(sa.select(documents.c.run_id, documents.c.pending).join(
        runs, runs.c.id == documents.c.run_id).where(runs.c.status.in_(LIVE))).all()
    for run_id, pending in rows:
        ids = list(pending or [])
        for i in range(0, len(ids), 500):  # SQLite caps the bound parameters of one statement
            bind.execute(jobs.update().where(jobs.c.id.in_(ids[i:i + 500])).values(summarization_run_id=run_id))


def downgrade() -> None:
    op.drop_index('ix_jobs_summarization_run_status', table_name='jobs')
    with op.batch_alter_table('jobs') as batch:
        batch.drop_column('summarization_run_id')
