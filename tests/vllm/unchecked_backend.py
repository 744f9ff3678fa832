"""The real vLLM engine under a structured-output backend the API does not check with (outlines or
lm-format-enforcer, the first argument): a constraint the backend refuses ends its request with vLLM's reason, an
error the job fails with (a 400 for a request that waits on it), not a hang or a job left running. Prints, as JSON,
the backend the worker publishes and what the engine said of each request.

Run as ``python -m tests.vllm.unchecked_backend BACKEND`` (vLLM's in-process engine core is process-wide: a process
of its own).
"""

from __future__ import annotations

import json
import sys

from gpu_runtime.request import Request
from gpu_runtime.sampling import OutputConstraint, SamplingParams
from gpu_runtime.vllm.build import build_vllm_engine
from gpu_runtime.vllm.offline import OFFLINE_QOS, random_prompts

# request id -> the constraint: refused by the backend's validation, or (a structural tag) by its compile
CONSTRAINTS = {
    "grammar": OutputConstraint("grammar", 'root ::= "a" | "b"'),
    "tag": OutputConstraint("structural_tag", json.dumps({"structures": [
        {"begin": "<a>", "schema": {"type": "object"}, "end": "</a>"}], "triggers": ["<a"]})),
    "served": OutputConstraint("regex", "(yes|no)"),
}


def main(backend: str) -> None:
    engine = build_vllm_engine("smollm2-135m", max_model_len=512, cost_profile=None, dtype="float32",
                               overrides={"structured_outputs_config": {"backend": backend}})
    prompt = random_prompts(1, 16)[0]
    qos = OFFLINE_QOS["interactive"][0]
    for rid, constraint in CONSTRAINTS.items():
        engine.add_request(Request(rid, list(prompt), SamplingParams(max_tokens=4, structured=constraint), qos,
                                   arrival_time=engine.executor.now()))
    said: dict[str, dict] = {}
    while len(said) < len(CONSTRAINTS):
        for out in engine.step():
            if out.finished or out.event == "rejected":
                said[out.request_id] = {"event": out.event, "status": out.status.value, "error": out.error}
    print(json.dumps({"published": engine.grammar_backend, "unavailable": engine.grammar_unavailable, "said": said,
                      "held": sorted(engine.requests),
                      "has_work": engine.has_work}))


if __name__ == "__main__":
    main(sys.argv[1])
