"""The dashboard's SLO chart: the finished jobs' SLO verdicts per minute and tier over a window, counted in SQL,
with the minutes that have settled kept per API process (every open dashboard polls the overview each second)."""

from __future__ import annotations

import threading
from collections import defaultdict
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func, select

from app.db.models import Job
from app.observability.tally import SETTLE
from app.services.transitions import utcnow
from app.services.usage import epoch

SLO_BUCKET_S = 60
SLO_FRESH_S = 5.0  # an API process counts the minutes not settled yet at most this often (every dashboard polls 1/s)

Counts = dict[tuple[int, str], list[int]]  # (bucket's start, tier) -> [met, violated]


def slo_counts(session, since: datetime, bucket_s: int = SLO_BUCKET_S) -> Counts:
    """The finished jobs' SLO verdicts since ``since`` per time bucket and tier, counted in SQL (an hour of a busy
    server's jobs is many rows): by ``ix_jobs_finished``."""
    bucket = (epoch(Job.finished_at, session.get_bind().dialect.name) // bucket_s).label("bucket")
    rows = session.execute(select(bucket, Job.tier, Job.slo_met, func.count())
                           .where(Job.finished_at >= since, Job.slo_met.is_not(None))
                           .group_by(bucket, Job.tier, Job.slo_met)).all()
    acc: Counts = defaultdict(lambda: [0, 0])
    for index, tier, met, n in rows:
        acc[(int(index) * bucket_s, tier)][0 if met else 1] += n
    return acc


def _points(acc: Counts, first: int) -> list[dict[str, Any]]:
    return [{"t": t, "tier": tier, "met": m, "violated": v} for (t, tier), (m, v) in sorted(acc.items()) if t >= first]


def _first_bucket(minutes: int, bucket_s: int, now: datetime) -> int:
    """The window's first bucket: the earliest that lies wholly in the last ``minutes`` (a cut one would count
    fewer jobs as the clock moves on)."""
    return -(-(int(now.timestamp()) - minutes * 60) // bucket_s) * bucket_s


def slo_series(session, minutes: int, bucket_s: int = SLO_BUCKET_S) -> list[dict[str, Any]]:
    """SLO attainment per time bucket and tier over the last ``minutes`` (finished jobs), all counted now."""
    first = _first_bucket(minutes, bucket_s, utcnow())
    return _points(slo_counts(session, epoch_utc(first), bucket_s), first)


def epoch_utc(t: float) -> datetime:
    return datetime.fromtimestamp(t, UTC)


class SloChart:
    """``slo_series`` as the overview reads it every second: a bucket that ended ``SETTLE`` ago (the jobs finished
    in it have been written, as the metrics' totals take it) is counted once and kept, per database; the buckets
    after it are counted again at most every ``SLO_FRESH_S``. So a poll reads a few minutes of jobs, not the hour."""

    def __init__(self, fresh_s: float = SLO_FRESH_S) -> None:
        self.fresh_s = fresh_s
        self._lock = threading.Lock()
        # (database, bucket_s) -> (first bucket kept, first bucket not kept, counts); (..., the recent counts' time,
        # the bucket they start at, them)
        self._settled: dict[tuple[str, int], tuple[int, int, Counts]] = {}
        self._recent: dict[tuple[str, int], tuple[float, int, Counts]] = {}

    def clear(self) -> None:
        with self._lock:
            self._settled.clear()
            self._recent.clear()

    def series(self, session, minutes: int, bucket_s: int = SLO_BUCKET_S) -> list[dict[str, Any]]:
        bind = session.get_bind()
        key = (str(getattr(bind, "url", None) or bind.engine.url), bucket_s)
        now = utcnow()
        first = _first_bucket(minutes, bucket_s, now)
        settled = int((now - SETTLE).timestamp()) // bucket_s * bucket_s  # the buckets before it are settled
        with self._lock:
            lo, hi, kept = self._settled.get(key, (first, first, {}))
            recent = self._recent.get(key)
        if lo > first or hi < first:  # a longer window than kept, or all kept is older than the window
            lo, hi, kept = first, first, {}
        if recent is not None and recent[1] == hi and settled <= hi and now.timestamp() - recent[0] < self.fresh_s:
            return _points({**kept, **recent[2]}, first)
        counted = slo_counts(session, epoch_utc(hi), bucket_s)  # the buckets not kept
        if settled > hi:  # keep the buckets settled since, and those of the last day only (the longest window)
            day = _first_bucket(24 * 60, bucket_s, now)
            kept = {k: v for k, v in kept.items() if k[0] >= day} | {k: v for k, v in counted.items() if k[0] < settled}
            lo, hi = max(lo, day), settled
            counted = {k: v for k, v in counted.items() if k[0] >= settled}
        with self._lock:
            self._settled[key] = (lo, hi, kept)
            self._recent[key] = (now.timestamp(), hi, counted)
        return _points({**kept, **counted}, first)


SLO_CHART = SloChart()  # this API process's
