"""Settles the jobs the API stopped (cancelled, expired) while a worker held them that an older coserve left unsettled

Before the stop kept a held job's lease (app/services/transitions.py cancel_stamps), such a job's end settled only
when its worker wrote what it produced; where the worker died first, it stayed with ``settled_at`` and
``lease_expires_at`` null, which the sweeper (workers/lease.py settle_lapsed, on an expired lease) never settles, and
``/metrics`` read it afresh at every scrape. They settle here, with their values as they stand, at the upgrade's time
rather than at ``finished_at``: the totals ``/metrics`` keeps (app/observability/tally.py) read the ends settled
since their horizon, and one settled behind it would drop out of the counters, which would go back. A stopped job
with a lease is one a worker holds now: it settles as the current code settles it. The downgrade leaves them
settled (which ends were settled here is not kept; an older coserve reads a settled end as one).

Revision ID: 0044
Revises: 0042
Create Date: 2026-11-29 10:30:00
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision: str = '0044'
down_revision: str | Sequence[str] | None = '0042'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

STOPPED = ('cancelled', 'expired')
jobs = sa.table('jobs', sa.column('status', sa.String), sa.column('settled_at', sa.DateTime(timezone=True)),
                sa.column('lease_expires_at', sa.DateTime(timezone=True)))


def upgrade() -> None:
    op.get_bind().execute(jobs.update().where(jobs.c.status.in_(STOPPED), jobs.c.settled_at.is_(None),
                                              jobs.c.lease_expires_at.is_(None))
                          .values(settled_at=datetime.now(UTC)))


def downgrade() -> None:
    pass
