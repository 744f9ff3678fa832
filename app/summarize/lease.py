"""A summarization run's lease: the step that holds it is the one that may write the run's next version. Taken
while free or expired (``claim``), whoever holds it (``take_over``: a cancel), given back early (``release``), and
renewed while a long step goes on (``LeaseKeeper``); every write is guarded by the run's status or version as read,
so a step that lost its lease writes nothing."""

from __future__ import annotations

import logging
import time
from datetime import timedelta

from sqlalchemy import ColumnElement, or_, update

from app.db.models import SummarizationRun
from app.db.session import session_scope, write_guard
from app.services.transitions import utcnow

log = logging.getLogger(__name__)


def held(run: SummarizationRun, owner: str) -> tuple[ColumnElement[bool], ...]:
    """The guard of a step's writes: ``owner`` still holds the run's lease at the version it read."""
    return (SummarizationRun.id == run.id, SummarizationRun.lease_owner == owner,
            SummarizationRun.version == run.version)


def claim(url: str, run: SummarizationRun, owner: str, lease_s: float) -> bool:
    """Takes the run's lease while it is free or expired and the run is still as read (status, version)."""
    now = utcnow()
    with session_scope(url) as s, write_guard(s):
        claimed = s.execute(update(SummarizationRun).where(
            SummarizationRun.id == run.id, SummarizationRun.status == run.status,
            SummarizationRun.version == run.version,
            or_(SummarizationRun.lease_owner.is_(None), SummarizationRun.lease_expires_at < now))
            .values(lease_owner=owner, lease_expires_at=now + timedelta(seconds=lease_s))
            .execution_options(synchronize_session=False)).rowcount == 1
    return claimed


def take_over(url: str, run: SummarizationRun, owner: str, lease_s: float) -> bool:
    """Takes the run's lease whoever holds it, while the run is still as read (status, version): the holder's
    next write, guarded by its lease, matches nothing."""
    with session_scope(url) as s, write_guard(s):
        return s.execute(update(SummarizationRun).where(
            SummarizationRun.id == run.id, SummarizationRun.status == run.status,
            SummarizationRun.version == run.version)
            .values(lease_owner=owner, lease_expires_at=utcnow() + timedelta(seconds=lease_s))
            .execution_options(synchronize_session=False)).rowcount == 1


def release(url: str, run_id: str, owner: str) -> None:
    """Gives the lease back early (the step failed before committing); best effort: it expires anyway."""
    try:
        with session_scope(url) as s, write_guard(s):
            s.execute(update(SummarizationRun).where(SummarizationRun.id == run_id,
                                                     SummarizationRun.lease_owner == owner)
                      .values(lease_owner=None, lease_expires_at=None).execution_options(synchronize_session=False))
    except Exception:
        log.warning("could not release the lease of summarization %s; it expires on its own", run_id, exc_info=True)


class LeaseLost(Exception):
    """A step's lease was taken over (a cancel, or a process that found it lapsed) while the step went on."""


class LeaseKeeper:
    """Renews a step's lease while the step goes on: called often (between documents, between the sentences a split
    measures), it extends the lease by ``lease_s`` once a third of it has passed since the last renewal, guarded by
    (owner, version) as the step's commit is; ``LeaseLost`` where that matches nothing, so the step stops early
    and writes nothing."""

    clock = staticmethod(time.monotonic)

    def __init__(self, url: str, run: SummarizationRun, owner: str, lease_s: float):
        self.url, self.run, self.owner, self.lease_s = url, run, owner, lease_s
        self.renew_at = self.clock() + lease_s / 3

    def __call__(self) -> None:
        if self.clock() < self.renew_at:
            return
        with session_scope(self.url) as s, write_guard(s):
            kept = s.execute(update(SummarizationRun).where(*held(self.run, self.owner))
                             .values(lease_expires_at=utcnow() + timedelta(seconds=self.lease_s))
                             .execution_options(synchronize_session=False)).rowcount == 1
        if not kept:
            raise LeaseLost(self.run.id)
        self.renew_at = self.clock() + self.lease_s / 3
