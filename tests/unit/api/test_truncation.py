"""``truncation: "auto"`` (``fit_context``) with the default model's tokenizer and chat template, in a context of
512 tokens: the fewest oldest turns go, system messages and the newest message stay, a tool result goes with
its call."""

from __future__ import annotations

import pytest

from app.schemas import ChatMessage, JobCreate
from app.services.model_info import encode_input
from app.services.truncation import fit_context
from app.settings import Settings

WORDS = " ".join(f"word{i}" for i in range(40))  # ~80 tokens


@pytest.fixture
def settings(tmp_path, tiny_model_dir) -> Settings:
    return Settings(data_dir=tmp_path, model=str(tiny_model_dir), model_name="tiny", default_max_tokens=16,
                    backend="torch")


def spec_of(messages: list[dict], max_tokens: int = 64) -> JobCreate:
    return JobCreate(kind="interactive", messages=[ChatMessage(**m) for m in messages], max_tokens=max_tokens)


def tokens(settings: Settings, spec: JobCreate) -> int:
    return len(encode_input(settings.model, None, [m.stored() for m in spec.messages], None))


def conversation(turns: int) -> list[dict]:
    out = []
    for i in range(turns):
        out += [{"role": "user", "content": f"question {i}: {WORDS}"}, {"role": "assistant", "content": WORDS}]
    return out


def test_a_conversation_that_fits_is_left_as_it_is(settings):
    spec = spec_of([{"role": "system", "content": "Be brief"}, *conversation(1), {"role": "user", "content": "Hi"}])
    assert fit_context(settings, spec, 3) == (spec, 3)


@pytest.mark.parametrize("role", ["system", "developer"])
def test_the_fewest_oldest_turns_go_and_the_instructions_stay(settings, role):
    history = conversation(4)  # ~650 tokens with the input: over the context of 512 less 64 for the answer
    messages = [*history, {"role": role, "content": "Be brief"}, {"role": "user", "content": "And now?"}]
    fitted, input_from = fit_context(settings, spec_of(messages), len(history) + 1)
    kept = [m.stored() for m in fitted.messages]
    assert tokens(settings, fitted) + 64 <= 512
    assert kept[-2:] == messages[-2:] and kept == messages[len(messages) - len(kept):]  # a suffix: oldest gone
    one_more = spec_of(messages[len(messages) - len(kept) - 1:])
    assert tokens(settings, one_more) + 64 > 512  # keeping one more message would not fit: the fewest went
    assert input_from == len(kept) - 1  # the input starts after the instructions, as before


def test_a_tool_result_goes_with_its_call_and_the_newest_message_stays(settings):
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [{"role": "user", "content": WORDS}, {"role": "assistant", "content": WORDS, "tool_calls": [call]},
                {"role": "tool", "content": "ok", "tool_call_id": "call_1"}, {"role": "user", "content": "Next"}]
    # room for the short result and the question, not for the call: the call goes, and its result with it
    fitted, _ = fit_context(settings, spec_of(messages, max_tokens=512 - 60), len(messages) - 1)
    assert [m.stored() for m in fitted.messages] == messages[-1:]
    # nothing to drop: the request goes on as it is (its submission refuses it as too long)
    alone = spec_of([{"role": "user", "content": WORDS * 8}])
    assert fit_context(settings, alone, 0) == (alone, 0)
