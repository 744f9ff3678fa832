"""``POST /tokenize`` and ``/detokenize`` on the real app: the tokenizer and chat template a job's prompt uses."""

from __future__ import annotations

import pytest

from tests.conftest import Keys

pytestmark = pytest.mark.integration

H = Keys.header
CHAT = [{"role": "user", "content": "Weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather"}}]


def test_tokenize_counts_what_a_job_would_run_and_detokenize_reverses_it(client, keys):
    r = client.post("/tokenize", json={"prompt": "Hello world"}, headers=H(keys.paid))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) > 1 and body["max_model_len"] == 512 and body["token_strs"] is None
    plain = client.post("/tokenize", json={"prompt": "Hello world", "add_special_tokens": False,
                                           "return_token_strs": True}, headers=H(keys.paid)).json()
    assert len(plain["token_strs"]) == plain["count"] <= body["count"]
    back = client.post("/detokenize", json={"tokens": plain["tokens"]}, headers=H(keys.paid))
    assert back.status_code == 200 and back.json() == {"prompt": "Hello world"}

    chat = client.post("/tokenize", json={"model": "tiny", "messages": CHAT, "tools": TOOLS}, headers=H(keys.paid))
    job = client.post("/v1/jobs", json={"messages": CHAT, "tools": TOOLS, "max_tokens": 4}, headers=H(keys.paid))
    assert chat.status_code == 200 and job.status_code == 201, (chat.text, job.text)
    assert chat.json()["count"] == job.json()["prompt_tokens"]  # the chat template, as the job's prompt


def test_template_options_shape_the_chat_prompt_as_a_job_runs_it(client, keys):
    def tokens(**extra) -> list[int]:
        r = client.post("/tokenize", json={"messages": CHAT, **extra}, headers=H(keys.paid))
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    def text(ids: list[int]) -> str:
        return client.post("/detokenize", json={"tokens": ids}, headers=H(keys.paid)).json()["prompt"]

    full, bare = tokens(), tokens(add_generation_prompt=False)
    assert full[:len(bare)] == bare and len(full) > len(bare)  # the assistant turn's opening, and only that
    prefill = [*CHAT, {"role": "assistant", "content": "It is sunny"}]
    closed = tokens(messages=prefill, add_generation_prompt=False)
    opened = tokens(messages=prefill, add_generation_prompt=False, continue_final_message=True)
    assert text(opened).endswith("It is sunny") and not text(closed).endswith("It is sunny")
    assert closed[:len(opened)] == opened  # the same turn, left open
    job = client.post("/v1/jobs", json={"messages": prefill, "add_generation_prompt": False,
                                        "continue_final_message": True, "max_tokens": 4}, headers=H(keys.paid))
    assert job.status_code == 201 and job.json()["prompt_tokens"] == len(opened), job.text
    kwargs = tokens(chat_template_kwargs={"enable_thinking": False})  # a variable this template does not read
    assert kwargs == full


def test_return_token_strs_null_is_left_unset_as_vllm_takes_it(client, keys):
    """vLLM's field is ``bool | None``: a client that sends null (an SDK writing its unset fields) gets the ids
    alone."""
    for body in ({"prompt": "Hello world"}, {"messages": CHAT}):
        r = client.post("/tokenize", json={**body, "return_token_strs": None}, headers=H(keys.paid))
        assert r.status_code == 200, r.text
        plain = client.post("/tokenize", json=body, headers=H(keys.paid)).json()
        assert r.json() == plain and plain["token_strs"] is None


@pytest.mark.parametrize("path,body,status,param", [
    ("/tokenize", {"messages": CHAT, "continue_final_message": True}, 400, "continue_final_message"),
    ("/tokenize", {"prompt": "x", "add_generation_prompt": False}, 400, "add_generation_prompt"),
    ("/tokenize", {"prompt": "x", "tools": TOOLS}, 400, "tools"),  # a prompt's count holds no tools
    ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"messages": []}}, 400, "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": {"tools": 1}}, 400, "chat_template_kwargs"),
    ("/tokenize", {"prompt": "x", "messages": CHAT}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "model": "gpt-4o"}, 404, "model"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    # vLLM's, refused as on chat (vLLM's too, unless started trusting them): they would change the count unapplied
    ("/tokenize", {"messages": CHAT, "chat_template": "{{ messages }}"}, 400, "chat_template"),
    ("/tokenize", {"messages": CHAT, "mm_processor_kwargs": {"num_crops": 4}}, 400, "mm_processor_kwargs"),
    ("/tokenize", {"prompt": "x", "media_io_kwargs": {"image": {"x": 1}}}, 400, "media_io_kwargs"),
    ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens.0"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
])
def test_bad_input_is_a_400_in_openais_shape(client, keys, path, body, status, param):
    r = client.post(path, json=body, headers=H(keys.paid))
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert client.post(path, json=body).status_code == 401  # a key is needed


BRACKETS = "{% for m in messages %}<<{{ m['role'] }}: {{ m['content'] }}>>{% endfor %}"


def test_a_chat_template_of_the_operators_replaces_the_models(settings, keys, tmp_path):
    """COSERVE_CHAT_TEMPLATE (Jinja text or a file), as vllm serve --chat-template; an app without it renders with
    the model's own again; a template Jinja cannot parse stops the app at start with where it fails."""
    from fastapi.testclient import TestClient

    from app.main import create_app

    def rendered(client) -> str:
        ids = client.post("/tokenize", json={"messages": CHAT}, headers=H(keys.paid)).json()["tokens"]
        return client.post("/detokenize", json={"tokens": ids}, headers=H(keys.paid)).json()["prompt"]

    (tmp_path / "brackets.jinja").write_text(BRACKETS)
    for template in (BRACKETS, str(tmp_path / "brackets.jinja")):
        settings.chat_template = template
        with TestClient(create_app(settings)) as client:
            assert rendered(client).endswith("<<user: Weather in Paris?>>"), rendered(client)
    settings.chat_template = None
    with TestClient(create_app(settings)) as client:
        assert "<<" not in rendered(client) and "Weather in Paris?" in rendered(client)
    settings.chat_template = "{% for m in messages %}{{ m.content }"
    with pytest.raises(ValueError, match="not a Jinja template: line 1"):
        create_app(settings)
    settings.chat_template = str(tmp_path / "mistyped.jinja")
    with pytest.raises(ValueError, match="no file .*mistyped.jinja"):
        create_app(settings)
    settings.chat_template = "{{ messages[0]['content'] }}" * 40  # longer than a file name: a template
    with TestClient(create_app(settings)) as client:
        assert rendered(client).endswith("Weather in Paris?" * 40)
    settings.chat_template = None
    create_app(settings)  # the model's own again, for the tests after this one


def test_responses_input_tokens_count_what_the_response_would_run_on(client, keys):
    """``POST /v1/responses/input_tokens`` (OpenAI's count): a conversation's turns, instructions, input and tools
    as the response's job counts them (a background response, answered before any worker runs it)."""
    items = [{"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": "Hello Ada."}]
    conv = client.post("/v1/conversations", json={"items": items}, headers=H(keys.paid)).json()["id"]
    request = {"conversation": conv, "input": "What is my name?", "instructions": "Be brief",
               "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
               "tool_choice": "none"}
    counted = client.post("/v1/responses/input_tokens", json=request, headers=H(keys.paid))
    assert counted.status_code == 200, counted.text
    assert counted.json()["object"] == "response.input_tokens"
    ran = client.post("/v1/responses", json={**request, "background": True, "max_output_tokens": 4},
                      headers=H(keys.paid))
    assert ran.status_code == 200, ran.text
    job = client.get(f"/v1/jobs/job_{ran.json()['id'].removeprefix('resp_')}", headers=H(keys.paid)).json()
    assert counted.json()["input_tokens"] == job["prompt_tokens"] > 20
    # the conversation's turns alone (with the same instructions: first, they stand in for the bundled template's
    # default system prompt, as vLLM orders them)
    alone = client.post("/v1/responses/input_tokens", json={"conversation": conv, "instructions": "Be brief"},
                        headers=H(keys.paid)).json()
    assert 0 < alone["input_tokens"] < counted.json()["input_tokens"]

    # a conversation over the context: counted whole, or as truncation "auto" would cut it
    long_items = [{"role": "user" if i % 2 == 0 else "assistant", "content": "word " * 60} for i in range(12)]
    long_conv = client.post("/v1/conversations", json={"items": long_items}, headers=H(keys.paid)).json()["id"]
    whole = client.post("/v1/responses/input_tokens", json={"conversation": long_conv, "input": "Sum up"},
                        headers=H(keys.paid)).json()["input_tokens"]
    cut = client.post("/v1/responses/input_tokens", json={"conversation": long_conv, "input": "Sum up",
                                                          "truncation": "auto", "max_output_tokens": 16},
                      headers=H(keys.paid)).json()["input_tokens"]
    assert whole > 512 >= cut + 16 and cut > 0

    for body, status, param in (({}, 400, "input"), ({"input": "x", "model": "nope"}, 404, "model"),
                                ({"previous_response_id": "resp_nope"}, 400, "previous_response_id"),
                                ({"conversation": "conv_nope"}, 400, "conversation"),
                                ({"input": [{"role": "user", "content": 5}]}, 400, None)):
        r = client.post("/v1/responses/input_tokens", json=body, headers=H(keys.paid))
        assert r.status_code == status and (param is None or r.json()["error"]["param"] == param), (body, r.text)
    assert client.post("/v1/responses/input_tokens", json={"conversation": conv},
                       headers=H(keys.other)).status_code == 400  # another tenant's conversation


def test_reasoning_effort_reaches_the_chat_template_as_vllm_passes_it(client, keys, settings):
    """Chat's ``reasoning_effort`` and Responses' ``reasoning.effort``: the template's ``reasoning_effort``, and its
    ``enable_thinking`` (off for "none") unless the request's own chat_template_kwargs set it."""
    from app.db.models import Job
    from app.db.session import session_scope
    from app.openai_schemas import ChatCompletionRequest

    chat = ChatCompletionRequest(messages=CHAT, reasoning_effort="none")
    assert chat.template_fields() == {"chat_template_kwargs": {"reasoning_effort": "none", "enable_thinking": False}}
    own = ChatCompletionRequest(messages=CHAT, reasoning_effort="high", chat_template_kwargs={"enable_thinking": False})
    assert own.template_fields()["chat_template_kwargs"] == {"reasoning_effort": "high", "enable_thinking": False}

    r = client.post("/v1/responses", json={"input": "hi", "reasoning": {"effort": "low"}, "background": True,
                                           "max_output_tokens": 2}, headers=H(keys.paid))
    assert r.status_code == 200 and r.json()["reasoning"] == {"effort": "low", "summary": None}, r.text
    with session_scope(settings.sqlalchemy_url) as s:
        job = s.get(Job, "job_" + r.json()["id"].removeprefix("resp_"))
        assert job.template_options["chat_template_kwargs"] == {"reasoning_effort": "low", "enable_thinking": True}
    for reasoning, param in (({"effort": "extreme"}, "reasoning.effort"), ({"summary": "auto"}, "reasoning")):
        r = client.post("/v1/responses", json={"input": "hi", "reasoning": reasoning}, headers=H(keys.paid))
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
