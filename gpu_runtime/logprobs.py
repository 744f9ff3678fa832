"""Token log-probabilities of a generated text, as engines report them (OpenAI's ``logprobs``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MAX_TOP_LOGPROBS = 20  # alternatives per token a request may ask for (OpenAI's and vLLM's default limit)
FLOOR = -9999.0  # a token the sampler ruled out has log-probability -inf, which JSON cannot carry (vLLM's floor too)


@dataclass(frozen=True)
class TokenLogprob:
    """One token: its text, its log-probability under the model (None for a prompt's first token: nothing precedes
    it), and the most likely alternatives at its position (text, log-probability; most likely first)."""

    token: str
    logprob: float | None
    top: tuple[tuple[str, float], ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {"token": self.token, "logprob": self.logprob, "top": [list(t) for t in self.top]}

    @classmethod
    def of(cls, d: dict[str, Any]) -> TokenLogprob:
        logprob = d["logprob"]
        return cls(d["token"], None if logprob is None else float(logprob),
                   tuple((str(t), float(lp)) for t, lp in d.get("top") or ()))
