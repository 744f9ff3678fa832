"""Request/response schemas of the jobs API (``JobCreate`` in, ``JobPublic`` out)."""

from __future__ import annotations

import json
import math
import re
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, ValidationInfo,
                      field_validator, model_validator)

from app import output_constraints
from app.bounds import MAX_RATE
from app.tool_calls import (MAX_TOOLS, ToolCall, ToolChoice, ToolSpec, forced_schema, is_forced, kept_choice,
                            needs_tools, read_answer)
from app.wire import FieldProblem, NumbersNotBooleans, Text, UtcDatetime
from gpu_runtime.logprobs import MAX_TOP_LOGPROBS
from gpu_runtime.sampling import CONSTRAINT_OPTIONS, LOGIT_BIAS_LIMIT, PENALTY_LIMIT

MAX_TARGET_MS = 3_600_000.0  # a TTFT/TBT target above an hour is a unit mistake
MAX_WINDOW_S = 30 * 24 * 3600.0
MAX_SEED = 2**63 - 1  # torch generators take a 64-bit seed; a larger one fails inside the engine step
MIN_SEED = -(2**63)  # OpenAI's and vLLM's int64
MAX_TOP_K = 2**31 - 1  # vLLM keeps top_k as int32 (a k beyond the vocabulary means all tokens)
MAX_LOGIT_BIASES = 1024  # tokens one request may bias
MAX_TEMPLATE_KWARGS = 32
TEMPLATE_VARIABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
TEMPLATE_DEFAULTS: dict[str, Any] = {"add_generation_prompt": True, "continue_final_message": False,
                                     "chat_template_kwargs": None}
# apply_chat_template's own arguments and what it renders the template with: a request's kwargs cannot replace them
RESERVED_TEMPLATE_VARIABLES = frozenset({
    "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "bos_token", "eos_token", "pad_token", "unk_token"})
MAX_STOP_TOKEN_IDS = 256
MAX_ALLOWED_TOKEN_IDS = 262_144  # a vocabulary's worth
MAX_BAD_WORDS = 128  # vLLM's VLLM_MAX_NUM_BAD_WORDS default
MAX_BAD_WORDS_TOKENS = 1024  # vLLM's VLLM_MAX_BAD_WORDS_TOTAL_TOKENS default: their token sequences' tokens
TokenId = Annotated[int, Field(ge=0)]
Bias = Annotated[float, Field(ge=-LOGIT_BIAS_LIMIT, le=LOGIT_BIAS_LIMIT)]
_TOKEN_ID = TypeAdapter(TokenId)


def _is_token_id(value: Any) -> bool:
    """Whether ``value`` reads as a ``TokenId`` (an integer, or its text, 0 or more)."""
    try:
        _TOKEN_ID.validate_python(value)
    except ValidationError:
        return False
    return True


INSTRUCTION_ROLES = ("system", "developer")  # the messages that instruct the model (truncation keeps them)


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(description=(
        "developer: as OpenAI's, instructions that a chat template naming the role is given as such (vLLM's role "
        "as sent), and one that does not as the system message"))
    content: Text
    tool_calls: list[ToolCall] | None = Field(None, description="an assistant message's calls (its history)")
    tool_call_id: Text | None = Field(None, description="a tool message: the call it answers")
    name: Text | None = None
    reasoning: Text | None = Field(None, description=(
        "an assistant message's thinking, given back (vLLM's interleaved thinking): its chat template reads it as "
        "reasoning and reasoning_content; a template that does not render it leaves it out"))
    tools: list[dict[str, Any]] | None = Field(None, description=(
        "a developer message's own tools, given to its chat template as sent where the template knows the role "
        "(vLLM's; DeepSeek's templates write them); one that does not gets the system message, without them (as "
        "vLLM's; OpenAI's developer message has none)"))
    parts: list[Text] | None = Field(None, description=(
        "the text parts the content came as (content: them joined with newlines; [] for no content): a chat "
        "template that loops over a message's content parts (vLLM's 'openai' content format) is given each"))

    @field_validator("parts")
    @classmethod
    def _parts_of_content(cls, parts: list[str] | None, info: ValidationInfo) -> list[str] | None:
        # a template reads the content or the parts (its content format): they must say the same
        if parts is not None and "content" in info.data and "\n".join(parts) != info.data["content"]:
            raise ValueError("parts must be the content's text parts (content: them joined with newlines); leave "
                             "parts out to give the content as one part")
        return parts

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("only a tool message has a tool_call_id")
        if self.reasoning is not None and self.role != "assistant":
            raise ValueError("only an assistant message has reasoning")
        if self.tools is not None and self.role != "developer":
            raise ValueError("only a developer message has tools of its own; give the request's in tools")
        return self

    def stored(self) -> dict[str, Any]:
        """The message as a job keeps it and a chat template reads it (fields it does not have left out; a call's own
        keys kept whole, a null one too, as vLLM's chat route gives them)."""
        out = self.model_dump(exclude_none=True)
        if self.tool_calls is not None:
            out["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        return out


def _is_default(option: str, value: Any) -> bool:
    """Whether a chat-template option is at its default (no kwargs: None or {})."""
    return value == TEMPLATE_DEFAULTS.get(option) or value == {}


def _all_finite(value: Any) -> bool:
    """Whether every number in a JSON value is finite."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_all_finite(v) for v in value.values())
    if isinstance(value, list):
        return all(_all_finite(v) for v in value)
    return True


def alternatives_range(value: int) -> str:
    """Why ``value`` alternatives per token are refused: vLLM takes -1 (the whole vocabulary) and any number up to
    its max_logprobs, 20 unless raised, which coserve's engine keeps; so -1 is over it there too."""
    whole = f" (-1, the whole vocabulary, is more than the {MAX_TOP_LOGPROBS} vLLM's max_logprobs allows)"
    return (f"the number of alternatives per token is 0-{MAX_TOP_LOGPROBS}; got {value}"
            + (whole if value == -1 else ""))


def _in_range(value: int | None) -> int | None:
    if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
        raise ValueError(alternatives_range(value))
    return value


Alternatives = Annotated[int | None, AfterValidator(_in_range)]  # alternatives per token: top_logprobs' kind


class StructuredOutputs(BaseModel):
    """vLLM's structured outputs: exactly one constraint the generated text must match (vLLM backend)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_schema: dict[str, Any] | Text | None = Field(None, alias="json", description="a JSON schema (an object, "
                                                                                      "or its JSON text)")
    regex: Text | None = Field(None, description="a regular expression")
    choice: list[Text] | None = Field(None, min_length=1, description="the text is one of these strings")
    grammar: Text | None = Field(None, min_length=1, description="a grammar (EBNF as xgrammar reads it, or Lark)")
    json_object: Literal[True] | None = Field(None, description="any JSON object")
    structural_tag: Text | None = Field(None, description=(
        "vLLM's structural tag as JSON text: free text until a trigger, then tagged parts under their constraints"))
    # vLLM's options of the constraint (StructuredOutputsParams' own): its backends read them with a JSON constraint
    disable_any_whitespace: bool = Field(False, description="JSON without whitespace between its tokens")
    disable_additional_properties: bool = Field(False, description=(
        "a JSON schema's objects take no properties it does not name, where it leaves additionalProperties unset"))
    whitespace_pattern: Text | None = Field(None, description="the regex JSON's whitespace matches")

    @model_validator(mode="after")
    def _one(self) -> StructuredOutputs:
        given = [k for k in self.fields() if k not in CONSTRAINT_OPTIONS]
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar, json_object or structural_tag"
                             + (f" (got {', '.join(given)})" if given else ""))
        schema = self.json_schema
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise ValueError(f"json is not valid JSON: {exc}") from None
            if not isinstance(schema, dict):
                raise ValueError("json must be a JSON schema object")
        if schema is not None and not _all_finite(schema):  # Python's JSON reads NaN and Infinity; JSON has neither
            raise ValueError("json holds a number that is not finite (NaN or Infinity); JSON schemas cannot")
        if self.regex is not None and "\x00" in self.regex:
            raise ValueError("regex must not contain a NUL character")
        for kind, text in (("regex", self.regex), ("grammar", self.grammar), ("structural_tag", self.structural_tag),
                           ("json", output_constraints.schema_text(schema) if schema is not None else None),
                           output_constraints.JSON_OBJECT if self.json_object else ("json_object", None)):
            if text is not None:  # the one given: compiled as vLLM's server compiles it before its engine sees it
                try:
                    output_constraints.check(kind, text)
                except ValueError as exc:
                    raise FieldProblem(kind, str(exc)) from None
        return self

    def fields(self) -> dict[str, Any]:
        """The one constraint in vLLM's field form, e.g. ``{"json": {...}}``, and the options set (what a job's
        sampling keeps)."""
        return self.model_dump(by_alias=True, exclude_none=True, exclude_defaults=True)


class JobCreate(NumbersNotBooleans):
    """One generation job: a prompt or chat messages, QoS targets and sampling params."""

    # allow_inf_nan: Python's JSON decoder turns NaN/Infinity into floats, which no target,
    # window or sampling parameter can be (NaN slips through every gt/le bound)
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    kind: Literal["interactive", "batch"] = "interactive"
    model: Text | None = Field(None, description="served model name; default: the server's model")
    prompt: Text | None = Field(None, description="raw prompt (completion)")
    prompt_token_ids: list[int] | None = Field(None, min_length=1, description=(
        "the prompt as token ids of the model's tokenizer (instead of prompt or messages)"))
    messages: list[ChatMessage] | None = Field(None, description="chat messages (chat template applied)")
    tier: Text | None = Field(None, description="free | paid; default: the API key's tier")
    app_id: Text | None = Field(None, max_length=200, description=(
        "application key for decode-length history (output lengths are predicted from the tenant's finished "
        "jobs of the same app_id; without one, from its jobs of the same kind)"))
    prompt_cache_key: Text | None = Field(None, max_length=1024, description=(
        "OpenAI's: requests that give the same key go to the same worker, whose prefix cache holds what they "
        "share (prefix routing; without it a chat's opening messages are the key)"))
    user: Text | None = Field(None, max_length=256, description=(
        "the client's end user (OpenAI's safety_identifier or user, Anthropic's metadata.user_id): the Usage API "
        "groups and filters by it (user_id)"))
    # QoS: interactive jobs have TTFT/TBT targets, batch jobs a deadline
    ttft_ms: float | None = Field(None, gt=0, le=MAX_TARGET_MS, description="time-to-first-token target")
    tbt_ms: float | None = Field(None, gt=0, le=MAX_TARGET_MS, description="time-between-tokens target")
    tbt_anchor: Literal["arrival", "first-token"] | None = Field(
        None, description="interactive: when token n is due, 'arrival' (arrival + TTFT + (n-1) TBT) or "
                          "'first-token' (first token + (n-1) TBT: a steady stream); default: the server's")
    deadline_at: datetime | None = Field(None, description="batch: absolute completion deadline (with timezone)")
    deadline_window_s: float | None = Field(None, gt=0, le=MAX_WINDOW_S, description="batch: seconds from now")
    # sampling
    max_tokens: int | None = Field(None, ge=1, le=1_000_000)
    temperature: float = Field(0.0, ge=0, le=2, description="0: greedy; at most 2 (OpenAI's and vLLM's range)")
    top_p: float = Field(1.0, gt=0, le=1)
    stop: list[Text] = Field(default_factory=list, max_length=16)
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=MAX_STOP_TOKEN_IDS, description=(
        "token ids that end the text beside the end of sequence (vLLM backend)"))
    min_tokens: int = Field(0, ge=0, le=1_000_000, description=(
        "no end of sequence or stop token before this many tokens (vLLM backend)"))
    cache_salt: Text | None = Field(None, min_length=1, max_length=256, description=(
        "vLLM's: only requests with the same salt share prefix-cache blocks (within the tenant, under "
        "COSERVE_PREFIX_CACHE_SCOPE=tenant)"))
    truncate_prompt_tokens: int | None = Field(None, ge=-1, description=(
        "vLLM's: the prompt keeps only its last k tokens (left truncation; a special token the tokenizer adds to a "
        "text, e.g. BOS, stays); -1, as vLLM 0.32: the context less one token, the answer getting what is left"))
    include_stop_str_in_output: bool = Field(False, description=(
        "vLLM's: the stop string that ended the text stays at its end"))
    return_token_ids: bool = Field(False, description=(
        "vLLM's: the answer carries the prompt's token ids and each choice's generated ids (the job keeps them as "
        "output_token_ids)"))
    allowed_token_ids: list[TokenId] | None = Field(None, min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS, description=(
        "vLLM's: only these token ids may be generated (vLLM backend)"))
    bad_words: list[Text] | None = Field(None, max_length=MAX_BAD_WORDS, description=(
        "vLLM's: words (each as the tokenizer writes it, with or without a leading space) never generated (vLLM "
        "backend)"))
    seed: int | None = Field(None, ge=MIN_SEED, le=MAX_SEED)
    top_k: int = Field(0, ge=-1, le=MAX_TOP_K, description="sample among the k most likely tokens (0 or -1: all)")
    min_p: float = Field(0.0, ge=0, le=1, description="drop tokens less likely than min_p x the most likely one")
    presence_penalty: float = Field(0.0, ge=-PENALTY_LIMIT, le=PENALTY_LIMIT, description=(
        "taken off the logit of every token the output already holds (vLLM backend)"))
    frequency_penalty: float = Field(0.0, ge=-PENALTY_LIMIT, le=PENALTY_LIMIT, description=(
        "taken off a token's logit once per time the output holds it (vLLM backend)"))
    repetition_penalty: float = Field(1.0, gt=0, description=(
        "divides positive and multiplies negative logits of tokens in the prompt or output (1: none; vLLM backend)"))
    logit_bias: dict[TokenId, Bias] | None = Field(None, max_length=MAX_LOGIT_BIASES, description=(
        "token id -> a bias in [-100, 100] added to its logit before sampling (-100: never, 100: always; vLLM "
        "backend, without speculation)"))
    # the range in the message, as the OpenAI routes say it; the schema documents it too
    logprobs: Alternatives = Field(None, json_schema_extra={"minimum": 0, "maximum": MAX_TOP_LOGPROBS}, description=(
        "report each output token's log-probability and this many most likely alternatives (vLLM backend)"))
    prompt_logprobs: Alternatives = Field(None, json_schema_extra={"minimum": 0, "maximum": MAX_TOP_LOGPROBS},
                                          description="the same for each prompt token (vLLM backend)")
    echo: bool = Field(False, description=("OpenAI completions' echo: that route's answer starts with the prompt "
                                           "(the job resource keeps prompt and output apart)"))
    echo_only: bool = Field(False, description=(
        "completions' echo with max_tokens 0 (vLLM's): that route's answer is the prompt alone, the token generated "
        "with its logprobs left out"))
    thinking_token_budget: int | None = Field(None, ge=0, le=1_000_000, description=(
        "vLLM's: a reasoning model thinks at most this many tokens, then its end of thinking is forced (vLLM "
        "backend with COSERVE_REASONING_PARSER)"))
    include_reasoning: bool = Field(True, description=(
        "vLLM's: where the server reads a reasoning model's thinking (COSERVE_REASONING_PARSER), false leaves it "
        "out of the chat answer (it is still not content)"))
    structured_outputs: StructuredOutputs | None = Field(None, description=(
        "constrain the text to a JSON schema, a regex, a list of choices, a grammar or a structural tag (vLLM "
        "backend)"))
    tools: list[ToolSpec] | None = Field(None, max_length=MAX_TOOLS, description=(
        "functions the model may call, given to the model's chat template (chat messages only)"))
    tool_choice: ToolChoice | None = Field(None, description=(
        "'required' (one call or more to the tools) or {'type': 'function', 'function': {'name': ...}} (that "
        "function): the text is generated as the calls' JSON and read back as tool_calls (vLLM backend); "
        "'auto': the model may call tools in its own syntax, read back where the server has a parser for it "
        "(COSERVE_TOOL_CALL_PARSER); 'none' or unset: the text is free (unset means 'auto' on the OpenAI route)"))
    parallel_tool_calls: bool = Field(True, description="with tool_choice 'required': more than one call allowed")
    # how the messages go through the chat template (vLLM's chat extensions)
    add_generation_prompt: bool = Field(True, description=(
        "end the rendered chat with the template's start of an assistant turn (chat messages only)"))
    continue_final_message: bool = Field(False, description=(
        "leave the last message open, so the model continues it (a prefilled answer: give add_generation_prompt "
        "false; chat messages only)"))
    chat_template_kwargs: dict[str, Any] | None = Field(None, max_length=MAX_TEMPLATE_KWARGS, description=(
        "more variables for the chat template (e.g. {'enable_thinking': false} for Qwen3; chat messages only)"))
    add_special_tokens: bool | None = Field(None, description=(
        "vLLM's: add the tokenizer's special tokens (e.g. BOS) to the prompt text, on top of those a chat template "
        "writes (unset: a prompt's true, chat messages' false, as vLLM's completions and chat; prompt_token_ids are "
        "fed as given)"))
    ignore_eos: bool = False
    stream: bool = Field(False, description="follow the tokens at GET /v1/jobs/{id}/stream (server-sent events)")

    @field_validator("add_generation_prompt", "continue_final_message", "chat_template_kwargs")
    @classmethod
    def _for_messages(cls, value: Any, info: ValidationInfo) -> Any:
        if not _is_default(info.field_name or "", value) and "messages" in info.data and info.data["messages"] is None:
            raise ValueError(f"{info.field_name} is for the chat template: send messages, not a prompt")
        return value

    @field_validator("continue_final_message")
    @classmethod
    def _one_turn_at_the_end(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("add_generation_prompt"):
            raise ValueError("continue_final_message continues the last message, add_generation_prompt (true by "
                             "default) starts a new one: give add_generation_prompt false with it")
        return value

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        for key, item in (value or {}).items():
            if not TEMPLATE_VARIABLE.fullmatch(key) or key in RESERVED_TEMPLATE_VARIABLES:
                raise ValueError(f"key {key!r}: give a template variable's name (letters, digits and _), and none "
                                 "that the server sets itself (messages, tools, add_generation_prompt, ...)")
            if not _all_finite(item):
                raise ValueError(f"[{key!r}] holds a number that is not finite")
        return value

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias_keys_are_token_ids(cls, biases: Any) -> Any:
        # the field's error naming the key, as vLLM's server blames logit_bias: pydantic's own for a key, as
        # "logit_bias.-1: Input should be greater than or equal to 0", read as if the bias were wrong
        if isinstance(biases, dict) and (bad := [k for k in biases if not _is_token_id(k)]):
            raise ValueError(f"key {bad[0]} is not a token id: keys are token ids, 0 or more")
        return biases

    @field_validator("stop")
    @classmethod
    def _stops_not_empty(cls, stops: list[str]) -> list[str]:
        if any(not s for s in stops):  # vLLM's SamplingParams refuses one (an empty string would end every text)
            raise ValueError("stop sequences must not be empty")
        return stops

    @field_validator("prompt", "messages")
    @classmethod
    def _not_empty(cls, value: Any) -> Any:
        if value is not None and not value:  # the error's loc names the field, as OpenAI's param does
            raise ValueError("must not be empty")
        return value

    @model_validator(mode="after")
    def _check(self) -> JobCreate:
        if sum(x is not None for x in (self.prompt, self.messages, self.prompt_token_ids)) != 1:
            raise ValueError("give exactly one of 'prompt' or 'messages'" + (
                " or 'prompt_token_ids'" if self.prompt_token_ids is not None else ""))
        if self.echo_only and not self.echo:
            raise ValueError("echo_only answers the prompt alone: give echo true with it")
        if self.truncate_prompt_tokens == 0:
            raise ValueError("truncate_prompt_tokens keeps the last k tokens of the prompt (k >= 1), or -1: as many "
                             "as fit; 0 would leave no prompt")
        if self.kind == "interactive" and (self.deadline_at or self.deadline_window_s):
            raise ValueError("interactive jobs take ttft_ms/tbt_ms; use kind='batch' for a deadline")
        if self.kind == "batch" and (self.ttft_ms or self.tbt_ms or self.tbt_anchor):
            raise ValueError("batch jobs take deadline_at or deadline_window_s, not ttft_ms/tbt_ms/tbt_anchor")
        if self.deadline_at is not None and self.deadline_window_s is not None:
            raise ValueError("give deadline_at or deadline_window_s, not both")
        if self.deadline_at is not None and self.deadline_at.tzinfo is None:
            raise ValueError("deadline_at needs a timezone (e.g. '2030-01-01T12:00:00Z')")
        self._check_tools()
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise FieldProblem("min_tokens", f"{self.min_tokens} is more than max_tokens ({self.max_tokens})")
        if self.deadline_at is not None and self.deadline_at.utcoffset():
            # SQLite keeps a datetime's wall time and drops its offset: store UTC
            try:
                self.deadline_at = self.deadline_at.astimezone(UTC)
            except OverflowError:  # year 1 or 9999 pushed past the calendar's edge
                raise ValueError("deadline_at is out of range; give a time within the next 30 days") from None
        return self

    def _check_tools(self) -> None:
        if self.tools is not None and self.messages is None:
            raise ValueError("tools are given to a chat template: send messages, not a prompt")
        names = [t.function.name for t in self.tools or ()]
        for i, tool in enumerate(self.tools or ()):
            if not _all_finite(tool.function.parameters):
                raise FieldProblem(f"tools.{i}.function.parameters", "they hold a number that is not finite (NaN or "
                                                                     "Infinity); JSON schemas cannot")
            if (first := names.index(tool.function.name)) < i:
                raise FieldProblem(f"tools.{i}.function.name", f"{tool.function.name!r} is the name of tools.{first} "
                                                               "too; tools must have different names")
        choice = kept_choice(self.tool_choice)
        if choice is None:
            return
        if not names:
            raise FieldProblem("tool_choice", needs_tools(choice))
        if isinstance(choice, dict) and choice["function"]["name"] not in names:
            raise FieldProblem("tool_choice", f"it names {choice['function']['name']!r}, which is not among the "
                                              f"tools ({', '.join(names)})")
        if is_forced(choice) and self.structured_outputs is not None:
            raise ValueError("a forced tool_choice constrains the text already: give it or structured_outputs, "
                             "not both")
        if is_forced(choice):
            forced_schema(self.tools or [], choice)  # raises where the tools' definitions clash

    def template_options(self) -> dict[str, Any] | None:
        """How the input is tokenized: the chat template's options that differ from the defaults, and
        ``add_special_tokens`` where the request gave it (None where there is nothing of either: a request that
        gives neither keeps the row it always had)."""
        options = {k: v for k in TEMPLATE_DEFAULTS if not _is_default(k, v := getattr(self, k))}
        if self.add_special_tokens is not None:
            options["add_special_tokens"] = self.add_special_tokens
        return options or None

    def output_constraint(self) -> dict[str, Any] | None:
        """The constraint the text is generated under, in vLLM's field form: the structured outputs asked for,
        or the JSON of a forced tool choice."""
        if is_forced(choice := kept_choice(self.tool_choice)):
            return {"json": forced_schema(self.tools or [], choice, self.parallel_tool_calls)}
        return self.structured_outputs.fields() if self.structured_outputs else None

    def sampling(self, default_max_tokens: int) -> dict[str, Any]:
        return {"max_tokens": self.max_tokens or default_max_tokens, "temperature": self.temperature,
                "top_p": self.top_p, "stop": list(self.stop), "seed": self.seed, "ignore_eos": self.ignore_eos,
                "top_k": max(0, self.top_k), "min_p": self.min_p, "presence_penalty": self.presence_penalty,
                "frequency_penalty": self.frequency_penalty, "repetition_penalty": self.repetition_penalty,
                "structured_outputs": self.output_constraint(), "tool_choice": kept_choice(self.tool_choice),
                "parallel_tool_calls": self.parallel_tool_calls,
                "logit_bias": {str(t): b for t, b in self.logit_bias.items()} if self.logit_bias else None,
                "min_tokens": self.min_tokens, "stop_token_ids": list(self.stop_token_ids),
                "include_stop_str_in_output": self.include_stop_str_in_output,
                "return_token_ids": self.return_token_ids,
                "truncate_prompt_tokens": self.truncate_prompt_tokens, "cache_salt": self.cache_salt,
                "allowed_token_ids": self.allowed_token_ids, "bad_words": self.bad_words,
                "logprobs": self.logprobs, "prompt_logprobs": self.prompt_logprobs, "echo": self.echo,
                **({} if self.include_reasoning else {"include_reasoning": False}),
                **({"echo_only": True} if self.echo_only else {}),
                **({} if self.thinking_token_budget is None else {"thinking_token_budget": self.thinking_token_budget})}


class SloMiss(BaseModel):
    """The first deadline a job missed; times in seconds after its arrival (submission)."""

    token: int = Field(description="the output token (1-based) that came late; a batch job's last token")
    due_s: float = Field(description="when it was due: TTFT + (n-1) TBT (from the first token with "
                                     "tbt_anchor first-token), or a batch job's deadline")
    at_s: float | None = Field(None, description="when it came out (null: no token came out)")
    late_ms: float | None = Field(None, description="at_s - due_s, in milliseconds")


class JobMetrics(BaseModel):
    queue_s: float | None = Field(None, description="seconds from submission until the engine ran the first "
                                                    "chunk of its prompt (vLLM's queue time)")
    ttft_s: float | None = None
    tbt_p50_s: float | None = None
    tbt_p99_s: float | None = None
    ttlt_s: float | None = None
    slo_met: bool | None = Field(None, description="every token by its deadline (interactive: token n by "
                                                   "TTFT + (n-1) TBT as tbt_anchor anchors it; batch: the last "
                                                   "token by deadline_at); null until finished")
    slo_miss: SloMiss | None = Field(None, description="when slo_met is false: the first deadline missed")
    relegation_count: int = 0


class JobPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: str
    object: Literal["job"] = "job"
    kind: str
    tier: str
    model: str
    status: str
    created_at: UtcDatetime
    dispatched_at: UtcDatetime | None = None
    started_at: UtcDatetime | None = None
    first_token_at: UtcDatetime | None = None
    finished_at: UtcDatetime | None = None
    app_id: str | None = None
    request_id: str | None = Field(None, description=(
        "the X-Request-Id of the request that submitted it (the client's own, or the one the API answered with)"))
    ttft_ms: float | None = None
    tbt_ms: float | None = None
    tbt_anchor: str | None = None
    deadline_at: UtcDatetime | None = None
    sampling: dict[str, Any] = Field(default_factory=dict)
    output_text: str | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = Field(None, description=(
        "what ended it where finish_reason is stop: the stop string (text) or stop token id (a number); null for "
        "the end-of-sequence token (vLLM's stop_reason)"))
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = Field(None, description=(
        "of the prompt tokens, those the engine found in its prefix cache (not computed again); 0 on the own "
        "engine, which keeps no prefix cache; null until the job succeeded (or was cancelled after its first "
        "token: a cancelled job keeps the text and token counts produced before the cancel)"))
    reasoning_tokens: int | None = Field(None, description=(
        "of the completion tokens, those a reasoning model spent thinking (COSERVE_REASONING_PARSER; the tags "
        "themselves not counted); null where no reasoning parser read the job"))
    tool_calls: list[dict[str, Any]] | None = Field(None, description=(
        "the calls read from the output text where tool_choice asked for calls (OpenAI's shape, arguments as JSON "
        "text; a named function's arguments as generated, cut short where max_tokens cut them); null while "
        "running, where the model made none, or where the text of 'required' or 'auto' was cut before a call "
        "was whole"))
    output_token_ids: list[int] | None = Field(None, description=(
        "the generated token ids, where the job asked for them (return_token_ids)"))
    output_logprobs: list[dict[str, Any]] | None = Field(None, description=(
        "where the job asked for logprobs: per output token its text, log-probability and the top alternatives"))
    prompt_logprobs: list[dict[str, Any]] | None = Field(None, description=(
        "where the job asked for prompt_logprobs: the same per prompt token (the first one's logprob is null)"))
    attempt: int = 0
    worker_id: str | None = None
    error: str | None = None
    error_code: str | None = Field(None, description="a failure's cause: 'invalid_request' when the engine refused "
                                                     "the request's parameters (resubmit with them changed)")
    batch_id: str | None = None
    custom_id: str | None = None
    metrics: JobMetrics = Field(default_factory=JobMetrics)

    @classmethod
    def of(cls, job: Any) -> JobPublic:
        out = cls.model_validate(job)
        out.metrics = JobMetrics(queue_s=job.queue_s, ttft_s=job.ttft_s, tbt_p50_s=job.tbt_p50_s,
                                 tbt_p99_s=job.tbt_p99_s, ttlt_s=job.ttlt_s, slo_met=job.slo_met,
                                 relegation_count=job.relegation_count,
                                 slo_miss=job.slo_miss if job.slo_met is False else None)
        if not (job.sampling or {}).get("return_token_ids"):  # kept for the stream's replay, not asked for
            out.output_token_ids = None
        if job.output_text is not None:
            out.tool_calls = read_answer(job.id, job.sampling, job.output_text, job.finish_reason).tool_calls
        return out


class JobCancelled(JobPublic):
    """The answer of ``POST /v1/jobs/{id}/cancel``: the job as the cancel left it, and whether this cancel stopped
    it (the job alone reads "cancelled" as well where another request had cancelled it before)."""

    cancelled: bool = Field(description=(
        "true where this request cancelled the job; false where it had ended before (cancelled by another request, "
        "succeeded, failed or expired): nothing was changed"))


class JobList(BaseModel):
    object: Literal["list"] = "list"
    data: list[JobPublic]
    next_cursor: str | None = Field(None, description="pass as ?cursor= for the next page")




class TenantLimits(BaseModel):
    """A tenant's rate limits on its API requests and its Batch API queue limit (null: no limit). The rate
    buckets refill the limit per minute."""

    model_config = ConfigDict(extra="forbid")
    requests_per_minute: int | None = Field(None, ge=1, le=MAX_RATE)
    tokens_per_minute: int | None = Field(None, ge=1, le=MAX_RATE, description=(
        "a request costs its prompt tokens plus its max_tokens (the most it may use), as OpenAI counts"))
    batch_queue_tokens: int | None = Field(None, ge=1, le=MAX_RATE, description=(
        "prompt tokens its batches may have queued at once, per model; a batch past it fails validation "
        "(token_limit_exceeded)"))


class TenantUpdate(TenantLimits):
    """What an admin may change of a tenant: its limits, and whether it is disabled."""

    disabled: bool = Field(False, description=(
        "true: its keys are refused (403) and its open jobs and batches cancelled; false: its keys work again"))


class TenantCreate(TenantLimits):
    name: Text = Field(min_length=1, max_length=200)
    default_tier: Text | None = Field(None, description="the tier of its keys that name none; unset: "
                                                        "COSERVE_DEFAULT_TIER")
    admin: bool = Field(False, description="the first key is an admin key")


class TenantPublic(TenantLimits):
    model_config = ConfigDict(from_attributes=True)
    # as stored, unbounded: a value over MAX_RATE that `coserve keys limits` once let in (SQLite) still reads
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = Field(None, description=TenantLimits.model_fields["tokens_per_minute"].description)
    batch_queue_tokens: int | None = Field(None,
                                           description=TenantLimits.model_fields["batch_queue_tokens"].description)

    id: str
    name: str
    default_tier: str
    disabled: bool = False


class KeyPublic(BaseModel):
    """An API key as listed or revoked (never the key itself: only its prefix)."""

    model_config = ConfigDict(from_attributes=True)

    id: str
    tenant_id: str
    prefix: str
    tier: str | None = None
    is_admin: bool
    revoked: bool
    created_at: UtcDatetime


class KeyCreate(BaseModel):
    """A new key of a tenant (``POST /v1/admin/tenants/{id}/keys``): its tier and whether it is an admin key."""

    model_config = ConfigDict(extra="forbid")  # a misspelt field would make a key of the tenant's tier unasked
    tier: Text | None = Field(None, description="the key's tier; unset: the tenant's default tier")
    admin: bool = Field(False, description="an admin key (the dashboard's actions and every tenant's usage)")


class KeyCreated(BaseModel):
    tenant_id: str
    key_id: str
    api_key: str = Field(description="shown once; only its hash is stored")
    tier: str
    is_admin: bool
