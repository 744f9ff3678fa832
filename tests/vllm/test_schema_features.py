"""``app.schema_features`` against vLLM 0.32's own validation of a JSON schema under its ``auto`` backend: the
features it names are those the workers' engine refuses (or serves by a grammar that does not follow the schema)."""

from __future__ import annotations

import json

import pytest

from app import schema_features

_TAGS = {"type": "array", "items": {"type": "string"}}
# (schema, whether vLLM's validation refuses it, whether xgrammar's grammar follows it where vLLM takes it)
SCHEMAS = {
    "uniqueItems": ({**_TAGS, "uniqueItems": True}, True),
    "uniqueItems-false": ({**_TAGS, "uniqueItems": False}, True),
    "contains": ({**_TAGS, "contains": {"const": "a"}, "minContains": 2}, True),
    "maxContains": ({**_TAGS, "maxContains": 2}, True),
    "nested-uniqueItems": ({"type": "object", "properties": {"tags": {**_TAGS, "uniqueItems": True}}}, True),
    "uniqueItems-in-anyOf": ({"anyOf": [{**_TAGS, "uniqueItems": True}, {"type": "null"}]}, True),
    "uniqueItems-in-defs": ({"$defs": {"T": {**_TAGS, "uniqueItems": True}}, "$ref": "#/$defs/T"}, True),
    "format-iri": ({"type": "string", "format": "iri"}, True),
    "format-color": ({"type": "object", "properties": {"c": {"type": "string", "format": "color"}}}, True),
    "propertyNames-properties": ({"type": "object", "propertyNames": {"pattern": "^a"},
                                  "properties": {"ab": {"type": "integer"}}}, True),
    "propertyNames-bounded": ({"type": "object", "propertyNames": {"pattern": "^a", "maxLength": 3}}, True),
    "multipleOf-beside-not": ({"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 5},
                                                               "s": {"type": "string", "not": {"const": "x"}}}}, True),
    "allOf-beside-dependentRequired": ({"type": "object", "allOf": [{"required": ["a"]}, {"required": ["b"]}],
                                        "dependentRequired": {"a": ["b"]}}, True),
    "maxLength-beside-uri-template": ({"type": "object", "properties": {
        "u": {"type": "string", "format": "uri-template"}, "p": {"type": "string", "pattern": "^a+$",
                                                                 "maxLength": 4}}}, True),
    # served (vLLM takes it), looser than asked: xgrammar ignores the keyword
    "multipleOf": ({"type": "integer", "multipleOf": 5}, False),
    "multipleOf-nested": ({"type": "object", "properties": {"n": {"type": "number", "multipleOf": 0.5}}}, False),
    "allOf-two": ({"allOf": [{"type": "string"}, {"enum": ["yes", "no"]}]}, False),
    "pattern-maxLength": ({"type": "string", "pattern": "[a-z]+", "maxLength": 5}, False),
    "format-minLength": ({"type": "string", "format": "email", "minLength": 3}, False),
    "multipleOf-beside-a-property-named-not": ({"type": "object", "properties": {
        "not": {"type": "integer", "multipleOf": 2}, "if": {"enum": [{"not": 1}]}}}, False),
    # served by xgrammar, no gap
    "plain": ({"type": "object", "properties": {"a": {"type": "string", "format": "uri-reference"}}}, False),
    "not-alone": ({"type": "string", "not": {"const": "x"}}, False),
    "propertyNames-alone": ({"type": "object", "propertyNames": {"pattern": "^a"}}, False),
    "uniqueItems-without-type": ({"items": {"type": "string"}, "uniqueItems": True}, False),
    "one-patternProperties": ({"type": "object", "patternProperties": {"^x": {"type": "integer"}}}, False),
    "property-named-uniqueItems": ({"type": "object", "properties": {"uniqueItems": {"type": "boolean"}}}, False),
}
# vLLM validates these with outlines and takes them, but xgrammar's grammar refuses the schema's own instances
SERVED_WRONGLY = {
    "patternProperties-beside-properties": {"type": "object", "patternProperties": {"^x": {"type": "integer"}},
                                            "properties": {"a": {"type": "string"}}},
    "two-patternProperties": {"type": "object", "patternProperties": {"^x": {"type": "integer"},
                                                                      "^y": {"type": "string"}}},
}


def vllm_refuses(schema: dict) -> bool:
    """vLLM's validation under ``auto`` (``SamplingParams._validate_structured_outputs``): xgrammar's, or where the
    schema holds a feature xgrammar does not support, guidance's (outlines' where guidance does not read it)."""
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams
    from vllm.v1.structured_output.backend_guidance import (has_guidance_unsupported_json_features,
                                                            validate_guidance_grammar)
    from vllm.v1.structured_output.backend_outlines import validate_structured_output_request_outlines
    from vllm.v1.structured_output.backend_xgrammar import validate_xgrammar_grammar

    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=json.dumps(schema)))
    try:
        validate_xgrammar_grammar(params)
        return False
    except VLLMValidationError:
        pass
    try:
        if has_guidance_unsupported_json_features(schema):
            validate_structured_output_request_outlines(params)
        else:
            validate_guidance_grammar(params, tokenizer=None)
    except (VLLMValidationError, ValueError):
        return True
    return False


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_the_features_named_are_those_vllm_refuses(name):
    schema, refused = SCHEMAS[name]
    assert vllm_refuses(schema) == refused, "the case no longer says what vLLM does"
    assert bool(schema_features.refusals(schema)) == refused, schema_features.refusals(schema)


@pytest.mark.parametrize("name", list(SERVED_WRONGLY))
def test_a_schema_vllm_takes_but_xgrammar_serves_by_another_grammar_is_named(name):
    import xgrammar

    schema = SERVED_WRONGLY[name]
    assert not vllm_refuses(schema)
    instance = {"x1": 1, "a": "s"} if "properties" in schema else {"x1": 1, "y1": "s"}
    tokens = xgrammar.TokenizerInfo(["<s>"] + [chr(i) for i in range(32, 127)])
    grammar = xgrammar.GrammarCompiler(tokens).compile_json_schema(json.dumps(schema), any_whitespace=False)
    assert not xgrammar.GrammarMatcher(grammar).accept_string(json.dumps(instance))  # an instance, refused
    assert schema_features.refusals(schema)


def test_vllms_feature_scan_is_ported():
    from vllm.v1.structured_output.backend_xgrammar import has_xgrammar_unsupported_json_features

    for schema, _ in SCHEMAS.values():
        assert bool(schema_features.xgrammar_gaps(schema)) == has_xgrammar_unsupported_json_features(schema), schema
    for schema in SERVED_WRONGLY.values():
        assert schema_features.xgrammar_gaps(schema) and has_xgrammar_unsupported_json_features(schema)
