"""FastAPI application factory: one router per resource."""

from __future__ import annotations

from fastapi import FastAPI

from app.api import admin, batches, files, health, jobs, metrics, models, openai_compat, summarize


def create_app() -> FastAPI:
    api = FastAPI(title="coserve", version="0.1.0",
                  description="Co-serving interactive LLM requests and deadline batch jobs.")
    for module in (health, jobs, openai_compat, models, files, batches, summarize, admin, metrics):
        api.include_router(module.router)
    return api
