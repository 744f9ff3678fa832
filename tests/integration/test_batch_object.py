"""The Batch object and error lines as OpenAI's client reads them (the real app, Redis and SQLite; no worker: the
jobs' ends are written as a worker would): the batch names the model its lines ran on."""

from __future__ import annotations

import json

import pytest
from openai.types import Batch as OpenAIBatch

from tests.conftest import Keys, load_runtime_adapter

pytestmark = pytest.mark.integration


def _batch(client, keys, models: list[str], window: str = "24h") -> str:
    """A batch of a one-job line per model, validated and fanned out (TestClient runs the fan-out before it
    returns)."""
    text = "\n".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                                 "body": {"model": model, "prompt": "Hi", "max_tokens": 2}})
                     for i, model in enumerate(models))
    auth = Keys.header(keys.paid)
    f = client.post("/v1/files", headers=auth, data={"purpose": "batch"}, files={"file": ("in.jsonl", text)}).json()
    return client.post("/v1/batches", headers=auth, json={"input_file_id": f["id"], "endpoint": "/v1/completions",
                                                          "completion_window": window}).json()["id"]


def _read(client, keys, batch_id: str) -> OpenAIBatch:
    return OpenAIBatch.model_validate(client.get(f"/v1/batches/{batch_id}", headers=Keys.header(keys.paid)).json())


def test_a_batch_names_the_model_its_lines_ran_on(client, keys, settings, tmp_path):
    """One model for all its lines: that model; lines of several models: none (OpenAI's ``model`` is the one model
    that processed the batch); not fanned out yet: none."""
    load_runtime_adapter(settings, tmp_path)
    one, several = _batch(client, keys, ["tiny", "tiny"]), _batch(client, keys, ["tiny", "rt-lora"])
    assert {b: _read(client, keys, b).model for b in (one, several)} == {one: "tiny", several: None}
    page = client.get("/v1/batches", headers=Keys.header(keys.paid)).json()["data"]
    assert {b["id"]: OpenAIBatch.model_validate(b).model for b in page} == {one: "tiny", several: None}
