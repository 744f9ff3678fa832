"""A structured output's constraint checked as a worker whose vLLM engine compiles with guidance reads it
(``COSERVE_VLLM_ENGINE_ARGS`` naming ``--structured-outputs-config '{"backend": "guidance"}'``): vLLM's
``validate_guidance_grammar`` (vllm/v1/structured_output/backend_guidance.py), done with llguidance's own API so
that the API does not import vLLM. ``CHECKS``: the constraint's kind -> its check, raising ValueError that names the
field and what to write instead; each passes where llguidance is not installed (the worker's vLLM judges then)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from app import structural_tag

_WHAT = {
    "regex": "a regular expression guidance reads (Rust's regex syntax, without lookarounds or backreferences)",
    "grammar": "a Lark grammar with a start rule, or an EBNF grammar with a root rule",
    "json": "a JSON schema without the keywords guidance does not implement (uniqueItems, contains, not, "
            "if/then/else, dependentRequired, dependentSchemas, propertyNames, unevaluatedProperties, ...)",
    "structural_tag": "a structural tag in the legacy form: structures (each with begin, schema and end) and "
                      "triggers that each structure's begin starts with",
}


def _validated(field: str, grammar_of: Callable[[Any], Any]) -> None:
    """ValueError with guidance's reason where llguidance refuses the grammar ``grammar_of`` builds (as vLLM's
    ``serialize_guidance_grammar`` builds it, from the llguidance module)."""
    try:
        import llguidance
    except ImportError:  # an API without vLLM's grammar libraries: the vLLM worker judges it
        return
    try:
        reason = llguidance.LLMatcher.validate_grammar(grammar_of(llguidance), None)
    except (ValueError, KeyError, TypeError) as exc:  # vLLM's "Invalid grammar specification"
        reason = str(exc) or type(exc).__name__
    if reason:
        first = reason.strip().splitlines()[0]
        raise ValueError(f"{field} does not compile ({first}) under guidance, the backend of the workers' engine; "
                         f"give {_WHAT[field]}")


def _schema_grammar(llg: Any, schema: str) -> Any:
    return llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": True})


def check_regex(regex: str) -> None:
    _validated("regex", lambda llg: llg.grammar_from("regex", regex))


def check_grammar(grammar: str) -> None:
    _validated("grammar", lambda llg: llg.grammar_from("grammar", grammar))


def check_schema(text: str) -> None:
    if structural_tag.nesting(json.loads(text)) > structural_tag.MAX_SCHEMA_NESTING:  # vLLM's check_json_nesting
        raise ValueError(f"json nests objects and arrays deeper than {structural_tag.MAX_SCHEMA_NESTING} levels")
    _validated("json", lambda llg: _schema_grammar(llg, text))


def check_structural_tag(text: str) -> None:
    try:
        tag = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"structural_tag is not valid JSON: {exc}") from None
    if not isinstance(tag, dict) or "structures" not in tag:
        raise ValueError("structural_tag: guidance, the backend of the workers' engine, reads only "
                         + _WHAT["structural_tag"])
    if structural_tag.nesting(tag) > structural_tag.MAX_TAG_NESTING:
        raise ValueError(f"structural_tag nests objects and arrays deeper than {structural_tag.MAX_TAG_NESTING} "
                         "levels")
    _validated("structural_tag", lambda llg: _tag_grammar(llg, tag))


def _tag_grammar(llg: Any, tag: dict[str, Any]) -> Any:
    """vLLM's guidance grammar of a legacy structural tag: each structure under the first trigger its begin starts
    with (a KeyError or TypeError where the form is malformed)."""
    tags = []
    for s in tag["structures"]:
        trigger = next((t for t in tag["triggers"] if s["begin"].startswith(t)), None)
        if trigger is None:
            raise ValueError(f"the begin {s['begin']!r} starts with none of the triggers {tag['triggers']}")
        tags.append(llg.StructTag(trigger=trigger, begin=s["begin"], grammar=_schema_grammar(llg, json.dumps(
            s["schema"])), end=s["end"]))
    if not tags:
        raise ValueError("it holds no structures")
    return llg.StructTag.to_grammar(tags)


CHECKS: dict[str, Callable[[str], None]] = {"regex": check_regex, "grammar": check_grammar, "json": check_schema,
                                            "structural_tag": check_structural_tag}
