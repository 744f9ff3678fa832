"""Which backends the API checks a structured output's constraint with (``app.output_constraints``), from the
backends the live workers publish in their heartbeats (``routing.grammar_backends_of``), and what each refuses."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from app import output_constraints
from app.db.models import WorkerState
from app.services.routing import grammar_backends_of, grammar_unavailable_of


def _rows(*states: dict) -> list[WorkerState]:
    """Live workers of the model ``m``, their heartbeat states ``states`` (served ``m`` unless they say)."""
    now = datetime.now(UTC)
    return [WorkerState(id=f"w{i}", model="m", queue="q", device="cpu", draining=False, heartbeat_at=now,
                        state={"served": ["m"], **state}) for i, state in enumerate(states)]


def _backends(*states: dict, model: str = "m") -> tuple[str, ...]:
    return output_constraints.backends_of(grammar_backends_of(_rows(*states), model))


_LARK = 'start: "a" | "b"'  # a Lark grammar xgrammar and guidance read


def test_no_worker_published_checks_with_xgrammar():
    assert _backends() == ("xgrammar",)  # none up yet
    assert _backends({}, {"grammar_backend": None}) == ("xgrammar",)  # an older worker, the own torch engine


def test_the_published_backends_are_each_checked():
    assert _backends({"grammar_backend": "guidance"}) == ("guidance",)
    assert _backends({"grammar_backend": "guidance"}, {}) == ("guidance",)  # one that says none is not a backend
    assert _backends({"grammar_backend": "guidance"}, {"grammar_backend": "xgrammar"},
                     {"grammar_backend": "guidance"}) == ("guidance", "xgrammar")  # a job may go to either


def test_workers_of_another_model_and_stopping_ones_do_not_count():
    assert _backends({"grammar_backend": "guidance", "served": ["other"]}) == ("xgrammar",)
    assert _backends({"grammar_backend": "guidance", "stopping": True}, {"grammar_backend": "xgrammar"}) \
        == ("xgrammar",)
    # a worker that reads only its model's queue (COSERVE_ROUTING=queue) takes its jobs too
    assert _backends({"grammar_backend": "guidance", "own_queue": False}) == ("guidance",)


@pytest.mark.parametrize("regex", [r"[\p{L}]+", r"[a\P{Lu}]", r"[^\p{N}_]", r"[]\p{L}]"],
                         ids=["class", "negated-property", "negated-class", "bracket-first"])
def test_a_property_class_inside_a_character_class_is_refused_under_xgrammar(regex):
    """xgrammar reads ``[\\p{L}]`` as the characters p, {, L and } without an error: the regex's meaning changed."""
    with pytest.raises(ValueError, match=r"inside \[\.\.\.\].*spell the characters out as ranges"):
        output_constraints.check("regex", regex)


def test_a_property_class_inside_a_character_class_of_a_schemas_pattern_is_refused_under_xgrammar():
    schema = {"type": "object", "properties": {"name": {"type": "string", "pattern": r"^[\p{L} ]+$"}}}
    with pytest.raises(ValueError, match=r"json's pattern at #/properties/name holds a Unicode property class"):
        output_constraints.check("json", output_constraints.schema_text(schema))


@pytest.mark.parametrize("regex", [r"[a-z]+\.p\{", r"\[\p", r"[p{L}]", r"[a\]]p{L}"],
                         ids=["escaped-p-outside", "escaped-bracket", "no-backslash", "escaped-close"])
def test_what_only_looks_like_a_property_class_in_a_class_is_not_refused_as_one(regex):
    answers = output_constraints.outcomes([("regex", regex)])
    assert "inside [...]" not in (answers[("regex", regex)] or ""), answers


def test_guidance_reads_a_unicode_property_class_and_refuses_what_it_does_not_implement():
    schema = output_constraints.schema_text({"type": "object", "properties": {"x": {"not": {"type": "string"}}}})
    answers = output_constraints.outcomes([("regex", r"\p{L}+"), ("regex", r"[\p{L}]+"), ("json", schema)],
                                          ("guidance",))
    assert answers[("regex", r"\p{L}+")] is None and answers[("regex", r"[\p{L}]+")] is None, answers
    refused = answers[("json", schema)] or ""
    assert refused.startswith("json does not compile (Unimplemented keys") and "under guidance" in refused, refused
    assert "give a JSON schema without the keywords guidance does not implement" in refused, refused


def test_a_constraint_must_compile_under_each_backend():
    answers = output_constraints.outcomes([("regex", r"\p{L}+")], ("guidance", "xgrammar"))
    assert "under xgrammar" in (answers[("regex", r"\p{L}+")] or ""), answers


@pytest.mark.parametrize("backend", ["outlines", "lm-format-enforcer"])
def test_an_unchecked_backend_leaves_a_regex_or_schema_to_the_workers_vllm(backend):
    """outlines' and lm-format-enforcer's libraries are not checked with here: the worker's vLLM validation judges a
    regex or a JSON schema (one it refuses fails its job with vLLM's reason: tests/vllm/test_unchecked_backend.py)."""
    schema = output_constraints.schema_text({"type": "array", "uniqueItems": True})
    assert output_constraints.outcomes([("regex", r"\p{L}+"), ("json", schema)], (backend,)) == {
        ("regex", r"\p{L}+"): None, ("json", schema): None}


@pytest.mark.parametrize("backend", ["outlines", "lm-format-enforcer"])
def test_an_unchecked_backend_refuses_the_kinds_it_never_takes(backend):
    """vLLM's validation under these refuses every grammar, and their compile fails on every structural tag."""
    tag = json.dumps({"structures": [{"begin": "<a>", "schema": {"type": "object"}, "end": "</a>"}],
                      "triggers": ["<a"]})
    answers = output_constraints.outcomes([("grammar", _LARK), ("structural_tag", tag)], (backend,))
    assert answers[("grammar", _LARK)] == (f"grammar: {backend}, the backend of the workers' engine, does not take "
                                           "a grammar; give a regex, a JSON schema or a choice instead"), answers
    assert (answers[("structural_tag", tag)] or "").startswith(f"structural_tag: {backend}, the backend"), answers


def test_guidance_reads_a_structural_tag_only_in_its_legacy_form():
    legacy = json.dumps({"structures": [{"begin": "<a>", "schema": {"type": "object"}, "end": "</a>"}],
                         "triggers": ["<a"]})
    current = json.dumps({"type": "structural_tag", "format": {"type": "any_text"}})
    answers = output_constraints.outcomes([("structural_tag", legacy), ("structural_tag", current)], ("guidance",))
    assert answers[("structural_tag", legacy)] is None, answers
    assert "reads only a structural tag in the legacy form" in (answers[("structural_tag", current)] or ""), answers


def test_check_compiles_with_the_backends_it_is_under():
    with output_constraints.under(("guidance",)):
        output_constraints.check("regex", r"\p{L}+")
    with pytest.raises(ValueError, match="under xgrammar"):
        output_constraints.check("regex", r"\p{L}+")


def test_a_messages_output_format_schema_is_carried():
    """POST /v1/messages' ``output_config.format`` is a JSON schema constraint: ``CheckedRoute`` checks it with the
    workers' backends, as a response_format's."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}}}
    body = {"output_config": {"format": {"type": "json_schema", "schema": schema}}, "messages": []}
    assert output_constraints.carried(body) == [("json", output_constraints.schema_text(schema))]


def _tagged(schema: dict) -> dict[str, str]:
    """A structural tag in its legacy form and in xgrammar's (a tag under triggered_tags) around ``schema``."""
    legacy = {"structures": [{"begin": "<a>", "schema": schema, "end": "</a>"}], "triggers": ["<a"]}
    current = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<a"], "tags": [
        {"begin": "<a>", "content": {"type": "json_schema", "json_schema": schema}, "end": "</a>"}]}}
    return {"legacy": json.dumps(legacy), "current": json.dumps(current)}


@pytest.mark.parametrize("form, at", [("legacy", "#/structures/0/schema"),
                                      ("current", "#/format/tags/0/content/json_schema")])
def test_a_property_class_in_a_structural_tags_schema_pattern_is_refused_under_xgrammar(form, at):
    tag = _tagged({"type": "object", "properties": {"name": {"type": "string", "pattern": r"^[\p{L} ]+$"}}})[form]
    with pytest.raises(ValueError) as refused:
        output_constraints.check("structural_tag", tag)
    assert str(refused.value).startswith(f"structural_tag's pattern at {at}/properties/name holds a Unicode "
                                         "property class"), refused.value


def test_a_property_class_in_a_structural_tags_regex_is_refused_under_xgrammar():
    tag = json.dumps({"type": "structural_tag", "format": {"type": "regex", "pattern": r"[\p{L}]+"}})
    with pytest.raises(ValueError, match=r"structural_tag's regex at #/format/pattern holds a Unicode property"):
        output_constraints.check("structural_tag", tag)


@pytest.mark.parametrize("form", ["legacy", "current"])
def test_a_structural_tags_schema_is_not_held_to_what_guidance_refuses(form):
    """vLLM validates and compiles a structural tag with xgrammar alone (``validate_xgrammar_grammar`` does not scan
    its schemas for the features it sends a JSON schema to guidance for), which serves these, not enforcing them."""
    tag = _tagged({"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True},
                                                    "s": {"type": "string", "not": {"const": "x"}},
                                                    "n": {"type": "integer", "multipleOf": 2}}})[form]
    assert output_constraints.outcomes([("structural_tag", tag)]) == {("structural_tag", tag): None}


@pytest.mark.parametrize("form", ["legacy", "current"])
def test_a_structural_tags_schema_xgrammar_misreads_is_refused(form):
    tag = _tagged({"type": "object", "properties": {"a": {"type": "string"}},
                   "patternProperties": {"^x": {"type": "integer"}}})[form]
    with pytest.raises(ValueError, match=r"structural_tag's schema at #/\S+ is refused: patternProperties at #: "
                                         r"xgrammar's grammar of it refuses what the schema allows"):
        output_constraints.check("structural_tag", tag)


def test_a_structural_tags_plain_schema_is_still_accepted_under_xgrammar():
    tags = _tagged({"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z]+$"}}})
    answers = output_constraints.outcomes([("structural_tag", tag) for tag in tags.values()])
    assert set(answers.values()) == {None}, answers



def test_a_worker_on_vllms_auto_is_checked_as_auto_picks():
    """A worker whose engine leaves ``auto`` to vLLM (a Mistral tokenizer) publishes it: what xgrammar refuses and
    guidance, auto's fallback, reads is served (vLLM's ``_validate_structured_outputs``); what neither reads is
    refused, naming both."""
    backends = _backends({"grammar_backend": "auto"})
    assert backends == ("auto",)
    uniques = output_constraints.schema_text({"type": "array", "uniqueItems": True})  # xgrammar's gap, guidance's too
    answers = output_constraints.outcomes([("regex", r"\p{L}+"), ("regex", r"[\p{L}]+"), ("regex", r"(?=a)a"),
                                           ("json", uniques)], backends)
    assert answers[("regex", r"\p{L}+")] is None, answers  # xgrammar refuses it, guidance serves it
    assert "inside [...]" in (answers[("regex", r"[\p{L}]+")] or ""), answers  # xgrammar takes it: misread
    refused = answers[("regex", r"(?=a)a")] or ""
    assert "under guidance" in refused and "tried xgrammar first, which does not take it either" in refused, answers
    assert "Unimplemented keys" in (answers[("json", uniques)] or ""), answers


def test_auto_sends_a_lark_grammar_to_guidance_for_a_tekken_tokenizer_only():
    grammar = '?start: "a"'  # xgrammar reads it; guidance does not (an inlined start rule)
    assert output_constraints.outcomes([("grammar", grammar)]) == {("grammar", grammar): None}
    answers = output_constraints.outcomes([("grammar", grammar), ("grammar", _LARK)], ("auto",))
    refused = answers[("grammar", grammar)] or ""
    assert "under guidance" in refused and "tried xgrammar" not in refused, answers  # guidance alone judged it
    assert answers[("grammar", _LARK)] is None, answers
    # an older Mistral tokenizer: xgrammar first, outlines (unchecked here) for the rest
    assert output_constraints.outcomes([("grammar", grammar), ("regex", r"(?=a)a")], ("auto-outlines",)) == {
        ("grammar", grammar): None, ("regex", r"(?=a)a"): None}


def test_auto_leaves_a_schema_with_pattern_properties_to_outlines():
    """vLLM's auto validates a schema xgrammar does not support with outlines where it holds patternProperties
    (``has_guidance_unsupported_json_features``), which the API does not check."""
    schema = output_constraints.schema_text({"type": "object", "patternProperties": {"^x": {"type": "integer"}},
                                             "properties": {"a": {"type": "array", "uniqueItems": True}}})
    assert output_constraints.outcomes([("json", schema)], ("auto",)) == {("json", schema): None}


_LMFE_WHY = ("the worker's structured-output backend lm-format-enforcer cannot run on this engine: vllm is not "
             "installed; send the request without a structured output, or have the operator name another backend "
             "(--structured-outputs-config in COSERVE_VLLM_ENGINE_ARGS)")  # pin_grammar_backend's words
_UNUSABLE = {"grammar_backend": "lm-format-enforcer", "grammar_unavailable": _LMFE_WHY}


def _refusal(*states: dict, model: str = "m") -> str | None:
    rows = _rows(*states)
    return output_constraints.unusable_refusal(grammar_unavailable_of(rows, model),
                                               len(grammar_backends_of(rows, model)))


def test_a_worker_whose_backend_cannot_run_is_no_backend_to_check_with():
    assert _backends(_UNUSABLE) == ("xgrammar",)  # nothing to check with: the refusal (``unusable_refusal``) says why
    assert _backends(_UNUSABLE, {"grammar_backend": "guidance"}) == ("guidance",)


def test_every_live_worker_without_a_usable_backend_refuses_a_structured_output():
    refused = _refusal(_UNUSABLE, {**_UNUSABLE, "grammar_unavailable": "another reason"})
    assert refused is not None and refused.startswith("no live worker of the model can run a structured output")
    assert "worker 'w0': " + _LMFE_WHY in refused and "send the request without a structured output" in refused


def test_some_live_workers_without_a_usable_backend_refuse_a_structured_output_as_any_may_take_it():
    refused = _refusal({"grammar_backend": "xgrammar"}, _UNUSABLE)
    assert refused is not None and refused.startswith("1 of the model's 2 live workers cannot run a structured output")
    assert "worker 'w1'" in refused and "a job may go to any of them" in refused, refused


def test_usable_backends_other_models_and_stopping_workers_refuse_nothing():
    assert _refusal() is None  # none up yet
    assert _refusal({"grammar_backend": "lm-format-enforcer"}, {"grammar_backend": "xgrammar"}, {}) is None
    assert _refusal({**_UNUSABLE, "served": ["other"]}, {"grammar_backend": "xgrammar"}) is None
    assert _refusal({**_UNUSABLE, "stopping": True}, {"grammar_backend": "xgrammar"}) is None
    assert _refusal({**_UNUSABLE, "grammar_unavailable": None}) is None  # one that made its backend
