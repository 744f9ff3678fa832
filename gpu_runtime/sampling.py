"""Per-request sampling parameters (what an OpenAI/vLLM user sets)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 128  # generation stops after this many new tokens
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0  # nucleus mass kept before sampling
    stop: tuple[str, ...] = field(default_factory=tuple)  # stop strings, not included in the text
    seed: int | None = None  # per-request generator seed for reproducible sampling
    ignore_eos: bool = False  # keep going past EOS (benchmarks with fixed output lengths)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
