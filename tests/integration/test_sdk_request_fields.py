"""Request fields the current openai SDK's create params list (chat completions, Responses), over HTTP on the real
app (migrated SQL, real Redis, no worker: a background response is answered queued): each is taken where coserve
can honour it or it changes nothing, and refused by name where answering without it would mislead."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from app.db.models import Job
from app.db.session import session_scope
from tests.conftest import Keys

pytestmark = pytest.mark.integration

H = Keys.header
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def background(settings, **fields) -> dict:
    return {"model": settings.model_name, "input": "hi", "background": True, "max_output_tokens": 2, **fields}


def test_service_tier_fast_is_openais_other_name_for_priority(client, keys, settings):
    # OpenAI: "service_tier=fast or service_tier=priority ... the response will show service_tier=priority"
    r = client.post("/v1/responses", json=background(settings, service_tier="fast"), headers=H(keys.paid))
    assert r.status_code == 200, r.text
    assert r.json()["service_tier"] == "priority"
    with session_scope(settings.sqlalchemy_url) as s:
        assert s.scalars(select(Job.tier)).all() == [settings.tiers[-1]]


@pytest.mark.parametrize("path, body", [
    ("/v1/responses", {"input": "hi", "background": True}), ("/v1/chat/completions", CHAT)])
def test_moderation_is_refused_by_name(client, keys, settings, path, body):
    # answered without the moderation it asks for, a blocked input or output would pass for having been screened
    moderation = {"model": "omni-moderation-latest", "policy": {"input": {"mode": "block"}}}
    r = client.post(path, json={"model": settings.model_name, **body, "moderation": moderation},
                    headers=H(keys.paid))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "moderation" and error["code"] == "unsupported_value", error
    assert "leave moderation unset" in error["message"] and "moderation" in error["message"]


def test_fields_that_change_nothing_here_are_taken(client, keys, settings):
    # stream obfuscation pads stream events (coserve adds none: false is honoured, true asks for padding only);
    # prompt caching options tune OpenAI's cache, coserve's prefix cache keeps what fits; moderation null is unset
    for fields in ({"stream_options": {"include_obfuscation": False}},
                   {"stream_options": {"include_obfuscation": True}}, {"moderation": None},
                   {"prompt_cache_retention": "24h"}, {"prompt_cache_options": {"mode": "explicit", "ttl": "30m"}}):
        r = client.post("/v1/responses", json=background(settings, **fields), headers=H(keys.paid))
        assert r.status_code == 200, (fields, r.text)
