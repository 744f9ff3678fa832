"""OpenAI's stored chat completions: ``GET /v1/chat/completions`` lists what chat requests given ``store: true``
answered; ``GET``, ``POST`` (metadata) and ``DELETE /v1/chat/completions/{id}``, and ``GET .../messages``
(``app.services.stored_completions``)."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

from app.api.deps import CurrentPrincipal, SessionDep, SettingsDep
from app.api.errors import openai_responses
from app.db.session import read_then_write
from app.openai_schemas import OpenAIError, OpenAIRoute, validation_code
from app.services import stored_completions as service
from app.wire import Metadata

router = APIRouter(prefix="/v1", tags=["openai"], route_class=OpenAIRoute)

_METADATA_PARAM = re.compile(r"metadata\[(.*)\]")  # the filter's pairs: metadata[key]=value, as OpenAI's
_METADATA = TypeAdapter(Metadata)


class CompletionUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")  # only the metadata of a stored completion can change

    metadata: Metadata | None


def _metadata_filter(request: Request) -> dict[str, str]:
    """The pairs of ``metadata[key]=value``, checked as a request's metadata is (``app.wire.Metadata``)."""
    pairs = {m.group(1): v for k, v in request.query_params.multi_items() if (m := _METADATA_PARAM.fullmatch(k))}
    try:
        return _METADATA.validate_python(pairs)
    except ValidationError as exc:
        raise OpenAIError(400, f"metadata filters: {exc.errors()[0]['msg']}", param="metadata",
                          code=validation_code(list(exc.errors()))) from exc


@router.get("/chat/completions", responses=openai_responses(400, 401))
def list_completions(request: Request, session: SessionDep, principal: CurrentPrincipal, settings: SettingsDep,
                     limit: Annotated[int, Query(ge=1, le=100)] = 20, order: Literal["asc", "desc"] = "asc",
                     after: str | None = None, model: str | None = None):
    """The tenant's stored chat completions, oldest first unless ``order=desc``; ``after``: a completion id, the
    page starts past it; ``model`` and ``metadata[key]=value`` (any number of pairs) filter them."""
    return service.page(session, principal.tenant_id, settings.tiers, limit=limit, order=order, after=after,
                        model=model, metadata=_metadata_filter(request))


@router.get("/chat/completions/{completion_id}", responses=openai_responses(401, 404))
def get_completion(completion_id: str, session: SessionDep, principal: CurrentPrincipal, settings: SettingsDep):
    """A stored chat completion, as its request was answered, with its metadata."""
    return service.completion_body(service.finished(session, principal.tenant_id, completion_id), settings.tiers)


@router.post("/chat/completions/{completion_id}", responses=openai_responses(400, 401, 404))
def update_completion(completion_id: str, body: CompletionUpdate, principal: CurrentPrincipal,
                      settings: SettingsDep):
    """Replaces a stored chat completion's metadata (the one thing of it that can change)."""
    with read_then_write(settings.sqlalchemy_url) as s:
        jobs = service.finished(s, principal.tenant_id, completion_id, lock=True)
        jobs[0].response = {**jobs[0].response, "metadata": body.metadata or {}}
        return service.completion_body(jobs, settings.tiers)


@router.delete("/chat/completions/{completion_id}", responses=openai_responses(401, 404))
def delete_completion(completion_id: str, principal: CurrentPrincipal, settings: SettingsDep):
    """Forgets a stored chat completion: it is no longer listed or retrieved (its jobs stay in /v1/jobs)."""
    with read_then_write(settings.sqlalchemy_url) as s:
        job = service.find(s, principal.tenant_id, completion_id, lock=True)
        job.response = {**job.response, "store": False}
    return {"object": "chat.completion.deleted", "id": completion_id, "deleted": True}


@router.get("/chat/completions/{completion_id}/messages", responses=openai_responses(400, 401, 404))
def list_messages(completion_id: str, session: SessionDep, principal: CurrentPrincipal,
                  limit: Annotated[int, Query(ge=1, le=100)] = 20, order: Literal["asc", "desc"] = "asc",
                  after: str | None = None):
    """The stored chat completion's request messages, first first unless ``order=desc``; ``after``: a message id,
    the page starts past it."""
    job = service.finished(session, principal.tenant_id, completion_id)[0]
    return service.message_page(job, limit, order, after)
