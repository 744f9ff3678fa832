"""What a Responses request names, through the official client against the real app, SQLite and Redis (no worker:
a background response is answered queued): its ``prompt_cache_key`` echoed in the Response, as OpenAI's is, on
create and on retrieval; a refusal's hint names the Responses field (``max_output_tokens``), not chat's."""

from __future__ import annotations

import openai
import pytest

from tests.integration.test_conversation_item_include import oai  # noqa: F401 - oai: a fixture

pytestmark = pytest.mark.integration


def test_the_prompt_cache_key_is_echoed_in_the_response(oai):
    resp = oai.responses.create(model="tiny", input="Hi", background=True, prompt_cache_key="support-bot")
    assert resp.prompt_cache_key == "support-bot"
    assert oai.responses.retrieve(resp.id).prompt_cache_key == "support-bot"
    assert oai.responses.create(model="tiny", input="Hi", background=True).prompt_cache_key is None


def test_the_verbosity_refusal_hints_at_max_output_tokens(oai):
    with pytest.raises(openai.BadRequestError) as refused:
        oai.responses.create(model="tiny", input="Hi", background=True, text={"verbosity": "low"})
    error = refused.value.body
    assert error["param"] == "text.verbosity", error
    assert "max_output_tokens" in error["message"] and "max_completion_tokens" not in error["message"], error
