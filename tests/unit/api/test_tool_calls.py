"""Tool calling: a forced tool choice's schema, the calls read back from its text, and the request checks."""

from __future__ import annotations

import functools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from app.batch.objects import output_line
from app.db.models import Job
from app.openai_schemas import ChatCompletionRequest, OpenAIError, chat_completion
from app.schemas import ChatMessage, JobCreate
from app.tool_calls import AnswerStream, ToolSpec, call_id, forced_schema, read_answer, template_messages
from app.tool_syntax import SYNTAXES

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "today's weather",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}  # no parameters: it takes none
USER = [{"role": "user", "content": "Weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def tools() -> list[ToolSpec]:
    return [ToolSpec.model_validate(WEATHER), ToolSpec.model_validate(CLOCK)]


def test_a_named_choice_generates_that_functions_arguments():
    assert forced_schema(tools(), NAMED) == WEATHER["function"]["parameters"]
    assert forced_schema(tools(), {"type": "function", "function": {"name": "get_time"}}) == {
        "type": "object", "properties": {}}


def test_required_generates_a_list_of_calls_each_naming_one_tool():
    schema = forced_schema(tools(), "required")
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    names = [c["properties"]["name"]["enum"] for c in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    assert schema["items"]["anyOf"][0]["properties"]["parameters"] == WEATHER["function"]["parameters"]
    assert forced_schema(tools(), "required", parallel=False)["maxItems"] == 1


def test_the_schemas_compile_as_vllms_grammar_backend_reads_them():
    xgrammar = pytest.importorskip("xgrammar")
    for choice in ("required", NAMED):
        xgrammar.Grammar.from_json_schema(json.dumps(forced_schema(tools(), choice)))


def calls(job_id: str, choice, text: str, reason: str = "stop"):
    return read_answer(job_id, {"tool_choice": choice}, text, reason).tool_calls


def test_forced_calls_read_back_from_the_text():
    text = json.dumps([{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time",
                                                                                  "parameters": {}}])
    got = calls("job_abc", "required", text)
    assert [c["function"]["name"] for c in got] == ["get_weather", "get_time"]
    assert json.loads(got[0]["function"]["arguments"]) == {"city": "Paris"}
    assert [c["id"] for c in got] == ["call_abc_0", "call_abc_1"]  # stable: every read of the job agrees
    assert calls("job_abc", NAMED, '{"city": "Rome"}') == [
        {"id": "call_abc_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]
    assert calls("job_abc", None, "plain text") is None  # a free choice: the answer is text
    cut = read_answer("job_abc", {"tool_choice": "required"}, '[{"name": "get_weather", "param', "length")
    assert (cut.content, cut.tool_calls, cut.finish_reason) == ('[{"name": "get_weather", "param', None, "length")


def test_finish_reason_is_openais():
    assert read_answer("j", {"tool_choice": "required"}, "[]", "stop").finish_reason == "tool_calls"
    named = read_answer("j", {"tool_choice": NAMED}, "{}", "stop")
    assert named.finish_reason == "stop" and named.content is None  # OpenAI ends a named call with stop
    assert read_answer("j", {"tool_choice": None}, "hello", None) == read_answer("j", None, "hello", "stop")
    auto = read_answer("j", {"tool_choice": "auto", "tool_parser": "hermes"},
                       'Let me look.<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', "stop")
    assert auto.content == "Let me look." and auto.finish_reason == "tool_calls"
    assert read_answer("j", {"tool_choice": "auto", "tool_parser": "hermes"}, "Hi!", "stop").tool_calls is None


def test_calls_cut_by_max_tokens_end_in_length_streamed_or_not():
    # OpenAI's length says the answer was cut (more calls, a call's arguments, may be missing), which tool_calls
    # would hide: here max_tokens cut the answer before its call's end tag, where the call is read all the same
    auto = {"tool_choice": "auto", "tool_parser": "hermes"}
    cut = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
    plain = read_answer("j", auto, cut, "length")
    assert plain.tool_calls and plain.finish_reason == "length"
    stream = AnswerStream("j", auto)
    for piece in (cut[:20], cut[20:]):
        stream.feed(piece)
    assert stream.end("length")[3] == plain  # the stream's last chunk says what the plain answer says
    whole = read_answer("j", {"tool_choice": "required"}, '[{"name": "get_time", "parameters": {}}]', "length")
    assert whole.tool_calls and whole.finish_reason == "length"  # the list closed on the last token: cut all the same


HERMES = SYNTAXES["hermes"]


@pytest.mark.parametrize("text,content,raw", [
    ("It is sunny.", "It is sunny.", None),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None,
     [("get_weather", '{"city": "Paris"}')]),
    ('Checking.\n<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": '
     '{"x": 1}}</tool_call>', "Checking.\n", [("a", "{}"), ("b", '{"x": 1}')]),
    ('<tool_call>{"name": "a", "arguments": {"x": 1}}', None, [("a", '{"x": 1}')]),  # the end tag cut off
    ('<tool_call>{"name": "a", "argu', '<tool_call>{"name": "a", "argu', None),  # no whole call: all text
    ('<tool_call>["a"]</tool_call>', '<tool_call>["a"]</tool_call>', None),
])
def test_hermes_syntax_splits_content_and_calls(text, content, raw):
    assert HERMES.split(text) == (content, raw)


def test_hermes_stream_shows_only_what_surely_is_content():
    assert HERMES.content_so_far("Hello <tool") == len("Hello ")  # "<tool" may become "<tool_call>"
    assert HERMES.content_so_far("a < b") == len("a < b")
    assert HERMES.content_so_far('ok<tool_call>{"na') == 2


LLAMA3 = SYNTAXES["llama3_json"]


@pytest.mark.parametrize("text,content,raw", [
    ("It is sunny.", "It is sunny.", None),
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [("get_weather", '{"city": "Paris"}')]),
    ('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}', None,
     [("a", "{}"), ("b", '{"x": 1}')]),
    (' {"name": "a", "parameters": {"x": 1}} ', None, [("a", '{"x": 1}')]),
    ('{"name": "a", "parame', '{"name": "a", "parame', None),  # cut short: all text
    ('{"city": "Paris"}', '{"city": "Paris"}', None),  # JSON, but no call
    ('Sure. {"name": "a", "parameters": {}}', 'Sure. {"name": "a", "parameters": {}}', None),  # calls come first
])
def test_llama3_json_syntax_reads_calls_that_are_the_whole_answer(text, content, raw):
    assert LLAMA3.split(text) == (content, raw)


def test_llama3_json_stream_holds_back_what_may_be_a_call():
    assert LLAMA3.content_so_far("") == 0 and LLAMA3.content_so_far("  {") == 0
    assert LLAMA3.content_so_far("<|pyt") == 0 and LLAMA3.content_so_far("<|python_tag|>{") == 0
    assert LLAMA3.content_so_far("The weather") == len("The weather")
    assert LLAMA3.content_so_far("The weather {", known=3) == len("The weather {")  # shown as content already
    stream = AnswerStream("job_l", {"tool_choice": "auto", "tool_parser": "llama3_json"})
    fed = [stream.feed(p)[1:] for p in ['{"name": "get_time", ', '"parameters": {}}']]
    _, rest, calls, answer = stream.end("stop")
    assert fed == [("", None), ("", [{"index": 0, "id": "call_l_0", "type": "function",
                                      "function": {"name": "get_time", "arguments": "{}"}}])]
    assert (rest, calls) == ("", None) and answer.content is None and answer.finish_reason == "tool_calls"


def streamed_calls(deltas: list[dict]) -> list[dict]:
    """Calls put together from their stream's deltas, as a client does."""
    calls: dict[int, dict] = {}
    for d in deltas:
        call = calls.setdefault(d["index"], {"id": d.get("id"), "type": "function",
                                             "function": {"name": d["function"].get("name"), "arguments": ""}})
        call["function"]["arguments"] += d["function"].get("arguments", "")
    return [calls[k] for k in sorted(calls)]


def test_auto_streams_the_content_then_each_call_as_it_comes():
    sampling = {"tool_choice": "auto", "tool_parser": "hermes"}
    stream = AnswerStream("job_s", sampling)
    pieces = ["Let", " me <", "tool_call>{\"name\": \"get_weather\",", " \"arguments\": {\"ci", "ty\": \"Oslo\"}",
              "}</tool_call>\n<tool_call>{\"name\": \"get_time\", \"arguments\": {}}</tool_call>"]
    fed = [stream.feed(p)[1:] for p in pieces]
    _, rest, calls, answer = stream.end("stop")
    deltas = [d for _, ds in fed for d in ds or ()] + (calls or [])
    assert [d["function"].get("arguments") for d in deltas] == ['{"ci', 'ty": "Oslo"}', "{}"]  # as they came
    assert [d.get("id") for d in deltas] == ["call_s_0", None, "call_s_1"]
    assert streamed_calls(deltas) == answer.tool_calls  # the stream adds up to the answer
    assert "".join(t for t, _ in fed) + rest == "Let me " and answer.content == "Let me "
    assert answer.finish_reason == "tool_calls" and calls is None
    one = AnswerStream("job_o", {**sampling, "parallel_tool_calls": False})  # the first call only
    sent = [d for p in pieces for d in one.feed(p)[2] or ()] + (one.end("stop")[2] or [])
    assert [c["function"]["name"] for c in streamed_calls(sent)] == ["get_weather"]
    plain = AnswerStream("job_p", sampling)  # no call: every character is shown, the held-back tail at the end
    shown = "".join(plain.feed(p)[1] for p in ["1 <", " 2"]) + plain.end("stop")[1]
    assert shown == "1 < 2"
    free = AnswerStream("job_t", None)
    assert free.feed("abc") == ("", "abc", None)
    assert free.end("length") == ("", "", None, read_answer("job_t", None, "abc", "length"))  # the whole answer


def test_a_named_call_streams_its_arguments_as_they_come():
    forced = AnswerStream("job_f", {"tool_choice": NAMED})
    deltas = [forced.feed(p)[1:] for p in [" ", '{"city":', "", ' "Rome"}']]
    assert deltas[0] == ("", None)  # blank so far: no call yet
    assert deltas[1] == ("", [{"index": 0, "id": "call_f_0", "type": "function",
                               "function": {"name": "get_weather", "arguments": ' {"city":'}}])
    assert deltas[2] == ("", None) and deltas[3] == ("", [{"index": 0, "function": {"arguments": ' "Rome"}'}}])
    _, rest, calls, answer = forced.end("stop")
    assert (rest, calls) == ("", None)  # nothing left to send
    assert answer.tool_calls[0]["function"]["arguments"] == ' {"city": "Rome"}' and answer.finish_reason == "stop"
    blank = AnswerStream("job_b", {"tool_choice": NAMED})
    assert blank.feed("  ") == ("", "", None) and blank.end("length")[1:3] == ("  ", None)  # no call: the text as is
    required = AnswerStream("job_r", {"tool_choice": "required"})
    pieces = ['[{"name": "get_weather", "param', 'eters": {"city":"Os', 'lo"}}, {"parameters": {"q": ["a"]}, ',
              '"name": "search"}]']
    fed = [required.feed(p)[1:] for p in pieces]
    _, rest, calls, answer = required.end("stop")
    deltas = [d for _, ds in fed for d in ds or ()] + (calls or [])
    assert fed[0] == ("", None) and fed[1][1][0]["function"] == {"name": "get_weather", "arguments": '{"city":"Os'}
    assert streamed_calls(deltas) == answer.tool_calls and answer.finish_reason == "tool_calls"
    assert answer.tool_calls[0]["function"]["arguments"] == '{"city":"Oslo"}'  # as generated, as streamed
    assert answer.tool_calls[1]["function"] == {"name": "search", "arguments": '{"q": ["a"]}'}  # named after
    # max_tokens cut the list inside a call's arguments: the answer is the calls streamed, not the raw text again
    cut = AnswerStream("job_c", {"tool_choice": "required"})
    fed = [cut.feed(p)[1:] for p in pieces[:2]]
    _, rest, calls, answer = cut.end("length")
    deltas = [d for _, ds in fed for d in ds or ()] + (calls or [])
    assert rest == "" and answer.content is None and answer.finish_reason == "length"
    assert streamed_calls(deltas) == answer.tool_calls == [
        {"id": "call_c_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Os'}}]


def test_job_create_checks_the_tools_and_keeps_the_constraint():
    spec = JobCreate(messages=USER, tools=[WEATHER, CLOCK], tool_choice=NAMED)
    sampling = spec.sampling(16)
    assert sampling["structured_outputs"] == {"json": WEATHER["function"]["parameters"]}
    assert sampling["tool_choice"] == NAMED
    assert JobCreate(messages=USER, tools=[WEATHER], tool_choice="none").sampling(16)["tool_choice"] is None
    for bad, words in [
        (dict(messages=USER, tool_choice="required"), "needs tools"),
        (dict(messages=USER, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
         "not among the tools"),
        (dict(messages=USER, tools=[WEATHER, WEATHER]), "different names"),
        (dict(prompt="x", tools=[WEATHER]), "send messages"),
        (dict(messages=USER, tools=[WEATHER], tool_choice="required", structured_outputs={"choice": ["a"]}),
         "not both"),
        (dict(messages=USER, tools=[{"type": "function", "function": {"name": ""}}]), "at least 1 character"),
        (dict(messages=USER, tool_choice="auto"), "needs tools"),
        (dict(messages=USER, tools=[WEATHER], tool_choice="maybe"), "tool_choice must be"),
        (dict(messages=USER, tools=[{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "maximum": float("nan")}}}]), "not finite")]:
        with pytest.raises(ValidationError, match=words):
            JobCreate(**bad)


@pytest.mark.parametrize("name", ["github.create_issue", "weather:today", "get weather", "f" * 80])
def test_a_function_of_any_name_vllm_takes_is_offered_and_forced(name):
    # vLLM's FunctionDefinition takes any name (MCP tools are often named server.tool); coserve held names to
    # OpenAI's ^[A-Za-z0-9_-]{1,64}$ and answered a 400
    tool = {"type": "function", "function": {"name": name, "parameters": WEATHER["function"]["parameters"]}}
    named = {"type": "function", "function": {"name": name}}
    spec = JobCreate(messages=USER, tools=[tool, CLOCK], tool_choice=named)
    assert spec.sampling(16)["structured_outputs"] == {"json": WEATHER["function"]["parameters"]}
    required = JobCreate(messages=USER, tools=[tool, CLOCK], tool_choice="required").sampling(16)
    assert required["structured_outputs"]["json"]["items"]["anyOf"][0]["properties"]["name"] == {
        "type": "string", "enum": [name]}
    answer = read_answer("job_n", {"tool_choice": "required"}, json.dumps([{"name": name, "parameters": {}}]), "stop")
    assert answer.tool_calls[0]["function"]["name"] == name


def test_history_with_calls_reaches_the_template_with_arguments_as_objects():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = [ChatMessage(role="assistant", content="", tool_calls=[call]),
               ChatMessage(role="tool", content="sunny", tool_call_id="call_1")]
    stored = [m.stored() for m in history]
    assert "name" not in stored[0] and stored[1]["tool_call_id"] == "call_1"
    assert template_messages(stored)[0]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert stored[0]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # the job keeps the text
    with pytest.raises(ValidationError, match="only an assistant"):
        ChatMessage(role="user", content="x", tool_calls=[call])
    with pytest.raises(ValidationError, match="only a tool message"):
        ChatMessage(role="user", content="x", tool_call_id="call_1")


def test_openai_request_maps_tools():
    body = {"messages": [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c"}], "tools": [WEATHER], "tool_choice": "required",
        "parallel_tool_calls": False}
    req = ChatCompletionRequest.model_validate(body)
    spec = req.job_spec(messages=req.chat_messages())
    assert spec.tool_choice == "required" and spec.sampling(16)["structured_outputs"]["json"]["maxItems"] == 1
    assert spec.messages[1].tool_calls[0].id == "c" and spec.messages[2].tool_call_id == "c"
    for choice in ({}, {"tool_choice": "auto"}):  # OpenAI's default where tools are given (the server's parser)
        req = ChatCompletionRequest.model_validate({"messages": USER, "tools": [WEATHER], **choice})
        spec = req.job_spec(messages=req.chat_messages())
        assert spec.tool_choice == "auto" and spec.sampling(16)["structured_outputs"] is None
    # an explicit null (the openai SDK sends tool_choice=None as one) is kept, as vLLM keeps it: the tools reach
    # the template and the answer is text
    req = ChatCompletionRequest.model_validate({"messages": USER, "tools": [WEATHER], "tool_choice": None})
    spec = req.job_spec(messages=req.chat_messages())
    assert spec.tool_choice is None and spec.sampling(16)["tool_choice"] is None and spec.tools
    req = ChatCompletionRequest.model_validate({"messages": USER, "tools": [WEATHER], "tool_choice": "maybe"})
    with pytest.raises(OpenAIError) as exc:
        req.job_spec(messages=req.chat_messages())
    assert exc.value.param == "tool_choice"
    # a choice naming no offered tool, or offered none: the error names tool_choice (it named no field)
    for bad in ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                {"tool_choice": "required"}):
        req = ChatCompletionRequest.model_validate({"messages": USER, **bad})
        with pytest.raises(OpenAIError) as exc:
            req.job_spec(messages=req.chat_messages())
        assert exc.value.param == "tool_choice" and exc.value.message.startswith("tool_choice: "), exc.value.message


def test_answers_carry_the_calls_and_no_content():
    got = calls("job_abc", NAMED, '{"city": "Rome"}')
    body = chat_completion("chatcmpl-job_abc", "m", 0, None, "stop", 5, 7, tool_calls=got)
    message = body["choices"][0]["message"]
    assert message["content"] is None and message["tool_calls"] == got
    job = Job(id="job_abc", endpoint="/v1/chat/completions", model="m", output_text='[{"name": "get_time", '
              '"parameters": {}}]', finish_reason="stop", sampling={"tool_choice": "required"}, prompt_tokens=5,
              completion_tokens=9, custom_id="r1")
    line = output_line([job])["response"]["body"]["choices"][0]
    assert line["finish_reason"] == "tool_calls" and line["message"]["tool_calls"][0]["function"]["name"] == "get_time"


def test_required_lifts_each_tools_definitions_to_the_root_where_refs_resolve():
    with_defs = {"type": "function", "function": {"name": "add_person", "parameters": {
        "type": "object", "properties": {"person": {"$ref": "#/$defs/Person"}},
        "$defs": {"Person": {"type": "object", "properties": {"name": {"type": "string"}}}}}}}
    schema = forced_schema([ToolSpec.model_validate(with_defs), ToolSpec.model_validate(CLOCK)], "required")
    assert schema["$defs"] == {"Person": {"type": "object", "properties": {"name": {"type": "string"}}}}
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    xgrammar = pytest.importorskip("xgrammar")
    xgrammar.Grammar.from_json_schema(json.dumps(schema))  # the $ref resolves
    clash = json.loads(json.dumps(with_defs).replace("add_person", "other").replace('"string"', '"integer"'))
    with pytest.raises(ValidationError, match="differently"):
        JobCreate(messages=USER, tools=[with_defs, clash], tool_choice="required")


def test_one_call_at_most_when_parallel_calls_are_off_and_none_from_an_empty_named_text():
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    auto = {"tool_choice": "auto", "tool_parser": "hermes"}
    assert len(read_answer("j", auto, text, "stop").tool_calls) == 2
    assert len(read_answer("j", {**auto, "parallel_tool_calls": False}, text, "stop").tool_calls) == 1
    assert read_answer("j", {"tool_choice": NAMED}, "  ", "length").tool_calls is None


def test_a_template_that_refuses_the_history_is_the_clients_error(tiny_model_dir, tmp_path):
    import shutil

    from app.auth import Principal
    from app.services.jobs import JobValidationError, build_job
    from app.services.model_info import ChatTemplateError, encode_input
    from app.settings import Settings

    model = tmp_path / "strict"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}{% if m.tool_calls is defined and m.tool_calls | length > 1 %}"
                               "{{ raise_exception('one tool call per message') }}{% endif %}{{ m.content }}"
                               "{% endfor %}")
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    call = {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    history = [*USER, {"role": "assistant", "content": "", "tool_calls": [call, {**call, "id": "d"}]}]
    with pytest.raises(ChatTemplateError, match="one tool call per message"):
        encode_input(str(model), None, history)
    settings = Settings(model=str(model), model_name="strict", backend="vllm")
    with pytest.raises(JobValidationError, match="one tool call per message") as exc:
        build_job(settings, Principal("k", "t", "paid", False), JobCreate(model="strict", messages=history))
    assert exc.value.param == "messages"


def test_the_call_scanner_reads_strings_nesting_and_arguments_that_are_no_object():
    from app.tool_call_scan import CallScanner, raw_arguments

    text = ('[{"name": "a\\"}", "parameters": {"s": "x}\\\\\\"{", "n": [1, {"y": null}]}}, '
            '{"name": "b", "parameters": "{}"}]')
    scanner = CallScanner(2)
    for c in text:  # one character at a time: every prefix is read as the whole text is
        scanner.feed(c)
    first, second = scanner.calls
    assert first.name == 'a"}' and first.arguments(text) == '{"s": "x}\\\\\\"{", "n": [1, {"y": null}]}'
    assert second.name == "b" and not second.streamable and second.arguments(text) is None
    assert raw_arguments(text, 2) == [first.arguments(text), None]
    stream = AnswerStream("job_x", {"tool_choice": "required"})
    fed = [d for c in text for d in stream.feed(c)[2] or ()]
    _, rest, calls, answer = stream.end("stop")
    assert [d["index"] for d in calls] == [1] and calls[0]["function"]["arguments"] == "{}"  # the string, whole
    assert streamed_calls(fed + calls) == answer.tool_calls


MISTRAL = SYNTAXES["mistral"]


@pytest.mark.parametrize("text,content,raw", [
    ("It is sunny.", "It is sunny.", None),
    ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "t", "arguments": {}}]', None,
     [("get_weather", '{"city": "Paris"}'), ("t", "{}")]),  # tokenizers before v11
    ('Sure.[TOOL_CALLS]get_weather[ARGS]{"city":"Oslo"}[TOOL_CALLS]t[ARGS]{}', "Sure.",
     [("get_weather", '{"city":"Oslo"}'), ("t", "{}")]),  # v11 on
    ('[TOOL_CALLS] [{"name": "a", "argu', '[TOOL_CALLS] [{"name": "a", "argu', None),  # cut short: all text
    ("[TOOL_CALLS]get_weather{}", "[TOOL_CALLS]get_weather{}", None),  # no [ARGS]
])
def test_mistral_syntax_reads_both_forms_of_its_calls(text, content, raw):
    assert MISTRAL.split(text) == (content, raw)


def test_mistral_calls_stream_with_ids_its_templates_take():
    sampling = {"tool_choice": "auto", "tool_parser": "mistral"}
    stream = AnswerStream("job_m", sampling)
    pieces = ["Checking", " [TOOL", '_CALLS] [{"name": "get_weather", "arguments": {"ci', 'ty": "Rome"}}]']
    fed = [stream.feed(p)[1:] for p in pieces]
    _, rest, calls, answer = stream.end("stop")
    deltas = [d for _, ds in fed for d in ds or ()] + (calls or [])
    assert "".join(t for t, _ in fed) + rest == "Checking " == answer.content
    assert streamed_calls(deltas) == answer.tool_calls and len(deltas) == 2  # named, then the rest of its arguments
    ids = {call_id(f"job_{i}", k, "mistral") for i in range(50) for k in range(3)}
    assert len(ids) == 150 and all(len(i) == 9 and i.isalnum() for i in ids)
    assert answer.tool_calls[0]["id"] == call_id("job_m", 0, "mistral")
    v11 = AnswerStream("job_v", sampling)  # name[ARGS]{...}: the calls go out whole at the end
    fed = [v11.feed(p)[1:] for p in ["[TOOL_CALLS]get_time", "[ARGS]", "{}"]]
    _, rest, calls, answer = v11.end("stop")
    assert all(ds is None for _, ds in fed) and streamed_calls(calls) == answer.tool_calls


ARGUMENT_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=6),
                               lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                         max_size=3), max_leaves=6)
CALLS = st.lists(st.tuples(st.from_regex(r"[a-z_]{1,8}", fullmatch=True),
                           st.dictionaries(st.text(max_size=5), ARGUMENT_VALUES, max_size=3)), min_size=1, max_size=3)


@given(calls=CALLS, cuts=st.lists(st.integers(0, 400), max_size=12), compact=st.booleans(),
       syntax=st.sampled_from(["required", "hermes", "llama3_json", "mistral"]))
@settings(max_examples=300, deadline=None)
def test_any_chunking_of_the_calls_streams_deltas_that_add_up_to_the_answer(calls, cuts, compact, syntax):
    separators = (",", ":") if compact else (", ", ": ")
    dumps = functools.partial(json.dumps, separators=separators)  # escapes as json does: quotes, backslashes
    key = "parameters" if syntax in ("required", "llama3_json") else "arguments"
    objects = [dumps({"name": name, key: arguments}) for name, arguments in calls]
    text = {"required": "[" + ", ".join(objects) + "]",
            "hermes": "Let me see. " + "".join(f"<tool_call>\n{o}\n</tool_call>" for o in objects),
            "llama3_json": "; ".join(objects), "mistral": "[TOOL_CALLS] [" + ", ".join(objects) + "]"}[syntax]
    sampling = {"tool_choice": "required"} if syntax == "required" else {"tool_choice": "auto", "tool_parser": syntax}
    stream = AnswerStream("job_h", sampling)
    bounds = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    fed = [stream.feed(text[a:b])[1:] for a, b in zip(bounds, bounds[1:])]
    _, rest, more, answer = stream.end("stop")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in answer.tool_calls] == calls
    assert streamed_calls([d for _, ds in fed for d in ds or ()] + (more or [])) == answer.tool_calls
    assert "".join(t for t, _ in fed) + rest == (answer.content or "")


PERSON = {"type": "object", "properties": {"who": {"$ref": "#/$defs/Person"}},
          "$defs": {"Person": {"type": "object", "properties": {"name": {"type": "string"}}}}}
NUMBER_PERSON = {**PERSON, "$defs": {"Person": {"type": "object", "properties": {"name": {"type": "integer"}}}}}
NOT_FINITE = {"type": "object", "maximum": float("nan")}
EMPTY = {"type": "object", "properties": {}}


def refusal(route: str, tools: list[tuple[str, dict]], choice: str | None = None) -> OpenAIError:
    """The 400 of a request on ``route`` offering ``tools`` (name, parameters), forced where ``choice`` is
    "required" (written as the route writes it)."""
    from app.anthropic_schemas import MessagesRequest
    from app.responses_schemas import ResponsesRequest

    if route == "messages":
        raw = {"model": "m", "max_tokens": 8, "messages": USER,
               "tools": [{"name": n, "input_schema": p} for n, p in tools],
               **({"tool_choice": {"type": "any"}} if choice else {})}
        call = functools.partial(MessagesRequest.model_validate(raw).chat_request, raw)
    elif route == "responses":
        raw = {"model": "m", "input": "hi", "tools": [{"type": "function", "name": n, "parameters": p}
                                                     for n, p in tools], **({"tool_choice": choice} if choice else {})}
        call = functools.partial(ResponsesRequest.model_validate(raw).chat_request, raw, [])
    else:
        req = ChatCompletionRequest.model_validate({
            "messages": USER, "tools": [{"type": "function", "function": {"name": n, "parameters": p}}
                                        for n, p in tools], **({"tool_choice": choice} if choice else {})})
        call = functools.partial(req.job_spec, messages=req.chat_messages())
    with pytest.raises(OpenAIError) as exc:
        call()
    return exc.value


# the field of a tool's parameters and of its name as each route's request writes them
PARAMETERS = {"chat": "function.parameters", "responses": "parameters", "messages": "input_schema"}
NAME = {"chat": "function.name", "responses": "name", "messages": "name"}


@pytest.mark.parametrize("route", ["chat", "responses", "messages"])
def test_a_tools_error_names_the_tool_and_its_field_as_the_route_writes_them(route):
    # these named no field (param None, reported as "body"), and Messages' tool_choice any was called 'required'
    clash = refusal(route, [("a", PERSON), ("b", NUMBER_PERSON)], "required")
    assert clash.param == f"tools.1.{PARAMETERS[route]}", clash.message
    assert clash.message.startswith(f"tools.1.{PARAMETERS[route]}: ") and "$defs/Person" in clash.message
    assert ("'required'" in clash.message) == (route != "messages"), clash.message
    assert (route != "messages") or "tool_choice {\"type\": \"any\"}" in clash.message
    twice = refusal(route, [("a", EMPTY), ("b", EMPTY), ("a", EMPTY)])
    assert twice.param == f"tools.2.{NAME[route]}" and "tools.0" in twice.message, twice.message
    nan = refusal(route, [("a", EMPTY), ("b", NOT_FINITE)])
    assert nan.param == f"tools.1.{PARAMETERS[route]}" and "not finite" in nan.message, nan.message
    assert "function" not in nan.message.partition(":")[0] or route == "chat"



@pytest.mark.parametrize("cut", [
    'Let me look. <tool_call>{"name": "get_weather", "arguments": {"city": "Os',
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n'
    '<tool_call>{"name": "get_weather", "arguments": {"c'])
def test_a_hermes_call_cut_by_max_tokens_answers_as_it_streamed(cut):
    # the stream sent the cut call's name and arguments so far, then the whole text again as content (the plain
    # answer read none: the last call does not parse): a client assembled another answer than the plain one
    auto = {"tool_choice": "auto", "tool_parser": "hermes"}
    stream = AnswerStream("job_h", auto)
    fed = [stream.feed(cut[i:i + 7])[1:] for i in range(0, len(cut), 7)]
    _, rest, more, answer = stream.end("length")
    assert "".join(content for content, _ in fed) + rest == (answer.content or "")
    assert streamed_calls([d for _, ds in fed for d in ds or ()] + (more or [])) == answer.tool_calls
    assert answer == read_answer("job_h", auto, cut, "length") and answer.finish_reason == "length"
    assert answer.content == ("Let me look. " if cut.startswith("Let") else None)
    assert answer.tool_calls[-1]["function"] == {"name": "get_weather", "arguments": cut[cut.rindex('{"c'):]}
    # a call whose name has not come is no call yet: the text is the content, streamed or not
    named_not = '<tool_call>{"na'
    stream = AnswerStream("job_h", auto)
    fed = [stream.feed(named_not)[1:]]
    _, rest, more, answer = stream.end("length")
    assert fed[0][0] + rest == answer.content == named_not and more is None and answer.tool_calls is None


def choice_refusal(route: str, choice: str | dict) -> OpenAIError:
    """The 400 of a request on ``route`` that gives ``tool_choice`` (as the route writes it) and no tools."""
    from app.anthropic_schemas import MessagesRequest
    from app.responses_schemas import ResponsesRequest

    if route == "messages":
        raw = {"model": "m", "max_tokens": 8, "messages": USER, "tool_choice": choice}
        call = functools.partial(MessagesRequest.model_validate(raw).chat_request, raw)
    elif route == "responses":
        raw = {"model": "m", "input": "hi", "tool_choice": choice}
        call = functools.partial(ResponsesRequest.model_validate(raw).chat_request, raw, [])
    else:
        req = ChatCompletionRequest.model_validate({"messages": USER, "tool_choice": choice})
        call = functools.partial(req.job_spec, messages=req.chat_messages())
    with pytest.raises(OpenAIError) as exc:
        call()
    return exc.value


@pytest.mark.parametrize(("route", "choice", "words"), [
    ("chat", "required", "tool_choice: 'required' needs tools"),
    ("chat", {"type": "function", "function": {"name": "f"}},
     'tool_choice: {"type": "function", "function": {"name": ...}} needs tools'),
    ("messages", {"type": "any"}, 'tool_choice: {"type": "any"} needs tools'),
    ("messages", {"type": "tool", "name": "f"}, 'tool_choice: {"type": "tool", "name": ...} needs tools'),
    ("responses", "required", "tool_choice: 'required' needs tools"),
    ("responses", {"type": "function", "name": "f"}, 'tool_choice: {"type": "function", "name": ...} needs tools')])
def test_a_choice_of_tools_with_none_given_is_refused_in_the_routes_words(route, choice, words):
    # Messages' {"type": "any"} was called chat's 'required', and a named choice was shown as chat's Python dict
    # ({'type': 'function', 'function': {'name': 'f'}}) on every route
    refused = choice_refusal(route, choice)
    assert refused.param == "tool_choice" and refused.message.startswith(words), refused.message
    assert "{'" not in refused.message and ("'f'" in refused.message) == ("'name'" in str(choice)), refused.message


def job_refusal(route: str, choice: str | dict | None, **settings: str) -> OpenAIError:
    """The 400 a server of ``settings`` answers on ``route`` to a request offering a tool, with ``tool_choice``
    as the route writes it (None: left out), as the route's answer words it: its job refused (a refusal of the
    server's backend or tool-call parser), in the route's terms."""
    from app.anthropic_schemas import MessagesRequest, in_messages_terms
    from app.api.openai_compat import openai_refusals
    from app.auth import Principal
    from app.responses_schemas import ResponsesRequest, in_responses_terms
    from app.services.jobs import job_values
    from app.settings import Settings

    server = Settings(model_name="m", **settings)
    given = {} if choice is None else {"tool_choice": choice}
    if route == "messages":
        raw = {"model": "m", "max_tokens": 8, "messages": USER, **given,
               "tools": [{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}]}
        _, spec = MessagesRequest.model_validate(raw).chat_request(raw)
        in_terms = in_messages_terms
    else:
        raw = {"model": "m", "input": "hi", **given,
               "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}]}
        _, spec = ResponsesRequest.model_validate(raw).chat_request(raw, [])
        in_terms = functools.partial(in_responses_terms, raw=raw)
    with pytest.raises(OpenAIError) as exc, openai_refusals():
        job_values(server, Principal("k", "t", "paid", False), spec, count_tokens=False)
    return in_terms(exc.value)


# each route's words for the choices ("required" is the Responses API's own, as chat's); the named one's
MESSAGES_FORMS = {"auto": '{"type": "auto"}', "none": '{"type": "none"}', "required": '{"type": "any"}',
                  "named": '{"type": "tool", "name": ...}'}
RESPONSES_FORMS = {"auto": "'auto'", "none": "'none'", "required": "'required'",
                   "named": '{"type": "function", "name": ...}'}
CHAT_WORDS = ("'required'", "'auto'", "'none'", '"function": {"name"')  # chat's choices, as its errors write them


@pytest.mark.parametrize(("route", "choice", "forms"), [
    ("messages", {"type": "any"}, MESSAGES_FORMS),
    ("messages", {"type": "tool", "name": "get_weather"}, MESSAGES_FORMS),
    ("responses", "required", RESPONSES_FORMS),
    ("responses", {"type": "function", "name": "get_weather"}, RESPONSES_FORMS)])
@pytest.mark.parametrize("parser", [None, "hermes"])
def test_a_forced_choice_the_own_engine_cannot_generate_is_refused_in_the_routes_words(route, choice, forms, parser):
    # Messages' refusal named chat's 'required', 'none' and 'auto' (its choices are {"type": ...}), and on both routes
    # the choice left to send was chat's form
    refused = job_refusal(route, choice, backend="torch", **({"tool_call_parser": parser} if parser else {}))
    assert refused.param == "tool_choice" and "COSERVE_BACKEND=vllm" in refused.message, refused.message
    assert f"tool_choice {forms['required']} or {forms['named']}" in refused.message, refused.message
    left = f"send tool_choice {forms['none']} or tool_choice {forms['auto']}" if parser else (
        f"send tool_choice {forms['none']} (this server has no parser for the calls of tool_choice {forms['auto']}")
    assert left in refused.message, refused.message
    assert route == "responses" or not any(word in refused.message for word in CHAT_WORDS), refused.message


@pytest.mark.parametrize(("route", "choice", "forms"), [
    ("messages", {"type": "auto"}, MESSAGES_FORMS), ("messages", None, MESSAGES_FORMS),
    ("responses", "auto", RESPONSES_FORMS), ("responses", None, RESPONSES_FORMS)])
def test_auto_without_a_tool_call_parser_is_refused_in_the_routes_words(route, choice, forms):
    # Messages' refusal named chat's "auto", "required" and "none" (its choices are {"type": ...}); Responses' its
    # named choice only
    refused = job_refusal(route, choice, backend="vllm")
    assert refused.param == "tool_choice" and "COSERVE_TOOL_CALL_PARSER" in refused.message, refused.message
    assert refused.message.startswith(f"tool_choice {forms['auto']} (the default where tools are given)"), (
        refused.message)
    assert (f"send tool_choice {forms['required']}, tool_choice {forms['named']} or tool_choice {forms['none']}"
            in refused.message), refused.message
    assert route == "responses" or not any(word in refused.message for word in CHAT_WORDS), refused.message


def streamed_answer(sampling: dict, text: str, reason: str, size: int = 5) -> tuple[str, list[dict], object]:
    """The content and the calls a client puts together from a stream of ``text`` in pieces of ``size``, and the
    answer its last chunk says."""
    stream = AnswerStream("job_t", sampling)
    fed = [stream.feed(text[i:i + size])[1:] for i in range(0, len(text), size)]
    _, rest, more, answer = stream.end(reason)
    deltas = [d for _, ds in fed for d in ds or ()] + (more or [])
    return "".join(content for content, _ in fed) + rest, streamed_calls(deltas), answer


def answer_items(sampling: dict, text: str, reason: str, stop_reason: str | int | None = None,
                 size: int = 5) -> list:
    """The answer events a job of ``text`` (in pieces of ``size``) gives its routes' streams: a ``Piece`` each,
    then ``Finished`` with the engine's ``stop_reason``."""
    from app.services.answer_events import Finished, Piece

    stream = AnswerStream("job_t", sampling)
    items = [Piece(0, content, reasoning, calls, None, i, i // size + 1)
             for i in range(0, len(text), size) for reasoning, content, calls in [stream.feed(text[i:i + size])]]
    reasoning, rest, more, answer = stream.end(reason)
    if reasoning or rest or more:
        items.append(Piece(0, rest, reasoning, more, None, len(text), len(items) + 1))
    return items + [Finished(0, answer, 9, len(items), stop_reason=stop_reason)]


# a call cut inside its arguments: by a stop string, or a stop token id (vLLM's stop_reason a number then)
CUT_CALLS = [("required", '[{"name": "get_weather", "parameters": {"city": "Pa'),
             ("auto", 'Let me look. <tool_call>{"name": "get_weather", "arguments": {"city": "Pa'),
             (NAMED, '{"city": "Pa')]
CUT_BY = ["ris", 128009]


@pytest.mark.parametrize(("choice", "cut"), [
    ("required", '[{"name": "get_weather", "parameters": {"city": "Pa'),
    ("auto", 'Let me look. <tool_call>{"name": "get_weather", "arguments": {"city": "Pa')])
def test_a_call_a_stop_string_cut_never_ends_in_tool_calls_streamed_or_not(choice, cut):
    # a stop string matched inside a call's JSON: "required" answered the half call with finish_reason tool_calls
    # (a client runs it, and json.loads(arguments) fails); "auto" answered it as content though its stream had sent
    # the call. As streamed, and ending in stop (the engine's reason, as vLLM's test of a whole call says)
    sampling = {"tool_choice": choice, "tool_parser": "hermes"}
    plain = read_answer("job_t", sampling, cut, "stop")
    assert plain.finish_reason == "stop"
    content, calls, answer = streamed_answer(sampling, cut, "stop")
    assert answer == plain and calls == plain.tool_calls and content == (plain.content or "")
    assert plain.tool_calls[-1]["function"] == {"name": "get_weather", "arguments": '{"city": "Pa'}
    whole = read_answer("job_t", sampling, cut + '"}' + ("}]" if choice == "required" else "}</tool_call>"), "stop")
    assert whole.finish_reason == "tool_calls" and json.loads(whole.tool_calls[-1]["function"]["arguments"])


def test_a_hermes_block_that_is_no_call_stays_content_beside_the_good_calls():
    # one <tool_call> block that was no JSON lost the good calls around it (all the text came back as content, as
    # vLLM's hermes parser answers unstreamed), though the stream had sent them: now the good calls are answered,
    # the other block kept as content, streamed or not
    sampling = {"tool_choice": "auto", "tool_parser": "hermes"}
    text = ('Checking. <tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n<tool_call>not json</tool_call>'
            '\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')
    plain = read_answer("job_t", sampling, text, "stop")
    assert [c["function"] for c in plain.tool_calls] == [
        {"name": "get_time", "arguments": "{}"}, {"name": "get_weather", "arguments": '{"city": "Oslo"}'}]
    assert plain.content == "Checking. <tool_call>not json</tool_call>" and plain.finish_reason == "tool_calls"
    content, calls, answer = streamed_answer(sampling, text, "stop")
    assert answer == plain and calls == plain.tool_calls and content == plain.content


# a <tool_call> block that names a function and begins its arguments, though its JSON does not parse: the stream
# has sent it as a call by then (as vLLM's hermes stream does), so the plain answer takes it as one, its arguments as
# written; an answer with a call whose arguments do not parse never ends in tool_calls (the call must not run)
BROKEN_BLOCKS = [
    ('{"name": "get_time", "arguments": {"tz": "UTC"}', '{"tz": "UTC"}', "tool_calls"),  # the outer brace lost
    ('{"name": "get_time", "arguments": {"tz": "UTC",}}', '{"tz": "UTC",}', "stop"),  # a trailing comma
    ('{"name": "get_time", "arguments": {"tz": UTC}}', '{"tz": UTC}', "stop"),  # a bare word
    ('{"name": "get_time", "arguments": {"tz": "UTC"', '{"tz": "UTC"', "stop"),  # both braces lost
]


@pytest.mark.parametrize(("block", "arguments", "reason"), BROKEN_BLOCKS)
@pytest.mark.parametrize("size", [1, 4, 9])
def test_a_hermes_call_with_broken_json_keeps_the_indexes_streamed_or_not(block, arguments, reason, size):
    # the stream sent the broken block's call at index 0 and the next call's arguments after it (the scanner never
    # left the broken object), while the plain answer kept the block as content and the next call at index 0
    sampling = {"tool_choice": "auto", "tool_parser": "hermes"}
    text = (f'Checking. <tool_call>{block}</tool_call>\n'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')
    plain = read_answer("job_t", sampling, text, "stop")
    assert [c["function"] for c in plain.tool_calls] == [
        {"name": "get_time", "arguments": arguments}, {"name": "get_weather", "arguments": '{"city": "Oslo"}'}]
    assert plain.content == "Checking. " and plain.finish_reason == reason
    content, calls, answer = streamed_answer(sampling, text, "stop", size)
    assert answer == plain and calls == plain.tool_calls and content == plain.content


def test_messages_stop_at_the_end_of_the_turn_where_any_call_is_broken():
    # Messages read only the last call's arguments: a broken call before a good one answered tool_use (run them)
    from app.anthropic_schemas import stop_of

    text = ('<tool_call>{"name": "get_time", "arguments": {"tz": "UTC",}}</tool_call>\n'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')
    plain = read_answer("job_t", {"tool_choice": "auto", "tool_parser": "hermes"}, text, "stop")
    assert stop_of(plain.finish_reason, None, plain.tool_calls) == ("end_turn", None)


@pytest.mark.parametrize("text,raw", [
    ('{"name": "get_time", "parameters": {}} I asked for the time.', [("get_time", "{}")]),
    ('<|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "Oslo"}}'
     '\nThat is all.', [("get_time", "{}"), ("get_weather", '{"city": "Oslo"}')]),
    ('{"name": "get_time", "parameters": {}} and then {"name": "get_weather", "parameters": {"city": "Oslo"}}.',
     [("get_time", "{}"), ("get_weather", '{"city": "Oslo"}')]),
])
def test_llama3_json_text_after_the_calls_is_dropped_and_the_calls_stand_streamed_or_not(text, raw):
    # a Llama answer with words after its whole calls ended in stop, not tool_calls (a client that runs calls on
    # tool_calls ran none), its calls read only as cut ones. vLLM's llama3_json reader takes each object from a
    # "{" on, the text around them dropped, and answers tool_calls; its stream drops that text too
    sampling = {"tool_choice": "auto", "tool_parser": "llama3_json"}
    assert LLAMA3.split(text) == (None, raw)
    plain = read_answer("job_t", sampling, text, "stop")
    assert plain.finish_reason == "tool_calls" and plain.content is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in plain.tool_calls] == raw
    content, calls, answer = streamed_answer(sampling, text, "stop")
    assert answer == plain and calls == plain.tool_calls and content == ""
