"""A reasoning model's thinking, read out of its text (vLLM's ``--reasoning-parser``; ``COSERVE_REASONING_PARSER``).

Models such as DeepSeek-R1 and Qwen3 think between ``<think>`` and ``</think>`` before they answer. The answer's
``reasoning`` is that thinking and its content the text after it, as vLLM splits them:

- ``deepseek_r1``: the text starts in thought (its chat template opens the ``<think>``; one the model writes is
  dropped) and thinks up to ``</think>``; a text cut off before it is all reasoning, with no content.
- ``qwen3``: a text that starts with ``<think>`` thinks up to ``</think>`` (or to its end, cut off); any other text
  is all content (thinking switched off).

``split_reasoning`` reads a whole text, ``ReasoningStream`` the same text as its pieces come; both give the same.
``ReasoningTokens`` counts the generated tokens that are thinking (usage's ``reasoning_tokens``), as the worker
sees them come.
"""

from __future__ import annotations

from typing import Any, Literal

ReasoningParser = Literal["deepseek_r1", "qwen3"]
OPEN, CLOSE = "<think>", "</think>"


def has_think_tokens(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` has ``OPEN`` and ``CLOSE`` as tokens: vLLM's reasoning parser needs them to apply a
    grammar after the thinking and to end the thinking once a ``thinking_token_budget`` is spent."""
    vocab = tokenizer.get_vocab()
    return OPEN in vocab and CLOSE in vocab
STARTS_IN_THOUGHT = {"deepseek_r1": True, "qwen3": False}


def split_reasoning(parser: str, text: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole text: reasoning None where it did not think, content None where it never
    stopped thinking."""
    thinks = text.startswith(OPEN)
    if not thinks and not STARTS_IN_THOUGHT[parser]:
        return None, text
    reasoning, closed, content = text.removeprefix(OPEN).partition(CLOSE)
    return reasoning, content if closed else None


def _held_back(text: str) -> int:
    """How many characters at the end of ``text`` may begin a ``</think>`` still to come."""
    return next((n for n in range(min(len(CLOSE) - 1, len(text)), 0, -1) if CLOSE.startswith(text[-n:])), 0)


class ReasoningStream:
    """``split_reasoning`` piece by piece: each piece's reasoning and content, holding back only what may still
    turn out to be a tag."""

    def __init__(self, parser: str) -> None:
        self.starts_in_thought = STARTS_IN_THOUGHT[parser]
        self.mode: Literal["head", "thinking", "content"] = "head"  # head: a leading <think> not yet ruled out
        self.held = ""

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning, content) to show now."""
        self.held += delta
        if self.mode == "head":
            if len(self.held) < len(OPEN) and OPEN.startswith(self.held):
                return "", ""
            thinks = self.held.startswith(OPEN)
            self.held = self.held.removeprefix(OPEN)
            self.mode = "thinking" if thinks or self.starts_in_thought else "content"
        reasoning = ""
        if self.mode == "thinking":
            at = self.held.find(CLOSE)
            if at < 0:
                cut = len(self.held) - _held_back(self.held)
                reasoning, self.held = self.held[:cut], self.held[cut:]
                return reasoning, ""
            reasoning, self.held, self.mode = self.held[:at], self.held[at + len(CLOSE):], "content"
        content, self.held = self.held, ""
        return reasoning, content

    @property
    def in_thought(self) -> bool:
        """Whether the text so far leaves the model thinking (a deepseek_r1 text starts in thought)."""
        return self.mode == "thinking" or (self.mode == "head" and self.starts_in_thought)

    def end(self) -> tuple[str, str]:
        """(reasoning, content) held back, once the text is whole."""
        held, self.held = self.held, ""
        if self.mode == "head":  # shorter than <think>: no tag
            return (held, "") if self.starts_in_thought else ("", held)
        return held, ""  # a partial </think> that never closed is thought


class ReasoningTokens:
    """How many generated tokens are thinking, fed the text and token count of each engine step.

    A token is thinking when the model is still in thought after it and it is not the ``<think>`` tag (vLLM's
    ``count_reasoning_tokens`` leaves both tags out). A step of several tokens (speculation) that closes the thought
    counts the share of them its thinking text has. Exact where the tags are single tokens, as in the models these
    parsers are for; a tag written as several tokens counts its pieces inside the thought."""

    def __init__(self, parser: str) -> None:
        self.stream = ReasoningStream(parser)
        self.count = 0

    def feed(self, text: str, tokens: int) -> None:
        reasoning, content = self.stream.feed(text)
        if self.stream.in_thought:
            self.count += 0 if text == OPEN else tokens
        elif reasoning and tokens > 1:  # thought and tag (and content) in one step: its share of the tokens
            self.count += round(tokens * len(reasoning) / (len(reasoning) + len(CLOSE) + len(content)))
