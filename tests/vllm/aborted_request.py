"""One request on the real vLLM engine, cancelled while it decodes: prints vLLM's own scheduler gauges (as its stat
logger last recorded them) while it ran and once the engine went idle, as JSON.

Run as ``python -m tests.vllm.aborted_request`` (vLLM's in-process engine core is process-wide: a process of its own).
"""

from __future__ import annotations

import json

from prometheus_client import REGISTRY

from gpu_runtime.request import Request, RequestStatus
from gpu_runtime.sampling import SamplingParams
from gpu_runtime.vllm.build import build_vllm_engine
from gpu_runtime.vllm.offline import OFFLINE_QOS, random_prompts

GAUGES = ("vllm:num_requests_running", "vllm:kv_cache_usage_perc")


def main() -> None:
    engine = build_vllm_engine("smollm2-135m", max_model_len=512, cost_profile=None, dtype="float32")
    labels = {"engine": "0", "model_name": engine.llm.vllm_config.model_config.served_model_name}

    def gauges() -> dict[str, float | None]:
        return {name: REGISTRY.get_sample_value(name, labels) for name in GAUGES}

    engine.add_request(Request("r", random_prompts(1, 64)[0], SamplingParams(max_tokens=200, ignore_eos=True),
                               OFFLINE_QOS["interactive"][0], arrival_time=engine.executor.now()))
    made = 0
    while made < 5:
        made += sum(len(out.new_token_ids) for out in engine.step())
    running = gauges()
    engine.abort("r")
    engine.step()  # takes the abort, as the worker's engine thread does with a cancel
    while engine.has_work:
        engine.step()
    idle = gauges()
    # a request whose status says finished while the engine still holds it (a fault between the two): its abort
    # lets it go in vLLM and here, and reports it once
    held = Request("held", random_prompts(1, 16)[0], SamplingParams(max_tokens=200, ignore_eos=True),
                   OFFLINE_QOS["interactive"][0], arrival_time=engine.executor.now())
    engine.add_request(held)
    while not held.output_token_ids:
        engine.step()
    held.status = RequestStatus.FINISHED_STOPPED
    engine.abort("held")
    reported = [out.status.value for out in engine.step() if out.request_id == "held" and out.finished]
    while engine.has_work:
        reported += [out.status.value for out in engine.step() if out.request_id == "held" and out.finished]
    print(json.dumps({"running": running, "idle": idle, "held": {"reported": reported,
                                                                  "still_held": "held" in engine.requests}}))


if __name__ == "__main__":
    main()
