"""The Responses API's ``truncation: "auto"``: a conversation too long for the model's context loses its oldest
turns until the prompt and the answer's ``max_output_tokens`` fit. And vLLM's ``truncate_prompt_tokens``, which keeps
a prompt's last tokens (``fed_prompt``).

System messages (the instructions, and system or developer input) stay; a tool result whose call was dropped
goes with it (a template cannot render a result without its call); the newest message always stays, so a
request that does not fit even then is refused as any other over-long one."""

from __future__ import annotations

import logging
from typing import Any

from app.schemas import INSTRUCTION_ROLES, JobCreate
from app.services.model_info import ChatTemplateError, context_length, encode_input
from app.services.workers import held_context_length
from app.settings import Settings
from app.tool_calls import template_tools

log = logging.getLogger(__name__)


def kept_count(truncate: int | None, context: int) -> int | None:
    """How many tokens a prompt keeps under ``truncate_prompt_tokens``: ``truncate`` (None: no cut), or for -1 a
    ``context``-token model's context less the one token vLLM 0.32 holds back for the answer
    (``TokenizeParams.max_truncation_tokens``); the answer then gets what the context leaves (``job_values``)."""
    if truncate is None:
        return None
    return max(1, context - 1 if truncate == -1 else truncate)


def fed_prompt(settings: Settings, job: Any, context: int | None = None) -> list[int]:
    """A job's prompt as its worker feeds the engine: the token ids of its prompt, or of its messages and tools
    through the chat template, cut to ``truncate_prompt_tokens`` within ``context`` tokens: the API passes the
    context it holds jobs to, the worker none (its engine settings'). Raises ``ChatTemplateError``.

    As vLLM: token ids keep their last k; a text is cut inside its tokenization, so the special tokens the tokenizer
    adds (a completion prompt's BOS) stay and the text gives up the room they take (``encode_input``)."""
    sampling = job.sampling or {}
    truncate = sampling.get("truncate_prompt_tokens")
    keep = kept_count(truncate, context_length(settings) if context is None else context)
    if job.prompt_token_ids:
        return list(job.prompt_token_ids)[-keep:] if keep else list(job.prompt_token_ids)
    return encode_input(settings.model, job.prompt, job.messages, job.tools, job.template_options, keep=keep,
                        endpoint=job.endpoint)


def fit_context(settings: Settings, spec: JobCreate, input_from: int) -> tuple[JobCreate, int]:
    """``spec`` with the oldest droppable messages left out until it fits, and where the response's own input
    starts among those kept (``input_from`` was its place among all of them)."""
    limit = held_context_length(settings) - spec.sampling(settings.default_max_tokens)["max_tokens"]
    messages = list(spec.messages or ())
    tools = template_tools(spec.tools)

    def fits(kept: list[int]) -> bool:
        try:
            ids = encode_input(settings.model, None, [messages[i].stored() for i in kept], tools,
                               spec.template_options(), endpoint="/v1/responses")
        except ChatTemplateError:
            return True  # the submission names the template's error
        return len(ids) <= limit

    kept = list(range(len(messages)))
    answered = messages[-1].tool_call_id if messages else None  # the call the newest message answers stays too
    droppable = [i for i in kept[:-1] if messages[i].role not in INSTRUCTION_ROLES
                 and not any(c.id == answered for c in messages[i].tool_calls or ())]
    if fits(kept) or not droppable:
        return spec, input_from
    # the fewest oldest turns to drop: a binary search over how many (each try tokenizes the whole prompt)
    low, high = 1, len(droppable)
    while low < high:
        mid = (low + high) // 2
        if fits(_without(messages, kept, droppable[:mid])):
            high = mid
        else:
            low = mid + 1
    kept = _without(messages, kept, droppable[:low])
    log.info("truncation auto: dropped %d of %d messages to fit the context", len(messages) - len(kept),
             len(messages))
    return (spec.model_copy(update={"messages": [messages[i] for i in kept]}),
            sum(1 for i in kept if i < input_from))


def fit_response(settings: Settings, spec: JobCreate, kept: dict[str, Any]) -> JobCreate:
    """A Responses job's ``fit_context``: ``kept`` (what the job keeps of the request) says where the input starts
    among the messages kept and, where the prompt lost some of the input, the whole input (``own_input``): the
    response's input items and its conversation's turn are what the client sent, only the engine reads less."""
    own = [m.stored() for m in (spec.messages or ())[kept["input_from"]:]]
    fitted, kept["input_from"] = fit_context(settings, spec, kept["input_from"])
    if len(fitted.messages or ()) - kept["input_from"] < len(own):
        kept.setdefault("own_input", own)  # (already there where it keeps an item's text parts apart)
    return fitted


def _without(messages: list[Any], kept: list[int], dropped: list[int]) -> list[int]:
    """``kept`` less ``dropped`` and the tool results whose calls are gone with them."""
    gone = set(dropped)
    calls = {c.id for i in dropped for c in messages[i].tool_calls or ()}
    return [i for i in kept if i not in gone and not (messages[i].role == "tool" and messages[i].tool_call_id in calls)]
