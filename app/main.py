"""FastAPI application factory: one router per resource."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from app.api import admin, batches, files, health, jobs, metrics, models, openai_compat, summarize, tenants
from app.settings import Settings, get_settings


def create_app(settings: Settings | None = None) -> FastAPI:
    api = FastAPI(title="coserve", version="0.1.0",
                  description="Co-serving interactive LLM requests and deadline batch jobs.")
    api.state.settings = settings or get_settings()
    limit = api.state.settings.max_body_bytes

    @api.middleware("http")
    async def limit_body(request: Request, call_next):
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return JSONResponse({"detail": f"request body over {limit} bytes; split it or upload a file"},
                                status_code=413)
        return await call_next(request)

    for module in (health, jobs, openai_compat, models, files, batches, summarize, admin, tenants, metrics):
        api.include_router(module.router)
    return api


def app_factory() -> FastAPI:
    """For ``uvicorn --factory app.main:app_factory`` (settings from the environment)."""
    return create_app()
