"""``GET /metrics``: Prometheus text format, derived from SQL at scrape time (the finished jobs' totals kept between
scrapes: app.observability.tally), with vLLM's own engine series
from the workers that run it (see app.observability). A scrape needs the admin key (the rate limits' series name
tenants): ``app.api.deps.require_metrics_reader``.

Where the database cannot serve (down, or busy past its bounds) the scrape still answers, with
``coserve:database_up`` 0 and the series kept in Redis (the engines', the rate limits'), as an exporter reports the
system it watches being down."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from app.api.deps import MetricsReader, SettingsDep
from app.db.session import DATABASE_ERRORS, database_unavailable
from app.observability.collector import SqlCollector
from app.observability.engine_metrics import EngineMetricsCollector
from app.observability.rate_limit_metrics import RateLimitCollector
from app.services.lora_adapters import served_models
from app.services.workers import heartbeat_cutoff
from app.settings import Settings

log = logging.getLogger(__name__)

router = APIRouter(tags=["metrics"])


@router.get("/metrics", include_in_schema=False, dependencies=[MetricsReader])
def metrics(request: Request, settings: SettingsDep) -> Response:
    registry = CollectorRegistry(auto_describe=False)
    sql = SqlCollector(settings.sqlalchemy_url, settings.model_name, tiers=settings.tiers,
                       models=_counted_models(settings), live_since=heartbeat_cutoff(settings),
                       # vLLM exports these names itself: from the configuration, so a scrape's names never
                       # depend on whether Redis answered it
                       vllm_aliases=settings.engine_backend != "vllm")
    registry.register(sql)
    if settings.redis_url:  # vLLM's own series from the live workers on the vLLM backend
        registry.register(EngineMetricsCollector(settings.redis_url, sql.live_workers(),
                                                 model_name=settings.model_name, left_out=sql.vllm_names))
        registry.register(RateLimitCollector(settings.redis_url))
    registry.register(request.app.state.http_metrics)  # the app's HTTP series (app.observability.http_metrics)
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


def _counted_models(settings: Settings) -> tuple[str, ...]:
    """The jobs' models this deployment's series count: its model and adapters (those loaded at runtime too, where
    the database says which)."""
    try:
        return served_models(settings)
    except DATABASE_ERRORS as exc:  # the collector's own read fails alike, and says so
        if not database_unavailable(exc):
            raise
        return settings.served_models
