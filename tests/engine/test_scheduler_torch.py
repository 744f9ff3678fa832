"""The QoServe scheduler object drives the real default model (TorchExecutor, CPU):
a mixed run of interactive and batch jobs completes with per-job metrics, and the
tokens are the ones the same requests get under a plain FCFS schedule."""

from __future__ import annotations

import pytest
import torch

from gpu_runtime.engine import Engine
from gpu_runtime.qos import QoSClass, QoSSpec, Tier
from gpu_runtime.request import Request
from gpu_runtime.sampling import SamplingParams
from gpu_runtime.scheduler.registry import create_scheduler

pytestmark = pytest.mark.model

QUESTIONS = ["What is the capital of France?", "Name three colors.", "Write one sentence about the sea.",
             "What is 2 + 2?"]


def _requests(ex, now: float) -> list[Request]:
    reqs = []
    for i, q in enumerate(QUESTIONS):
        prompt = ex.chat_prompt_ids([{"role": "user", "content": q}])
        if i % 2 == 0:
            qos = QoSSpec(QoSClass.INTERACTIVE, Tier.PAID, ttft_s=30.0, tbt_s=5.0)
        else:
            qos = QoSSpec(QoSClass.BATCH, Tier.FREE, ttlt_s=600.0)
        reqs.append(Request(f"{'i' if i % 2 == 0 else 'b'}{i}", prompt,
                            SamplingParams(max_tokens=4, ignore_eos=True), qos, now, app_id="test"))
    return reqs


def _run(ex, policy: str, **config) -> tuple[list[Request], list, object]:
    sched = create_scheduler(policy, executor=ex, **config)
    eng = Engine(ex, sched)
    reqs = _requests(ex, ex.now())
    for r in reqs:
        eng.add_request(r)
    outs = eng.run_until_idle(max_steps=500)
    return reqs, outs, sched


def test_qoserve_drives_the_torch_executor_on_a_mixed_workload(default_executor):
    ex = default_executor
    torch.set_num_threads(2)
    reqs, outs, sched = _run(ex, "qoserve", chunk_floor=16, chunk_ceiling=16)
    finished = {o.request_id: o for o in outs if o.finished}
    assert set(finished) == {r.request_id for r in reqs}
    for r in reqs:
        m = finished[r.request_id].metrics
        assert m is not None and m.num_output_tokens == 4
        assert m.ttft_s is not None and m.ttft_s > 0 and m.ttlt_s >= m.ttft_s
        assert m.queue_s is not None and 0 <= m.queue_s <= m.ttft_s
        assert m.slo_met is not None
    # chunked prompts: some iteration ran less than a whole prompt (budget 16 tokens)
    assert any(len(r.prompt_token_ids) > 16 for r in reqs)
    assert ex.capacity().free_blocks == ex.capacity().total_blocks  # every block returned
    # the scheduler's decode-length history learned from the finished jobs
    assert sched.history.stats["test"].n == 4 and sched.history.predict("test", 100) == 4
    assert sched.queue_depths() == {"prefill": 0, "decode": 0, "relegated": 0}

    fcfs_reqs, _, _ = _run(ex, "sarathi-fcfs", chunk_size=512)
    for a, b in zip(reqs, fcfs_reqs):
        assert a.output_token_ids == b.output_token_ids  # scheduling never changes greedy tokens
