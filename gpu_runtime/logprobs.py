"""Token log-probabilities of a generated text, as engines report them (OpenAI's ``logprobs``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MAX_TOP_LOGPROBS = 20  # alternatives per token a request may ask for (OpenAI's and vLLM's default limit)
FLOOR = -9999.0  # a token the sampler ruled out has log-probability -inf, which JSON cannot carry (vLLM's floor too)


@dataclass(frozen=True)
class TokenLogprob:
    """One token: its text, its log-probability under the model (None for a prompt's first token: nothing precedes
    it), and the most likely alternatives at its position (text, log-probability; most likely first). Where the
    engine says them (vLLM), the token's id and its rank in the vocabulary, and the alternatives' ids (their ranks
    are their places, from 1): what vLLM's own ``prompt_logprobs`` field names."""

    token: str
    logprob: float | None
    top: tuple[tuple[str, float], ...] = ()
    token_id: int | None = None
    rank: int | None = None
    top_ids: tuple[int, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        ids = {} if self.token_id is None else {"id": self.token_id, "rank": self.rank, "top_ids": list(self.top_ids)}
        return {"token": self.token, "logprob": self.logprob, "top": [list(t) for t in self.top], **ids}

    @classmethod
    def of(cls, d: dict[str, Any]) -> TokenLogprob:
        logprob = d["logprob"]
        return cls(d["token"], None if logprob is None else float(logprob),
                   tuple((str(t), float(lp)) for t, lp in d.get("top") or ()), d.get("id"), d.get("rank"),
                   tuple(d.get("top_ids") or ()))
