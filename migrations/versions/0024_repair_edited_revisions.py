"""Repair what edited revisions left out, and index jobs by finished_at

Five revisions were changed after databases had been built with their first version, and Alembic never runs a
revision twice, so such a database lacks what was added later: jobs.prompt_logprobs and jobs.prompt_token_ids (0007),
jobs.cache_write_tokens (0022), the indexes ix_jobs_model_finished (0002) and ix_jobs_created (0016), and
lora_adapters.loaded_at, first named created_at (0017). This revision adds whichever of them the database lacks.
ix_jobs_finished serves the reads of the jobs finished lately (the dashboard's SLO chart, every second).

Revision ID: 0024
Revises: 0023
Create Date: 2026-11-28 19:40:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0024'
down_revision: str | Sequence[str] | None = '0023'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JOB_COLUMNS = (('prompt_logprobs', sa.JSON), ('prompt_token_ids', sa.JSON), ('cache_write_tokens', sa.Integer))
JOB_INDEXES = (('ix_jobs_model_finished', ['model', 'finished_at']), ('ix_jobs_created', ['created_at']))


def upgrade() -> None:
    schema = sa.inspect(op.get_bind())
    have = {c['name'] for c in schema.get_columns('jobs')}
    if missing := [sa.Column(name, kind(), nullable=True) for name, kind in JOB_COLUMNS if name not in have]:
        with op.batch_alter_table('jobs') as batch:
            for column in missing:
                batch.add_column(column)
    indexed = {i['name'] for i in schema.get_indexes('jobs')}
    for name, columns in JOB_INDEXES:
        if name not in indexed:
            op.create_index(name, 'jobs', columns)
    if 'loaded_at' not in {c['name'] for c in schema.get_columns('lora_adapters')}:
        with op.batch_alter_table('lora_adapters') as batch:
            batch.alter_column('created_at', new_column_name='loaded_at')
    op.create_index('ix_jobs_finished', 'jobs', ['finished_at'])


def downgrade() -> None:
    op.drop_index('ix_jobs_finished', table_name='jobs')  # what it repaired belongs to the revisions before it
