"""Totals of finished jobs kept in the database between scrapes, so a scrape reads only the jobs finished since.

Every series ``/metrics`` derives from finished jobs is a sum per group (a count, a sum of seconds or tokens, a
bucket's count), and a finished job's values do not change once its end has settled. So the totals of the jobs that
finished before a horizon are summed once and kept (``metric_totals``, one row per deployment (model name), shared by
every API process and kept across restarts), and each scrape adds those finished since the horizon. Summing all of
them at every scrape took 37-48 s at 300,000 jobs (docs/BENCHMARKS.md), past Prometheus's scrape timeout.

A job's end is kept by when it settled (``settled_at``: when its values stopped changing), not by ``finished_at``:
a job the API cancelled while an engine held it gets its token counts from its worker later, however late, and
settles then (workers/lease.py keep_cancelled); until then it is read afresh at every scrape, so it is counted once,
with its values as they stand. ``SETTLE`` is the margin a settled end's commit may take behind its ``settled_at``.

A deployment's first scrape starts the totals (at its horizon) rather than summing every job ever ended: it reads an
index range, as every later scrape does. The counters count the jobs ended since, as vLLM's count the requests since
its start; Prometheus reads a counter's rate, and the Usage API sums any range of jobs.

The totals are the deployment's (one row per model name: its series' label), over every model it has counted: the
model and its adapters, a runtime adapter's jobs from the scrape that first counted it (``Kept.models``). A model is
never dropped from them (an adapter unloaded), so no counter goes back when the set of served models changes."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import Select, false, func, update
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session

from app.db.models import Job, MetricTotals
from app.db.session import session_scope
from app.services.transitions import utcnow

log = logging.getLogger(__name__)

SETTLE = timedelta(minutes=5)

Groups = dict[tuple, tuple[float, ...]]  # a query's additive columns, per group key


@dataclass(frozen=True)
class Summed:
    """A grouped query of finished jobs whose columns after the first ``keys`` (the group) are sums or counts."""

    query: Select
    keys: int


@dataclass
class Kept:
    """The totals of the jobs finished before ``horizon`` (None: none kept yet), per query name."""

    horizon: datetime | None = None
    groups: dict[str, Groups] = field(default_factory=dict)
    models: tuple[str, ...] = ()  # the jobs' models counted in them (none in a row kept before they were named)


MODELS = "counted_models"  # the key of Kept.models in a row's totals (the others are query names)


def scope_of(model_name: str) -> str:
    """The row of the totals of the deployment of ``model_name`` (its series' label), whichever models it counts.
    The hash of a one-name list: the row a deployment without adapters kept before adapters joined its totals."""
    return hashlib.sha256(json.dumps([model_name]).encode()).hexdigest()[:40]


def counted(start: Kept, models: Sequence[str]) -> tuple[str, ...]:
    """The models a scrape counts: ``models`` (those served now) and every one counted before."""
    return tuple(sorted(set(start.models) | set(models)))


def kept(session: Session, scope: str) -> Kept:
    row = session.get(MetricTotals, scope)
    if row is None:
        return Kept()
    return Kept(row.horizon, {name: {tuple(key): tuple(values) for key, values in groups}
                              for name, groups in row.totals.items() if name != MODELS},
                tuple(row.totals.get(MODELS, ())))


def totals(session: Session, start: Kept, queries: Mapping[str, Summed],
           models: Sequence[str] = ()) -> tuple[dict[str, Groups], Kept]:
    """Each query's totals per group over all finished jobs (of ``models``: ``counted``), and what to keep from here:
    ``start``'s totals plus the jobs finished since its horizon, those finished before the new horizon kept apart."""
    horizon = utcnow() - SETTLE
    # the first scrape starts the totals at the horizon: the jobs settled before are not read (the module's doc)
    since = start.horizon if start.horizon is not None else horizon
    settled = func.coalesce(Job.settled_at < horizon, false())
    after = Kept(horizon, models=tuple(models))
    out: dict[str, Groups] = {}
    # two ranges of one index (ix_jobs_settled: model, settled_at, finished_at), a query each (SQLite scans the table
    # for their OR): the ends settled since the horizon kept, and those ended (each query's finished_at term) but not
    # settled yet, read at each scrape until they settle
    ranges = (Job.settled_at >= since, Job.settled_at.is_(None))
    for name, summed in queries.items():
        after.groups[name], recent = dict(start.groups.get(name, {})), {}
        for where in ranges:
            for *row, is_settled in session.execute(summed.query.add_columns(settled).group_by(settled).where(where)):
                add(after.groups[name] if is_settled else recent, tuple(row[:summed.keys]), row[summed.keys:])
        out[name] = dict(after.groups[name])
        for key, values in recent.items():
            add(out[name], key, values)
    return out, after


def keep(url: str, scope: str, start: Kept, after: Kept) -> bool:
    """Writes ``after`` where the row still holds ``start`` (another process may have moved it on: its totals are as
    good). False where it was not written; a scrape answers all the same."""
    totals_json = {name: [[list(key), list(values)] for key, values in groups.items()]
                   for name, groups in after.groups.items()} | {MODELS: list(after.models)}
    try:
        with session_scope(url) as s:
            if start.horizon is None:
                s.add(MetricTotals(scope=scope, horizon=after.horizon, totals=totals_json))
                s.flush()
                return True
            return s.execute(update(MetricTotals).where(MetricTotals.scope == scope,
                                                        MetricTotals.horizon == start.horizon)
                             .values(horizon=after.horizon, totals=totals_json)).rowcount == 1
    except IntegrityError:  # another process kept the first totals meanwhile
        return False
    except SQLAlchemyError as exc:  # the next scrape reads from the horizon kept before
        log.warning("/metrics: the finished jobs' totals were not kept: %s", exc)
        return False


def add(groups: Groups, key: tuple, values: Sequence[float | None]) -> None:
    """Adds one group's sums into ``groups`` (a NULL sum, of no rows, is 0)."""
    before = groups.get(key)
    values = tuple(float(v or 0) for v in values)
    groups[key] = values if before is None else tuple(a + b for a, b in zip(before, values))

