"""The JSON-schema features the workers' vLLM engine refuses, found without vLLM (heavy to import in the API).

vLLM 0.32 validates a schema under its ``auto`` backend with xgrammar unless the schema holds a feature its
``has_xgrammar_unsupported_json_features`` lists (vllm/v1/structured_output/backend_xgrammar.py; ported here as
``xgrammar_gaps``): then it validates it with guidance (outlines where the schema holds ``patternProperties``), and
the workers' engine still compiles it with xgrammar (``gpu_runtime.vllm.scheduler.pin_grammar_backend``). A gap is:

- refused on the worker, a late 400 or a failed job, where guidance does not implement it (``uniqueItems``,
  ``contains``, ``propertyNames``, a ``format`` it does not know), or served by a grammar that does not follow the
  schema (``patternProperties`` beside ``properties`` or another pattern): ``refusals`` names it, for a 400 at submit;
- served looser than asked where guidance validates it and xgrammar ignores it (``multipleOf``, an ``allOf`` of
  several branches, ``minLength``/``maxLength`` beside ``pattern`` or ``format``): accepted, as vLLM's own xgrammar
  engine would serve it (README lists what is not enforced);

and once a schema holds any gap, each keyword guidance does not implement, anywhere in it, fails it on the worker
too (llguidance 1.7.6's "Unimplemented keys"): ``refusals`` names those with the gap that sent the schema there."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

# the string formats xgrammar follows (vLLM's STRING_SUPPORTED_FORMATS)
XGRAMMAR_FORMATS = frozenset({"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid",
                              "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"})
# the formats llguidance knows ("Unknown format: ..." for the others)
GUIDANCE_FORMATS = frozenset({"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid",
                              "uri"})
# keywords llguidance refuses ("Unimplemented keys: [...]")
GUIDANCE_UNIMPLEMENTED = frozenset({
    "uniqueItems", "contains", "minContains", "maxContains", "not", "if", "then", "else", "dependentRequired",
    "dependentSchemas", "dependencies", "propertyNames", "unevaluatedProperties", "unevaluatedItems", "$dynamicRef",
    "$dynamicAnchor"})
# gaps xgrammar compiles and ignores while guidance validates them: the schema is served, looser than asked
LOOSE = frozenset({"multipleOf", "allOf", "minLength", "maxLength"})
# gaps xgrammar compiles into a grammar that refuses the schema's own instances (not merely looser than asked)
MISREAD = frozenset({"patternProperties"})
# keywords whose value maps names to schemas, and those whose value is data, not a schema
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
_DATA = frozenset({"enum", "const", "default", "examples"})
_ARRAY_GAPS = ("uniqueItems", "contains", "minContains", "maxContains")

_WHAT_TO_DO = {
    "uniqueItems": "drop it and check the items yourself, or list the allowed arrays in an enum",
    "contains": "drop it, or give the items a schema (items, prefixItems) or an enum that xgrammar can follow",
    "format": "drop it, or give a pattern, or one of the formats xgrammar follows: "
              + ", ".join(sorted(XGRAMMAR_FORMATS)),
    "propertyNames": "drop it, or name the keys in properties with additionalProperties: false, or give one "
                     "patternProperties pattern alone",
    "patternProperties": "give one patternProperties pattern and no properties beside it, or name the keys in "
                         "properties",
}
_WHAT_TO_DO.update(dict.fromkeys(("minContains", "maxContains"), _WHAT_TO_DO["contains"]))


@dataclass(frozen=True)
class Feature:
    """A keyword of a JSON schema at ``where``, the JSON pointer of the (sub)schema holding it (``#``: its top)."""

    where: str
    keyword: str

    def __str__(self) -> str:
        return f"{self.keyword} at {self.where}"


def refusals(schema: dict[str, Any]) -> list[str]:
    """Why the workers' engine refuses ``schema`` (or serves a grammar that does not follow it), one line per
    feature, each naming the keyword, where it is and what to do; empty where it serves the schema."""
    gaps = xgrammar_gaps(schema)
    if not gaps:
        return []
    found = [f"{gap}: xgrammar, the workers' engine's backend, does not follow it, and vLLM refuses it there; "
             f"{_WHAT_TO_DO[gap.keyword]}" for gap in gaps if gap.keyword not in LOOSE]
    if loose := [gap for gap in gaps if gap.keyword in LOOSE]:  # alone, served; with these, refused on the worker
        sent = f"{loose[0]} (not enforced by xgrammar) makes vLLM validate the schema with guidance"
        found += [f"{feature}: {sent}, which does not implement {feature.keyword}; drop one of the two"
                  for feature in _unknown_to_guidance(schema) if feature not in gaps]
    return found


def misreadings(schema: dict[str, Any]) -> list[str]:
    """The gaps of ``schema`` xgrammar compiles into a grammar that does not take the schema's own instances
    (``MISREAD``), one line each: all a schema vLLM compiles with xgrammar alone (a structural tag's) is held to."""
    return [f"{gap}: xgrammar's grammar of it refuses what the schema allows; {_WHAT_TO_DO[gap.keyword]}"
            for gap in xgrammar_gaps(schema) if gap.keyword in MISREAD]


def xgrammar_gaps(schema: dict[str, Any]) -> list[Feature]:
    """Every feature for which vLLM's ``has_xgrammar_unsupported_json_features`` is true (it stops at the first),
    visiting the nested objects as it does: all of them, a map of names to schemas and an enum's values too."""
    return [gap for where, obj, _ in objects(schema) for gap in _gaps_of(where, obj)]


def _gaps_of(where: str, obj: dict[str, Any]) -> Iterator[Feature]:
    types = _types(obj)
    if types & {"integer", "number"} and "multipleOf" in obj:
        yield Feature(where, "multipleOf")
    if "array" in types:
        yield from (Feature(where, key) for key in _ARRAY_GAPS if key in obj)
    if "string" in types:
        fmt = obj.get("format")
        if "format" in obj and not (isinstance(fmt, str) and fmt in XGRAMMAR_FORMATS):
            yield Feature(where, "format")
        if _bounds_a_pattern(obj):
            yield from (Feature(where, key) for key in ("minLength", "maxLength") if key in obj)
    if "object" in types and "propertyNames" in obj:
        names = obj["propertyNames"]
        if ((isinstance(names, dict) and _bounds_a_pattern(names)) or "patternProperties" in obj
                or "properties" in obj or obj.get("unevaluatedProperties", True) is not True):
            yield Feature(where, "propertyNames")
    patterns = obj.get("patternProperties")
    if "object" in types and isinstance(patterns, dict) and ("properties" in obj or len(patterns) > 1):
        yield Feature(where, "patternProperties")
    if isinstance(obj.get("allOf"), list) and len(obj["allOf"]) >= 2:
        yield Feature(where, "allOf")


def _unknown_to_guidance(schema: dict[str, Any]) -> Iterator[Feature]:
    """The keywords of ``schema`` llguidance refuses (a ``format`` it does not know among them), where a schema
    stands (not a property's name, not an enum's value)."""
    for where, obj, is_schema in objects(schema):
        if is_schema:
            yield from (Feature(where, key) for key in obj if key in GUIDANCE_UNIMPLEMENTED)
            if isinstance(fmt := obj.get("format"), str) and fmt not in GUIDANCE_FORMATS:
                yield Feature(where, "format")


def objects(schema: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any], bool]]:
    """Each object nested in ``schema`` (itself included) with its JSON pointer, and whether a schema stands there
    (not a map of names to schemas, not data such as an enum's value)."""
    todo: list[tuple[str, Any, str]] = [("#", schema, "schema")]
    while todo:
        where, value, role = todo.pop()
        if isinstance(value, list):
            todo.extend((f"{where}/{i}", item, role) for i, item in enumerate(value))
            continue
        if not isinstance(value, dict):
            continue
        yield where, value, role == "schema"
        for key, inner in value.items():
            inner_role = ("schema" if role == "map" else role if role == "data" else
                          "map" if key in _SCHEMA_MAPS else "data" if key in _DATA else "schema")
            todo.append((f"{where}/{_escaped(str(key))}", inner, inner_role))


def _types(obj: dict[str, Any]) -> set[str]:
    """A scalar or list ``type``, as vLLM's ``_schema_types`` reads it."""
    kind = obj.get("type")
    return {kind} if isinstance(kind, str) else {t for t in kind if isinstance(t, str)} if isinstance(
        kind, list) else set()


def _bounds_a_pattern(obj: dict[str, Any]) -> bool:
    """vLLM's ``_has_pattern_and_length_bounds``: a pattern or format with minLength or maxLength beside it."""
    return ("pattern" in obj or "format" in obj) and ("minLength" in obj or "maxLength" in obj)


def _escaped(key: str) -> str:
    """A key as a JSON pointer spells it (RFC 6901)."""
    return key.replace("~", "~0").replace("/", "~1")
