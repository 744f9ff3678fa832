"""A worker whose engine compiles structured outputs with outlines or lm-format-enforcer (the operator's
``--structured-outputs-config``): the API does not check a regex or a schema with those libraries, so what the
backend refuses must end on the worker as a failed request with vLLM's reason (the job fails with it, a 400 for a
request waiting on it), never a hang or a request left in the engine; what it never takes (a grammar, a structural
tag) the API refuses first (``tests/unit/test_output_constraints.py``)."""

from __future__ import annotations

import json

from tests.vllm.engine_process import run_module


def test_a_constraint_outlines_refuses_fails_its_request_with_vllms_reason():
    backend, grammar_refused = "outlines", "Outlines structured outputs backend does not support grammar specifications"
    proc = run_module("tests.vllm.unchecked_backend", backend)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    # vLLM logs to stdout too: the answer is its one JSON line
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith('{"published"')))
    assert result["published"] == backend, result  # the heartbeat's grammar_backend: the API knows it
    said = result["said"]
    assert said["grammar"] == {"event": "rejected", "status": "finished_aborted", "error": grammar_refused}, said
    assert said["tag"]["event"] == "rejected" and said["tag"]["error"].startswith(
        "the structured output's grammar (schema, regex, choice or grammar) did not compile: "), said
    assert said["served"]["event"] is None and said["served"]["status"] == "finished_stopped", said
    assert result["held"] == [], result
