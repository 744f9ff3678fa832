"""A runtime LoRA adapter on the real vLLM engine, replaced and then unloaded: prints the adapter ids vLLM's engine
lists (``list_loras``) after each, as JSON; then a request whose job read a version just before a reload from
another directory, which the engine removed and the admin deleted before the request came (``late``: how it ended),
and one whose job read the adapter before an unload the engine heard of before the request came (``gone``).

Run as ``python -m tests.vllm.retired_lora ADAPTER_DIR`` (vLLM's in-process engine core is process-wide: a process of
its own).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile

from gpu_runtime.request import Request
from gpu_runtime.sampling import SamplingParams
from gpu_runtime.vllm.build import build_vllm_engine
from gpu_runtime.vllm.offline import OFFLINE_QOS, random_prompts


def main(path: str) -> None:
    # two runtime slots: vLLM's cache would hold both versions, so only a removal takes the first out
    engine = build_vllm_engine("smollm2-135m", max_model_len=512, cost_profile=None, dtype="float32",
                               runtime_loras=2)

    def run(rid: str, version: float, where: str = path) -> str:
        engine.add_request(Request(rid, random_prompts(1, 16)[0], SamplingParams(max_tokens=2, ignore_eos=True),
                                   OFFLINE_QOS["interactive"][0], arrival_time=engine.executor.now(),
                                   lora_name="ada", lora_path=where, lora_version=version))
        ends = []
        while engine.has_work:
            ends += [f"{out.status.value}: {out.error}" for out in engine.step() if out.request_id == rid
                     and out.status.finished]
        return ends[-1]

    def retire(loaded: dict[str, tuple[str, float]]) -> list[int]:
        engine.retire_loras(loaded)
        engine.step()  # takes it, as the worker's engine thread does after a heartbeat
        return sorted(engine.llm.list_loras())

    run("first", 1.0)
    served = sorted(engine.llm.list_loras())
    run("second", 2.0)  # loaded again (new weights): version 2
    both = sorted(engine.llm.list_loras())
    replaced, unloaded = retire({"ada": (path, 2.0)}), retire({})
    old = shutil.copytree(path, f"{tempfile.mkdtemp()}/ada-3")
    run("third", 3.0, old)
    retire({"ada": (path, 4.0)})  # loaded again from ``path``: version 3 leaves vLLM
    shutil.rmtree(old)
    late = run("late", 3.0, old)  # its job read version 3 before that reload
    retire({})  # unloaded, its directory kept
    gone = run("gone", 4.0)  # its job read version 4 before that unload
    print(json.dumps({"served": served, "both": both, "replaced": replaced, "unloaded": unloaded, "late": late,
                      "gone": gone}))


if __name__ == "__main__":
    main(sys.argv[1])
