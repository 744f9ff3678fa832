"""Two attempts of one job on the real vLLM engine, as the worker names them (``Lease.request_id``): attempt 1
decodes, then its abort and attempt 2 reach the engine together, as when a rerun is added beside an aborted attempt.
Prints what the engine said of each request id, as JSON.

Run as ``python -m tests.vllm.two_attempts`` (vLLM's in-process engine core is process-wide: a process of its own).
"""

from __future__ import annotations

import json

from gpu_runtime.request import Request
from gpu_runtime.sampling import SamplingParams
from gpu_runtime.vllm.build import build_vllm_engine
from gpu_runtime.vllm.offline import OFFLINE_QOS, random_prompts
from workers.lease import engine_request_id

JOB = f"job_{'a' * 24}"


def main() -> None:
    engine = build_vllm_engine("smollm2-135m", max_model_len=512, cost_profile=None, dtype="float32")
    prompt = random_prompts(1, 64)[0]
    qos = OFFLINE_QOS["interactive"][0]
    first, second = engine_request_id(JOB, 1), engine_request_id(JOB, 2)

    def request(rid: str) -> Request:
        return Request(rid, list(prompt), SamplingParams(max_tokens=20, ignore_eos=True), qos,
                       arrival_time=engine.executor.now())

    said: dict[str, dict] = {}

    def take(outputs) -> None:
        for out in outputs:
            seen = said.setdefault(out.request_id, {"tokens": 0, "status": None})
            seen["tokens"] += len(out.new_token_ids)
            if out.finished:
                seen["status"] = out.status.value
    engine.add_request(request(first))
    while said.get(first, {}).get("tokens", 0) < 5:
        take(engine.step())
    engine.add_request(request(second))  # the rerun beside the attempt being aborted
    engine.abort(first)
    while engine.has_work:
        take(engine.step())
    print(json.dumps({"said": said, "held": sorted(engine.requests)}))


if __name__ == "__main__":
    main()
