"""The worker's own vLLM steps, one JSON line each: the batch a step ran and what it cost in place.

A grid profile (``coserve profile --backend vllm``) times steps back to back in a quiet process,
one prompt chunk per step. The worker's steps differ: many short chunks share a step, the API,
Redis and the outbox thread compete for the cores, and between two steps the engine thread
turns outputs into records and admits new requests. ``COSERVE_STEP_LOG`` makes the worker
write every step it runs (``StepRecord``); ``profile_from_steps`` turns such logs into a
profile whose latency is the step plus the host time up to the next one, which is what a
step costs the policy that plans it (``coserve profile --from-steps``).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from gpu_runtime.costmodel.features import BatchFeatures
from gpu_runtime.costmodel.profile import Profile

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

# A pause longer than this between two steps is the engine thread waiting for work, not host time.
IDLE_GAP_S = 0.25


def batch_features(out: SchedulerOutput, requests: dict[str, Any]) -> BatchFeatures:
    """The cost model's features of the step vLLM just scheduled (its computed-token counts already
    include this step's tokens)."""
    p_tok = p_ctx = d_tok = d_ctx = tree = chunks = 0
    p_attn = 0.0
    spec = out.scheduled_spec_decode_tokens
    for rid, n in out.num_scheduled_tokens.items():
        req = requests.get(rid)
        if req is None:
            continue
        start = req.num_computed_tokens - n
        if start < req.num_prompt_tokens:  # a prompt chunk
            p_tok += n
            p_ctx += start + n
            p_attn += n * (start + n / 2)
            chunks += 1
        else:  # a decode, with the draft tokens it verifies
            drafts = len(spec.get(rid, ()))
            d_tok += 1
            tree += drafts
            d_ctx += start
    return BatchFeatures(p_tok, d_tok, p_ctx, d_ctx, tree, chunks + d_tok, p_attn)


@dataclass(frozen=True)
class StepRecord:
    t: float  # wall-clock start of the step (time.time())
    latency_s: float  # LLMEngine.step(): scheduling, the forward pass, sampling, output processing
    gap_s: float | None  # host time since the previous step ended (None: the previous one ran nothing)
    features: BatchFeatures
    plan_scale: float | None = None  # the policy's cost model / its profile when it planned (calibration; None: off)

    def to_json(self) -> str:
        extra = {} if self.plan_scale is None else {"plan_scale": round(self.plan_scale, 4)}
        return json.dumps({"t": round(self.t, 6), "latency_s": round(self.latency_s, 6),
                           "gap_s": None if self.gap_s is None else round(self.gap_s, 6), **asdict(self.features),
                           **extra})

    @classmethod
    def from_json(cls, line: str) -> StepRecord:
        row = json.loads(line)
        return cls(row["t"], row["latency_s"], row["gap_s"], BatchFeatures.from_dict(row), row.get("plan_scale"))


class StepLog:
    """Appends ``StepRecord`` lines to a file (the engine thread is its only writer), a line at a time, so
    a worker stopped by a signal leaves whole lines."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] = self.path.open("a", buffering=1)

    def write(self, record: StepRecord) -> None:
        self._file.write(record.to_json() + "\n")

    def close(self) -> None:
        self._file.close()


def load_steps(path: str | Path) -> list[StepRecord]:
    return [StepRecord.from_json(line) for line in Path(path).read_text().splitlines() if line.strip()]


def busy_gap(step: StepRecord, idle_gap_s: float = IDLE_GAP_S) -> float | None:
    """The host time before ``step`` if the engine thread was busy through it (None: after an idle pause)."""
    return step.gap_s if step.gap_s is not None and step.gap_s <= idle_gap_s else None


def step_costs(steps: list[StepRecord], idle_gap_s: float = IDLE_GAP_S) -> list[tuple[BatchFeatures, float]]:
    """Each step's cost to the schedule: its latency plus the host time before the next step began
    (a step followed by an idle pause, or by nothing, is left out: its host time is unknown)."""
    out = []
    for step, nxt in zip(steps, steps[1:], strict=False):
        gap = busy_gap(nxt, idle_gap_s)
        if gap is not None and step.features.total_tokens:
            out.append((step.features, step.latency_s + gap))
    return out


def profile_from_steps(paths: list[str | Path], name: str = "vllm-in-place") -> Profile:
    """A profile of the steps the worker ran (``step_costs`` of each log)."""
    samples: list[tuple[BatchFeatures, float]] = []
    gaps: list[float] = []
    for p in paths:
        steps = load_steps(p)
        samples += step_costs(steps)
        gaps += [g for g in map(busy_gap, steps) if g is not None]
    if not samples:
        raise ValueError(f"no step with a known cost in {', '.join(map(str, paths))}: was the worker busy?")
    meta = {"engine": "vllm", "source": "worker step log", "logs": [str(p) for p in paths],
            "steps": len(samples), "host_gap_s_median": statistics.median(gaps) if gaps else 0.0}
    return Profile(name, samples, synthetic=False, meta=meta)
