"""Totals of finished jobs kept between scrapes, so a scrape reads only the jobs finished since the last one.

Every series ``/metrics`` derives from finished jobs is a sum per group (a count, a sum of seconds or tokens, a
bucket's count), and a finished job's values do not change once its end has settled. So the totals of the jobs that
finished before a horizon are summed once and kept in the API process, and each scrape adds those finished since
the horizon. Summing all of them at every scrape took 40 s at 300,000 jobs (docs/BENCHMARKS.md), past Prometheus's
scrape timeout.

``SETTLE`` is how long a job's end may take to settle: a worker stamps ``finished_at`` at the attempt that writes
the end, and a job cancelled while running gets its token counts from its worker shortly after the API stamped it.
A job whose end is written later than that behind its ``finished_at`` is missed by the processes that had kept that
span (a restarted API counts it)."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import Select
from sqlalchemy.orm import Session

from app.db.models import Job
from app.services.transitions import utcnow

SETTLE = timedelta(minutes=5)

Groups = dict[tuple, tuple[float, ...]]  # a query's additive columns, per group key


@dataclass(frozen=True)
class Summed:
    """A grouped query of finished jobs whose columns after the first ``keys`` (the group) are sums or counts."""

    query: Select
    keys: int


@dataclass
class Tally:
    """One API process's kept totals, for one set of counted models (another set starts over)."""

    scope: tuple = ()
    horizon: datetime | None = None  # the totals kept are those of the jobs finished before it
    kept: dict[str, Groups] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)  # scrapes run on the API's thread pool

    def totals(self, session: Session, scope: tuple, queries: Mapping[str, Summed]) -> dict[str, Groups]:
        """Each query's totals per group over all finished jobs: those kept, plus the jobs finished since the
        horizon. The horizon moves on only where every query was read."""
        with self.lock:
            if scope != self.scope:
                self.scope, self.horizon, self.kept = scope, None, {}
            horizon = utcnow() - SETTLE
            settled = Job.finished_at < horizon
            kept: dict[str, Groups] = {}
            totals: dict[str, Groups] = {}
            for name, summed in queries.items():
                query = summed.query.add_columns(settled).group_by(settled)
                if self.horizon is not None:
                    query = query.where(Job.finished_at >= self.horizon)
                kept[name], recent = dict(self.kept.get(name, {})), {}
                for *row, is_settled in session.execute(query):
                    add(kept[name] if is_settled else recent, tuple(row[:summed.keys]), row[summed.keys:])
                totals[name] = dict(kept[name])
                for key, values in recent.items():
                    add(totals[name], key, values)
            self.kept, self.horizon = kept, horizon
            return totals


def add(groups: Groups, key: tuple, values: Sequence[float | None]) -> None:
    """Adds one group's sums into ``groups`` (a NULL sum, of no rows, is 0)."""
    before = groups.get(key)
    values = tuple(float(v or 0) for v in values)
    groups[key] = values if before is None else tuple(a + b for a, b in zip(before, values))
