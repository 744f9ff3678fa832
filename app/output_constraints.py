"""A structured output's constraint (a regex, a grammar, a JSON schema or a structural tag) checked at the API as
the workers' vLLM engine compiles it, so that one it cannot read is the client's 400 as it submits, not a job that
fails on its worker (after a stream began, or a 201 was answered). vLLM's engine compiles with one backend, which
each worker publishes in its heartbeat (``grammar_backend``: xgrammar under ``auto``, pinned by
``gpu_runtime.vllm.scheduler.pin_grammar_backend``; guidance, outlines or lm-format-enforcer where the operator
named it; ``auto`` or ``auto-outlines`` where vLLM still picks per request, for a Mistral tokenizer, until the
engine made its one backend at the first constraint it met: that one from then on). A route checks
a constraint with each backend its model's live workers compile with (``under``: a job may go to any of them), and
with xgrammar where none has said (none up yet). The API checks xgrammar's, guidance's and ``auto``'s reading;
under outlines and lm-format-enforcer, whose libraries it does not check with, it refuses what they never take (a
grammar, a structural tag) and leaves a regex or a JSON schema to the worker's vLLM validation (a refused one fails
its job there, with vLLM's reason).

Compiling takes seconds at xgrammar's first import: an API on the vLLM backend imports the grammar libraries as it
starts (``warm_up``), and the routes compile a body's constraints off the event loop (``carried``, ``outcomes``,
``known``); a check where a backend's library is not installed passes (the worker's engine judges it then)."""

from __future__ import annotations

import functools
import importlib
import json
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from app import guidance_check, schema_features, structural_tag

# a constraint as the checks key it: (its structured_outputs field, its text; a JSON schema as json.dumps writes it)
Constraint = tuple[str, str]
# a json_object constraint as the checks key it: it has no text
JSON_OBJECT: Constraint = ("json_object", "")
# the outcomes of constraints a request checked beforehand (``outcomes``, off the event loop): check's message or None
_known: ContextVar[dict[Constraint, str | None] | None] = ContextVar("output_constraints_known", default=None)
XGRAMMAR, GUIDANCE, OUTLINES, LM_FORMAT_ENFORCER = "xgrammar", "guidance", "outlines", "lm-format-enforcer"
# vLLM's ``auto`` before the engine made its backend (a Mistral tokenizer: ``pin_grammar_backend`` leaves it), as
# ``gpu_runtime.vllm.scheduler.grammar_backend`` publishes it: vLLM picks per request, xgrammar where its validation
# takes the constraint, else guidance (a Tekken tokenizer: AUTO, which sends a Lark grammar to guidance first) or
# outlines (an older, SentencePiece one: AUTO_OUTLINES)
AUTO, AUTO_OUTLINES = "auto", "auto-outlines"
# the backends the workers' engines compile with where none has said (``under``): xgrammar, ``auto``'s pinned one
DEFAULT_BACKENDS = (XGRAMMAR,)
_backends: ContextVar[tuple[str, ...]] = ContextVar("output_constraints_backends", default=DEFAULT_BACKENDS)
# xgrammar's messages start with where in its C++ they were raised: "[19:23:38] /project/cpp/x.cc:83: "
_XGRAMMAR_PLACE = re.compile(r"^\s*\[[^\]]*\]\s*\S+:\d+:\s*")
# what a regex may not hold under xgrammar (guidance reads some, but the workers' engine compiles with xgrammar)
_REGEX_LIMITS = ("without Unicode property classes (\\p{..}, \\P{..}: spell the characters out as ranges, e.g. "
                 "[A-Za-z\\u00c0-\\u024f] for letters), lookarounds, backreferences, possessive quantifiers (a++), "
                 "inline flags ((?i): list both cases) or named groups ((?P<name>...): use (...))")


def check(kind: str, text: str) -> None:
    """Raise ValueError saying what to fix where the ``kind`` constraint (``regex``, ``grammar``, ``json``,
    ``structural_tag`` or ``json_object``, whose text is empty) ``text`` does not compile under a backend of the
    workers' engines (``under``; xgrammar where none is known). A constraint checked beforehand in this context
    (``known``) answers as it did, without compiling again."""
    if (known := _known.get()) is not None and (kind, text) in known:
        if (message := known[(kind, text)]) is not None:
            raise ValueError(message)
        return
    for backend in _backends.get():
        # a backend it does not know, or a kind the backend takes as it is (json_object): the worker's vLLM judges
        if (one := _CHECKS.get(backend, {}).get(kind)) is not None:
            one(text)


def _check_regex(regex: str) -> None:
    _refuse_property_in_class("regex", regex)
    _refuse_unless_compiled("regex", f"a regular expression {_REGEX_LIMITS}",
                            lambda xgr: xgr.Grammar.from_regex(regex))


def _refuse_property_in_class(field: str, regex: str) -> None:
    """ValueError where ``regex`` (``field``'s) holds a Unicode property class inside a character class: xgrammar
    reads ``[\\p{L}]`` as the characters p, {, L and }, without an error, so the text would follow another regex."""
    if _property_in_class(regex):
        raise ValueError(f"{field} holds a Unicode property class (\\p{{..}} or \\P{{..}}) inside [...], which "
                         "xgrammar, the backend of the workers' engine, reads as the characters p, {, the name and }; "
                         "spell the characters out as ranges, e.g. [A-Za-z\\u00c0-\\u024f] for letters")


def _property_in_class(regex: str) -> bool:
    """Whether ``regex`` holds ``\\p{..}`` or ``\\P{..}`` inside a character class (``[...]``)."""
    in_class, i = False, 0
    while i < len(regex):
        char = regex[i]
        if char == "\\":
            if in_class and regex[i + 1:i + 3] in ("p{", "P{"):
                return True
            i += 2  # the escaped character is no class bracket
            continue
        if not in_class and char == "[":
            in_class = True
            i += 2 if regex[i + 1:i + 2] == "^" else 1
            i += 1 if regex[i:i + 1] == "]" else 0  # a ] first in a class is one of its characters
            continue
        if in_class and char == "]":
            in_class = False
        i += 1
    return False


def _check_grammar(grammar: str) -> None:
    lark = _likely_lark(grammar)
    _refuse_unless_compiled(
        "grammar", "an EBNF grammar with a root rule, or a Lark grammar with a start rule",
        lambda xgr: xgr.Grammar.from_lark(grammar) if lark else xgr.Grammar.from_ebnf(grammar))


def _check_schema(text: str) -> None:
    schema = _read_schema(text)
    _refuse_misread_schema(schema)
    _refuse_unless_compiled("json", "a JSON schema", lambda xgr: xgr.Grammar.from_json_schema(text))


def _read_schema(text: str) -> dict[str, Any]:
    """The JSON schema ``text`` read, refused (ValueError) where vLLM refuses it under every backend (its
    ``check_json_nesting``) or where a pattern nests so deep that xgrammar would crash on it."""
    schema = json.loads(text)
    if structural_tag.nesting(schema) > structural_tag.MAX_SCHEMA_NESTING:  # vLLM's check_json_nesting
        raise ValueError(f"json nests objects and arrays deeper than {structural_tag.MAX_SCHEMA_NESTING} levels")
    structural_tag.check_patterns(schema, "json")  # before xgrammar, which one nesting deep crashes
    return schema


def _refuse_misread_schema(schema: dict[str, Any]) -> None:
    """ValueError where xgrammar would compile the JSON schema ``schema`` (json's) into a grammar that does not
    follow it: a pattern with a Unicode property class inside [...], or a feature ``schema_features.refusals``
    names."""
    _refuse_misread_patterns("json's pattern at #", schema)
    if refused := schema_features.refusals(schema):  # xgrammar compiles them, vLLM's validation on the worker not
        more = f"; and {len(refused) - 3} more such" if len(refused) > 3 else ""  # a short message for a long schema
        raise ValueError(f"json is refused by the workers' engine: {'; '.join(refused[:3])}{more}")


def _refuse_misread_patterns(field: str, schema: dict[str, Any]) -> None:
    """ValueError where a ``pattern`` in ``schema`` holds a Unicode property class inside [...] (xgrammar compiles a
    pattern as a regex); ``field`` names where the schema is, each pattern's pointer in it follows."""
    for where, obj, is_schema in schema_features.objects(schema):
        if is_schema and isinstance(pattern := obj.get("pattern"), str):
            _refuse_property_in_class(f"{field}{where[1:]}", pattern)


def _check_structural_tag(text: str) -> None:
    """xgrammar compiles the structural tag (``structural_tag.check``), and each pattern and regex it holds is held
    to xgrammar's reading (a Unicode property class inside [...], ``schema_features.misreadings``). vLLM validates
    and compiles a tag with xgrammar alone (``validate_xgrammar_grammar`` does not look for the schema features it
    sends a JSON schema to guidance for), so a tag's schemas are not held to what guidance refuses
    (``schema_features.refusals``): xgrammar serves them, not enforcing the features it does not support."""
    structural_tag.check(text)
    for where, kind, inner in structural_tag.inner_constraints(json.loads(text)):
        if kind == "regex":
            _refuse_property_in_class(f"structural_tag's regex at {where}", inner)
        else:
            _refuse_misread_patterns(f"structural_tag's pattern at {where}", inner)
            if misread := schema_features.misreadings(inner):
                raise ValueError(f"structural_tag's schema at {where} is refused: {'; '.join(misread)}")


def _likely_lark(grammar: str) -> bool:
    """vLLM's ``grammar_is_likely_lark``: no line (comments aside) defines an EBNF rule (``::=``)."""
    return not any("::=" in re.sub(r"(#|//).*$", "", line) for line in grammar.split("\n"))


def _refuse_unless_compiled(field: str, what: str, by_xgrammar: Callable[[Any], Any]) -> None:
    """ValueError with xgrammar's reason where xgrammar does not compile the constraint (``by_xgrammar``), as the
    workers' engine would not: a constraint only guidance reads is refused too (``pin_grammar_backend``)."""
    try:
        import xgrammar
    except ImportError:  # an API without vLLM's grammar library: the vLLM worker judges it (a bad one is a 400)
        return
    try:
        by_xgrammar(xgrammar)
    except Exception as exc:  # xgrammar's parse and conversion errors
        reason = (_XGRAMMAR_PLACE.sub("", str(exc)).strip().splitlines() or ["xgrammar cannot read it"])[0]
        raise ValueError(f"{field} does not compile ({reason}) under xgrammar, the backend of the workers' engine; "
                         f"give {what}") from None


_XGRAMMAR_CHECKS: dict[str, Callable[[str], None]] = {"regex": _check_regex, "grammar": _check_grammar,
                                                      "json": _check_schema, "structural_tag": _check_structural_tag}


def _xgrammar_validates_schema(text: str) -> None:
    """vLLM's ``validate_xgrammar_grammar`` of a JSON schema: refused where it holds a feature xgrammar does not
    support (``has_xgrammar_unsupported_json_features``), else where xgrammar does not compile it."""
    if gaps := schema_features.xgrammar_gaps(_read_schema(text)):
        raise ValueError(f"json holds {gaps[0]}, which vLLM's xgrammar backend does not support")
    _refuse_unless_compiled("json", "a JSON schema", lambda xgr: xgr.Grammar.from_json_schema(text))


# kind -> vLLM's ``validate_xgrammar_grammar`` of it, which ``auto`` tries first: ValueError where it refuses
_XGRAMMAR_VALIDATIONS: dict[str, Callable[[str], None]] = {
    "regex": lambda regex: _refuse_unless_compiled("regex", "a regular expression",
                                                   lambda xgr: xgr.Grammar.from_regex(regex)),
    "grammar": _check_grammar, "json": _xgrammar_validates_schema, "structural_tag": structural_tag.check}


def _check_auto(fallback: str, kind: str, text: str) -> None:
    """The ``kind`` constraint ``text`` as vLLM's ``auto`` takes it (``SamplingParams._validate_structured_outputs``
    for a Mistral tokenizer): a Lark grammar goes to guidance where ``fallback`` is guidance (a Tekken tokenizer);
    else xgrammar takes what its validation takes (checked then as under xgrammar: what it would misread is
    refused), and ``fallback`` the rest (guidance or outlines; outlines too for a schema with
    ``patternProperties``, which guidance does not read)."""
    if kind == "json":
        _read_schema(text)  # refused under every backend
    if fallback == GUIDANCE and kind == "grammar" and _likely_lark(text):
        return guidance_check.CHECKS[kind](text)
    try:
        _XGRAMMAR_VALIDATIONS[kind](text)
    except ValueError:
        if kind == "json" and _holds_pattern_properties(json.loads(text)):
            fallback = OUTLINES
        try:
            return _CHECKS[fallback][kind](text)
        except ValueError as refused:
            raise ValueError(f"{refused}; vLLM's auto backend tried xgrammar first, which does not take it either"
                             ) from None
    return _XGRAMMAR_CHECKS[kind](text)


def _holds_pattern_properties(schema: dict[str, Any]) -> bool:
    """vLLM's ``has_guidance_unsupported_json_features``: ``patternProperties`` in any object nested in ``schema``."""
    return any("patternProperties" in obj for _, obj, _ in schema_features.objects(schema))


def _refuse_kind(backend: str, kind: str, _: str) -> None:
    """ValueError: vLLM's ``backend`` (outlines, lm-format-enforcer) never takes a ``kind`` constraint (a grammar:
    its validation refuses it; a structural tag: its compile fails on the worker)."""
    raise ValueError(f"{kind}: {backend}, the backend of the workers' engine, does not take a {_KIND_NAMES[kind]}; "
                     "give a regex, a JSON schema or a choice instead")


_KIND_NAMES = {"grammar": "grammar", "structural_tag": "structural tag"}


def _refuse_json_object(_: str) -> None:
    """ValueError: vLLM's outlines validation refuses a json_object constraint (any JSON object), which
    ``response_format`` json_object and Responses' ``text.format`` json_object are too; a JSON schema of an object
    says the same and outlines takes it."""
    raise ValueError("json_object: outlines, the backend of the workers' engine, does not take a json_object "
                     "constraint (response_format json_object); give the JSON schema {\"type\": \"object\"} instead "
                     "(response_format json_schema, or structured_outputs' json)")


def _unchecked(_: str) -> None:
    """A regex or JSON schema under outlines or lm-format-enforcer, whose libraries the API does not check with:
    the worker's vLLM validation judges it (a refused one fails its job with vLLM's reason)."""


# backend -> kind -> its check; a backend not here is left to the worker's vLLM
_CHECKS: dict[str, dict[str, Callable[[str], None]]] = {
    XGRAMMAR: _XGRAMMAR_CHECKS, GUIDANCE: guidance_check.CHECKS,
    **{auto: {kind: functools.partial(_check_auto, fallback, kind) for kind in _XGRAMMAR_CHECKS}
       for auto, fallback in ((AUTO, GUIDANCE), (AUTO_OUTLINES, OUTLINES))},
    **{backend: {"regex": _unchecked, "json": _unchecked,
                 **{kind: functools.partial(_refuse_kind, backend, kind) for kind in _KIND_NAMES}}
       for backend in (OUTLINES, LM_FORMAT_ENFORCER)}}
_CHECKS[OUTLINES]["json_object"] = _refuse_json_object


def schema_text(schema: dict[str, Any]) -> str:
    """A JSON schema as the checks key it."""
    return json.dumps(schema)


def carried(raw: Any) -> list[Constraint]:
    """The constraints ``check`` would compile for a request body ``raw``: vLLM's ``structured_outputs`` (a regex,
    grammar, JSON schema or structural tag), OpenAI's json_schema ``response_format`` (chat, completions) or
    ``text.format`` (Responses), Anthropic's ``output_config.format`` (Messages), and a structural tag in either
    (``structural_tag.carried``), and a json_object constraint in either (``JSON_OBJECT``)."""
    if not isinstance(raw, dict):
        return []
    found = [("structural_tag", tag) for tag in structural_tag.carried(raw)]
    outputs, text = raw.get("structured_outputs"), raw.get("text")
    formats = [raw.get("response_format"), *(h.get("format") for h in (text,) if isinstance(h, dict))]
    if (isinstance(outputs, dict) and outputs.get("json_object") is True) or any(
            isinstance(f, dict) and f.get("type") == "json_object" for f in formats):
        found.append(JSON_OBJECT)
    if isinstance(outputs, dict):
        found += [(kind, value) for kind in ("regex", "grammar") if isinstance(value := outputs.get(kind), str)]
        schema = outputs.get("json")
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError:
                schema = None
        if isinstance(schema, dict):
            found.append(("json", schema_text(schema)))
    fmt = raw.get("response_format")
    schemas = [(fmt.get("json_schema") or {}).get("schema") if isinstance(fmt, dict) and isinstance(
        fmt.get("json_schema"), dict) else None]
    for holder in (text, raw.get("output_config")):  # Responses' and Messages' formats hold their schema at their top
        if isinstance(holder, dict) and isinstance(fmt := holder.get("format"), dict):
            schemas.append(fmt.get("schema"))
    return found + [("json", schema_text(s)) for s in schemas if isinstance(s, dict)]


def outcomes(constraints: list[Constraint], backends: tuple[str, ...] = DEFAULT_BACKENDS,
             ) -> dict[Constraint, str | None]:
    """``check``'s answer for each constraint under ``backends`` (``under``): its ValueError's message, or None where
    it compiles (seconds at xgrammar's first import: called in a thread)."""
    answers: dict[Constraint, str | None] = {}
    with under(backends):
        for kind, text in constraints:
            try:
                check(kind, text)
                answers[(kind, text)] = None
            except ValueError as exc:
                answers[(kind, text)] = str(exc)
    return answers


def backends_of(published: list[str | None]) -> tuple[str, ...]:
    """The backends to check a constraint with, from those the live workers published (a worker's
    ``grammar_backend``; None: it said none, an older worker or the own engine, which serves no constraint): each one
    published, sorted, else xgrammar (``DEFAULT_BACKENDS``), as none being up leaves it."""
    return tuple(sorted({b for b in published if isinstance(b, str) and b})) or DEFAULT_BACKENDS


def unusable_refusal(unusable: dict[str, str], live: int) -> str | None:
    """Why a structured output is refused at submit, from the live workers of the model that take jobs (``live`` of
    them) and those among them whose backend cannot run (``unusable``: worker id -> why, as its heartbeat says);
    None where none says so. Every such worker refuses a constrained request; and a job may go to any live worker
    (the model's queue is shared, prefix routing picks by load), so one such worker among usable ones refuses it
    too: nothing keeps the job off it."""
    if not unusable:
        return None
    worker, why = min(unusable.items())
    named = f"worker {worker!r}: {why}"
    if len(unusable) >= live:
        return f"no live worker of the model can run a structured output ({named})"
    return (f"{len(unusable)} of the model's {live} live workers cannot run a structured output ({named}), and a job "
            "may go to any of them, so it is refused; the operator may also stop those workers, or restart them with a "
            "backend that runs")


@contextmanager
def under(backends: tuple[str, ...]) -> Iterator[None]:
    """Within it, ``check`` compiles a constraint with each of ``backends`` (``backends_of``)."""
    token = _backends.set(backends or DEFAULT_BACKENDS)
    try:
        yield
    finally:
        _backends.reset(token)


@contextmanager
def known(answers: dict[Constraint, str | None]) -> Iterator[None]:
    """Within it, ``check`` answers these constraints from ``answers`` (``outcomes``) instead of compiling them."""
    token = _known.set(answers)
    try:
        yield
    finally:
        _known.reset(token)


def _import_grammar_libraries() -> None:
    for library in ("xgrammar", "llguidance"):
        try:
            importlib.import_module(library)  # imported for its cost only
        except Exception:  # not installed, or broken: ``check`` passes then, and the worker judges the constraint
            pass


def warm_up() -> threading.Thread:
    """Imports xgrammar (seconds) and llguidance in a thread of their own, so that the first request carrying a
    constraint does not pay for it (``check`` runs where pydantic validates a body, on the event loop for some
    routes)."""
    thread = threading.Thread(target=_import_grammar_libraries, name="xgrammar-warm-up", daemon=True)
    thread.start()
    return thread
