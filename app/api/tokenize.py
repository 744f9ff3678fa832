"""``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info``: the served model's tokenizer, as vLLM's
server offers it.

Clients count a prompt's tokens before they send it (or fit it to the context), and turn token ids back into
text, with the tokenizer and chat template the worker uses; a client that renders prompts itself reads the
tokenizer's configuration and chat template (vLLM's, and here too, only where the operator turned it on). The
answers have vLLM's shapes.
"""

from __future__ import annotations

from typing import Any, ClassVar

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, ConfigDict, Field

from app.api.deps import CurrentPrincipal, SettingsDep
from app.api.errors import openai_responses
from app.api.openai_compat import charge_count
from app.openai_schemas import (ChatCompletionRequest, OpenAIError, OpenAIRoute, UnsupportedFields, VllmUnsupported,
                                charged, openai_parsed)
from app.schemas import TEMPLATE_DEFAULTS, TokenId
from app.services import lora_adapters
from app.services.jobs import JobValidationError, check_token_ids, encode_spec, resolve_model
from app.services.model_info import ChatTemplateError, encode_input, get_tokenizer
from app.services.rate_limits import rate_headers
from app.services.workers import held_context_length
from app.settings import Settings
from app.wire import Text

router = APIRouter(tags=["openai"], route_class=OpenAIRoute, responses=openai_responses(400, 401, 404))

MAX_DETOKENIZE = 1_000_000  # token ids in one request (a body of this size is already megabytes)


class TokenizeRequest(UnsupportedFields):
    """A prompt, or chat messages (with the tools offered) through the model's chat template."""

    model_config = ConfigDict(extra="ignore")
    # vLLM's, refused as chat refuses them (vLLM's own unless started trusting them): the count would be of another
    # template's prompt, or of media this server does not take
    unsupported: ClassVar[dict[str, tuple[Any, ...]]] = {
        k: VllmUnsupported.unsupported[k] for k in ("chat_template", "mm_processor_kwargs", "media_io_kwargs")}
    chat_template: Any = None
    mm_processor_kwargs: Any = None
    media_io_kwargs: Any = None

    model: Text | None = None
    prompt: Text | None = None
    messages: list[dict[str, Any]] | None = Field(None, min_length=1)
    tools: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = Field(None, description=(
        "the tokenizer's special tokens (e.g. BOS) too, as a completion or chat request takes it (unset: a prompt's "
        "true, messages' false)"))
    add_generation_prompt: bool | None = Field(None, description="messages: as a chat request takes it")
    continue_final_message: bool | None = Field(None, description="messages: as a chat request takes it")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="messages: as a chat request takes it")
    # vLLM's is ``bool | None``: null, as a client writes a field it leaves unset, is false
    return_token_strs: bool | None = Field(False, description="also each token's text")


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Text | None = None
    tokens: list[TokenId] = Field(max_length=MAX_DETOKENIZE)


def _check_model(settings: Settings, model: str | None) -> None:
    """A model this server serves (an adapter shares the model's tokenizer); an adapter of
    COSERVE_LORA_RESOLVER_DIR not loaded yet is loaded, as vLLM's tokenize routes resolve it."""
    if model is None or lora_adapters.is_served(settings, model):
        return
    try:
        resolve_model(settings, model)
    except JobValidationError as exc:
        if exc.code != "model_not_found":  # an adapter found that cannot be served here
            raise OpenAIError(400, str(exc), param="model") from exc
        raise OpenAIError(404, f"The model '{model}' does not exist", param="model", code="model_not_found") from exc


def _tokenize(settings: Settings, req: TokenizeRequest) -> list[int]:
    req.check_unsupported()
    if (req.prompt is None) == (req.messages is None):
        raise OpenAIError(400, "give exactly one of prompt or messages", param="prompt")
    if req.prompt is not None:
        for name in (*TEMPLATE_DEFAULTS, "tools"):  # vLLM's drops them: the count would pass for holding them
            if getattr(req, name) not in (None, []):
                raise OpenAIError(400, f"{name} is for the chat template: send messages, not a prompt", param=name)
        # as a completion's prompt is fed (the flag unset: true)
        return encode_input(settings.model, req.prompt, None, options={"add_special_tokens": req.add_special_tokens})
    chat = openai_parsed(ChatCompletionRequest, req.model_dump(include={"messages", "tools", "add_special_tokens",
                                                                        *TEMPLATE_DEFAULTS}))
    try:  # the messages, tools and template options as a chat job keeps them: the same checks, the same input
        return encode_spec(settings.model, chat.job_spec(messages=chat.chat_messages()))
    except ChatTemplateError as exc:
        raise OpenAIError(400, str(exc), param="messages") from exc


@router.post("/tokenize", responses=openai_responses(429))
async def tokenize(body: dict[str, Any], settings: SettingsDep, principal: CurrentPrincipal, request: Request
                   ) -> dict[str, Any]:
    """Token ids of a prompt or of chat messages, their count and the model's context length; a request of the
    tenant's token-counting requests per minute (``charge_count``)."""
    req = openai_parsed(TokenizeRequest, body)
    charged(request, rate_headers(await charge_count(request, principal)))  # its 404 for a model says it too
    await run_in_threadpool(_check_model, settings, req.model)
    ids, context = await run_in_threadpool(lambda: (_tokenize(settings, req), held_context_length(settings)))
    strs = get_tokenizer(settings.model).convert_ids_to_tokens(ids) if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": context, "tokens": ids, "token_strs": strs}


@router.post("/detokenize", responses=openai_responses(429))
async def detokenize(body: dict[str, Any], settings: SettingsDep, principal: CurrentPrincipal, request: Request
                     ) -> dict[str, Any]:
    """The text of token ids; a request of the tenant's token-counting requests per minute, as /tokenize."""
    req = openai_parsed(DetokenizeRequest, body)
    charged(request, rate_headers(await charge_count(request, principal)))  # its 404 for a model says it too
    await run_in_threadpool(_check_model, settings, req.model)
    try:
        check_token_ids(settings.model, req.tokens, "tokens")
    except JobValidationError as exc:
        raise OpenAIError(400, str(exc), param="tokens") from exc
    return {"prompt": await run_in_threadpool(get_tokenizer(settings.model).decode, req.tokens)}


# a tokenizer's settings that name files of the server's, not the tokenizer's behaviour (vLLM's drops the first two)
SERVER_PATHS = ("vocab_file", "merges_file", "tokenizer_file", "name_or_path")


def tokenizer_info(tok: Any) -> dict[str, Any]:
    """vLLM's answer: the tokenizer's configuration (its ``tokenizer_config.json``, special tokens as their text), its
    class, and the chat template chat messages are rendered with."""
    config = {k: _json_value(v) for k, v in (getattr(tok, "init_kwargs", None) or {}).items() if k not in SERVER_PATHS}
    config["tokenizer_class"] = type(tok).__name__
    if template := getattr(tok, "chat_template", None):
        config["chat_template"] = template
    return config


def _json_value(value: Any) -> Any:
    """``value`` as JSON writes it: a special token (transformers' ``AddedToken``) as its text, anything else that
    JSON has no value for as its text too."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    return value if value is None or isinstance(value, (str, int, float, bool)) else str(value)


@router.get("/tokenizer_info", responses=openai_responses(401, 404))
async def get_tokenizer_info(settings: SettingsDep, _principal: CurrentPrincipal) -> dict[str, Any]:
    """The tokenizer's configuration and chat template, where COSERVE_ENABLE_TOKENIZER_INFO_ENDPOINT is set (vLLM's
    --enable-tokenizer-info-endpoint); else a 404 ``unsupported_endpoint`` saying so."""
    if not settings.enable_tokenizer_info_endpoint:
        raise OpenAIError(404, "GET /tokenizer_info is off on this server: it shows the tokenizer's configuration "
                               "and chat template where the operator sets COSERVE_ENABLE_TOKENIZER_INFO_ENDPOINT=true "
                               "(vLLM's --enable-tokenizer-info-endpoint); POST /tokenize renders chat messages "
                               "with that template meanwhile", code="unsupported_endpoint")
    return await run_in_threadpool(lambda: tokenizer_info(get_tokenizer(settings.model)))
