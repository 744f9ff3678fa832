"""``POST /reset_prefix_cache``: every live worker of the model forgets its cached prefix blocks, as vLLM's server
offers it (there in its dev mode). A benchmark of the prefix cache starts cold with it; an operator clears blocks
that should not be served again. ``/reset_mm_cache`` and ``/reset_encoder_cache``, which vLLM's benchmark sweep
posts too, answer as vLLM's do for a text-only model: there is nothing to forget. They need the admin key."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from app.api.deps import AdminPrincipal, SessionDep, SettingsDep
from app.api.errors import responses
from app.services.workers import reset_prefix_caches

router = APIRouter(tags=["admin"])
NOTHING_CACHED = {200: {"description": "done: a text-only model caches no multi-modal inputs or encoder outputs "
                                       "(vLLM's empty answer)"}, **responses(401, 403)}


@router.post("/reset_prefix_cache", responses={
    200: {"description": "every live worker of the model forgot its cached prefixes"},
    409: {"description": "a worker kept its cache (running requests held blocks, or it did not answer); the body "
                         "gives each worker's answer"}, **responses(401, 403)})
async def reset_prefix_cache(session: SessionDep, settings: SettingsDep, _admin: AdminPrincipal,
                             reset_running_requests: Annotated[bool, Query(
                                 description="preempt running requests first, so their blocks go too (vLLM's)")]
                             = False) -> JSONResponse:
    """Each live worker's answer, by worker id: ``reset`` true where its engine forgot every cached block;
    ``success``, vLLM's name for the outcome, says the same as ``reset``."""
    workers = await run_in_threadpool(reset_prefix_caches, session, settings,
                                      reset_running_requests=reset_running_requests)
    done = all(w["reset"] for w in workers.values())
    return JSONResponse({"success": done, "reset": done, "workers": workers}, status_code=200 if done else 409)


@router.post("/reset_mm_cache", response_class=Response, responses=NOTHING_CACHED)
@router.post("/reset_encoder_cache", response_class=Response, responses=NOTHING_CACHED)
async def reset_nothing(_admin: AdminPrincipal) -> Response:
    """vLLM's multi-modal input cache and encoder output cache: none for the text-only models coserve serves."""
    return Response(status_code=200)
