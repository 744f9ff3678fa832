"""A rerun continues from what the job's earlier attempts streamed, instead of generating from scratch.

A job handed back (a worker's shutdown, an engine error) or re-leased (its worker died, its lease lapsed) runs again as
a new attempt. Its stream has already sent the earlier attempts' text. From scratch, the rerun recomputes every token,
and a sampled one may part from that text (vLLM on the CPU does not apply the seed the server drew for reruns:
``gpu_runtime.vllm.engine.seed_applies``), which ends the client's stream with ``stream_diverged``. Here the new
attempt's engine request is the prompt followed by the token ids the stream holds, with ``max_tokens`` (and
``min_tokens``) less their count; its output is those tokens' text followed by what it generates, and it counts the
original prompt and every output token once (``Resumed``).

Only where continuing cannot change what the request asks for; otherwise the rerun starts from scratch, as before:

* the stream must hold the attempt's text and ids whole from their start (a trimmed or gapped stream does not);
* the text the ids decode to must go on from every character the client was sent, and end neither inside a character
  (a replacement character) nor with the beginning of a stop string (the engine looks for stop strings in the text it
  generates only, so one that straddled the prompt's end would be missed);
* the sampling must not depend on where the prompt ends: structured outputs (the grammar starts at the prompt's end),
  presence and frequency penalties and bad words (vLLM counts them over the generated tokens only), and prompt logprobs
  (they would cover the produced tokens); token logprobs where asked must be in the stream for every produced token.

Choices: ``n`` > 1 runs one job per choice, so each resumes on its own. Both engines take the longer prompt as any
other; the text check decodes with the worker's tokenizer, as both engines do (context-free for byte-level BPE; a
tokenizer that decodes a first token differently alone fails the check and reruns from scratch).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from app.services.streaming import StreamEvent
from app.wire import storable
from gpu_runtime.sampling import SamplingParams


@dataclass
class _Placed:
    """A sequence rebuilt from pieces that say where they start (a repeated one overlaps, a lost one leaves a hole)."""

    items: list = field(default_factory=list)
    hole: bool = False

    def place(self, start: int | None, piece: list | str) -> None:
        if self.hole or not piece:
            return
        if start is None or start > len(self.items):
            self.hole = True  # an older publisher that gave no offset, or a lost piece
            return
        self.items.extend(piece[len(self.items) - start:])


@dataclass
class _Attempt:
    text: _Placed = field(default_factory=_Placed)
    ids: _Placed = field(default_factory=_Placed)
    logprobs: _Placed = field(default_factory=_Placed)
    times: _Placed = field(default_factory=_Placed)  # when each token id went out (None: not known)

    def feed(self, ev: StreamEvent) -> None:
        self.text.place(ev.offset, list(ev.text))
        self.ids.place(ev.data.get("token_offset"), list(ev.token_ids))
        self.times.place(ev.data.get("token_offset"), [ev.at] * len(ev.token_ids))
        if entries := ev.data.get("logprobs"):
            self.logprobs.place(ev.data.get("logprobs_offset"), list(entries))


@dataclass(frozen=True)
class Streamed:
    """What an earlier attempt streamed, whole from its start."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[dict, ...] = ()
    token_times: tuple[float, ...] = ()  # when a client got each of them (epoch seconds); () where not known


def _first_sent(attempts: dict[int, _Attempt], chosen: _Attempt) -> tuple[float, ...]:
    """When a client of the stream got each of ``chosen``'s tokens: the earliest of the attempts that streamed it (one
    that went on from an earlier attempt streams those tokens again at its start, and a follower skips them); ()
    where one's time is not known."""
    ids = chosen.ids.items
    out: list[float | None] = list(chosen.times.items[:len(ids)])
    for a in attempts.values():
        for i, (token, at) in enumerate(zip(a.ids.items, a.times.items, strict=False)):
            if i >= len(ids) or token != ids[i]:
                break  # it went its own way from here (a rerun from scratch)
            if at is not None and out[i] is not None:
                out[i] = min(out[i], at)
    return () if len(out) < len(ids) or None in out else tuple(out)  # type: ignore[return-value]


def streamed(events: Iterable[StreamEvent], before: int) -> Streamed | None:
    """The earlier attempt (of those before attempt ``before``) that streamed the most text: what a client of the
    stream has is at most that. None where nothing was streamed, or where that attempt's stream is not whole."""
    attempts: dict[int, _Attempt] = {}
    for ev in events:
        if ev.type == "delta" and ev.attempt < before:
            attempts.setdefault(ev.attempt, _Attempt()).feed(ev)
    if not attempts:
        return None
    # the longest text; of equal ones a whole one, then the latest (a resumed attempt repeats the one it went on from)
    _, _, best = max((len(a.text.items), not (a.text.hole or a.ids.hole), n) for n, a in attempts.items())
    chosen = attempts[best]
    if chosen.text.hole or chosen.ids.hole or not chosen.ids.items:
        return None
    logprobs = () if chosen.logprobs.hole else tuple(chosen.logprobs.items)
    return Streamed("".join(chosen.text.items), tuple(chosen.ids.items), logprobs, _first_sent(attempts, chosen))


def refusal(sampling: SamplingParams) -> str | None:
    """Why a rerun with ``sampling`` starts from scratch whatever was streamed (None: it may continue)."""
    if sampling.structured is not None:
        return "structured outputs (the grammar starts where the prompt ends)"
    if sampling.presence_penalty or sampling.frequency_penalty:
        return "presence or frequency penalty (counted over the generated tokens only)"
    if sampling.bad_words:
        return "bad words (matched against the generated tokens only)"
    if sampling.prompt_logprobs is not None:
        return "prompt logprobs (they would cover the tokens already produced)"
    return None


@dataclass(frozen=True)
class Resumed:
    """How a rerun goes on: the produced ids (fed after the prompt), their text and logprobs, the prompt's length."""

    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[dict, ...]
    prompt_len: int
    token_times: tuple[float, ...] = ()  # when the client got them (epoch seconds; ``Streamed``); () where not known

    def sampling(self, sp: SamplingParams) -> SamplingParams:
        """The engine request's sampling: what is left of ``max_tokens`` and ``min_tokens``."""
        k = len(self.token_ids)
        return replace(sp, max_tokens=sp.max_tokens - k, min_tokens=max(0, sp.min_tokens - k))

    def prompt(self, prompt_ids: list[int]) -> list[int]:
        return [*prompt_ids, *self.token_ids]

    def usage(self, engine_output_tokens: int, engine_cached_tokens: int, engine_cache_writes: int) -> dict[str, int]:
        """The job's counts over both attempts: every output token once, the prompt as it was billed (of the tokens
        the engine found in or wrote to its prefix cache, those of the prompt only: the produced ids it was fed are
        output, counted once as such)."""
        cached = min(engine_cached_tokens, self.prompt_len)
        return {"completion_tokens": len(self.token_ids) + engine_output_tokens, "prompt_tokens": self.prompt_len,
                "cached_tokens": cached, "cache_write_tokens": min(engine_cache_writes, self.prompt_len - cached)}


def plan(sampling: SamplingParams, prompt_ids: list[int], done: Streamed | None,
         decode: Callable[[list[int]], str]) -> Resumed | None:
    """How the rerun of a job with ``sampling`` and ``prompt_ids`` goes on from ``done`` (None: from scratch).
    ``decode``: token ids to text as the engine detokenizes them (special tokens as ``sampling`` says)."""
    if done is None or refusal(sampling) is not None:
        return None
    k = len(done.token_ids)
    if not 0 < k < sampling.max_tokens:  # all of them made: the attempt ended as it was given up; run it again
        return None
    if sampling.logprobs is not None and len(done.logprobs) != k:
        return None
    text = storable(decode(list(done.token_ids)))  # as the stream and SQL hold it
    if not text.startswith(done.text) or text.endswith("\ufffd"):
        return None
    if any(text.endswith(stop[:i]) for stop in sampling.stop for i in range(1, len(stop))):
        return None
    if any(stop in text for stop in sampling.stop):  # it would have ended there
        return None
    return Resumed(tuple(done.token_ids), text, tuple(done.logprobs) if sampling.logprobs is not None else (),
                   len(prompt_ids), done.token_times)
