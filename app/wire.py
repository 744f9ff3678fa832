"""What may cross the wire: valid Unicode text and finite numbers, in and out.

JSON lets a client send a lone UTF-16 surrogate (``"\\ud800"``) and Python's decoder lets
it send ``NaN``/``Infinity``; neither can be tokenized, stored in SQL as UTF-8 text or
written back as strict JSON, so they are refused where a request comes in
(``find_lone_surrogate``, ``Text``, ``allow_inf_nan=False`` on the models) and escaped in
the error bodies that echo them (``json_safe``). A model's JSON (a tool call's arguments) is read the same
strict way (``strict_json``): where it holds them it is no JSON, as where it breaks.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from functools import cache
from datetime import UTC, datetime
from types import UnionType
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import AfterValidator, BaseModel, BeforeValidator, Field, StringConstraints, model_validator

SURROGATE_HINT = ("which is not valid Unicode; send valid UTF-8 text (a JSON \\u escape of a surrogate "
                  "must be a high one followed by a low one, e.g. \\ud83d\\ude00)")


def _lone_surrogate(text: str) -> str | None:
    # every str Python can hold encodes to UTF-8 except one with a lone surrogate in it: the
    # C-level encode is the fast check, the scan only runs on the rare failure
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return text[exc.start]
    return None


NUL = "\x00"  # PostgreSQL's text refuses it


def _unstorable(text: str) -> str | None:
    """The first character of ``text`` no database column takes: a lone surrogate (not UTF-8) or NUL."""
    return NUL if NUL in text else _lone_surrogate(text)


def storable(text: str) -> str:
    """``text`` as every database column holds it: a NUL (a model may generate one, and a token id may decode to
    one) as U+FFFD, the replacement character."""
    return text.replace(NUL, "\ufffd") if NUL in text else text


def unstorable_message(char: str) -> str:
    if char == NUL:
        return "contains a NUL character (\\u0000), which cannot be stored; remove it"
    return f"contains a lone surrogate {escape(char)}, {SURROGATE_HINT}"


MAX_SHOWN = 80  # characters of a client's value an error message repeats back


def shown(value: Any) -> str:
    """A client's value as an error message repeats it: as written where short, else what it is (a 50 KB schema is
    not sent back whole, nor written whole to the API's log)."""
    text = repr(value)
    return text if len(text) <= MAX_SHOWN else _kind_of(value)


def as_given(name: str, value: Any) -> str:
    """The field ``name`` set to ``value`` as an error message names it: ``name=value``, or ``name (what the value
    is)`` where the value is too long to repeat (``shown``)."""
    text = repr(value)
    return f"{name}={text}" if len(text) <= MAX_SHOWN else f"{name} ({_kind_of(value)})"


def _kind_of(value: Any) -> str:
    if isinstance(value, str):
        return f"a {len(value)}-character string"
    return {dict: "an object", list: "a list"}.get(type(value), f"a {type(value).__name__}")


def check_text(value: str) -> str:
    """Pydantic validator: refuses a string holding a lone surrogate or NUL."""
    bad = _unstorable(value)
    if bad is not None:
        raise ValueError(unstorable_message(bad))
    return value


def finite_or_text(value: Any) -> Any:
    """Pydantic before-validator of a ``float | str`` union (a window): a NaN or infinity gets one
    error on the field, instead of one per union member ("deadline.float", "deadline.str")."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("must be a finite number of seconds or a window like '2h'")
    return value


NOT_A_BOOLEAN = "not true or false"


def boolean_for_number(value: Any, annotation: Any) -> bool:
    """Whether ``value`` holds JSON's true or false where ``annotation`` wants a number: the value itself, an item
    of a list of numbers or a value of a dict of them. Pydantic's lax mode reads true as 1 and false as 0 (a
    bool is an int in Python), so ``"max_tokens": true`` was a one-token job; OpenAI refuses it."""
    if not _may_hold_a_boolean(value):  # most values: no walk of the annotation (a prompt's ids at C speed)
        return False
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return boolean_for_number(value, args[0])
    if origin in (Union, UnionType):  # a window's ``float | str`` too; ``bool | int`` takes one
        return bool not in args and any(boolean_for_number(value, a) for a in args if a is not type(None))
    if origin is list and isinstance(value, list):
        return any(boolean_for_number(item, args[0]) for item in value)
    if origin is dict and isinstance(value, dict):
        return any(boolean_for_number(item, args[1]) for item in value.values())
    return isinstance(value, bool) and annotation in (int, float)


def _may_hold_a_boolean(value: Any) -> bool:
    if isinstance(value, bool):
        return True
    items = value if isinstance(value, list) else value.values() if isinstance(value, dict) else None
    return items is not None and not {bool, list, dict}.isdisjoint(map(type, items))


def wants_number(annotation: Any) -> bool:
    """Whether a field of ``annotation`` may hold a number, alone, in a list or as a dict's values (and no bool)."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return wants_number(args[0])
    if origin in (Union, UnionType):
        return bool not in args and any(wants_number(a) for a in args)
    if origin is list:
        return wants_number(args[0])
    if origin is dict:
        return wants_number(args[1])
    return annotation in (int, float)


class NumbersNotBooleans(BaseModel):
    """A request body whose number fields refuse JSON's true/false (``boolean_for_number``), each error naming its
    field, where pydantic's lax mode took them as 1 and 0 (OpenAI refuses them; the OpenAI routes take them as
    vLLM's protocol does). One check a body, of its number fields only (``number_fields``, found once a class)."""

    @classmethod
    @cache
    def number_fields(cls) -> tuple[tuple[str, Any], ...]:
        """(the name a body gives it, its annotation) of each field that may hold a number."""
        return tuple((f.alias or name, f.annotation) for name, f in cls.model_fields.items()
                     if wants_number(f.annotation))

    @model_validator(mode="before")
    @classmethod
    def _not_a_boolean(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, annotation in cls.number_fields():
                if name in data and boolean_for_number(data[name], annotation):
                    raise FieldProblem(name, f"must be a number, {NOT_A_BOOLEAN}")
        return data


# a str field that must be valid Unicode (it is tokenized, stored as UTF-8 and echoed)
Text = Annotated[str, AfterValidator(check_text)]
# OpenAI's metadata: at most 16 pairs, keys of at most 64 characters, values of at most 512
Metadata = Annotated[dict[Annotated[str, StringConstraints(max_length=64), AfterValidator(check_text)],
                          Annotated[str, StringConstraints(max_length=512), AfterValidator(check_text)]],
                     Field(max_length=16)]
# seconds or a window like '2h'
SecondsOrWindow = Annotated[float | str, BeforeValidator(finite_or_text)]


def may_hold_unstorable(json_text: str) -> bool:
    """Whether JSON decoded from ``json_text`` may hold a lone surrogate or NUL: one is in the text itself, or a
    ``\\u`` escape (JSON's only way to write a character the text does not hold) may make one. False: no need to
    walk the decoded value with ``find_unstorable``."""
    return "\\u" in json_text or _unstorable(json_text) is not None


def find_unstorable(value: Any, path: tuple[str | int, ...] = ()) -> tuple[tuple[str | int, ...], str] | None:
    """The location and character of the first lone surrogate or NUL in decoded JSON (keys too), or None."""
    if isinstance(value, str):
        bad = _unstorable(value)
        return (path, bad) if bad is not None else None
    if isinstance(value, dict):
        for k, v in value.items():
            if isinstance(k, str) and (bad := _unstorable(k)) is not None:
                return (*path, escape(k).replace(NUL, "\\u0000")), bad
            if (found := find_unstorable(v, (*path, k))) is not None:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            if (found := find_unstorable(v, (*path, i))) is not None:
                return found
    return None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999: JSON's, but no float holds it, and no strict JSON writes it back
        raise ValueError(f"{text} is out of a float's range")
    return value


# Python's decoder reads NaN, Infinity and -Infinity (no JSON) and 1e999 as inf; this one refuses them
STRICT_JSON = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite_float)


def strict_json(text: str) -> Any:
    """The value of the JSON ``text`` (raises ValueError where it is none, or holds a number no float holds:
    answered, it could not be written back as JSON)."""
    return STRICT_JSON.decode(text)


def holds_non_finite(value: Any) -> bool:
    """Whether a parsed JSON ``value`` holds a NaN or infinity anywhere."""
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(holds_non_finite(v) for v in value.values())
    return isinstance(value, list) and any(holds_non_finite(v) for v in value)


def escape(text: str) -> str:
    """``text`` with lone surrogates written as ``\\udXXX`` (printable, encodable)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def json_safe(value: Any) -> Any:
    """``value`` with what strict JSON cannot carry made printable: non-finite floats as
    "NaN"/"Infinity"/"-Infinity" (how the client wrote them), lone surrogates escaped,
    anything else unknown as its ``str``."""
    if isinstance(value, str):
        return escape(value) if _lone_surrogate(value) is not None else value
    if isinstance(value, bool) or value is None or isinstance(value, int):
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {json_safe(str(k) if not isinstance(k, str) else k): json_safe(v) for k, v in value.items()}
    if isinstance(value, Iterable) and not isinstance(value, bytes | bytearray):
        return [json_safe(v) for v in value]
    if isinstance(value, bytes | bytearray):
        return value.decode("utf-8", "backslashreplace")
    return escape(str(value))


def as_utc(dt: datetime) -> datetime:
    """SQLite hands datetimes back naive (they are stored in UTC); others may carry any offset."""
    return dt.replace(tzinfo=UTC) if dt.tzinfo is None else dt.astimezone(UTC)


def utc_z(dt: datetime | None) -> str | None:
    """ISO 8601 in UTC with a ``Z``: the one way every response writes a timestamp."""
    if dt is None:
        return None
    return as_utc(dt).isoformat().replace("+00:00", "Z")


# a response timestamp in UTC, whether it came from SQLite (naive) or Python (any offset);
# pydantic writes a UTC datetime with a 'Z'
UtcDatetime = Annotated[datetime, AfterValidator(as_utc)]


class FieldProblem(ValueError):
    """A model validator's refusal that one field is to blame for (its ``field``): the error names it as pydantic
    names a field validator's."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
