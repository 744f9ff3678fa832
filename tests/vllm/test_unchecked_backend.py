"""A worker whose engine compiles structured outputs with outlines or lm-format-enforcer (the operator's
``--structured-outputs-config``): the API does not check a regex or a schema with those libraries, so what the
backend refuses must end on the worker as a failed request with vLLM's reason (the job fails with it, a 400 for a
request waiting on it), never a hang or a request left in the engine; what it never takes (a grammar, a structural
tag) the API refuses first (``tests/unit/test_output_constraints.py``)."""

from __future__ import annotations

import json

from tests.vllm.engine_process import run_module


def _run(backend: str) -> dict:
    """What ``tests.vllm.unchecked_backend`` printed for ``backend``."""
    proc = run_module("tests.vllm.unchecked_backend", backend)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    # vLLM logs to stdout too: the answer is its one JSON line
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith('{"published"')))


def test_a_constraint_outlines_refuses_fails_its_request_with_vllms_reason():
    backend, grammar_refused = "outlines", "Outlines structured outputs backend does not support grammar specifications"
    result = _run(backend)
    assert result["published"] == backend, result  # the heartbeat's grammar_backend: the API knows it
    assert result["unavailable"] is None, result  # made: the API takes its constraints
    said = result["said"]
    assert said["grammar"] == {"event": "rejected", "status": "finished_aborted", "error": grammar_refused}, said
    assert said["tag"]["event"] == "rejected" and said["tag"]["error"].startswith(
        "the structured output's grammar (schema, regex, choice or grammar) did not compile: "), said
    assert said["served"]["event"] is None and said["served"]["status"] == "finished_stopped", said
    assert result["held"] == [] and result["has_work"] is False, result


def test_a_backend_vllm_cannot_make_fails_each_constrained_request_and_leaves_the_engine_idle():
    """lm-format-enforcer's vLLM integration (0.11.3) imports ``vllm.transformers_utils.tokenizer``, gone from vLLM
    0.32: vLLM cannot make the backend, at each constrained request. vLLM's LLMEngine had registered the request for
    its output before its engine core failed to take it, so the engine had work for ever: the worker's loop stepped
    an empty engine, its requests never finished; and they failed as the worker's fault, with "vllm is not installed" in
its log. Each now fails with why, a request's error (the operator names another backend, the user sends none)."""
    result = _run("lm-format-enforcer")
    assert result["held"] == [] and result["has_work"] is False, result
    # the heartbeat's grammar_unavailable: the API refuses a structured output at submit (test_output_constraints.py)
    assert result["unavailable"].startswith(
        "the worker's structured-output backend lm-format-enforcer cannot run on this engine: "), result
    said = result["said"]
    for rid in ("grammar", "tag", "served"):  # refused before vLLM: the worker found at its start why it cannot run
        assert said[rid]["event"] == "rejected" and said[rid]["status"] == "finished_aborted", said
        assert said[rid]["error"].startswith(
            "the worker's structured-output backend lm-format-enforcer cannot run on this engine: "), said
