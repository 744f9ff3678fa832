"""``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``: LoRA adapters loaded while coserve runs, as
vLLM's server offers them with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` (here ``COSERVE_RUNTIME_LORA``).

The adapter's directory is a path on the server, so these need the admin key. The answers have vLLM's shapes: a
line of text on success, an error object otherwise.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from app.api.deps import AdminPrincipal, SettingsDep
from app.api.errors import openai_responses
from app.openai_schemas import OpenAIError, OpenAIRoute, openai_parsed
from app.services import lora_adapters
from app.wire import Text

router = APIRouter(prefix="/v1", tags=["openai"], route_class=OpenAIRoute,
                   responses=openai_responses(400, 401, 403, 404))
DONE = {200: {"description": "a line saying it is done", "content": {"text/plain": {"schema": {"type": "string"}}}}}


class LoadAdapter(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: Text
    lora_path: Text
    load_inplace: bool = False  # replace an adapter of that name (its jobs not yet begun take the new weights)


class UnloadAdapter(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: Text
    lora_int_id: int | None = None  # vLLM's; the name alone says which adapter here


@router.post("/load_lora_adapter", responses=DONE)
async def load_lora_adapter(body: dict[str, Any], settings: SettingsDep,
                            _admin: AdminPrincipal) -> PlainTextResponse:
    """Serves a LoRA adapter of the model under ``lora_name`` from now on: requests name it as their model."""
    req = openai_parsed(LoadAdapter, body)
    try:
        await run_in_threadpool(lora_adapters.load, settings, req.lora_name, req.lora_path,
                                load_inplace=req.load_inplace)
    except lora_adapters.AdapterError as exc:
        raise OpenAIError(exc.status, str(exc)) from exc
    except ValueError as exc:  # the directory is not an adapter vLLM could load
        raise OpenAIError(400, str(exc), param="lora_path") from exc
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' loaded.")


@router.post("/unload_lora_adapter", responses=DONE)
async def unload_lora_adapter(body: dict[str, Any], settings: SettingsDep,
                              _admin: AdminPrincipal) -> PlainTextResponse:
    """Stops serving a runtime adapter; its jobs that have not begun fail, saying it was unloaded."""
    req = openai_parsed(UnloadAdapter, body)
    try:
        await run_in_threadpool(lora_adapters.unload, settings, req.lora_name)
    except lora_adapters.AdapterError as exc:
        raise OpenAIError(exc.status, str(exc), param="lora_name") from exc
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' unloaded.")
