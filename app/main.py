"""FastAPI application factory: one router per resource."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from app.api import admin, batches, files, health, jobs, metrics, models, openai_compat, summarize, tenants
from app.credentials import ensure_admin_key
from app.services.job_writer import JobWriter
from app.services.model_info import get_tokenizer, max_model_len
from app.settings import Settings, get_settings

log = logging.getLogger(__name__)


@asynccontextmanager
async def lifespan(api: FastAPI):
    # load the tokenizer before the first request instead of during it
    model = api.state.settings.model
    try:
        await run_in_threadpool(get_tokenizer, model)
        await run_in_threadpool(max_model_len, model)
    except Exception as exc:  # the API still serves reads; submissions will report the problem
        log.warning("could not load the tokenizer of %s at start-up: %s", model, exc)
    settings = api.state.settings
    if settings.admin_key:  # deployments (compose) pass the admin key in the environment
        try:
            await run_in_threadpool(ensure_admin_key, settings.sqlalchemy_url, settings.admin_key,
                                    settings.default_tier)
        except Exception as exc:
            log.warning("could not register COSERVE_ADMIN_KEY: %s", exc)
    api.state.job_writer = JobWriter(settings)
    try:
        yield
    finally:
        api.state.job_writer.close()


class BodyLimit:
    """Answers 413 when Content-Length is over the limit (a plain ASGI middleware: cheap)."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            for name, value in scope["headers"]:
                if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                    body = JSONResponse({"detail": f"request body over {self.limit} bytes; split it or upload a file"},
                                        status_code=413)
                    return await body(scope, receive, send)
        return await self.app(scope, receive, send)


def create_app(settings: Settings | None = None) -> FastAPI:
    api = FastAPI(title="coserve", version="0.1.0", lifespan=lifespan,
                  description="Co-serving interactive LLM requests and deadline batch jobs.")
    api.state.settings = settings or get_settings()
    limit = api.state.settings.max_body_bytes

    api.add_middleware(BodyLimit, limit=limit)
    for module in (health, jobs, openai_compat, models, files, batches, summarize, admin, tenants, metrics):
        api.include_router(module.router)
    return api


def app_factory() -> FastAPI:
    """For ``uvicorn --factory app.main:app_factory`` (settings from the environment)."""
    return create_app()
