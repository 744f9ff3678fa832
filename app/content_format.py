"""How a chat template reads a message's content, as vLLM 0.32 decides it (``--chat-template-content-format auto``,
its ``_detect_content_format``): "openai" where the template loops over a message's content (each part a
``{"type": "text", "text": ...}``), "string" where it reads the content as one text (the parts joined with
newlines). A template that loops over a string would render its characters one by one: the format decides what
the template is given."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from functools import lru_cache
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from jinja2 import nodes

logger = logging.getLogger(__name__)

ContentFormat = Literal["string", "openai"]
ContentFormatOption = Literal["auto", "string", "openai"]  # COSERVE_CHAT_TEMPLATE_CONTENT_FORMAT: auto detects it


@lru_cache(maxsize=32)
def content_format(template: str | None) -> ContentFormat:
    """The content format ``template`` reads (vLLM's detection): "openai" where one of its loops runs over a
    message's content (``message['content']``, a macro's parameter given it, or a ``content`` outside macros);
    "string" else, and where the template does not parse or its loops are not as vLLM reads them."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    if not template:
        return "string"
    try:  # parsed as transformers compiles it (its extensions: a {% generation %} block parses)
        root = _compile_jinja_template(template).environment.parse(template)
        return "string" if next(_content_loops(root), None) is None else "openai"
    except Exception:  # noqa: BLE001 - any template vLLM cannot read is a "string" one to it
        logger.debug("chat template content format: not detected, 'string' taken", exc_info=True)
        return "string"


def _reads(node: nodes.Node | None, name: str, key: str | None = None) -> bool:
    """Whether ``node`` is the variable ``name`` (``key``: its item or attribute ``key``), through filters, tests
    and slices around it."""
    from jinja2 import nodes

    while isinstance(node, (nodes.Filter, nodes.Test)) or (
            isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice)):
        node = node.node
    if key is not None:
        keyed = (isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and node.arg.value == key
                 or isinstance(node, nodes.Getattr) and node.attr == key)
        if not keyed:
            return False
        node = node.node
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name


def _target(loop: nodes.For | nodes.Assign) -> str:
    """The one name a loop or ``set`` binds (vLLM reads no other: a tuple is an error, the template a string one)."""
    from jinja2 import nodes

    if not isinstance(loop.target, nodes.Name):
        raise ValueError(f"a loop or set binding {type(loop.target).__name__}, not a name")
    return loop.target.name


def _aliases(root: nodes.Template, name: str) -> list[str]:
    """``name`` and the names set from it (and from those), e.g. ``{% set loop_messages = messages[1:] %}``."""
    from jinja2 import nodes

    found, queue = [name], [name]
    while queue:
        current = queue.pop()
        for assign in root.find_all(nodes.Assign):
            if _reads(assign.node, current):
                alias = _target(assign)
                found.append(alias)
                if alias != current:
                    queue.append(alias)
    return found


def _message_names(root: nodes.Template) -> list[str]:
    """The names a loop over the messages binds each message to (``{% for message in messages %}``)."""
    from jinja2 import nodes

    messages = _aliases(root, "messages")
    return [_target(loop) for loop in root.find_all(nodes.For) if any(_reads(loop.iter, m) for m in messages)]


def _content_parameters(root: nodes.Template) -> dict[int, set[str]]:
    """Each loop inside a macro (by id), with the macro's parameters that some call gives a message's content."""
    from jinja2 import nodes

    messages = _message_names(root)
    by_loop: dict[int, set[str]] = {}
    for macro in root.find_all(nodes.Macro):
        params = [arg.name for arg in macro.args]
        given: set[str] = set()
        for call in root.find_all(nodes.Call):
            if not (isinstance(call.node, nodes.Name) and call.node.name == macro.name):
                continue
            given |= {params[i] for i, arg in enumerate(call.args[:len(params)])
                      if any(_reads(arg, m, "content") for m in messages)}
            given |= {kw.key for kw in call.kwargs
                      if kw.key in params and any(_reads(kw.value, m, "content") for m in messages)}
        for loop in macro.find_all(nodes.For):
            by_loop[id(loop)] = given
    return by_loop


def _content_loops(root: nodes.Template) -> Iterator[nodes.For]:
    """The loops that run over a message's content, as vLLM finds them."""
    from jinja2 import nodes

    messages = _message_names(root)
    in_macros = _content_parameters(root)
    for loop in root.find_all(nodes.For):
        params = in_macros.get(id(loop))
        if (any(_reads(loop.iter, m, "content") for m in messages)
                or isinstance(loop.iter, nodes.Name) and loop.iter.name in (
                    params if params is not None else {"content"})):
            _target(loop)
            yield loop
