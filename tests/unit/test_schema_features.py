"""The JSON-schema features the workers' vLLM engine refuses, found by a pure scan (``app.schema_features``; its
agreement with vLLM's own validation: tests/vllm/test_schema_features.py)."""

from __future__ import annotations

from app.schema_features import Feature, refusals, xgrammar_gaps

_TAGS = {"type": "array", "items": {"type": "string"}}


def test_a_refused_feature_is_named_with_where_it_is_and_what_to_do():
    said, = refusals({"type": "object", "properties": {"tags": {**_TAGS, "uniqueItems": True}}})
    assert said.startswith("uniqueItems at #/properties/tags: xgrammar, the workers' engine's backend, does not "
                           "follow it"), said
    assert "drop it" in said and "enum" in said, said


def test_each_feature_vllm_sends_away_from_xgrammar_is_found_where_it_is():
    schema = {"type": "object", "allOf": [{"required": ["a"]}, {"required": ["b"]}], "properties": {
        "n": {"type": ["integer", "null"], "multipleOf": 3},
        "s": {"type": "string", "format": "iri", "pattern": "^a", "maxLength": 9},
        "a/b": {"type": "array", "contains": {"const": 1}, "minContains": 2},
        "m": {"type": "object", "propertyNames": {"pattern": "^a"}, "properties": {},
              "patternProperties": {"^x": {}, "^y": {}}}}}
    assert set(xgrammar_gaps(schema)) == {
        Feature("#", "allOf"), Feature("#/properties/n", "multipleOf"), Feature("#/properties/s", "format"),
        Feature("#/properties/s", "maxLength"), Feature("#/properties/a~1b", "contains"),
        Feature("#/properties/a~1b", "minContains"), Feature("#/properties/m", "propertyNames"),
        Feature("#/properties/m", "patternProperties")}


def test_a_feature_xgrammar_only_ignores_is_served():
    for schema in ({"type": "integer", "multipleOf": 5}, {"allOf": [{"type": "string"}, {"enum": ["y", "n"]}]},
                   {"type": "string", "pattern": "[a-z]+", "maxLength": 5}):
        assert xgrammar_gaps(schema) and refusals(schema) == [], schema


def test_beside_an_ignored_feature_each_keyword_guidance_lacks_is_refused_naming_both():
    schema = {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 5},
                                               "s": {"type": "string", "not": {"const": "x"}},
                                               "u": {"type": "string", "format": "uri-template"}}}
    assert sorted(refusals(schema)) == [
        f"{keyword} at {where}: multipleOf at #/properties/n (not enforced by xgrammar) makes vLLM validate the "
        f"schema with guidance, which does not implement {keyword}; drop one of the two"
        for keyword, where in (("format", "#/properties/u"), ("not", "#/properties/s"))]


def test_names_and_data_that_spell_a_keyword_are_not_keywords():
    schema = {"type": "object", "properties": {"not": {"type": "integer", "multipleOf": 2},
                                               "uniqueItems": {"type": "boolean"},
                                               "e": {"enum": [{"if": 1}], "default": {"then": 2}}}}
    assert refusals(schema) == []
    assert xgrammar_gaps({"type": "object", "properties": {"s": {"type": "string"}}}) == []
