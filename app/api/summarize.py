"""Summarization API: start a map-reduce run over documents with a deadline, poll it, fetch results."""

from __future__ import annotations

import logging
from datetime import timedelta

from fastapi import APIRouter, HTTPException, status
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from app.api.deps import CurrentPrincipal, SettingsDep
from app.openai_schemas import parse_window
from app.services.jobs import JobValidationError, resolve_tier
from app.services.transitions import utcnow
from app.summarize import service
from app.summarize.documents import Document

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/summarize", tags=["summarize"])


class DocumentIn(BaseModel):
    id: str = Field(min_length=1, max_length=200)
    text: str = Field(min_length=1)


class SummarizeCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    documents: list[DocumentIn] = Field(min_length=1, max_length=10_000)
    deadline: str | float = Field("2h", description="window ('30m', '2h', '7d') or seconds from now")
    max_summary_tokens: int = Field(128, ge=8, le=4096)
    chunk_tokens: int = Field(1024, ge=64, le=32_768, description="largest chunk of document text per job")
    overlap_tokens: int = Field(64, ge=0, le=1024)
    tier: str | None = None


@router.post("", status_code=status.HTTP_201_CREATED)
async def start(body: SummarizeCreate, principal: CurrentPrincipal, settings: SettingsDep) -> dict:
    ids = [d.id for d in body.documents]
    if len(set(ids)) != len(ids):
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, "document ids must be unique")
    try:
        window = float(body.deadline) if isinstance(body.deadline, float | int) else parse_window(body.deadline)
        tier = resolve_tier(settings, principal, body.tier)
    except (ValueError, JobValidationError) as exc:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, str(exc)) from exc
    if window <= 0:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, "deadline must be in the future")
    docs = [Document(d.id, d.text) for d in body.documents]
    try:
        run = await run_in_threadpool(
            service.start_run, settings, principal, docs, utcnow() + timedelta(seconds=window),
            max_summary_tokens=body.max_summary_tokens, chunk_tokens=body.chunk_tokens,
            overlap_tokens=body.overlap_tokens, tier=tier)
    except (ValueError, JobValidationError) as exc:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, str(exc)) from exc
    return run.progress()


def _own(settings, principal, run_id: str) -> dict:
    state = service.load(settings.data_dir, run_id)
    if state is None or state.pop("tenant_id") != principal.tenant_id:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no summarization {run_id!r}")
    return state


@router.get("/{run_id}")
def get_run(run_id: str, principal: CurrentPrincipal, settings: SettingsDep) -> dict:
    return _own(settings, principal, run_id)


@router.get("/{run_id}/results")
def results(run_id: str, principal: CurrentPrincipal, settings: SettingsDep) -> Response:
    state = _own(settings, principal, run_id)
    path = service.runs_dir(settings.data_dir) / f"{run_id}.jsonl"
    if state["status"] == "running" or not path.exists():
        raise HTTPException(status.HTTP_409_CONFLICT, "the run is still going; poll until its status is completed")
    return Response(path.read_bytes(), media_type="application/jsonl")
