"""A batch's end as a webhook event (``batch.completed`` ...), OpenAI's: only an OpenAI batch raises one.

A message batch (Anthropic's, ``/v1/messages/batches``) raises none: Anthropic has no webhooks for message batches,
so no client of that API subscribes to them, and OpenAI's event would name a batch that ``/v1/batches`` does not
show (a 404 to the handler that fetches it, as the official client's examples do).
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from app.anthropic_schemas import ENDPOINT as MESSAGES
from app.services.webhooks import emit


def batch_ended(session: Session, tenant_id: str, endpoint: str, status: str, batch_id: str) -> int:
    """Queues ``batch.<status>`` in the caller's transaction (the caller commits); returns how many deliveries."""
    if endpoint == MESSAGES:
        return 0
    return emit(session, tenant_id, f"batch.{status}", batch_id)
