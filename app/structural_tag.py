"""vLLM's structural tags: free text until a trigger, then a tagged part under its own constraint (a JSON schema,
a regex, ...). Accepted as vLLM's OpenAI server takes them, as ``response_format: {"type": "structural_tag", ...}``
(xgrammar's ``format`` form, or the legacy ``structures``/``triggers`` form) or as ``structured_outputs``'s
``structural_tag`` (the same JSON as text), and checked at the API the way vLLM checks them before its engine sees
them (xgrammar compiles the tag: ``app.output_constraints`` checks it off the event loop), so that a bad one is the
client's 400, not a failed job."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

# vLLM's sampling_params: a JSON schema nests at most 64 levels, a structural tag 16 more for its wrappers
MAX_SCHEMA_NESTING = 64
MAX_TAG_NESTING = MAX_SCHEMA_NESTING + 16
# a JSON schema's ``pattern`` nests groups at most this deep: xgrammar refuses a regex nesting deeper (its parser's
# limit), and its schema converter overflows its stack on one nesting ~30000 deep (the process dies, vLLM's too)
MAX_PATTERN_NESTING = 1000


class LegacyTag(BaseModel):
    """One structure of the legacy form: after ``begin``, JSON under ``schema``, then ``end``."""

    model_config = ConfigDict(populate_by_name=True)

    begin: str
    tag_schema: dict[str, Any] | None = Field(None, alias="schema")
    end: str


class LegacyTagFormat(BaseModel):
    """The legacy response_format: ``structures`` and the ``triggers`` that start them."""

    type: Literal["structural_tag"]
    structures: list[LegacyTag]
    triggers: list[str]


class TagFormat(BaseModel):
    """The response_format of xgrammar's structural tag: its ``format`` (triggered_tags, tag, sequence, ...)."""

    type: Literal["structural_tag"]
    format: Any


def nesting(value: Any) -> int:
    """How deep objects and arrays nest in a JSON value (iteratively: a hostile one may nest thousands deep)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            todo.extend((child, depth + 1) for child in children)
    return deepest


def check_patterns(value: Any, field: str) -> None:
    """Raise ValueError where a ``pattern`` in the JSON value (a schema, a structural tag) nests its groups deeper
    than ``MAX_PATTERN_NESTING``: what xgrammar cannot be given (``field``: the constraint, as the message names
    it)."""
    todo = [value]
    while todo:
        item = todo.pop()
        if isinstance(item, dict):
            if isinstance(pattern := item.get("pattern"), str) and group_nesting(pattern) > MAX_PATTERN_NESTING:
                raise ValueError(f"{field} holds a pattern nesting groups deeper than {MAX_PATTERN_NESTING} levels; "
                                 "give a flatter regular expression")
            todo.extend(item.values())
        elif isinstance(item, list):
            todo.extend(item)


def group_nesting(regex: str) -> int:
    """How deep a regular expression's groups nest (an escaped or bracketed parenthesis opens none)."""
    deepest = depth = 0
    escaped = in_class = False
    for char in regex:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
        elif char == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif char == ")":
            depth = max(depth - 1, 0)
    return deepest


def check(text: str) -> None:
    """Raise ValueError saying what to fix where xgrammar cannot compile the structural tag ``text`` (vLLM's
    validate_xgrammar_grammar: the legacy form where it has ``structures``, else xgrammar's own)."""
    if not text:
        raise ValueError("structural_tag is empty; give the structural tag as JSON text")
    try:
        tag = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"structural_tag is not valid JSON: {exc}") from None
    if not isinstance(tag, dict):
        raise ValueError("structural_tag must be a JSON object")
    if nesting(tag) > MAX_TAG_NESTING:
        raise ValueError(f"structural_tag nests objects and arrays deeper than {MAX_TAG_NESTING} levels")
    check_patterns(tag, "structural_tag")
    try:
        _compile(tag, text)
    except (KeyError, TypeError) as exc:
        raise ValueError("structural_tag's legacy form needs structures (each with begin, schema and end) and "
                         f"triggers; {exc!s} is missing or malformed") from None
    except Exception as exc:  # xgrammar's InvalidStructuralTagError and its compile errors
        raise ValueError(f"structural_tag is invalid: {exc}") from None


def _compile(tag: dict[str, Any], text: str) -> None:
    """xgrammar compiles the structural tag (``tag`` is ``text`` read); nothing where xgrammar is not installed."""
    try:
        import xgrammar as xgr
    except ImportError:  # an API without vLLM's grammar library: the vLLM worker compiles it (a bad one is a 400)
        return
    if "structures" in tag:
        items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                 for s in tag["structures"]]
        xgr.Grammar.from_structural_tag(items, tag["triggers"])
    else:
        xgr.Grammar.from_structural_tag(text)


def inner_constraints(tag: dict[str, Any]) -> Iterator[tuple[str, str, Any]]:
    """The constraints a structural tag (``check``'s, read) holds, each as (its JSON pointer, ``json`` or ``regex``,
    its schema or regex): the legacy form's structures' schemas, xgrammar's ``json_schema`` (and
    ``qwen_xml_parameter``) formats' schemas and ``regex`` formats' patterns, wherever they nest."""
    if isinstance(structures := tag.get("structures"), list):  # the legacy form: a schema per structure
        yield from ((f"#/structures/{i}/schema", "json", item["schema"]) for i, item in enumerate(structures)
                    if isinstance(item, dict) and isinstance(item.get("schema"), dict))
        return
    todo: list[tuple[str, Any]] = [("#", tag)]
    while todo:
        where, item = todo.pop()
        if isinstance(item, list):
            todo.extend((f"{where}/{i}", inner) for i, inner in enumerate(item))
        elif isinstance(item, dict):
            kind = item.get("type")
            if kind in _SCHEMA_FORMATS and isinstance(schema := item.get("json_schema"), dict):
                yield f"{where}/json_schema", "json", schema  # a schema's own keys are no formats: not walked
            elif kind == "regex" and isinstance(pattern := item.get("pattern"), str):
                yield f"{where}/pattern", "regex", pattern
            else:
                todo.extend((f"{where}/{key}", inner) for key, inner in item.items())


# xgrammar's structural tag formats whose ``json_schema`` is a JSON schema
_SCHEMA_FORMATS = ("json_schema", "qwen_xml_parameter")


def of_response_format(fmt: dict[str, Any]) -> str:
    """The structural tag, as JSON text, of a ``{"type": "structural_tag", ...}`` response_format (what vLLM passes
    on; ``check`` compiles it); ValueError says what to fix in its shape."""
    kind = LegacyTagFormat if "structures" in fmt or "triggers" in fmt else TagFormat
    try:
        parsed = kind.model_validate(fmt)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'response_format'}: {e['msg']}"
                             for e in exc.errors())
        raise ValueError(f"a structural_tag response_format takes format (xgrammar's structural tag) or the "
                         f"legacy structures and triggers: {problems}") from None
    return json.dumps(parsed.model_dump(by_alias=True))


def carried(raw: Any) -> list[str]:
    """The structural tags, as JSON text, that ``check`` would compile for a request body ``raw``: vLLM's
    ``structured_outputs.structural_tag``, and a ``structural_tag`` response_format (chat, completions) or text.format
    (Responses), as ``of_response_format`` reads it (one whose shape is wrong compiles nothing: left out)."""
    if not isinstance(raw, dict):
        return []
    outputs, text = raw.get("structured_outputs"), raw.get("text")
    tags = [tag] if isinstance(outputs, dict) and isinstance(tag := outputs.get("structural_tag"), str) else []
    for fmt in (raw.get("response_format"), text.get("format") if isinstance(text, dict) else None):
        if isinstance(fmt, dict) and fmt.get("type") == "structural_tag":
            try:
                tags.append(of_response_format(fmt))
            except ValueError:
                pass
    return tags
