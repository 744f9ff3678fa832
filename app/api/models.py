"""``GET /v1/models``: the model this deployment serves and its LoRA adapters, those configured and those loaded
since: in OpenAI's list shape, and in Anthropic's to Anthropic's SDKs (``client.models.list()`` and ``retrieve()``
send an ``anthropic-version`` header), its errors too."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Query, Request

from app.api.anthropic_messages import SharedPathRoute
from app.api.deps import CurrentPrincipal, SettingsDep
from app.api.errors import anthropic_sdk, openai_responses
from app.openai_schemas import OpenAIError
from app.services import lora_adapters
from app.services.workers import held_context_length
from app.settings import Settings

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/models", tags=["openai"], route_class=SharedPathRoute, responses=openai_responses(401))

_STARTED = int(datetime.now(UTC).timestamp())


def _model(settings: Settings, name: str) -> dict:
    """OpenAI's model object, with what vLLM's adds: the model it was loaded from and its context length; a LoRA
    adapter's parent is the model it adapts (its root is its name: the server's paths are not shown)."""
    adapter = name not in settings.model_names
    return {"id": name, "object": "model", "created": _STARTED, "owned_by": "coserve",
            "root": name if adapter else settings.model, "parent": settings.model_name if adapter else None,
            "max_model_len": held_context_length(settings)}


def _anthropic_model(settings: Settings, name: str) -> dict:
    """Anthropic's model object (docs.anthropic.com/en/api/models): its name is its display name."""
    return {"type": "model", "id": name, "display_name": name,
            "created_at": datetime.fromtimestamp(_STARTED, UTC).isoformat().replace("+00:00", "Z"),
            "max_input_tokens": held_context_length(settings)}


def _anthropic_page(names: tuple[str, ...], after_id: str | None, before_id: str | None, limit: int) -> tuple[str, ...]:
    """The names of Anthropic's page: those after ``after_id`` or before ``before_id`` (ids it does not know are
    a 400), at most ``limit``, nearest the cursor."""
    for cursor, param in ((after_id, "after_id"), (before_id, "before_id")):
        if cursor is not None and cursor not in names:
            raise OpenAIError(400, f"{param} {cursor!r} is not a model this server lists", param=param)
    if after_id is not None:
        return names[names.index(after_id) + 1:][:limit]
    if before_id is not None:
        return names[:names.index(before_id)][-limit:]
    return names[:limit]


@router.get("", responses=openai_responses(400))
def list_models(request: Request, settings: SettingsDep, _principal: CurrentPrincipal,
                after_id: Annotated[str | None, Query(description="Anthropic's: the page after this model")] = None,
                before_id: Annotated[str | None, Query(description="Anthropic's: the page before this model")] = None,
                limit: Annotated[int, Query(ge=1, le=1000, description="Anthropic's: models per page")] = 20) -> dict:
    """OpenAI's list; to Anthropic's SDKs, Anthropic's page (``after_id``, ``before_id``, ``limit``: theirs)."""
    names = lora_adapters.listed_models(settings)
    if not anthropic_sdk(request.headers):
        return {"object": "list", "data": [_model(settings, name) for name in names]}
    if after_id is not None and before_id is not None:
        raise OpenAIError(400, "give after_id or before_id, not both", param="before_id")
    page = _anthropic_page(names, after_id, before_id, limit)
    more = bool(page) and (page[0] != names[0] if before_id is not None else page[-1] != names[-1])
    return {"data": [_anthropic_model(settings, name) for name in page], "has_more": more,
            "first_id": page[0] if page else None, "last_id": page[-1] if page else None}


@router.get("/{model_id:path}", responses=openai_responses(404))
def get_model(request: Request, model_id: str, settings: SettingsDep, _principal: CurrentPrincipal) -> dict:
    if not lora_adapters.is_served(settings, model_id):
        raise OpenAIError(404, f"The model '{model_id}' does not exist", param="model", code="model_not_found")
    return (_anthropic_model if anthropic_sdk(request.headers) else _model)(settings, model_id)


@router.delete("/{model_id:path}", responses=openai_responses(403, 404))
def delete_model(model_id: str, settings: SettingsDep, _principal: CurrentPrincipal) -> dict:
    """OpenAI's ``client.models.delete`` deletes a fine-tuned model; coserve fine-tunes none, so there is no model
    of the caller's to delete: a model it serves is refused as OpenAI refuses a model the caller does not own."""
    if not lora_adapters.is_served(settings, model_id):
        raise OpenAIError(404, f"The model '{model_id}' does not exist", param="model", code="model_not_found")
    raise OpenAIError(403, f"The model '{model_id}' is served by this deployment and cannot be deleted through the "
                      "API (an admin unloads a LoRA adapter loaded at runtime with POST /v1/unload_lora_adapter)",
                      type="permission_error", param="model", code="model_not_deletable")
