"""vLLM's chat-template options on a job: which are kept, which are refused, and that they reach the template."""

from __future__ import annotations

import copy

import pytest
from pydantic import ValidationError

from app.schemas import JobCreate
from app.services import model_info
from app.services.model_info import ChatTemplateError, encode_input, get_tokenizer

USER = [{"role": "user", "content": "hi"}]


def test_only_the_options_that_differ_from_the_defaults_are_kept():
    assert JobCreate(messages=USER).template_options() is None
    assert JobCreate(messages=USER, add_generation_prompt=True, chat_template_kwargs={}).template_options() is None
    prefill = JobCreate(messages=[*USER, {"role": "assistant", "content": "Hel"}], add_generation_prompt=False,
                        continue_final_message=True, chat_template_kwargs={"enable_thinking": False})
    assert prefill.template_options() == {"add_generation_prompt": False, "continue_final_message": True,
                                          "chat_template_kwargs": {"enable_thinking": False}}


@pytest.mark.parametrize("fields, field, words", [
    (dict(prompt="x", add_generation_prompt=False), "add_generation_prompt", "send messages"),
    (dict(prompt="x", chat_template_kwargs={"a": 1}), "chat_template_kwargs", "send messages"),
    (dict(messages=USER, continue_final_message=True), "continue_final_message", "add_generation_prompt false"),
    (dict(messages=USER, chat_template_kwargs={"tools": []}), "chat_template_kwargs", "sets itself"),
    (dict(messages=USER, chat_template_kwargs={"a-b": 1}), "chat_template_kwargs", "variable's name"),
    (dict(messages=USER, chat_template_kwargs={"x": float("nan")}), "chat_template_kwargs", "not finite"),
])
def test_options_that_cannot_apply_name_their_field(fields, field, words):
    with pytest.raises(ValidationError) as exc:
        JobCreate(**fields)
    error, = exc.value.errors()
    assert error["loc"] == (field,) and words in error["msg"], error


@pytest.fixture
def reading_template(tiny_model_dir, monkeypatch):
    """The tiny model's tokenizer with a template that reads a variable of its own and writes no turn's end."""
    tok = copy.deepcopy(get_tokenizer(str(tiny_model_dir)))
    tok.chat_template = ("{% if terse %}[terse]{% endif %}{% for m in messages %}<{{ m.role }}>{{ m.content }}"
                         "{% if not loop.last %}</s>{% endif %}{% endfor %}{% if add_generation_prompt %}<assistant>"
                         "{% endif %}")
    monkeypatch.setattr(model_info, "get_tokenizer", lambda model: tok)
    return tok


def test_the_options_reach_the_template(reading_template):
    def text(options=None, messages=USER):
        return reading_template.decode(encode_input("tiny", None, messages, None, options))

    assert text() == "<user>hi<assistant>"
    assert text({"add_generation_prompt": False}) == "<user>hi"
    assert text({"chat_template_kwargs": {"terse": True}}) == "[terse]<user>hi<assistant>"


def test_a_final_message_the_template_does_not_write_is_a_template_error(tiny_model_dir, monkeypatch):
    tok = copy.deepcopy(get_tokenizer(str(tiny_model_dir)))
    tok.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content | upper }}{% endfor %}"
    monkeypatch.setattr(model_info, "get_tokenizer", lambda model: tok)
    with pytest.raises(ChatTemplateError, match="cannot render"):
        encode_input("tiny", None, [{"role": "assistant", "content": "abc"}], None,
                     {"add_generation_prompt": False, "continue_final_message": True})
