"""``GET /metrics``: Prometheus text format, derived from SQL at scrape time, with vLLM's own engine series
from the workers that run it (see app.observability)."""

from __future__ import annotations

import logging

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from sqlalchemy import select

from app.api.deps import SettingsDep
from app.db.models import WorkerState
from app.db.session import session_scope
from app.observability.collector import SqlCollector
from app.observability.engine_metrics import EngineMetricsCollector
from app.observability.rate_limit_metrics import RateLimitCollector

log = logging.getLogger(__name__)

router = APIRouter(tags=["metrics"])


@router.get("/metrics", include_in_schema=False)
def metrics(settings: SettingsDep) -> Response:
    registry = CollectorRegistry(auto_describe=False)
    engine_names: set[str] = set()
    if settings.redis_url:  # vLLM's own series from the workers on the vLLM backend
        with session_scope(settings.sqlalchemy_url) as s:
            workers = list(s.scalars(select(WorkerState.id)))
        engines = EngineMetricsCollector(settings.redis_url, workers)
        engine_names = engines.names()
        registry.register(engines)
        registry.register(RateLimitCollector(settings.redis_url))
    registry.register(SqlCollector(settings.sqlalchemy_url, settings.model_name, tiers=settings.tiers,
                                   engine_names=engine_names))
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
