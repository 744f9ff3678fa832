"""Batch input validation and OpenAI request mapping (pure logic)."""

from __future__ import annotations

import json

import pytest

from app.batch.lines import InvalidLine, ValidLine, parse_file
from app.openai_schemas import ChatCompletionRequest, CompletionRequest, OpenAIError, parse_window


def chat(cid, **body):
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"messages": [{"role": "user", "content": "hi"}], **body}})


@pytest.mark.parametrize("text,seconds", [("24h", 86400), ("30m", 1800), ("2h", 7200), ("7d", 604800),
                                          ("90s", 90), (" 1.5h ", 5400)])
def test_parse_window(text, seconds):
    assert parse_window(text) == seconds


@pytest.mark.parametrize("text", ["", "24", "h", "0h", "-1h", "2w", "soon"])
def test_parse_window_rejects(text):
    with pytest.raises(ValueError):
        parse_window(text)


def test_valid_lines_become_batch_specs_with_the_window():
    parsed = parse_file((chat("a", max_tokens=5, stop="END", seed=1) + "\n\n" + chat("b")).encode(),
                        "/v1/chat/completions", 3600)
    assert not parsed.invalid and not parsed.file_errors and parsed.total == 2
    a = parsed.valid[0]
    assert isinstance(a, ValidLine) and a.line_no == 1 and a.custom_id == "a"
    (spec,) = a.specs
    assert spec.kind == "batch" and spec.deadline_window_s == 3600 and spec.max_tokens == 5
    assert spec.stop == ["END"] and spec.seed == 1 and spec.messages[0].content == "hi"
    assert parsed.valid[1].line_no == 3  # blank lines are skipped but keep numbering


def test_invalid_lines_are_reported_with_line_and_reason():
    lines = ["[1]", chat("s", stream=True), chat("q", ttft_ms=5), chat("t", temperature=5),
             json.dumps({"custom_id": "m", "method": "GET", "url": "/v1/chat/completions", "body": {}}),
             chat("ok")]
    parsed = parse_file("\n".join(lines).encode(), "/v1/chat/completions", 60)
    assert [v.custom_id for v in parsed.valid] == ["ok"]
    by_line = {i.line_no: i for i in parsed.invalid}
    assert all(isinstance(i, InvalidLine) for i in parsed.invalid)
    assert by_line[1].code == "invalid_json"
    assert "stream" in by_line[2].message and "completion_window" in by_line[3].message
    assert "temperature" in by_line[4].message and by_line[5].code == "invalid_method"
    assert all(i.message.startswith(f"line {n}:") for n, i in by_line.items())


# a body of each OpenAI line kind, and each field that would make its job another than a batch job due when the
# batch's window ends: an interactive job's targets, a deadline of its own, the job's own deadline and kind (POST
# /v1/jobs' names, which a line's request would otherwise ignore)
LINE_BODIES = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
               "/v1/completions": {"prompt": "hi"}, "/v1/responses": {"input": "hi"}}
QOS_VALUES = {"ttft_ms": 50, "tbt_ms": 20, "tbt_anchor": "first-token", "deadline": "1h",
              "deadline_at": "2030-01-01T00:00:00Z", "deadline_window_s": 60, "kind": "interactive"}


@pytest.mark.parametrize("endpoint", LINE_BODIES)
@pytest.mark.parametrize("field", QOS_VALUES)
def test_a_line_with_a_qos_field_is_told_what_a_batch_line_takes(endpoint, field):
    # not "give either deadline or ttft_ms/tbt_ms/tbt_anchor" (a Responses line, or tbt_anchor alone: it reads as if
    # a deadline were taken), nor a silently ignored field: one refusal that names it
    text = json.dumps({"custom_id": "a", "method": "POST", "url": endpoint,
                       "body": {**LINE_BODIES[endpoint], field: QOS_VALUES[field]}})
    (bad,) = parse_file(text.encode(), endpoint, 86400).invalid
    assert bad.message == (f"line 1: invalid body: {field}: a batch's requests run as batch jobs due when the "
                           "batch's completion_window ends, and take no ttft_ms, tbt_ms, tbt_anchor, deadline, "
                           "deadline_at, deadline_window_s or kind; leave it out"), bad.message
    assert bad.code == "invalid_body"


def test_duplicates_and_empty_files_fail_the_whole_file():
    parsed = parse_file("\n".join([chat("a"), chat("a"), chat("b"), chat("a")]).encode(), "/v1/chat/completions", 60)
    assert [e["code"] for e in parsed.file_errors] == ["duplicate_custom_id"]
    assert "lines 1, 2, 4" in parsed.file_errors[0]["message"]
    assert parse_file(b"\n\n", "/v1/chat/completions", 60).file_errors[0]["code"] == "empty_file"
    assert parse_file(b"\xff\xfe", "/v1/chat/completions", 60).file_errors[0]["code"] == "invalid_file"


def test_openai_request_mapping():
    req = ChatCompletionRequest.model_validate({
        "messages": [{"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
                     {"role": "user", "content": "x"}],
        "max_completion_tokens": 9, "max_tokens": 3, "tbt_ms": 50, "stop": ["a", "b"], "tbt_anchor": "first-token"})
    spec = req.job_spec(messages=req.chat_messages())
    assert spec.kind == "interactive" and spec.max_tokens == 9 and spec.tbt_ms == 50
    assert spec.tbt_anchor == "first-token"
    assert spec.messages[0].role == "developer" and spec.messages[0].content == "be brief"  # as vLLM passes it
    parts = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]}]}).chat_messages()
    assert parts[0].content == "Hello\nworld"  # vLLM's join of a string-format template's text parts
    assert spec.temperature == 1.0  # OpenAI's default
    deadline = CompletionRequest.model_validate({"prompt": ["p"], "deadline": "2h"})
    (prompt,) = deadline.prompt_inputs()
    spec = deadline.job_spec(**prompt)
    assert spec.kind == "batch" and spec.deadline_window_s == 7200
    with pytest.raises(OpenAIError):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "n": 17}).check()
    for qos in ({"ttft_ms": 5}, {"tbt_anchor": "first-token"}):  # a deadline job has no token pace
        with pytest.raises(OpenAIError):
            CompletionRequest.model_validate({"prompt": "p", "deadline": "2h", **qos}).job_spec(prompt="p")


@pytest.mark.parametrize("field,value,ok", [
    ("logprobs", True, True), ("logprobs", False, True), ("logprobs", 3, False), ("top_logprobs", 2, False),
    ("top_logprobs", 0, True), ("top_logprobs", 21, False),
    ("tools", [{"type": "function", "function": {"name": "f"}}], True), ("tools", [], False),
    ("tool_choice", "maybe", False),
    ("tool_choice", "auto", False), ("tool_choice", "none", True),
    ("response_format", {"type": "xml"}, False), ("response_format", {"type": "text"}, True),
    ("response_format", {"type": "json_object"}, True), ("response_format", {"type": "json_schema"}, False),
    ("structured_outputs", {"choice": ["a"]}, True), ("structured_outputs", {"choice": ["a"], "regex": "a"}, False),
    ("logit_bias", {"42": 5}, True), ("logit_bias", {"x": 5}, False), ("logit_bias", {"42": 101}, False),
    ("logit_bias", {}, True), ("min_tokens", 5, True), ("min_tokens", -1, False), ("stop_token_ids", [2], True),
    ("stop_token_ids", [-1], False), ("service_tier", "flex", True), ("service_tier", "turbo", False),
    ("seed", -1, True), ("seed", -(2**63) - 1, False), ("seed", 2**63, False),
    ("seed", 2**63 - 1, True), ("presence_penalty", 0.5, True), ("presence_penalty", 2.5, False),
    ("frequency_penalty", -1.0, True), ("frequency_penalty", -2.01, False), ("repetition_penalty", 0, False),
    ("top_k", -2, False), ("top_k", 40, True), ("min_p", 1.1, False), ("min_p", 0.05, True)])
def test_unsupported_or_out_of_range_openai_fields_are_rejected_not_ignored(field, value, ok):
    parsed = parse_file(chat("a", **{field: value}).encode(), "/v1/chat/completions", 3600)
    if ok:
        assert parsed.valid and not parsed.invalid
    else:
        assert not parsed.valid and field in parsed.invalid[0].message


@pytest.mark.parametrize("body", [{"best_of": 2}, {"suffix": "x"}, {"truncation_side": "right"},
                                  {"logprob_token_ids": [3]}])
def test_unsupported_completion_fields(body):
    req = CompletionRequest.model_validate({"prompt": "x", **body})
    with pytest.raises(OpenAIError) as exc:
        req.check()
    assert exc.value.param == next(iter(body)) and exc.value.code == "unsupported_value"
    CompletionRequest.model_validate({"prompt": "x", "echo": False, "best_of": 1, "suffix": None,
                                      "truncation_side": "left", "logprob_token_ids": []}).check()


def test_a_lone_surrogate_fails_its_line_not_the_file():
    # decoded from "\ud800": it can be neither tokenized nor stored, so the line must not become a job
    lines = [chat("a"), chat("b").replace('"hi"', '"\\ud800"'), chat("\udc00")]  # json.dumps writes \udc00
    parsed = parse_file("\n".join(lines).encode(), "/v1/chat/completions", 60)
    assert not parsed.file_errors and [v.custom_id for v in parsed.valid] == ["a"]
    bad = {i.line_no: i for i in parsed.invalid}
    assert bad[2].custom_id == "b" and bad[2].code == "invalid_body"
    assert "body.messages.0.content contains a lone surrogate \\ud800" in bad[2].message
    assert bad[3].custom_id is None and bad[3].code == "invalid_request" and "custom_id" in bad[3].message


def test_service_tier_names_the_lowest_and_the_highest_configured_tier():
    from app.openai_schemas import service_tier

    def tier(tiers=("free", "paid"), **body):
        req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **body})
        return req.job_tier(tiers)

    assert tier(service_tier="flex") == "free" and tier(service_tier="priority") == "paid"
    assert tier(service_tier="auto") is None and tier() is None  # the key's own tier
    assert tier(service_tier="flex", tier="free") == "free"
    with pytest.raises(OpenAIError) as exc:
        tier(service_tier="flex", tier="paid")
    assert exc.value.param == "service_tier"
    tiers = ("free", "paid")
    assert [service_tier(t, tiers) for t in tiers] == ["flex", "priority"]
    assert service_tier("paid", ("paid",)) == "default"
    renamed = ("bronze", "silver", "gold")  # COSERVE_TIERS renamed: a request's name and the answer's agree
    assert tier(renamed, service_tier="flex") == "bronze" and tier(renamed, service_tier="priority") == "gold"
    assert [service_tier(tier(renamed, service_tier=s), renamed) for s in ("flex", "priority")] == ["flex", "priority"]
    assert tier(renamed, service_tier="default") is None



def test_a_batch_line_carries_the_token_ids_its_request_asked_for():
    from app.batch.objects import output_line
    from app.db.models import Job

    job = Job(id="job_t", endpoint="/v1/completions", model="m", output_text=" hi", finish_reason="length",
              sampling={"return_token_ids": True, "max_tokens": 2}, prompt_token_ids=[5, 6, 7], prompt_tokens=3,
              completion_tokens=2, output_token_ids=[9, 10], custom_id="r1")
    choice = output_line([job])["response"]["body"]["choices"][0]
    assert (choice["prompt_token_ids"], choice["token_ids"]) == ([5, 6, 7], [9, 10])
    job.sampling = {"max_tokens": 2}  # not asked: neither
    assert not {"prompt_token_ids", "token_ids"} & set(output_line([job])["response"]["body"]["choices"][0])


def test_lines_end_at_newlines_only_and_a_nul_or_an_overlong_custom_id_fails_its_line():
    # U+2028, U+2029 and U+0085 are line breaks to str.splitlines() but may stand raw inside a JSON string
    raw = [json.dumps({"custom_id": c, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"messages": [{"role": "user", "content": text}]}}, ensure_ascii=False)
           for c, text in (("a", "one\u2028two"), ("b", "x\u0085y\u2029z"), ("c", "plain"))]
    parsed = parse_file(("\r\n".join(raw) + "\r\n").encode(), "/v1/chat/completions", 60)
    assert not parsed.invalid and [v.custom_id for v in parsed.valid] == ["a", "b", "c"]
    assert parsed.valid[0].specs[0].messages[0].content == "one\u2028two" and parsed.valid[2].line_no == 3
    lines = [chat("a"), chat("n" * 201), chat("b", user="x\u0000y"), chat("c\u0000")]
    parsed = parse_file("\n".join(lines).encode(), "/v1/chat/completions", 60)
    assert not parsed.file_errors and [v.custom_id for v in parsed.valid] == ["a"]
    bad = {i.line_no: i for i in parsed.invalid}
    assert bad[2].code == "invalid_custom_id" and "201 characters; at most 200" in bad[2].message
    assert bad[3].custom_id == "b" and "body.user contains a NUL character" in bad[3].message
    assert bad[4].custom_id is None and bad[4].code == "invalid_request" and "custom_id" in bad[4].message


def test_a_line_of_several_choices_is_a_job_per_choice_in_openais_order():
    """OpenAI's Batch API and vLLM's run_batch take n > 1 and, on completions, several prompts per line."""
    (line,) = parse_file(chat("a", n=3, seed=7).encode(), "/v1/chat/completions", 3600).valid
    assert line.n == 3 and [s.seed for s in line.specs] == [7, 8, 9]  # each choice reproducible, unlike the others
    text = json.dumps({"custom_id": "b", "method": "POST", "url": "/v1/completions",
                       "body": {"prompt": ["p", "q"], "n": 2, "max_tokens": 3}})
    (line,) = parse_file(text.encode(), "/v1/completions", 3600).valid
    assert line.n == 2 and [s.prompt for s in line.specs] == ["p", "p", "q", "q"]  # index = prompt x n + choice
    (bad,) = parse_file(chat("c", n=17).encode(), "/v1/chat/completions", 3600).invalid
    assert "n must be between 1 and 16" in bad.message


def test_an_empty_prompt_names_its_field():
    req = CompletionRequest.model_validate({"prompt": ""})
    with pytest.raises(OpenAIError) as exc:
        req.job_spec(**req.prompt_inputs()[0])
    assert exc.value.param == "prompt" and "must not be empty" in exc.value.message  # it named no field


def test_a_byte_order_mark_is_not_part_of_the_first_line():
    content = b"\xef\xbb\xbf" + (chat("first") + "\n" + chat("second") + "\n").encode()
    parsed = parse_file(content, "/v1/chat/completions", 3600)
    assert [v.custom_id for v in parsed.valid] == ["first", "second"] and parsed.invalid == []


@pytest.mark.parametrize("text,may", [('{"p": "plain"}', False), ('{"p": "caf\u00e9 \u2028"}', False),
                                      ('{"p": "\\u00e9"}', True), ('{"p\\u0000": 1}', True),
                                      ('{"p": "a\\\\u0000"}', True),  # an escaped backslash: a walk, found nothing
                                      ('{"p": "\ud800"}', True), ('{"p": "\x00"}', True)])
def test_only_a_line_that_may_hold_an_unstorable_character_is_walked(text, may):
    from app.wire import find_unstorable, may_hold_unstorable

    assert may_hold_unstorable(text) is may
    if not may:  # the walk it saves would have found nothing
        assert find_unstorable(json.loads(text)) is None


@pytest.mark.parametrize("model", [ChatCompletionRequest, CompletionRequest])
def test_an_unsupported_field_left_out_holds_a_value_it_accepts(model):
    """check_unsupported looks only at the fields a request set: one left out must be at a default it accepts."""
    for name, defaults in model.unsupported.items():
        assert model.model_fields[name].default in defaults, name


def test_an_empty_tools_list_is_refused_on_chat_as_vllm_refuses_it():
    # vLLM's chat request (check_tool_usage) and OpenAI refuse tools: []; coserve took it and gave the template []
    with pytest.raises(OpenAIError) as refused:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": []}).check()
    assert refused.value.param == "tools" and "leave it out" in refused.value.message, vars(refused.value)
    ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": None}).check()


@pytest.mark.parametrize("field, value, said", [
    ("guided_json", {"type": "object"}, "give structured_outputs.json, or response_format json_schema instead"),
    ("guided_regex", "[0-9]+", "give structured_outputs.regex instead"),
    ("guided_choice", ["a", "b"], "give structured_outputs.choice instead"),
    ("guided_grammar", 'root ::= "a"', "give structured_outputs.grammar instead"),
    ("guided_whitespace_pattern", " ?", "takes vLLM's default whitespace")])
def test_vllms_removed_guided_decoding_fields_are_refused_not_left_unconstrained(field, value, said):
    """vLLM 0.32 removed guided decoding: its server ignores the fields (its log alone says the text goes
    unconstrained). Here the client hears it, naming what to give instead, a Batch API line too."""
    for model, body in ((ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]}),
                        (CompletionRequest, {"prompt": "x"})):
        with pytest.raises(OpenAIError) as refused:
            model.model_validate({**body, field: value}).check()
        assert refused.value.param == field and refused.value.code == "unsupported_value", vars(refused.value)
        assert said in refused.value.message, refused.value.message
    parsed = parse_file(chat("a", **{field: value}).encode(), "/v1/chat/completions", 3600)
    assert not parsed.valid and field in parsed.invalid[0].message
    ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], field: None}).check()


@pytest.mark.parametrize("field, value, said", [
    ("guided_json", {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(2000)}},
     "give structured_outputs.json, or response_format json_schema instead"),
    ("chat_template", "{{ messages }}" * 5000, "COSERVE_CHAT_TEMPLATE"),
    ("logits_processors", [f"pkg.module.Processor{i}" for i in range(2000)], "leave logits_processors unset")])
def test_a_refused_field_says_what_to_give_without_repeating_a_large_value(field, value, said):
    """A refusal names the field and what to give instead; it does not echo the client's value back whole (a 50 KB
    schema made a 50 KB message, in the API's log too): a short value is still shown."""
    body = {"messages": [{"role": "user", "content": "x"}]}
    with pytest.raises(OpenAIError) as refused:
        ChatCompletionRequest.model_validate({**body, field: value}).check()
    message = refused.value.message
    assert said in message and field in message and len(message) < 600, message
    with pytest.raises(OpenAIError) as refused:
        ChatCompletionRequest.model_validate({**body, "guided_regex": "[0-9]+"}).check()
    assert "guided_regex='[0-9]+'" in refused.value.message, refused.value.message


@pytest.mark.parametrize("field, value", [("url", "/v1/" + "x" * 4000), ("method", "G" * 4000)])
def test_a_lines_refused_url_or_method_is_named_not_repeated_whole(field, value):
    # each such line's error (in the batch's error file) repeated the client's value: 4 KB a line for a long url
    text = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi"},
                       field: value})
    (bad,) = parse_file(text.encode(), "/v1/completions", 86400).invalid
    assert f"{field} " in bad.message and f"a {len(value)}-character string" in bad.message, bad.message
    assert len(bad.message) < 300, bad.message


def test_a_line_whose_schema_the_workers_engine_refuses_is_refused_with_its_line():
    """A schema holding uniqueItems compiles under xgrammar, but vLLM's validation sends it to guidance, which
    refuses it: the line's job failed on its worker; now the line is refused as the file is read."""
    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"},
                                                        "uniqueItems": True}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    parsed = parse_file(chat("a", response_format=fmt).encode(), "/v1/chat/completions", 3600)
    assert not parsed.valid and "uniqueItems at #/properties/tags" in parsed.invalid[0].message, parsed.invalid


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e999"])
@pytest.mark.parametrize("endpoint", ["/v1/messages", "/v1/chat/completions"])
def test_a_batch_line_of_a_call_whose_arguments_hold_nan_is_json_and_the_call_broken(endpoint, value):
    """A call's arguments holding what no JSON writes (NaN, Infinity, 1e999 read as inf) are no JSON: the line (a
    message batch's result, a /v1/batches output line) says the call is broken, and is strict JSON."""
    from app.batch.objects import output_line
    from app.db.models import Job

    job = Job(id="job_n", endpoint=endpoint, model="m", custom_id="r1", finish_reason="stop", prompt_tokens=3,
              completion_tokens=9, messages=[{"role": "user", "content": "hi"}],
              output_text=f'<tool_call>{{"name": "f", "arguments": {{"a": {value}}}}}</tool_call>',
              sampling={"tool_choice": "auto", "tool_parser": "hermes"})
    body = json.loads(json.dumps(output_line([job]), allow_nan=False))["response"]["body"]
    ended = body["stop_reason"] if endpoint == "/v1/messages" else body["choices"][0]["finish_reason"]
    assert ended not in ("tool_use", "tool_calls")


@pytest.mark.parametrize("request_type,body", [
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]}), (CompletionRequest, {"prompt": "p"})])
def test_several_choices_of_a_greedy_request_are_refused_as_vllm_refuses_them(request_type, body):
    # n=3 with temperature 0 made three jobs that answer the same text (three times the tokens, for one answer);
    # vLLM's SamplingParams refuses it ("n must be 1 when using greedy sampling")
    with pytest.raises(OpenAIError) as exc:
        request_type.model_validate({**body, "n": 3, "temperature": 0}).check()
    assert exc.value.param == "n" and "n must be 1 when using greedy sampling (temperature 0)" in str(exc.value)
    request_type.model_validate({**body, "n": 3, "temperature": 0.5}).check()  # sampled: choices that differ
    request_type.model_validate({**body, "n": 1, "temperature": 0}).check()
    (bad,) = parse_file(chat("g", n=2, temperature=0).encode(), "/v1/chat/completions", 3600).invalid
    assert "n must be 1 when using greedy sampling" in bad.message
