"""A rate-limit refusal written in the terms of the route that refused it (pure logic)."""

from __future__ import annotations

import pytest

from app.api.openai_compat import openai_refusals
from app.openai_schemas import OpenAIError
from app.services.rate_limits import Decision, Limits, RateLimited

TOO_LARGE = Decision(False, Limits(tokens_per_minute=5), tokens_left=5.0, tokens_asked=9)


@pytest.mark.parametrize("endpoint,fields", [
    ("/v1/chat/completions", "lower max_completion_tokens (or max_tokens) or n,"),
    ("/v1/completions", "lower max_tokens or n,"),
    ("/v1/responses", "lower max_output_tokens,"),
    ("/v1/messages", "lower max_tokens,")])
def test_a_request_too_large_names_only_its_routes_own_fields(endpoint, fields):
    # every route said "lower max_tokens or n": Messages and Responses have no n, Responses no max_tokens
    with pytest.raises(OpenAIError) as exc, openai_refusals(endpoint):
        raise RateLimited(TOO_LARGE)
    assert exc.value.status_code == 429 and fields in exc.value.message, exc.value.message
    assert "lower max_tokens," in str(RateLimited(TOO_LARGE))  # the native job's fields (it has no n either)
