"""Per-request sampling parameters (what an OpenAI/vLLM user sets)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from gpu_runtime.logprobs import MAX_TOP_LOGPROBS

PENALTY_LIMIT = 2.0  # presence and frequency penalties lie in [-2, 2] (OpenAI's and vLLM's range)
NEUTRAL_PENALTIES = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}  # no penalty
PENALTIES_UNSUPPORTED = ("presence_penalty, frequency_penalty and repetition_penalty need the vLLM backend "
                         "(COSERVE_BACKEND=vllm): the own torch engine does not apply them; leave them unset")
MIN_P_WITH_SPECULATION = ("min_p cannot be combined with vLLM's speculative decoding, which this server runs "
                          "(COSERVE_SPEC_POLICY); leave min_p unset or use top_k / top_p")
VOCABULARY_UNSUPPORTED = ("allowed_token_ids and bad_words need the vLLM backend (COSERVE_BACKEND=vllm): the own "
                          "torch engine does not restrict its vocabulary; leave them unset")
STOP_TOKENS_UNSUPPORTED = ("min_tokens and stop_token_ids need the vLLM backend (COSERVE_BACKEND=vllm): the own "
                           "torch engine does not apply them; leave them unset")
LOGIT_BIAS_LIMIT = 100.0  # a bias lies in [-100, 100] (OpenAI's range; vLLM clamps to it)
LOGIT_BIAS_UNSUPPORTED = ("logit_bias needs the vLLM backend (COSERVE_BACKEND=vllm): the own torch engine does not "
                          "apply it; leave logit_bias unset")
LOGIT_BIAS_WITH_SPECULATION = ("logit_bias cannot be combined with vLLM's speculative decoding, which this server "
                               "runs (COSERVE_SPEC_POLICY; vLLM would ignore the bias); leave logit_bias unset")


LOGPROBS_UNSUPPORTED = ("token log-probabilities need the vLLM backend (COSERVE_BACKEND=vllm): the own torch "
                        "engine does not report them; leave logprobs unset")
# the error's param names the field, in the terms of the route that was asked (chat's or the Responses API's)
THINKING_BUDGET_UNSUPPORTED = ("a thinking budget needs the vLLM backend (COSERVE_BACKEND=vllm) with a reasoning "
                               "parser: the own torch engine does not cut a model's thinking short; leave it unset")
STRUCTURED_UNSUPPORTED = ("structured outputs need the vLLM backend (COSERVE_BACKEND=vllm): the own torch engine does "
                          "not constrain its output; leave the output format unset")
CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# vLLM's options of a constraint (StructuredOutputsParams' other fields), kept beside it where set
CONSTRAINT_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")


@dataclass(frozen=True)
class OutputConstraint:
    """Structured output: the text must match a JSON schema (``json``), any JSON object (``json_object``), a regular
    expression, one of a list of strings (``choice``), a grammar or a structural tag (vLLM's
    ``StructuredOutputsParams``, one field, and its options)."""

    kind: str  # one of CONSTRAINT_KINDS
    spec: str  # the schema, choices or structural tag as JSON text, the regex or the grammar ("" for json_object)
    options: tuple[tuple[str, Any], ...] = ()  # (name, value) of the CONSTRAINT_OPTIONS set, e.g. whitespace off

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise ValueError(f"unknown output constraint {self.kind!r}; choose from {', '.join(CONSTRAINT_KINDS)}")

    @classmethod
    def of(cls, fields: dict[str, Any]) -> OutputConstraint:
        """From vLLM's field form, e.g. ``{"json": {...schema...}}`` or ``{"choice": ["yes", "no"]}``."""
        options = tuple((k, v) for k, v in fields.items() if k in CONSTRAINT_OPTIONS)
        (kind, value), = ((k, v) for k, v in fields.items() if k not in CONSTRAINT_OPTIONS)
        if kind in ("json", "choice"):
            return cls(kind, value if isinstance(value, str) else json.dumps(value), options)
        return cls(kind, "" if kind == "json_object" else value, options)

    def fields(self) -> dict[str, Any]:
        """vLLM's field form (the inverse of ``of``), its options with it."""
        if self.kind == "json_object":
            return {"json_object": True, **dict(self.options)}
        return {self.kind: json.loads(self.spec) if self.kind in ("json", "choice") else self.spec,
                **dict(self.options)}


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 128  # generation stops after this many new tokens
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0  # nucleus mass kept before sampling
    stop: tuple[str, ...] = field(default_factory=tuple)  # stop strings, not included in the text
    seed: int | None = None  # per-request generator seed for reproducible sampling
    seed_drawn: bool = False  # the server drew the seed (for reruns), the client gave none
    ignore_eos: bool = False  # keep going past EOS (benchmarks with fixed output lengths)
    top_k: int = 0  # sample among the k most likely tokens only (0: all of them)
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one
    presence_penalty: float = 0.0  # taken off the logit of every token the output already holds
    frequency_penalty: float = 0.0  # taken off a token's logit once per time the output holds it
    repetition_penalty: float = 1.0  # divides positive (multiplies negative) logits of prompt and output tokens
    structured: OutputConstraint | None = None  # what the text must match (vLLM backend)
    logprobs: int | None = None  # report each output token's log-probability and this many alternatives (vLLM)
    prompt_logprobs: int | None = None  # the same for each prompt token (the first has none: nothing precedes it)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to the token's logit before sampling
    min_tokens: int = 0  # the end-of-sequence and stop tokens cannot come before this many tokens (vLLM)
    stop_token_ids: tuple[int, ...] = ()  # token ids that end the text beside the end of sequence (vLLM)
    skip_special_tokens: bool = True  # leave special tokens out of the text (False: a tool-call tag may be one)
    include_stop_str_in_output: bool = False  # the stop string that ended the text stays in it
    allowed_token_ids: tuple[int, ...] = ()  # only these may be generated (vLLM; empty: any)
    bad_words: tuple[str, ...] = ()  # never generated (vLLM)
    thinking_token_budget: int | None = None  # thinking tokens before vLLM forces its end (vLLM's reasoning_config)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0 (0: no limit)")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -PENALTY_LIMIT <= getattr(self, name) <= PENALTY_LIMIT:
                raise ValueError(f"{name} must be in [-{PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}]")
        for name in ("logprobs", "prompt_logprobs"):
            if (k := getattr(self, name)) is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_TOP_LOGPROBS}] (alternatives per token)")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError("repetition_penalty must be > 0 (1: none)")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}]; got {self.min_tokens}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be token ids (>= 0)")
        for token, bias in self.logit_bias:
            if token < 0 or not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise ValueError(f"logit_bias maps token ids (>= 0) to a bias in [-{LOGIT_BIAS_LIMIT:g}, "
                                 f"{LOGIT_BIAS_LIMIT:g}]; got {token}: {bias}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether a token's logit depends on the tokens before it (the penalties), not only on the model."""
        return any(getattr(self, name) != neutral for name, neutral in NEUTRAL_PENALTIES.items())

    def own_engine_refusal(self) -> tuple[str, str] | None:
        """(parameter, why) for what the own torch engine does not do (vLLM does all of it), else None."""
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                return name, LOGPROBS_UNSUPPORTED
        for name, neutral in NEUTRAL_PENALTIES.items():
            if getattr(self, name) != neutral:
                return name, PENALTIES_UNSUPPORTED
        if self.structured is not None:
            return "structured_outputs", STRUCTURED_UNSUPPORTED
        if self.logit_bias:
            return "logit_bias", LOGIT_BIAS_UNSUPPORTED
        if self.min_tokens:
            return "min_tokens", STOP_TOKENS_UNSUPPORTED
        if self.stop_token_ids:
            return "stop_token_ids", STOP_TOKENS_UNSUPPORTED
        for name in ("allowed_token_ids", "bad_words"):
            if getattr(self, name):
                return name, VOCABULARY_UNSUPPORTED
        if self.thinking_token_budget is not None:
            return "thinking_token_budget", THINKING_BUDGET_UNSUPPORTED
        return None

    def speculation_refusal(self) -> tuple[str, str] | None:
        """(parameter, why) for what vLLM's sampler leaves out while it speculates (it drops min_p and
        logit_bias then, with only a warning at start-up), else None."""
        if self.min_p:
            return "min_p", MIN_P_WITH_SPECULATION
        if self.logit_bias:
            return "logit_bias", LOGIT_BIAS_WITH_SPECULATION
        return None

    @classmethod
    def from_job(cls, sampling: dict[str, Any], default_max_tokens: int) -> SamplingParams:
        """A job's stored sampling (``JobCreate.sampling``; keys a job stored before they existed take their
        defaults)."""
        sp, structured = sampling, sampling.get("structured_outputs")
        return cls(max_tokens=int(sp.get("max_tokens", default_max_tokens)),
                   temperature=float(sp.get("temperature", 0.0)), top_p=float(sp.get("top_p", 1.0)),
                   stop=tuple(sp.get("stop") or ()), seed=sp.get("seed"), seed_drawn=bool(sp.get("seed_drawn", False)),
                   ignore_eos=bool(sp.get("ignore_eos", False)), top_k=int(sp.get("top_k", 0)),
                   min_p=float(sp.get("min_p", 0.0)), presence_penalty=float(sp.get("presence_penalty", 0.0)),
                   frequency_penalty=float(sp.get("frequency_penalty", 0.0)),
                   repetition_penalty=float(sp.get("repetition_penalty", 1.0)),
                   structured=OutputConstraint.of(structured) if structured else None, logprobs=sp.get("logprobs"),
                   prompt_logprobs=sp.get("prompt_logprobs"),
                   logit_bias=tuple(sorted((int(t), float(b)) for t, b in (sp.get("logit_bias") or {}).items())),
                   min_tokens=int(sp.get("min_tokens") or 0), stop_token_ids=tuple(sp.get("stop_token_ids") or ()),
                   # the model's own call or thinking syntax is read: keep its tags
                   skip_special_tokens=not (sp.get("tool_parser") or sp.get("reasoning_parser")),
                   include_stop_str_in_output=bool(sp.get("include_stop_str_in_output", False)),
                   allowed_token_ids=tuple(sp.get("allowed_token_ids") or ()),
                   bad_words=tuple(sp.get("bad_words") or ()),
                   thinking_token_budget=sp.get("thinking_token_budget"))
