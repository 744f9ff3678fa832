"""Profiles of the vLLM engine for the policies' cost model: shipped ones, and the driver behind
``coserve profile --backend vllm``.

The driver times whole ``LLMEngine.step()`` calls (scheduling, the forward pass, sampling
and output processing: what a step costs the policy that plans it) over a grid of batch
shapes. It shapes each step through the scheduler's token budget with vLLM's own FCFS
order: running decodes take one token each, then the chunked request takes the rest.
"""

from __future__ import annotations

import json
import logging
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpu_runtime.costmodel.features import BatchFeatures
from gpu_runtime.costmodel.machine import Machine, match_score, this_machine
from gpu_runtime.costmodel.profile import Profile
from gpu_runtime.costmodel.profiler import ProfileGrid

log = logging.getLogger(__name__)

PROFILES = Path(__file__).resolve().parent.parent / "costmodel" / "profiles"

# vLLM-CPU batches at most 2048 tokens a step by default: the chunks stay below it with 64 decodes beside.
VLLM_GRID = ProfileGrid(chunks=(0, 32, 128, 512, 1024, 1920), starts=(0, 1024), decodes=(0, 1, 8, 32, 64),
                        contexts=(256, 1024))
SMALL_GRID = ProfileGrid(chunks=(0, 32, 128, 384), starts=(0, 256), decodes=(0, 1, 8, 24), contexts=(128,))
SMOKE_GRID = ProfileGrid(chunks=(0, 64), starts=(0, 64), decodes=(0, 2), contexts=(64,), repeats=1, warmup=1)
GRIDS = {"full": VLLM_GRID, "small": SMALL_GRID, "smoke": SMOKE_GRID}


def shipped_vllm_profiles(folder: Path = PROFILES) -> list[tuple[Path, Machine | None]]:
    """The shipped profiles of the vLLM engine, each with the machine it was measured on (None: not recorded)."""
    found = []
    for path in sorted(folder.glob("*-vllm.json")):
        meta = json.loads(path.read_text()).get("meta", {})
        if meta.get("engine") == "vllm":
            found.append((path, Machine.from_dict(meta.get("machine"))))
    return found


def default_profile(here: Machine | None = None, folder: Path = PROFILES) -> str | None:
    """The shipped vLLM profile that best fits this machine (``COSERVE_COST_PROFILE=auto``): one measured on
    the same CPU, else on a CPU with the same instruction set, else the CPU profile without a recorded
    machine; on a GPU only one of the same GPU. None: nothing fits (the policy plans conservatively)."""
    if here is None:
        from vllm.platforms import current_platform

        here = this_machine("cpu" if current_platform.is_cpu() else "cuda")

    def fit(profiled: Machine | None) -> int:
        if profiled is None:  # not recorded: the first shipped profile (a CPU; which one was not kept)
            return 1 if here.device == "cpu" else 0
        return match_score(profiled, here)

    floor = 1 if here.device == "cpu" else 2  # a GPU plans only with a profile of the same GPU
    # among CPU profiles of other machines, the unrecorded one: it is the slowest shipped, and a policy that
    # overprices steps only chunks smaller than it could, while one that underprices them misses deadlines
    scored = [(fit(m), m is None, p) for p, m in shipped_vllm_profiles(folder)]
    best = max((t for t in scored if t[0] >= floor), default=None)
    if best is None:
        return None
    score, _, path = best
    if score < 2:
        log.warning("no shipped vLLM profile was measured on a machine like this one (%s): planning with %s; "
                    "`coserve profile --backend vllm` measures this one (then set COSERVE_COST_PROFILE)",
                    here.describe(), path.name)
    return str(path)


class _Driver:
    """Adds requests of random tokens to a ``VLLMEngine`` and runs steps of a chosen token budget."""

    def __init__(self, engine: Any, vocab: int, seed: int) -> None:
        self.engine, self.llm = engine, engine.llm
        self.scheduler = engine.core_scheduler
        self.rng = random.Random(seed)
        self.vocab, self.n = vocab, 0
        self.full = self.scheduler.max_num_scheduled_tokens

    def add(self, prompt_len: int, max_tokens: int) -> str:
        from vllm import SamplingParams

        rid = f"prof-{self.n}"
        self.n += 1
        ids = [self.rng.randrange(3, self.vocab) for _ in range(prompt_len)]
        self.llm.add_request(rid, {"prompt_token_ids": ids},
                             SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0))
        return rid

    def step(self, budget: int) -> float:
        self.scheduler.max_num_scheduled_tokens = max(1, min(self.full, budget))
        t0 = time.perf_counter()
        self.llm.step()
        dt = time.perf_counter() - t0
        self.scheduler.max_num_scheduled_tokens = self.full
        return dt

    def prefill_all(self) -> None:
        """Steps at full budget until every request is past its prompt."""
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in self.scheduler.running) \
                or len(self.scheduler.waiting):
            self.step(self.full)

    def abort(self, rids: list[str]) -> None:
        if rids:
            self.llm.abort_request(rids)
            self.llm.step()  # lets the scheduler free them


def profile_vllm(engine: Any, grid: ProfileGrid = VLLM_GRID, name: str = "vllm", vocab: int = 49152,
                 meta: dict | None = None, seed: int = 0,
                 progress: Callable[[int, int], None] | None = None) -> Profile:
    """Times ``engine`` (a ``VLLMEngine`` built with the ``vllm-fcfs`` policy) over ``grid``."""
    if engine.core_scheduler.coserve_policy is not None:
        raise ValueError("profile a vLLM engine built with scheduler_policy='vllm-fcfs' (vLLM's own order)")
    drv = _Driver(engine, vocab, seed)
    samples: list[tuple[BatchFeatures, float]] = []
    warm = drv.add(512, 1)
    for _ in range(grid.warmup):
        drv.step(64)
    drv.abort([warm])
    done = 0
    for ctx in grid.contexts:
        for nd in grid.decodes:
            decoders = [drv.add(ctx, 1 << 20) for _ in range(nd)]
            drv.prefill_all()
            for chunk in grid.chunks:
                for start in (grid.starts if chunk else (0,)):
                    if chunk == 0 and nd == 0:
                        continue
                    times = []
                    for _ in range(grid.repeats):
                        rid = drv.add(start + chunk + 8, 1) if chunk else None
                        if start:
                            drv.step(nd + start)  # untimed: the chunk's earlier part
                        times.append(drv.step(nd + chunk))
                        drv.abort([rid] if rid else [])
                    # contexts grow by the untimed steps too; the features use the grid's nominal values
                    samples.append((BatchFeatures.of_shape(chunk, start, nd, ctx), statistics.median(times)))
                    done += 1
                    if progress:
                        progress(done, grid.size)
            drv.abort(decoders)
    cap = engine.executor.capacity()
    info = {"engine": "vllm", "block_size": cap.block_size, "kv_blocks": cap.total_blocks,
            "max_model_len": engine.executor.max_model_len, "grid": grid.__dict__}
    info.update(meta or {})
    return Profile(name, samples, synthetic=False, meta=info)
