"""Issue 19's bad inputs over HTTP (real migrated SQLite, real Redis, no worker): each is a 4xx
that says what to fix, nothing is committed, and every answer matches the OpenAPI document."""

from __future__ import annotations

import json
import re
import time
from datetime import datetime, timezone
from urllib.parse import unquote

import anthropic
import openai
import pytest
from starlette.testclient import WebSocketDenialResponse
from sqlalchemy import func, select

from app.db.models import Batch, Job
from app.db.session import session_scope
from app.services.model_info import get_tokenizer
from tests.conftest import Keys, wait_for

pytestmark = pytest.mark.integration

H = Keys.header
SURROGATE = "lone surrogate"
NUL = "NUL character"


def jobs_in_sql(settings) -> int:
    with session_scope(settings.sqlalchemy_url) as s:
        return s.scalar(select(func.count()).select_from(Job))


def post_raw(client, key, path: str, raw: str):
    """``raw`` as the body: json.dumps cannot write NaN's or a lone surrogate's escape as a client might."""
    return client.post(path, content=raw.encode(), headers={**H(key), "Content-Type": "application/json"})


CHAT = '"messages": [{"role": "user", "content": "hi"}]'


@pytest.mark.parametrize("path, raw, status, field, fragment", [
    # non-finite numbers: Python's JSON decoder accepts them; the echo of the input used to fail to encode
    ("/v1/jobs", '{"prompt": "hi", "temperature": NaN}', 422, "temperature", "finite number"),
    ("/v1/jobs", '{"prompt": "hi", "ttft_ms": Infinity}', 422, "ttft_ms", "finite number"),
    ("/v1/jobs", '{"prompt": "hi", "kind": "batch", "deadline_window_s": NaN}', 422, "deadline_window_s",
     "finite number"),
    ("/v1/chat/completions", '{%s, "temperature": NaN}' % CHAT, 400, "temperature", "finite number"),
    ("/v1/completions", '{"prompt": "hi", "ttft_ms": -Infinity}', 400, "ttft_ms", "finite number"),
    # chat `deadline: NaN` blames the field sent, not deadline_window_s
    ("/v1/chat/completions", '{%s, "deadline": NaN}' % CHAT, 400, "deadline", "finite number"),
    ("/v1/chat/completions", '{%s, "deadline": 1e12}' % CHAT, 400, "deadline", "30 days"),
    ("/v1/summarize", '{"documents": [{"id": "a", "text": "x"}], "deadline": NaN}', 422, "deadline",
     "finite number"),
    # lone surrogates: cannot be tokenized, stored as UTF-8 or written back
    ("/v1/jobs", '{"prompt": "\\ud800"}', 422, "prompt", SURROGATE),
    ("/v1/jobs", '{"messages": [{"role": "user", "content": "a\\ud800"}]}', 422, "messages.0.content", SURROGATE),
    ("/v1/jobs", '{"prompt": "hi", "app_id": "\\ud800"}', 422, "app_id", SURROGATE),
    ("/v1/jobs", '{"prompt": "hi", "stop": ["\\ud83d"]}', 422, "stop.0", SURROGATE),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\udfff"}]}', 400, "messages.0.content",
     SURROGATE),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
     400, "messages.0.content.0.text", SURROGATE),
    ("/v1/chat/completions", '{%s, "stop": ["\\ud83d"], "max_tokens": 2}' % CHAT, 400, "stop.0", SURROGATE),
    ("/v1/chat/completions", '{%s, "app_id": "\\ud800"}' % CHAT, 400, "app_id", SURROGATE),
    ("/v1/completions", '{"prompt": "\\ud800", "max_tokens": 2}', 400, "prompt", SURROGATE),
    ("/v1/completions", '{"prompt": "hi", "user": "x", "tools": [{"\\ud800": 1}]}', 400, "tools.0.\\ud800", SURROGATE),
    ("/v1/summarize", '{"documents": [{"id": "\\ud800", "text": "x"}]}', 422, "documents.0.id", SURROGATE),
    # NUL: PostgreSQL's text refuses it (a 500 there before), so it is refused on every database
    ("/v1/jobs", '{"prompt": "a\\u0000b"}', 422, "prompt", NUL),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x\\u0000"}]}', 400, "messages.0.content",
     NUL),
    ("/v1/completions", '{"prompt": "hi", "user": "\\u0000"}', 400, "user", NUL),
    ("/v1/batches", '{"input_file_id": "file-x\\u0000", "endpoint": "/v1/completions"}', 400, "input_file_id", NUL),
    # sampling fields that cannot hold together
    ("/v1/completions", '{"prompt": "hi", "min_tokens": 100000}', 400, "min_tokens", "more than max_tokens"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 3, "min_tokens": 5}', 400, "min_tokens",
     "more than max_tokens"),
    ("/v1/chat/completions", '{%s, "max_tokens": 3, "min_tokens": 5}' % CHAT, 400, "min_tokens",
     "more than max_tokens"),
    ("/v1/jobs", '{"prompt": "hi", "max_tokens": 4, "min_tokens": 5}', 422, None, "more than max_tokens"),
    ("/v1/chat/completions", '{%s, "tier": "paid", "service_tier": "flex"}' % CHAT, 400, "service_tier", "disagree"),
    # vLLM's chat (and OpenAI) refuse an empty tools list
    ("/v1/chat/completions", '{%s, "tools": []}' % CHAT, 400, "tools", "leave it out"),
    # a job's message parts are its content's: a template reads one or the other (its content format)
    ("/v1/jobs", '{"messages": [{"role": "user", "content": "a", "parts": ["b"]}]}', 422, "messages.0.parts",
     "the content's text parts"),
    # a logit_bias key that is no token id blames logit_bias, naming the key; a bias out of range names its token
    # (past the vocabulary: the vLLM table below)
    ("/v1/chat/completions", '{%s, "logit_bias": {"-1": 5}}' % CHAT, 400, "logit_bias", "key -1 is not a token id"),
    ("/v1/completions", '{"prompt": "hi", "logit_bias": {"x": 5}}', 400, "logit_bias", "key x is not a token id"),
    ("/v1/jobs", '{"prompt": "hi", "logit_bias": {"1.5": 5}}', 422, "logit_bias", "key 1.5 is not a token id"),
    ("/v1/chat/completions", '{%s, "logit_bias": {"3": 500}}' % CHAT, 400, "logit_bias.3", "less than or equal to 100"),
    # out of range
    ("/v1/summarize", '{"documents": [{"id": "a", "text": "x"}], "deadline": 1e12}', 422, "deadline", "30 days"),
    ("/v1/summarize", '{"documents": [{"id": "a", "text": "x"}], "model": "gpt-9"}', 422, "model", "unknown model"),
    ("/v1/jobs", '{"prompt": "hi", "kind": "batch", "deadline_at": "9999-12-31T23:59:59-12:00"}', 422, None,
     "out of range"),
])
def test_bad_input_is_a_4xx_naming_the_field_and_commits_nothing(client, keys, settings, path, raw, status, field,
                                                                 fragment):
    r = post_raw(client, keys.paid, path, raw)
    assert r.status_code == status, r.text
    body = r.json()
    if status == 400:  # OpenAI's shape
        assert body["error"]["param"] == field and fragment in body["error"]["message"], body
    else:  # FastAPI's list of errors, as the OpenAPI document says
        assert isinstance(body["detail"], list), body
        locs = [".".join(str(p) for p in e["loc"][1:]) for e in body["detail"]]
        assert (field in locs if field else True) and fragment in r.text, body
    assert jobs_in_sql(settings) == 0
    assert client.get("/v1/jobs", headers=H(keys.paid)).status_code == 200  # and the list still renders


DOC = '"documents": [{"id": "a", "text": "x"}]'


@pytest.mark.parametrize("path, raw, field", [
    ("/v1/summarize", '{%s, "deadline": true}' % DOC, "deadline"),
    ("/v1/summarize", '{%s, "max_summary_tokens": true}' % DOC, "max_summary_tokens"),
    ("/v1/summarize", '{%s, "chunk_tokens": true}' % DOC, "chunk_tokens"),
    ("/v1/summarize", '{%s, "overlap_tokens": false}' % DOC, "overlap_tokens"),
    ("/v1/jobs", '{"prompt": "hi", "max_tokens": true}', "max_tokens"),
    ("/v1/jobs", '{"prompt": "hi", "temperature": true}', "temperature"),
    ("/v1/jobs", '{"prompt": "hi", "ttft_ms": true}', "ttft_ms"),
    ("/v1/jobs", '{"prompt": "hi", "kind": "batch", "deadline_window_s": true}', "deadline_window_s"),
    ("/v1/jobs", '{"prompt": "hi", "seed": false}', "seed"),
    ("/v1/jobs", '{"prompt": "hi", "stop_token_ids": [true]}', "stop_token_ids"),
    ("/v1/jobs", '{"prompt_token_ids": [5, true]}', "prompt_token_ids"),
    ("/v1/jobs", '{"prompt": "hi", "logit_bias": {"5": true}}', "logit_bias"),
])
def test_a_boolean_for_a_number_is_a_422_naming_the_field(client, keys, settings, path, raw, field):
    """Pydantic's lax mode read JSON's true as 1 and false as 0: ``"deadline": true`` was a run due in a second,
    ``"max_tokens": true`` a one-token job (OpenAI refuses a boolean there; vLLM's protocol, and so the OpenAI routes,
    read it as 1)."""
    test_bad_input_is_a_4xx_naming_the_field_and_commits_nothing(client, keys, settings, path, raw, 422, field,
                                                                 "not true or false")


# more words than vLLM's VLLM_MAX_NUM_BAD_WORDS (128) token sequences: each with and without a leading space
MANY_BAD_WORDS = json.dumps([f"word{i}" for i in range(70)])
# fewer sequences, but more tokens in all than vLLM's VLLM_MAX_BAD_WORDS_TOTAL_TOKENS (1024)
LONG_BAD_WORDS = json.dumps([" ".join(f"w{i}x{j}" for j in range(200)) for i in range(3)])


@pytest.mark.parametrize("path, raw, status, field, fragment", [
    ("/v1/completions", '{"prompt": "hi", "bad_words": [""]}', 400, "bad_words", "empty or only whitespace"),
    ("/v1/chat/completions", '{%s, "bad_words": ["red", "  "]}' % CHAT, 400, "bad_words", "empty or only whitespace"),
    ("/v1/completions", '{"prompt": "hi", "bad_words": %s}' % MANY_BAD_WORDS, 400, "bad_words", "more than the 128"),
    ("/v1/jobs", '{"prompt": "hi", "bad_words": [" "]}', 422, "bad_words", "empty or only whitespace"),
    ("/v1/jobs", '{"prompt": "hi", "bad_words": %s}' % MANY_BAD_WORDS, 422, "bad_words", "more than the 128"),
    # the engine's worker refuses them when it adds the request (vLLM's GPU model runner: 'Too many total bad word
    # tokens'), past the API's checks: the job failed, or the engine went down with it
    ("/v1/completions", '{"prompt": "hi", "bad_words": %s}' % LONG_BAD_WORDS, 400, "bad_words", "more than the 1024"),
    ("/v1/jobs", '{"prompt": "hi", "bad_words": %s}' % LONG_BAD_WORDS, 422, "bad_words", "more than the 1024"),
    ("/v1/jobs", '{"prompt": "hi", "stop": ["end", ""]}', 422, "stop", "must not be empty"),
    ("/v1/jobs", '{"prompt": "hi", "temperature": 3}', 422, "temperature", "less than or equal to 2"),
    # past the vocabulary: the id named, as the bound (the engine that applies logit_bias indexes its logits)
    ("/v1/chat/completions", '{%s, "logit_bias": {"99999999": 5}}' % CHAT, 400, "logit_bias", "got [99999999]"),
])
def test_what_vllms_sampling_params_refuse_is_refused_at_submit_naming_the_field(client, keys, settings, path, raw,
                                                                                  status, field, fragment):
    """vLLM's SamplingParams refuses these (its server a 400 naming the field, before it takes the request); coserve
    took them and its worker failed the job: 'the engine refused the request: ...', param null."""
    settings.backend = "vllm"  # whose engine applies bad_words
    test_bad_input_is_a_4xx_naming_the_field_and_commits_nothing(client, keys, settings, path, raw, status, field,
                                                                 fragment)


def test_chat_content_of_the_wrong_type_blames_content_not_role(client, keys):
    r = post_raw(client, keys.paid, "/v1/chat/completions", '{"messages": [{"role": "user", "content": 5}]}')
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content", r.text
    assert "valid string" in r.json()["error"]["message"]
    r = post_raw(client, keys.paid, "/v1/chat/completions", '{"messages": [{"role": "robot", "content": "x"}]}')
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.role", r.text


def test_malformed_json_names_no_param(client, keys):
    for path in ("/v1/batches", "/v1/chat/completions"):
        r = post_raw(client, keys.paid, path, '{"input_file_id": "file_x",')
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] is None and "not valid JSON" in err["message"], r.text
    r = post_raw(client, keys.paid, "/v1/jobs", '{"prompt": ')
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body"] and "not valid JSON" in r.text


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 600}, "messages"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 600}, "prompt"),
])
def test_over_the_context_is_400_context_length_exceeded(client, keys, settings, path, body, param):
    r = client.post(path, json=body, headers=H(keys.paid))  # the tiny model's context is 512 tokens
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded" and r.json()["error"]["param"] == param
    assert jobs_in_sql(settings) == 0


@pytest.mark.parametrize("content, max_tokens, says", [
    ("hi " * 600, 1, r"prompt is too long: \d+ tokens > 512 maximum"),
    ("hi", 600, r"input length and `max_tokens` exceed context limit: \d+ \+ 600 > 512, decrease input length or "
                r"`max_tokens` and try again"),
], ids=["prompt", "prompt_and_max_tokens"])
def test_over_the_context_messages_answer_in_anthropics_words(client, keys, settings, content, max_tokens, says):
    """Anthropic's API refuses an over-long request with a 400 invalid_request_error in its own words, which its
    clients match (not OpenAI's "maximum context length")."""
    r = client.post("/v1/messages", headers={"x-api-key": keys.paid, "anthropic-version": "2023-06-01"},
                    json={"model": "tiny", "max_tokens": max_tokens,
                          "messages": [{"role": "user", "content": content}]})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and re.fullmatch(says, error["message"]), error
    assert jobs_in_sql(settings) == 0


@pytest.mark.parametrize("model", [{}, {"model": None}], ids=["missing", "null"])
def test_a_message_without_a_model_is_anthropics_400_naming_it(client, keys, settings, model):
    """vLLM's AnthropicMessagesRequest (and Anthropic) take no Messages request without its model, where OpenAI's
    chat runs one with the default model (vLLM's ChatCompletionRequest)."""
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = client.post(path, headers={"x-api-key": keys.paid, "anthropic-version": "2023-06-01"},
                        json={"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], **model})
        assert r.status_code == 400 and r.json()["type"] == "error", (path, r.text)
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"].startswith("model: "), (path, error)
        assert r.json()["request_id"] == r.headers["request-id"]
    assert jobs_in_sql(settings) == 0


def test_without_max_tokens_a_prompt_that_fits_gets_what_the_context_leaves(client, keys, settings):
    """vLLM's and OpenAI's unset max_tokens: the default (16 in tests) where it fits, else the rest of the context."""
    def submit(n: int, **extra):
        return client.post("/v1/jobs", json={"prompt_token_ids": [5] * n, **extra}, headers=H(keys.paid))

    settings.backend = "vllm"  # which applies min_tokens
    for n, left in ((400, 16), (500, 12), (511, 1)):  # the tiny model's context is 512 tokens
        r = submit(n)
        assert r.status_code == 201, r.text
        with session_scope(settings.sqlalchemy_url) as s:
            assert s.get(Job, r.json()["id"]).sampling["max_tokens"] == left, n
    for n, extra in ((512, {}), (500, {"max_tokens": 13}), (500, {"min_tokens": 13})):
        r = submit(n, **extra)
        assert r.status_code == 422 and "maximum context length is 512 tokens" in r.text, (n, extra)
    assert jobs_in_sql(settings) == 3


def test_a_responses_request_over_the_context_is_told_to_lower_max_output_tokens(client, keys, settings):
    """OpenAI's over-the-context words name the field to lower: chat's max_tokens, which a Responses request does not
    have (its own is max_output_tokens)."""
    r = client.post("/v1/responses", json={"model": "tiny", "input": "hi", "max_output_tokens": 600},
                    headers=H(keys.paid))
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and "maximum context length is 512 tokens" in message, r.text
    assert message.endswith("shorten the prompt or lower max_output_tokens"), message
    r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                                  "max_tokens": 600}, headers=H(keys.paid))
    assert r.json()["error"]["message"].endswith("shorten the prompt or lower max_tokens"), r.text


def test_a_shorter_engine_context_holds_jobs_to_it(client, keys, settings):
    """vLLM set to less context than the model's (COSERVE_VLLM_MAX_MODEL_LEN, or max_model_len among its engine
    arguments: `vllm serve --max-model-len`): the API refuses what the engine would refuse, and says what it serves."""
    def submit(max_tokens: int):
        return client.post("/v1/jobs", json={"messages": [{"role": "user", "content": "hi"}],
                                             "max_tokens": max_tokens}, headers=H(keys.paid))

    def served() -> tuple[int, int]:
        model = client.get("/v1/models/tiny", headers=H(keys.paid)).json()
        counted = client.post("/tokenize", json={"prompt": "hi"}, headers=H(keys.paid)).json()
        return model["max_model_len"], counted["max_model_len"]

    settings.backend = "vllm"
    settings.vllm_max_model_len = 256
    assert served() == (256, 256) and submit(200).status_code == 201
    settings.vllm_engine_args = {"max_model_len": 128}  # the smaller of the two holds
    r = submit(200)
    assert r.status_code == 422 and "maximum context length is 128 tokens" in r.json()["detail"][0]["msg"], r.text
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200},
                    headers=H(keys.paid))
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert served() == (128, 128)
    settings.backend = "torch"  # the own engine serves the model's whole context (512 tokens)
    assert served() == (512, 512) and submit(200).status_code == 201
    assert jobs_in_sql(settings) == 2


def test_openai_client_raises_bad_request_for_the_context(client, keys):
    oai = openai.OpenAI(base_url="http://testserver/v1", api_key=keys.paid, http_client=client, max_retries=0)
    with pytest.raises(openai.BadRequestError) as exc:
        oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=600)
    assert exc.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):  # an unknown model is still a 404
        oai.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])


def test_huge_offset_is_422(client, keys):
    r = client.get("/v1/jobs", params={"offset": "99999999999999999999"}, headers=H(keys.paid))
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["query", "offset"], r.text
    r = client.get("/v1/jobs", params={"created_after": "0001-01-01T00:00:00+05:00"}, headers=H(keys.paid))
    assert r.status_code == 422 and "out of range" in r.text


def upload(client, key, name: str, content: bytes = b'{"x": 1}\n'):
    r = client.post("/v1/files", files={"file": (name, content)}, data={"purpose": "batch"}, headers=H(key))
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("name", ["résumé_✓.jsonl", 'a"b.jsonl', "semi;x=y\\\\.jsonl"])
def test_downloads_name_the_file_in_rfc_5987(client, keys, settings, name):
    from sqlalchemy import update

    from app.db.models import File

    f = upload(client, keys.paid, "in.jsonl")
    with session_scope(settings.sqlalchemy_url) as s:  # as stored from any client (httpx would send %22 for ")
        s.execute(update(File).where(File.id == f["id"]).values(filename=name))
    r = client.get(f"/v1/files/{f['id']}/content", headers=H(keys.paid))
    assert r.status_code == 200 and r.content == b'{"x": 1}\n'
    disposition = r.headers["content-disposition"]
    assert disposition.isascii() and disposition.startswith("attachment; filename=\"")
    fallback = disposition.split('filename="', 1)[1].split('"', 1)[0]
    assert '"' not in fallback and "\\" not in fallback  # a raw quote would end the quoted string early
    exact = disposition.split("filename*=UTF-8''", 1)[1]
    stored = client.get(f"/v1/files/{f['id']}", headers=H(keys.paid)).json()["filename"]
    assert unquote(exact) == stored == name and ";" not in exact and " " not in exact


def test_head_of_a_files_content_answers_as_get_without_the_body(client, keys):
    """``HEAD /v1/files/{id}/content`` (a download tool's look before it fetches) answered 405."""
    f = upload(client, keys.paid, "in.jsonl", b'{"x": 1}\n{"x": 2}\n')
    got = client.get(f"/v1/files/{f['id']}/content", headers=H(keys.paid))
    head = client.head(f"/v1/files/{f['id']}/content", headers=H(keys.paid))
    assert head.status_code == 200 and head.content == b"", head.headers
    for name in ("content-length", "content-type", "content-disposition"):
        assert head.headers[name] == got.headers[name], name
    assert head.headers["content-length"] == str(f["bytes"])
    assert client.head("/v1/files/file_nope/content", headers=H(keys.paid)).status_code == 404
    assert client.head(f"/v1/files/{f['id']}/content", headers=H(keys.other)).status_code == 404


def test_two_deletes_of_one_file_at_once_answer_200_then_404(client, keys, settings, monkeypatch):
    """Both DELETEs read the file before either wrote (each in its own session): the second answered 200 as well,
    its UPDATE not guarded on the file being there still. It is now the 404 a client gets after a delete."""
    from app.api import files
    from app.db.models import File

    f = upload(client, keys.paid, "in.jsonl")
    url, read, answers = f"/v1/files/{f['id']}", files._own, []

    def overtaken(session, principal, file_id):
        row = read(session, principal, file_id)
        if not answers:  # this DELETE has read the file: the other runs whole before it writes
            answers.append(None)
            answers.append(client.delete(url, headers=H(keys.paid)).status_code)
        return row

    monkeypatch.setattr(files, "_own", overtaken)
    late = client.delete(url, headers=H(keys.paid))
    assert answers[1] == 200 and late.status_code == 404, (answers, late.text)
    assert late.json()["error"]["code"] == "file_not_found"
    with session_scope(settings.sqlalchemy_url) as s:
        assert s.get(File, f["id"]).deleted


def test_uploads_keep_the_base_name_only(client, keys):
    assert upload(client, keys.paid, "C:\\Users\\me\\in.jsonl")["filename"] == "in.jsonl"
    assert upload(client, keys.paid, "../../etc/passwd")["filename"] == "passwd"


def test_a_batch_line_with_a_lone_surrogate_fails_that_line_only(client, keys, settings):
    def line(cid: str, content: str) -> str:
        return ('{"custom_id": "%s", "method": "POST", "url": "/v1/chat/completions", "body": '
                '{"messages": [{"role": "user", "content": "%s"}], "max_tokens": 2}}' % (cid, content))
    f = upload(client, keys.paid, "in.jsonl", "\n".join([line("good", "hi"), line("bad", "\\ud800"),
                                                          line("\\udc00", "hi")]).encode())
    r = client.post("/v1/batches", json={"input_file_id": f["id"], "endpoint": "/v1/chat/completions",
                                         "completion_window": "1h"}, headers=H(keys.paid))
    assert r.status_code == 200, r.text
    batch_id = r.json()["id"]

    def started():
        b = client.get(f"/v1/batches/{batch_id}", headers=H(keys.paid)).json()
        return b if b["status"] != "validating" else None
    b = wait_for(started, 30, "the batch's validation")
    assert b["status"] == "in_progress", b
    assert b["request_counts"] == {"total": 3, "completed": 0, "failed": 2}
    with session_scope(settings.sqlalchemy_url) as s:
        assert s.scalars(select(Job.custom_id).where(Job.batch_id == batch_id)).all() == ["good"]
        assert s.get(Batch, batch_id).errors is None
    from app.batch.fanout import invalid_path

    errors = [json.loads(t) for t in invalid_path(settings.data_dir, batch_id).read_text().splitlines()]
    assert [(e["custom_id"], e["id"]) for e in errors] == [("bad", "batch_req_line_2"), ("", "batch_req_line_3")]
    assert all(SURROGATE in e["error"]["message"] for e in errors)
    assert "body.messages.0.content" in errors[0]["error"]["message"]


def test_timestamps_are_utc_with_z_on_every_answer(client, keys):
    posted = client.post("/v1/jobs", json={"prompt": "hi", "kind": "batch", "deadline_at": "2099-01-01T05:00:00+05:00"},
                         headers=H(keys.paid))
    assert posted.status_code == 422  # more than 30 days away; a near one with an offset:
    near = time.strftime("%Y-%m-%dT%H:%M:%S+05:00", time.gmtime(time.time() + 5 * 3600 + 600))
    posted = client.post("/v1/jobs", json={"prompt": "hi", "kind": "batch", "deadline_at": near},
                         headers=H(keys.paid)).json()
    got = client.get(f"/v1/jobs/{posted['id']}", headers=H(keys.paid)).json()
    listed = client.get("/v1/jobs", headers=H(keys.paid)).json()["data"][0]
    cancelled = client.post(f"/v1/jobs/{posted['id']}/cancel", headers=H(keys.paid)).json()
    for body in (posted, got, listed, cancelled):
        assert body["created_at"].endswith("Z") and body["deadline_at"].endswith("Z"), body
        assert body["created_at"] == posted["created_at"]
        assert body["deadline_at"] == posted["deadline_at"]  # the instant asked for, kept across SQLite
    assert cancelled["finished_at"].endswith("Z")
    # 5 hours earlier in UTC (computed, not by replacing the hour digits: at 06:06 that also replaced the minutes)
    utc = datetime.fromisoformat(near).astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
    assert posted["deadline_at"][:19] == utc
    tenant = client.post("/v1/admin/tenants", json={"name": "zulu"}, headers=H(keys.admin)).json()
    keys_listed = client.get(f"/v1/admin/tenants/{tenant['tenant_id']}/keys", headers=H(keys.admin)).json()
    assert keys_listed[0]["created_at"].endswith("Z")
    assert client.get("/admin/api/overview", headers=H(keys.admin)).json()["now"].endswith("Z")


def test_every_422_is_a_list_of_errors(client, keys):
    answers = [
        client.get("/v1/jobs", params={"tier": "gold"}, headers=H(keys.paid)),
        client.post("/v1/jobs", json={"prompt": "hi", "tier": "gold"}, headers=H(keys.paid)),
        client.post("/v1/summarize", json={"documents": [{"id": "a", "text": "x"}] * 2}, headers=H(keys.paid)),
        client.post("/v1/admin/tenants", json={"name": "t", "default_tier": "gold"}, headers=H(keys.admin)),
        client.post("/admin/api/jobs/job_x/promote", json={"tier": "gold"}, headers=H(keys.admin)),
    ]
    for r in answers:
        assert r.status_code == 422, r.text
        detail = r.json()["detail"]
        assert isinstance(detail, list) and all({"loc", "msg", "type"} <= set(e) for e in detail), r.text


def test_options_and_405_list_every_method_of_the_resource(client, keys):
    f = upload(client, keys.paid, "in.jsonl")
    r = client.options(f"/v1/files/{f['id']}", headers=H(keys.paid))
    assert r.status_code == 204 and set(r.headers["allow"].split(", ")) == {"GET", "DELETE", "OPTIONS"}
    r = client.patch(f"/v1/files/{f['id']}", headers=H(keys.paid))
    assert r.status_code == 405 and "DELETE" in r.headers["allow"] and "DELETE" in r.json()["error"]["message"]


def openai_error(r) -> dict:
    """The ``error`` of an answer in OpenAI's shape (and nothing else: no FastAPI ``detail``)."""
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, r.text
    assert body["error"]["type"] == "invalid_request_error", r.text
    return body["error"]


@pytest.mark.parametrize("method, path, allowed", [("GET", "/v1/completions", {"POST"}),
                                                   ("PUT", "/v1/batches", {"GET", "POST"}),
                                                   ("PATCH", "/v1/models/tiny", {"GET"})])
def test_a_wrong_method_under_the_openai_prefix_answers_in_openais_shape(client, keys, method, path, allowed):
    r = client.request(method, path, headers=H(keys.paid))
    assert r.status_code == 405 and allowed <= set(r.headers["allow"].split(", ")), r.headers
    assert f"{method} is not allowed here" in openai_error(r)["message"]


def test_framework_errors_under_the_openai_prefix_answer_in_openais_shape(client, keys, settings):
    r = client.get("/v1/chat/completions/no/such/route", headers=H(keys.paid))
    assert r.status_code == 404 and "Invalid URL (GET /v1/chat/completions/no/such/route)" in openai_error(r)["message"]
    big = b"x" * (settings.max_body_bytes + 1)
    r = client.post("/v1/completions", content=big, headers={**H(keys.paid), "Content-Type": "application/json"})
    assert r.status_code == 413 and f"over {settings.max_body_bytes} bytes" in openai_error(r)["message"]
    assert len(r.headers["x-request-id"]) == 32


@pytest.mark.parametrize("path, says", [
    ("/v1/embeddings", "pooling model"), ("/v2/embed", "pooling model"), ("/pooling", "pooling model"),
    ("/classify", "pooling model"), ("/score", "pooling model"), ("/v1/score", "pooling model"),
    ("/rerank", "pooling model"), ("/v1/rerank", "pooling model"), ("/v2/rerank", "pooling model"),
    ("/v1/audio/transcriptions", "speech-to-text model"), ("/v1/audio/translations", "speech-to-text model")])
def test_a_route_vllm_serves_only_for_another_kind_of_model_says_so(client, keys, path, says):
    # vLLM registers these for a pooling or speech model only; a generative model's server answers a bare 404
    r = client.post(path, json={"model": "tiny", "input": "x"}, headers=H(keys.paid))
    error = openai_error(r)
    assert r.status_code == 404 and error["code"] == "unsupported_endpoint", r.text
    assert error["message"].startswith(f"POST {path} is not served here") and says in error["message"], error
    with pytest.raises(openai.NotFoundError) as exc:  # the SDK's own call, as a user makes it
        openai.OpenAI(base_url="http://testserver/v1", api_key=keys.paid, http_client=client,
                      max_retries=0).embeddings.create(model="tiny", input="x")
    assert "pooling model" in exc.value.body["message"], exc.value.body


@pytest.mark.parametrize("method, path, says", [
    # vLLM's behind a flag, its dev mode or another API: each says what coserve offers instead
    ("POST", "/v1/chat/completions/render", "POST /tokenize"), ("POST", "/v1/chat/completions/derender", "/detokenize"),
    ("POST", "/v1/completions/render", "--enable-scale-out"), ("POST", "/v1/responses/render", "POST /tokenize"),
    ("POST", "/inference/v1/generate", "/v1/completions"), ("POST", "/inference/v1/abort_requests", "/cancel"),
    ("POST", "/generative_scoring", "logprobs"), ("POST", "/v1/systemone", "response_format"),
    ("POST", "/cohere/v2/chat", "POST /v1/chat/completions"),
    ("POST", "/pause", "/admin/api/workers/{worker_id}/drain"),
    ("POST", "/resume", '{"drain": false}'), ("GET", "/is_paused", "GET /admin/api/overview"),
    ("POST", "/sleep", "do not sleep"), ("POST", "/wake_up", "VLLM_SERVER_DEV_MODE"),
    ("GET", "/is_sleeping", "drain"), ("POST", "/abort_requests", "POST /v1/jobs/{job_id}/cancel"),
    ("POST", "/update_weights", "POST /v1/load_lora_adapter"), ("GET", "/server_info", "GET /version"),
    ("POST", "/scale_elastic_ep", "draining"), ("GET", "/fault_tolerance/status", "supervisor"),
    ("POST", "/start_profile", "profiler"), ("GET", "/kv_event_sources", "KV cache events"),
    ("DELETE", "/adapters/a1", "/v1/unload_lora_adapter")])
def test_a_vllm_route_coserve_does_not_serve_says_what_to_use_instead(client, keys, method, path, says):
    # before, each answered a bare {"detail": "Not Found"} (render/derender: a stored completion's 400, read as its id)
    r = client.request(method, path, json={"model": "tiny", "prompt": "x"}, headers=H(keys.paid))
    error = openai_error(r)
    assert r.status_code == 404 and error["code"] == "unsupported_endpoint", r.text
    assert error["message"].startswith(f"{method} {path} is not served here: ") and says in error["message"], error


def test_unserved_routes_answer_anthropics_sdk_and_a_websocket_by_name(client, keys):
    claude = {**H(keys.paid), "anthropic-version": "2023-06-01"}
    r = client.post("/v1/messages/render", json={}, headers=claude)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", r.text
    assert "POST /tokenize" in r.json()["error"]["message"], r.text
    # vLLM's realtime transcription, a websocket: refused before the handshake with the same answer (it closed bare)
    with pytest.raises(WebSocketDenialResponse) as refused:
        with client.websocket_connect("/v1/realtime", headers=H(keys.paid)):
            pass
    assert refused.value.status_code == 404 and "speech-to-text model" in refused.value.json()["error"]["message"]


def test_tokenizer_info_is_served_where_the_operator_turns_it_on(client, keys, settings):
    r = client.get("/tokenizer_info", headers=H(keys.paid))  # off by default, as vLLM's: it says how to turn it on
    assert r.status_code == 404 and openai_error(r)["code"] == "unsupported_endpoint", r.text
    assert "COSERVE_ENABLE_TOKENIZER_INFO_ENDPOINT=true" in r.json()["error"]["message"], r.text
    settings.enable_tokenizer_info_endpoint = True
    r = client.get("/tokenizer_info", headers=H(keys.paid))
    info, tok = r.json(), get_tokenizer(settings.model)
    assert r.status_code == 200 and info["tokenizer_class"] == type(tok).__name__, r.text
    assert info["chat_template"] == tok.chat_template and info["eos_token"] == tok.eos_token, info
    assert "name_or_path" not in info, info  # a path on the server
    assert client.get("/tokenizer_info").status_code == 401


def test_framework_errors_answer_anthropics_sdk_in_its_shape_on_paths_shared_with_openai(client, keys, settings):
    claude = {**H(keys.paid), "anthropic-version": "2023-06-01"}  # what Anthropic's SDKs send on every request
    big = b"x" * (settings.max_body_bytes + 1)
    asks = [("PATCH", "/v1/models/tiny", None, 405, "invalid_request_error"),
            ("GET", "/v1/models/tiny/no/such/route", None, 404, "not_found_error"),
            ("POST", "/v1/models", big, 413, "request_too_large")]
    for method, path, body, status, kind in asks:
        r = client.request(method, path, content=body, headers={**claude, "Content-Type": "application/json"})
        got = r.json()
        assert r.status_code == status and got["type"] == "error" and got["error"]["type"] == kind, r.text
        assert got["request_id"] == r.headers["request-id"], r.headers
        # without the header, OpenAI's clients read OpenAI's shape there
        r = client.request(method, path, content=body, headers={**H(keys.paid), "Content-Type": "application/json"})
        assert r.status_code == status and openai_error(r)["message"], r.text


def test_anthropics_shape_answers_anthropics_sdk_only_on_paths_it_calls(client, keys, settings):
    """Anthropic's SDK sends anthropic-version to every path it calls: there (its beta's /v1/skills too, which
    coserve does not serve) an error no route answered is in its shape; elsewhere the path's own API decides."""
    claude = {**H(keys.paid), "anthropic-version": "2023-06-01", "Content-Type": "application/json"}
    r = client.get("/v1/skills", headers=claude)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", r.text
    big = b"x" * (settings.max_body_bytes + 1)
    for method, path, body, status in [("PUT", "/v1/jobs", None, 405), ("GET", "/v1/no-such-route", None, 404),
                                       ("POST", "/v1/jobs", big, 413)]:  # coserve's own paths: its own shape
        r = client.request(method, path, content=body, headers=claude)
        assert r.status_code == status and set(r.json()) == {"detail"}, r.text
    r = client.post("/v1/completions", content=big, headers=claude)  # OpenAI's alone: OpenAI's shape
    assert r.status_code == 413 and openai_error(r)["message"], r.text


def test_files_routes_answer_anthropics_sdk_in_its_shape(client, keys):
    """Anthropic's SDK calls /v1/files (its beta files API): the routes' own refusals there come in its shape, with
    its request-id header, as the framework's do; OpenAI's client still reads OpenAI's."""
    claude = anthropic.Anthropic(base_url="http://testserver", api_key=keys.paid, http_client=client, max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as exc:
        claude.beta.files.retrieve_metadata("file_nope")
    assert exc.value.body["type"] == "error" and exc.value.body["error"]["type"] == "not_found_error", exc.value.body
    assert "file_nope" in exc.value.body["error"]["message"] and exc.value.request_id, exc.value.body
    with pytest.raises(anthropic.NotFoundError):
        claude.beta.files.delete("file_nope")
    with pytest.raises(anthropic.BadRequestError) as exc:  # it sends no purpose: the field to add is named
        claude.beta.files.upload(file=("notes.txt", b"hello", "text/plain"))
    assert exc.value.body["error"]["type"] == "invalid_request_error", exc.value.body
    assert "purpose" in exc.value.body["error"]["message"], exc.value.body
    oai = openai.OpenAI(base_url="http://testserver/v1", api_key=keys.paid, http_client=client, max_retries=0)
    with pytest.raises(openai.NotFoundError) as oexc:
        oai.files.retrieve("file_nope")
    assert oexc.value.code == "file_not_found", oexc.value.body


def test_framework_errors_on_native_routes_keep_their_detail_shape(client, keys, settings):
    r = client.put("/v1/jobs", headers=H(keys.paid))
    assert r.status_code == 405 and "POST" in r.headers["allow"] and "PUT is not allowed" in r.json()["detail"]
    assert client.get("/v1/no-such-route", headers=H(keys.paid)).json() == {"detail": "Not Found"}
    r = client.post("/v1/jobs", content=b"x" * (settings.max_body_bytes + 1), headers=H(keys.paid))
    assert r.status_code == 413 and "bytes" in r.json()["detail"]


def test_the_openapi_document_lists_what_each_operation_answers(client):
    spec = client.get("/openapi.json").json()
    ops = {(m.upper(), p): op for p, item in spec["paths"].items() for m, op in item.items()}
    assert {"401", "404"} <= set(ops["GET", "/v1/jobs/{job_id}"]["responses"])
    assert {"400", "401", "404", "409", "413", "500", "504"} <= set(ops["POST", "/v1/chat/completions"]["responses"])
    assert "422" not in ops["POST", "/v1/chat/completions"]["responses"]  # OpenAI routes answer 400
    assert "messages" in ops["POST", "/v1/chat/completions"]["requestBody"]["content"]["application/json"][
        "schema"]["properties"]
    assert {"401", "403", "409", "413", "422"} <= set(ops["POST", "/v1/admin/tenants"]["responses"])
    # a body not sent as JSON is a 415 wherever the body is JSON (not an upload's form)
    assert all("415" in ops[op]["responses"] for op in [("POST", "/v1/chat/completions"), ("POST", "/v1/jobs"),
                                                         ("POST", "/v1/messages"), ("POST", "/v1/admin/tenants")])
    assert "415" not in ops["POST", "/v1/files"]["responses"]
    assert "503" in ops["GET", "/readyz"]["responses"]
    # OpenAPI asks each operation's id to be unique (client generators name their methods after them)
    ids = [op["operationId"] for op in ops.values()]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    assert {"GET", "POST"} <= {m for m, p in ops if p == "/ping"}


def test_a_body_that_is_not_utf8_is_a_documented_4xx(client, keys):
    headers = {**H(keys.paid), "Content-Type": "application/json"}
    r = client.post("/v1/jobs", content=b'{"prompt": "\xff\xfe"}', headers=headers)
    assert r.status_code == 422 and "not UTF-8" in r.json()["detail"][0]["msg"], r.text
    # FastAPI parses this route's body itself; its own 400 was neither documented nor OpenAI-shaped
    r = client.post("/v1/batches", content=b"\xff\xfe(", headers=headers)
    assert r.status_code == 400 and "not UTF-8" in r.json()["error"]["message"], r.text


def test_unknown_urls_under_openai_resources_answer_in_openai_shape(client, keys):
    r = client.get("/v1/models/a%0Ab", headers=H(keys.paid))  # the path converter stops at a newline
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert client.get("/v1/jobs/a/b/c", headers=H(keys.paid)).json() == {"detail": "Not Found"}


def test_an_unknown_upload_purpose_names_the_known_ones(client, keys):
    r = client.post("/v1/files", files={"file": ("in.jsonl", b"{}\n")}, data={"purpose": "fine-tune"},
                    headers=H(keys.paid))
    assert r.status_code == 400 and r.json()["error"]["param"] == "purpose", r.text
    assert "'batch'" in r.json()["error"]["message"] and "'user_data'" in r.json()["error"]["message"]


@pytest.mark.parametrize("path, status, field", [
    ("/v1/files/file%00x", 400, "file_id"), ("/v1/files/file%00x/content", 400, "file_id"),
    ("/v1/batches/batch%00x", 400, "batch_id"), ("/v1/batches?after=b%00", 400, "after"),
    ("/v1/files?purpose=b%00", 400, "purpose"), ("/v1/jobs/job%00x", 422, "job_id"),
])
def test_a_nul_in_the_url_is_a_4xx_naming_the_parameter(client, keys, path, status, field):
    r = client.get(path, headers=H(keys.paid))
    assert r.status_code == status, r.text
    if status == 400:
        assert r.json()["error"]["param"] == field and NUL in r.json()["error"]["message"]
    else:
        assert r.json()["detail"][0]["loc"][-1] == field and NUL in r.json()["detail"][0]["msg"]


def test_a_batchs_metadata_and_window_are_held_to_what_openai_and_the_store_take(client, keys, settings):
    f = client.post("/v1/files", headers=H(keys.paid), data={"purpose": "batch"},
                    files={"file": ("in.jsonl", b"{}\n")}).json()
    base = {"input_file_id": f["id"], "endpoint": "/v1/completions"}
    for extra, param in (({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
                         ({"metadata": {"k": "v" * 513}}, "metadata.k"),
                         ({"completion_window": "1.00000000000000h"}, "completion_window")):
        r = client.post("/v1/batches", headers=H(keys.paid), json={**base, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    with session_scope(settings.sqlalchemy_url) as s:
        assert s.scalar(select(func.count()).select_from(Batch)) == 0
    metadata = {f"k{i}": "v" * 512 for i in range(16)}
    r = client.post("/v1/batches", headers=H(keys.paid), json={**base, "metadata": metadata})
    assert r.status_code == 200 and len(r.json()["metadata"]) == 16


def test_listing_files_while_deleting_them_reaches_every_file_in_either_order(client, keys):
    for order in ("asc", "desc"):
        ids = [client.post("/v1/files", headers=H(keys.paid), data={"purpose": "batch"},
                           files={"file": (f"{i}.jsonl", b"{}\n")}).json()["id"] for i in range(5)]
        seen, after = [], None
        while True:  # `for f in client.files.list(): client.files.delete(f.id)`: a page starts after a deleted file
            page = client.get("/v1/files", headers=H(keys.paid),
                              params={"limit": 2, "order": order, **({"after": after} if after else {})}).json()
            for d in page["data"]:
                seen.append(d["id"])
                assert client.delete(f"/v1/files/{d['id']}", headers=H(keys.paid)).status_code == 200
            if not page["has_more"]:
                break
            after = page["last_id"]
        assert seen == (ids if order == "asc" else ids[::-1]), order


def test_listing_files_without_a_limit_gives_as_many_as_openai_does(client, keys):
    """OpenAI's ``GET /v1/files`` gives up to 10,000 files when no ``limit`` is sent: code that reads ``.data`` of
    ``client.files.list()`` (no paging) must see a tenant's 101st file."""
    ids = [client.post("/v1/files", headers=H(keys.paid), data={"purpose": "batch"},
                       files={"file": (f"{i}.jsonl", b"{}\n")}).json()["id"] for i in range(101)]
    page = client.get("/v1/files", headers=H(keys.paid), params={"order": "asc"}).json()
    assert [d["id"] for d in page["data"]] == ids and not page["has_more"]


def test_a_prompt_of_token_ids_that_decode_to_a_nul_is_kept_with_the_replacement_character(client, keys, settings):
    nul = get_tokenizer(settings.model).decode([190])
    assert nul == "\x00"  # a byte token of the default model's tokenizer
    r = client.post("/v1/jobs", json={"prompt_token_ids": [190, 5, 190]}, headers=H(keys.paid))
    assert r.status_code == 201, r.text
    with session_scope(settings.sqlalchemy_url) as s:
        job = s.get(Job, r.json()["id"])
        assert "\x00" not in job.prompt and job.prompt.count("\ufffd") == 2 and job.prompt_token_ids == [190, 5, 190]


@pytest.mark.parametrize("ctype", ["application/x-www-form-urlencoded", "text/plain", None])  # the first: curl -d's
def test_a_json_body_sent_as_another_content_type_is_a_415_in_each_apis_shape(client, keys, settings, ctype):
    """As vLLM's OpenAI server does (its ``validate_json_request``), a JSON route refuses a body that is not sent as
    JSON, saying which header to send, and stores nothing (the job's body is valid as JSON; the chats' max_tokens
    would be a 400 there, so a route that read them answers at once with no worker)."""
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}
    headers = {**H(keys.paid), **({"Content-Type": ctype} if ctype else {})}
    for path, body, error_of in [
            ("/v1/chat/completions", chat, lambda r: openai_error(r)["message"]),
            ("/v1/jobs", {"prompt": "hi", "max_tokens": 2}, lambda r: r.json()["detail"]),
            ("/v1/messages", chat, lambda r: r.json()["error"]["message"])]:  # Anthropic's shape
        r = client.post(path, content=json.dumps(body), headers=headers)
        assert r.status_code == 415 and "Content-Type: application/json" in error_of(r), (path, r.text)
        assert ("without a Content-Type" if ctype is None else repr(ctype)) in error_of(r), r.text
    assert jobs_in_sql(settings) == 0


def test_json_with_parameters_uploads_and_body_less_posts_need_no_other_content_type(client, keys):
    """What keeps working: a JSON media type with parameters, a multipart upload, and a POST without a body."""
    r = client.post("/v1/jobs", content=json.dumps({"prompt": "hi", "max_tokens": 2}),
                    headers={**H(keys.paid), "Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 201, r.text
    assert client.post(f"/v1/jobs/{r.json()['id']}/cancel", headers=H(keys.paid)).status_code == 200
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}}
    f = client.post("/v1/files", headers=H(keys.paid), data={"purpose": "batch"},
                    files={"file": ("in.jsonl", json.dumps(line).encode())})
    assert f.status_code == 200, f.text


@pytest.mark.parametrize(("headers", "says"), [
    ({}, "send 'Authorization: Bearer <key>' or 'x-api-key: <key>'"),
    ({"Authorization": "Basic dXNlcjpwYXNz"}, "read only as 'Bearer <key>'"),
    ({"Authorization": "sk-no-scheme"}, "read only as 'Bearer <key>'"),
])
def test_a_request_without_a_key_is_told_both_headers_a_key_is_read_from(client, headers, says):
    r = client.get("/v1/models", headers=headers)
    assert r.status_code == 401 and says in r.json()["error"]["message"], r.text
    assert "sk-no-scheme" not in r.text and "dXNlcjpwYXNz" not in r.text  # a key sent without its scheme stays unsaid


def test_a_file_of_the_upload_limit_is_taken_with_expires_after_and_one_byte_more_is_a_413_naming_it(settings, keys):
    """``COSERVE_MAX_FILE_BYTES`` is the largest file: the multipart envelope the client wraps it in (boundaries,
    the part's headers, ``purpose`` and ``expires_after``) does not count against it."""
    from fastapi.testclient import TestClient

    from app.main import create_app

    small = settings.model_copy(update={"max_file_bytes": 20_000})
    with TestClient(create_app(small)) as client:
        oai = openai.OpenAI(base_url="http://testserver/v1", api_key=keys.paid, http_client=client, max_retries=0)
        whole = oai.files.create(file=("in.jsonl", b"x" * 20_000), purpose="user_data",
                                 expires_after={"anchor": "created_at", "seconds": 3600})
        assert whole.bytes == 20_000 and oai.files.content(whole.id).content == b"x" * 20_000
        with pytest.raises(openai.APIStatusError) as exc:
            oai.files.create(file=("in.jsonl", b"x" * 20_001), purpose="user_data")
        assert exc.value.status_code == 413 and exc.value.body["param"] == "file", exc.value.body
        assert "20001 bytes" in exc.value.body["message"] and "20000" in exc.value.body["message"], exc.value.body
        assert [f.id for f in oai.files.list().data] == [whole.id]


@pytest.mark.parametrize("how", ["sdk_without_a_filename", "form_field", "curl_d"])
def test_a_file_sent_as_a_text_field_is_a_400_that_says_to_send_a_file_part(client, keys, how):
    """A part with no filename (the SDK given an empty name, ``-F 'file=<in.jsonl'``) or a URL-encoded form
    (``curl -d``) carries the file as text: the 400 says how to send it, not which Python class it expected."""
    oai = openai.OpenAI(base_url="http://testserver/v1", api_key=keys.paid, http_client=client, max_retries=0)
    line = b'{"custom_id": "a"}\n'
    if how == "sdk_without_a_filename":
        with pytest.raises(openai.BadRequestError) as exc:
            oai.files.create(file=("", line), purpose="batch")
        error = exc.value.body
    elif how == "form_field":
        error = client.post("/v1/files", headers=H(keys.paid), files={"purpose": (None, "batch"),
                                                                      "file": (None, line)}).json()["error"]
    else:
        error = client.post("/v1/files", headers=H(keys.paid), data={"purpose": "batch", "file": line}).json()["error"]
    assert error["param"] == "file" and "UploadFile" not in error["message"], error
    assert "filename" in error["message"] and "-F file=@" in error["message"], error
    assert oai.files.list().data == []


WIDE = {f"k{i}": "v" for i in range(17)}
LONG = {"k": "v" * 513}


@pytest.mark.parametrize("method, path, body", [
    ("POST", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "store": True}),
    ("POST", "/v1/responses", {"model": "tiny", "input": "x"}),
    ("POST", "/v1/conversations", {}),
    ("POST", "/v1/conversations/conv_nope", {}),
    ("POST", "/v1/chat/completions/chatcmpl-nope", {}),
])
def test_metadata_past_openais_limits_has_openais_code_on_every_route(client, keys, method, path, body):
    """Metadata past its limits was code null on chat and Responses create and invalid_value on updates and
    conversations; every route gives OpenAI's codes now (its API's answers to 17 pairs and to a 513-character
    value)."""
    for metadata, param, code in ((WIDE, "metadata", "object_above_max_properties"),
                                  (LONG, "metadata.k", "string_above_max_length")):
        r = client.request(method, path, headers=H(keys.paid), json={**body, "metadata": metadata})
        assert r.status_code == 400, r.text
        assert (r.json()["error"]["param"], r.json()["error"]["code"]) == (param, code), r.text


def test_a_metadata_filter_past_openais_limits_has_openais_code(client, keys):
    r = client.get("/v1/chat/completions", headers=H(keys.paid), params={f"metadata[{k}]": v for k, v in WIDE.items()})
    assert r.status_code == 400 and r.json()["error"]["code"] == "object_above_max_properties", r.text
