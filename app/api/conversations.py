"""OpenAI's Conversations API: ``/v1/conversations`` and its items. A response given ``conversation`` reads the
conversation's items first and adds its own turn (``app.services.conversations``)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query
from pydantic import BaseModel, ConfigDict, Field

from app.api.deps import CurrentPrincipal, SessionDep, SettingsDep, WithLogprobs
from app.api.errors import openai_responses
from app.db.models import Conversation
from app.db.session import read_then_write
from app.openai_schemas import OpenAIRoute
from app.responses_schemas import item_page
from app.services import conversations as service
from app.wire import Metadata

router = APIRouter(prefix="/v1", tags=["openai"], route_class=OpenAIRoute)


class ConversationCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    items: list[dict[str, Any]] | None = Field(None, max_length=service.MAX_ITEMS)
    metadata: Metadata | None = None


class ConversationUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    metadata: Metadata | None  # null (as the official client may send): none


class ItemsCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    items: list[dict[str, Any]] = Field(min_length=1, max_length=service.MAX_ITEMS)


def _find(session, principal, conversation_id: str, lock: bool = False) -> Conversation:
    return service.find(session, principal.tenant_id, conversation_id, lock=lock)


# writes read the conversation first, its row locked, each in a session that holds the write lock throughout
# (read_then_write): one that the conversation's deletion overtook answers 404

@router.post("/conversations", responses=openai_responses(400, 401))
def create_conversation(body: ConversationCreate, principal: CurrentPrincipal, settings: SettingsDep):
    """A conversation, with its first items if given."""
    items = service.new_items(body.items) if body.items else []
    with read_then_write(settings.sqlalchemy_url) as s:
        conv = Conversation(tenant_id=principal.tenant_id, meta=body.metadata or {})
        s.add(conv)
        s.flush()
        service.add_items(s, conv, items)
        return service.conversation_body(conv)


@router.get("/conversations/{conversation_id}", responses=openai_responses(401, 404))
def get_conversation(conversation_id: str, session: SessionDep, principal: CurrentPrincipal):
    return service.conversation_body(_find(session, principal, conversation_id))


@router.post("/conversations/{conversation_id}", responses=openai_responses(400, 401, 404))
def update_conversation(conversation_id: str, body: ConversationUpdate, principal: CurrentPrincipal,
                        settings: SettingsDep):
    """Replaces the conversation's metadata."""
    with read_then_write(settings.sqlalchemy_url) as s:
        conv = _find(s, principal, conversation_id, lock=True)
        conv.meta = body.metadata or {}
        return service.conversation_body(conv)


@router.delete("/conversations/{conversation_id}", responses=openai_responses(401, 404))
def delete_conversation(conversation_id: str, principal: CurrentPrincipal, settings: SettingsDep):
    """Deletes the conversation and its items (the responses given it stay)."""
    with read_then_write(settings.sqlalchemy_url) as s:
        service.delete_conversation(s, _find(s, principal, conversation_id, lock=True))
    return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}


@router.post("/conversations/{conversation_id}/items", responses=openai_responses(400, 401, 404))
def create_items(conversation_id: str, body: ItemsCreate, principal: CurrentPrincipal, settings: SettingsDep,
                 _logprobs: WithLogprobs):
    """Adds items at the end of the conversation; answers them as a list (reasoning items are not kept: a model's
    earlier thinking is not given back to it, so a list of only those adds nothing; given items have no
    logprobs to include)."""
    items = service.new_items(body.items)
    with read_then_write(settings.sqlalchemy_url) as s:
        service.add_items(s, _find(s, principal, conversation_id, lock=True), items)
    return {"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None, "has_more": False}


@router.get("/conversations/{conversation_id}/items", responses=openai_responses(400, 401, 404))
def list_items(conversation_id: str, session: SessionDep, principal: CurrentPrincipal, logprobs: WithLogprobs,
               limit: Annotated[int, Query(ge=1, le=100)] = 20, order: Literal["asc", "desc"] = "desc",
               after: str | None = None):
    """The conversation's items, newest first unless ``order=asc``; ``after``: an item id, the page starts past it."""
    conv = _find(session, principal, conversation_id)
    items = [item for _, item in service.items_of(session, conv, logprobs)]
    return item_page(items, limit, order, after, f"no item {after!r} in conversation {conversation_id!r}")


@router.get("/conversations/{conversation_id}/items/{item_id}", responses=openai_responses(400, 401, 404))
def get_item(conversation_id: str, item_id: str, session: SessionDep, principal: CurrentPrincipal,
             logprobs: WithLogprobs):
    return service.find_item(session, _find(session, principal, conversation_id), item_id, logprobs)[1]


@router.delete("/conversations/{conversation_id}/items/{item_id}", responses=openai_responses(401, 404))
def delete_item(conversation_id: str, item_id: str, principal: CurrentPrincipal, settings: SettingsDep):
    """Takes the item out of the conversation; answers the conversation."""
    with read_then_write(settings.sqlalchemy_url) as s:
        conv = _find(s, principal, conversation_id, lock=True)
        service.delete_item(s, conv, item_id)
        return service.conversation_body(conv)
