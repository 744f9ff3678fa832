"""Two requests on the real vLLM engine of a model that thinks in ``<think>`` tags (deepseek_r1's parser), their
prompts ending in ``<think>`` as a reasoning model's chat template ends them, one with a ``thinking_token_budget``:
prints each one's output token ids, the ids of ``</think>`` and the speculation policy's state, as JSON.

Run as ``python -m tests.vllm.thinking_budget DIR [SPEC]`` (vLLM's in-process engine core is process-wide: a process
of its own); ``DIR``: where the checkpoint with the tags is written; ``SPEC``: the speculation policy (default none).
The prompt repeats itself, so that n-gram drafts find their continuation in it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from gpu_runtime.request import Request
from gpu_runtime.sampling import SamplingParams
from gpu_runtime.vllm.build import build_vllm_engine
from gpu_runtime.vllm.offline import OFFLINE_QOS, random_prompts
from tests.vllm.conftest import thinking_checkpoint


def main(out: Path, spec: str = "none") -> None:
    checkpoint = thinking_checkpoint(out / "thinking", {"<repo_name>": "<think>", "<reponame>": "</think>"})
    engine = build_vllm_engine(str(checkpoint), max_model_len=512, cost_profile=None, dtype="float32",
                               reasoning_parser="deepseek_r1", spec_policy=spec)
    reasoning = engine.llm.vllm_config.reasoning_config
    close = reasoning.reasoning_end_token_ids
    prompt = random_prompts(1, 8)[0] * 3 + reasoning.reasoning_start_token_ids  # as a template's <think> opens it
    for rid, budget in (("budget", 3), ("free", None)):
        engine.add_request(Request(rid, prompt, SamplingParams(max_tokens=16, ignore_eos=True,
                                                               thinking_token_budget=budget),
                                   OFFLINE_QOS["interactive"][0], arrival_time=engine.executor.now()))
    ids: dict[str, list[int]] = {"budget": [], "free": []}
    while engine.has_work:
        for done in engine.step():
            ids[done.request_id] += list(done.new_token_ids)
    print(json.dumps({"close": close, **ids, "speculation": engine.speculation.state()}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), *sys.argv[2:])
