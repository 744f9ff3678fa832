"""jobs.request_job_id, jobs.prompt_job_id: a request's jobs linked, so usage bills its prompt whichever ran

The Usage API counted a request and its prompt's tokens on the request's first job (a prompt's first choice) only,
and only where that job ran: with n=2, a first choice cancelled or expired before it ran left the request 0 input
tokens and 0 requests while the other choice's output counted. A request's other jobs now name its first job and
their prompt's first choice, which count whenever any of theirs ran. Jobs written before this revision name none
and keep the old rule (the first job counts where it ran): no backfill, nothing links them.

Revision ID: 0047
Revises: 0046
Create Date: 2026-12-01 10:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0047'
down_revision: str | Sequence[str] | None = '0046'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

LINKS = ('request_job_id', 'prompt_job_id')


def upgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        for column in LINKS:
            batch.add_column(sa.Column(column, sa.String(length=40), nullable=True))
    for column in LINKS:  # only the jobs that name one (a request's later jobs) are indexed
        named = sa.text(f'{column} IS NOT NULL')
        op.create_index(f'ix_jobs_{column.removesuffix("_id")}', 'jobs', [column], sqlite_where=named,
                        postgresql_where=named)


def downgrade() -> None:
    for column in LINKS:
        op.drop_index(f'ix_jobs_{column.removesuffix("_id")}', table_name='jobs')
    with op.batch_alter_table('jobs') as batch:
        for column in reversed(LINKS):
            batch.drop_column(column)
