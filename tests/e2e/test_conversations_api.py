"""OpenAI's Conversations API with the official ``openai`` client against the real app (HTTP), Redis, Celery
worker and DB: a conversation's own items, responses that read it and add their turn, items deleted, metadata,
tenants kept apart."""

from __future__ import annotations

import httpx
import openai
import pytest

from app.db.models import Job
from app.db.session import session_scope
from tests.conftest import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.integration]


@pytest.fixture
def oai(stack) -> openai.OpenAI:
    """The paid key's client of the module's shared stack (its plain worker ``w1``)."""
    return stack.openai()


def _messages(settings, resp_id: str) -> list[dict]:
    with session_scope(settings.sqlalchemy_url) as s:
        return s.get(Job, "job_" + resp_id.removeprefix("resp_")).messages


def _texts(oai, conv_id: str) -> list[tuple[str, str]]:
    items = oai.conversations.items.list(conv_id, order="asc").data
    return [(i.role, i.content[0].text) if i.type == "message" else (i.type, i.id) for i in items]


def test_responses_read_a_conversation_and_add_their_turns(oai, stack):
    conv = oai.conversations.create(items=[{"type": "message", "role": "user", "content": "My name is Ada"}],
                                    metadata={"topic": "names"})
    assert conv.id.startswith("conv_") and conv.metadata == {"topic": "names"}
    assert oai.conversations.retrieve(conv.id).metadata == {"topic": "names"}

    first = oai.responses.create(model="tiny", conversation=conv.id, input="What is my name?", instructions="Be brief",
                                 max_output_tokens=4, extra_body={"ignore_eos": True})
    assert first.conversation.id == conv.id
    # the instructions first, before the conversation's items, as vLLM puts a continued response's (731ae5a)
    assert _messages(stack.settings, first.id) == [{"role": "system", "content": "Be brief"},
                                                   {"role": "user", "content": "My name is Ada"},
                                                   {"role": "user", "content": "What is my name?"}]
    # the turn (input, then output; not the instructions) follows the conversation's own item
    assert _texts(oai, conv.id) == [("user", "My name is Ada"), ("user", "What is my name?"),
                                    ("assistant", first.output_text)]
    assert oai.responses.input_items.list(first.id).data[0].content[0].text == "What is my name?"

    # items added by hand, retrieved one by one; the next response reads them all, as {"id": ...} too
    added = oai.conversations.items.create(conv.id, items=[{"type": "message", "role": "user", "content": "Hi"}])
    assert oai.conversations.items.retrieve(added.data[0].id, conversation_id=conv.id).content[0].text == "Hi"
    second = oai.responses.create(model="tiny", conversation={"id": conv.id}, input="Again", max_output_tokens=2,
                                  extra_body={"ignore_eos": True})
    assert _messages(stack.settings, second.id) == [
        {"role": "user", "content": "My name is Ada"}, {"role": "user", "content": "What is my name?"},
        {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "Hi"},
        {"role": "user", "content": "Again"}]

    # deleting an item of its own and one of a response's turn: neither is listed nor read again
    items = oai.conversations.items.list(conv.id, order="asc").data
    assert len(items) == 6 and oai.conversations.items.list(conv.id, limit=2).has_more
    oai.conversations.items.delete(items[0].id, conversation_id=conv.id)
    assert oai.conversations.items.delete(items[2].id, conversation_id=conv.id).id == conv.id
    assert [t for t, _ in _texts(oai, conv.id)] == ["user", "user", "user", "assistant"]
    third = oai.responses.create(model="tiny", conversation=conv.id, input="Last", max_output_tokens=1)
    assert [m["content"] for m in _messages(stack.settings, third.id)][:2] == ["What is my name?", "Hi"]
    with pytest.raises(openai.NotFoundError):
        oai.conversations.items.retrieve(items[0].id, conversation_id=conv.id)

    assert oai.conversations.update(conv.id, metadata={"topic": "other"}).metadata == {"topic": "other"}
    assert oai.conversations.update(conv.id, metadata=None).metadata == {}  # null clears it (a 400 before)

    # another tenant sees none of it, and cannot continue it
    other = openai.OpenAI(base_url=stack.url + "/v1", api_key=stack.keys.other, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        other.conversations.retrieve(conv.id)
    with pytest.raises(openai.NotFoundError):
        other.conversations.items.list(conv.id)
    with pytest.raises(openai.BadRequestError) as exc:
        other.responses.create(model="tiny", conversation=conv.id, input="x")
    assert exc.value.body["param"] == "conversation"

    deleted = oai.conversations.delete(conv.id)
    assert deleted.deleted is True and deleted.id == conv.id
    with pytest.raises(openai.NotFoundError):
        oai.conversations.retrieve(conv.id)
    assert oai.responses.retrieve(first.id).output_text == first.output_text  # its responses stay


@pytest.mark.parametrize(("path", "body", "param", "says"), [
    ("/v1/conversations", {"items": [{"role": "robot", "content": "x"}]}, "items.0.role", "must be user"),
    ("/v1/conversations", {"items": [{"type": "input_image"}]}, "items.0.type", "not supported"),
    ("/v1/conversations", {"items": [{"role": "user", "content": [{"type": "input_image"}]}]}, "items.0.content.0",
     "only input_text and output_text parts"),
    ("/v1/conversations", {"items": [{"role": "user", "content": "x"}] * 21}, "items", "at most 20"),
    ("/v1/conversations", {"metadata": {"k": 1}}, "metadata.k", "string"),
    ("/v1/responses", {"model": "tiny", "input": "x", "conversation": "conv_nope"}, "conversation", "no conversation"),
    ("/v1/responses", {"model": "tiny", "input": "x", "conversation": {"name": "x"}}, "conversation", "its id"),
    ("/v1/responses", {"model": "tiny", "input": "x", "conversation": "conv_x", "previous_response_id": "resp_y"},
     "conversation", "not both"),
])
def test_bad_conversation_requests_name_the_field(path, body, param, says, stack):
    resp = httpx.post(stack.url + path, headers={"Authorization": f"Bearer {stack.keys.paid}"}, json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and says in error["message"], error


def test_items_that_are_only_reasoning_add_nothing_and_say_so(stack):
    h = {"Authorization": f"Bearer {stack.keys.paid}"}
    conv = httpx.post(stack.url + "/v1/conversations", headers=h, json={"items": [
        {"type": "reasoning", "summary": []}]}).json()
    added = httpx.post(f"{stack.url}/v1/conversations/{conv['id']}/items", headers=h,
                       json={"items": [{"type": "reasoning", "summary": []}]})
    assert added.status_code == 200, added.text  # a 500 before
    assert added.json() == {"object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False}
    assert httpx.get(f"{stack.url}/v1/conversations/{conv['id']}/items", headers=h).json()["data"] == []


def test_one_response_at_a_time_runs_on_a_conversation(live_server, keys, start_worker):
    start_worker("w1", COSERVE_ENGINE_FACTORY="tests.e2e.slow_engine:build", COSERVE_STEP_DELAY_S="0.05")
    oai = openai.OpenAI(base_url=live_server + "/v1", api_key=keys.paid, max_retries=0, timeout=60)
    conv = oai.conversations.create(items=[{"type": "message", "role": "user", "content": "start"}])
    first = oai.responses.create(model="tiny", conversation=conv.id, input="turn A", max_output_tokens=20,
                                 background=True, extra_body={"ignore_eos": True})
    # both read "start" alone and wrote their turns after it, in either order, before
    with pytest.raises(openai.BadRequestError) as exc:
        oai.responses.create(model="tiny", conversation=conv.id, input="turn B", max_output_tokens=2)
    assert exc.value.body["code"] == "conversation_locked" and exc.value.body["param"] == "conversation"
    done = wait_for(lambda: (r := oai.responses.retrieve(first.id)).status not in ("queued", "in_progress") and r,
                    60, "the first response to end", interval=0.2)
    with pytest.raises(openai.BadRequestError):  # refused as its job is submitted: it takes no turn, locks nothing
        oai.responses.create(model="tiny", conversation=conv.id, input="turn B", max_output_tokens=4096)
    second = oai.responses.create(model="tiny", conversation=conv.id, input="turn B", max_output_tokens=2)
    assert _texts(oai, conv.id) == [("user", "start"), ("user", "turn A"), ("assistant", done.output_text),
                                    ("user", "turn B"), ("assistant", second.output_text)]


def test_truncation_auto_keeps_the_whole_input_in_the_conversation(oai, stack):
    conv = oai.conversations.create()
    words = " ".join(f"word{i}" for i in range(100))
    sent = [f"message number {i}: {words}" for i in range(3)]  # over the context of 512
    fitted = oai.responses.create(model="tiny", conversation=conv.id, input=[{"role": "user", "content": t}
                                                                             for t in sent],
                                  max_output_tokens=4, truncation="auto")
    read = [m["content"] for m in _messages(stack.settings, fitted.id)]
    assert 0 < len(read) < len(sent) and read == sent[-len(read):]  # the engine read the newest
    # the response's input and the conversation's turn are what was sent (its first message was lost before)
    assert [i.content[0].text for i in oai.responses.input_items.list(fitted.id, order="asc").data] == sent
    assert _texts(oai, conv.id) == [*(("user", t) for t in sent), ("assistant", fitted.output_text)]


def test_a_response_without_input_answers_the_conversation(oai, stack):
    conv = oai.conversations.create()
    oai.conversations.items.create(conv.id, items=[{"type": "message", "role": "user", "content": "Hi"}])
    answer = oai.responses.create(model="tiny", conversation=conv.id, max_output_tokens=2)  # a 400 before
    assert _messages(stack.settings, answer.id) == [{"role": "user", "content": "Hi"}]
    assert oai.responses.input_items.list(answer.id).data == []
    assert _texts(oai, conv.id) == [("user", "Hi"), ("assistant", answer.output_text)]


def test_an_output_whose_call_was_deleted_names_the_conversation(oai):
    conv = oai.conversations.create(items=[
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "42"}])
    call = oai.conversations.items.list(conv.id, order="asc").data[0]
    oai.conversations.items.delete(call.id, conversation_id=conv.id)
    with pytest.raises(openai.BadRequestError) as exc:
        oai.responses.create(model="tiny", conversation=conv.id, input="x", max_output_tokens=1)
    assert exc.value.body["param"] == "conversation" and "'call_1'" in exc.value.body["message"]


def test_an_items_text_parts_stay_apart(oai, stack):
    parts = [{"type": "input_text", "text": "Weather"}, {"type": "input_text", "text": "today?"}]
    conv = oai.conversations.create(items=[{"type": "message", "role": "user", "content": parts}])
    added = oai.conversations.items.create(conv.id, items=[{"type": "message", "role": "user", "content": parts}])
    assert [p.text for p in added.data[0].content] == ["Weather", "today?"]
    answer = oai.responses.create(model="tiny", conversation=conv.id, max_output_tokens=1,
                                  input=[{"type": "message", "role": "user", "content": parts}])
    # the model reads each item's parts joined (as vLLM joins text parts); the items keep them apart
    assert [m["content"] for m in _messages(stack.settings, answer.id)] == ["Weather\ntoday?"] * 3
    items = oai.conversations.items.list(conv.id, order="asc").data
    assert [[p.text for p in i.content] for i in items[:3]] == [["Weather", "today?"]] * 3
    assert [p.text for p in oai.responses.input_items.list(answer.id).data[0].content] == ["Weather", "today?"]


def test_a_response_not_stored_reads_the_conversation_and_adds_no_turn(oai, stack):
    conv = oai.conversations.create(items=[{"type": "message", "role": "user", "content": "My name is Ada"}])
    unstored = oai.responses.create(model="tiny", conversation=conv.id, input="Name?", max_output_tokens=1,
                                    store=False)
    assert unstored.store is False and [m["content"] for m in _messages(stack.settings, unstored.id)] == [
        "My name is Ada", "Name?"]
    # OpenAI keeps a response with store false nowhere: neither retrievable nor in the conversation
    assert _texts(oai, conv.id) == [("user", "My name is Ada")]
    stored = oai.responses.create(model="tiny", conversation=conv.id, input="Again", max_output_tokens=1)
    assert [m["content"] for m in _messages(stack.settings, stored.id)] == ["My name is Ada", "Again"]


def test_the_sdk_pages_through_a_conversations_items_and_a_responses_input(oai):
    sent = ["one", "two", "three"]
    conv = oai.conversations.create(items=[{"role": "user", "content": text} for text in sent])
    texts = [i.content[0].text for i in oai.conversations.items.list(conv.id, limit=1, order="asc")]
    assert texts == sent  # iterating follows the pages by their last id (after=...)
    newest = oai.conversations.items.list(conv.id, limit=1)
    assert newest.has_more and newest.first_id == newest.last_id == newest.data[0].id
    assert [i.content[0].text for i in oai.conversations.items.list(conv.id, limit=1)] == sent[::-1]
    answer = oai.responses.create(model="tiny", max_output_tokens=1,
                                  input=[{"role": "user", "content": text} for text in sent])
    assert [i.content[0].text for i in oai.responses.input_items.list(answer.id, limit=1, order="asc")] == sent
    assert [i.content[0].text for i in oai.responses.input_items.list(answer.id, limit=2)] == sent[::-1]


def test_assistant_items_are_output_messages_as_the_sdk_types_them(oai, stack):
    # an assistant message given as an item (a conversation's, a response's input) reads back as an output message:
    # its output_text parts have the annotations the SDK's ResponseOutputText requires (they had none)
    from openai.types.conversations import ConversationItemList
    from openai.types.responses.response_item_list import ResponseItemList

    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Again"}]}]
    conv = oai.conversations.create(items=turns)
    answer = oai.responses.create(model="tiny", max_output_tokens=1, input=[*turns, {"role": "user", "content": "?"}])
    h = {"Authorization": f"Bearer {stack.keys.paid}"}
    for listing, model in ((f"/v1/conversations/{conv.id}/items", ConversationItemList),
                           (f"/v1/responses/{answer.id}/input_items", ResponseItemList)):
        page = httpx.get(stack.url + listing, headers=h, params={"order": "asc"}).json()
        parts = [p for i in page["data"] if i["role"] == "assistant" for p in i["content"]]
        assert [p.get("annotations") for p in parts] == [[], []]
        assert model.model_validate(page, strict=True).data[1].content[0].text == "Hello"


def test_a_turn_cut_by_max_output_tokens_is_incomplete_in_the_conversation(oai):
    conv = oai.conversations.create()
    cut = oai.responses.create(model="tiny", conversation=conv.id, input="Talk", max_output_tokens=2,
                               extra_body={"ignore_eos": True})
    assert cut.status == "incomplete" and cut.output[0].status == "incomplete"
    # the conversation's item of that output is the response's (it said completed)
    listed = oai.conversations.items.list(conv.id, order="asc").data[-1]
    assert (listed.id, listed.status) == (cut.output[0].id, "incomplete")
    assert oai.conversations.items.retrieve(cut.output[0].id, conversation_id=conv.id).status == "incomplete"


def test_a_deleted_turn_stays_in_its_conversation_and_cannot_be_continued_from(oai, stack):
    # OpenAI keeps a conversation's items apart from its responses: deleting a response leaves its turn there, and
    # continuing from the deleted response is refused as OpenAI refuses it (clients, Codex's among them, read the
    # code previous_response_not_found to send the whole conversation instead; it was response_not_found)
    conv = oai.conversations.create(items=[{"type": "message", "role": "user", "content": "start"}])
    turn = oai.responses.create(model="tiny", conversation=conv.id, input="turn A", max_output_tokens=2)
    assert oai.responses.delete(turn.id) is None
    assert _texts(oai, conv.id) == [("user", "start"), ("user", "turn A"), ("assistant", turn.output_text)]
    for continued in (lambda: oai.responses.create(model="tiny", input="x", previous_response_id=turn.id),
                      lambda: oai.responses.input_tokens.count(model="tiny", input="x", previous_response_id=turn.id)):
        with pytest.raises(openai.BadRequestError) as exc:
            continued()
        error = exc.value.body
        assert (error["code"], error["param"]) == ("previous_response_not_found", "previous_response_id"), error
        assert turn.id in error["message"], error
    later = oai.responses.create(model="tiny", conversation=conv.id, input="turn B", max_output_tokens=1)
    assert [m["content"] for m in _messages(stack.settings, later.id)] == [
        "start", "turn A", turn.output_text, "turn B"]
