"""A request that cannot fit the model's context, as facts (its prompt's tokens, the tokens it asks for beside them,
the context's), worded as each API words it: OpenAI's (and vLLM's) ``maximum context length`` and Anthropic's
``prompt is too long``, which clients match to tell an over-long request from other refusals."""

from __future__ import annotations

from dataclasses import dataclass


LOWER_MAX_TOKENS = "lower max_tokens"  # the fix OpenAI's words name: the chat field (Responses writes its own)


@dataclass(frozen=True)
class ContextOverflow:
    """``prompt_tokens``: the prompt's tokens, or, where ``counted`` is False (not tokenized), how many it takes at
    least; ``max_tokens``: what the completion may make beside them; ``context``: the tokens the model holds."""

    prompt_tokens: int
    max_tokens: int
    context: int
    counted: bool = True
    chars: int | None = None  # the prompt's characters, where they alone show it cannot fit

    @property
    def prompt_alone(self) -> bool:
        """Whether the prompt overflows the context before any token is made."""
        return self.prompt_tokens > self.context

    def openai_message(self) -> str:
        """OpenAI's and vLLM's words."""
        head = f"This model's maximum context length is {self.context} tokens. However, "
        if self.chars is not None:
            return head + f"the prompt's {self.chars} characters cannot fit in it; shorten the prompt"
        least = "" if self.counted else "at least "
        return head + (f"you requested {least}{self.prompt_tokens + self.max_tokens} tokens ({least}"
                       f"{self.prompt_tokens} in the prompt, {self.max_tokens} for the completion); shorten the "
                       f"prompt or {LOWER_MAX_TOKENS}")

    def anthropic_message(self) -> str:
        """Anthropic's words: the prompt alone over the context, else the prompt and ``max_tokens`` together."""
        least = "" if self.counted else "at least "
        if self.prompt_alone:
            return f"prompt is too long: {least}{self.prompt_tokens} tokens > {self.context} maximum"
        return (f"input length and `max_tokens` exceed context limit: {least}{self.prompt_tokens} + "
                f"{self.max_tokens} > {self.context}, decrease input length or `max_tokens` and try again")
