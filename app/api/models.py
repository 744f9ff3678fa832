"""``GET /v1/models``: the model this deployment serves and its LoRA adapters, those configured and those loaded
since (OpenAI list shape)."""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from fastapi import APIRouter

from app.api.deps import CurrentPrincipal, SettingsDep
from app.api.errors import openai_responses
from app.openai_schemas import OpenAIError, OpenAIRoute
from app.services import lora_adapters
from app.services.workers import held_context_length
from app.settings import Settings

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/models", tags=["openai"], route_class=OpenAIRoute, responses=openai_responses(401))

_STARTED = int(datetime.now(UTC).timestamp())


def _model(settings: Settings, name: str) -> dict:
    """OpenAI's model object, with what vLLM's adds: the model it was loaded from and its context length; a LoRA
    adapter's parent is the model it adapts (its root is its name: the server's paths are not shown)."""
    adapter = name not in settings.model_names
    return {"id": name, "object": "model", "created": _STARTED, "owned_by": "coserve",
            "root": name if adapter else settings.model, "parent": settings.model_name if adapter else None,
            "max_model_len": held_context_length(settings)}


@router.get("")
def list_models(settings: SettingsDep, _principal: CurrentPrincipal) -> dict:
    return {"object": "list", "data": [_model(settings, name) for name in lora_adapters.listed_models(settings)]}


@router.get("/{model_id:path}", responses=openai_responses(404))
def get_model(model_id: str, settings: SettingsDep, _principal: CurrentPrincipal) -> dict:
    if not lora_adapters.is_served(settings, model_id):
        raise OpenAIError(404, f"The model '{model_id}' does not exist", param="model", code="model_not_found")
    return _model(settings, model_id)
