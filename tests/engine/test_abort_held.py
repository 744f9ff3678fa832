"""An abort lets go of whatever the engine still holds for the request, whatever its status."""

from __future__ import annotations

from gpu_runtime.engine import Engine
from gpu_runtime.executor.torch import TorchExecutor
from gpu_runtime.request import RequestStatus
from tests.engine.conftest import make_request
from tests.engine.fcfs import FCFSTestScheduler


def test_an_abort_releases_a_finished_request_the_engine_still_holds(tiny_model):
    """A step that raised between a request's status being set finished and ``_finish`` (a relegated job its
    scheduler let go as expired, then a fault freeing it) leaves the request held: in ``requests``, its KV taken,
    its scheduler no longer knowing it. The abort the worker sends then frees its KV, drops it and reports it
    once, aborted; it was skipped (finished), and the request held its KV and slot for good."""
    ex = TorchExecutor.from_model(tiny_model, kv_blocks=32, block_size=4)
    engine = Engine(ex, FCFSTestScheduler(ex))
    req = make_request(list(range(5, 14)), max_tokens=16)
    engine.add_request(req)
    for _ in range(3):
        engine.step()
    assert req.status is RequestStatus.DECODING and ex.capacity().free_blocks < 32
    engine.scheduler.abort_request(req.request_id)  # what the failed step left: the scheduler let it go as expired,
    req.status = RequestStatus.FINISHED_EXPIRED  # and _finish, which frees its KV, never ran
    engine.abort(req.request_id)
    assert engine.has_work
    outputs = engine.step()
    assert [(o.request_id, o.status) for o in outputs if o.finished] == [(req.request_id,
                                                                          RequestStatus.FINISHED_ABORTED)]
    assert req.request_id not in engine.requests and not ex.blocks.tables and not ex._requests
    assert ex.capacity().free_blocks == 32
    engine.abort(req.request_id)  # a second abort of it: nothing held, nothing reported again
    assert [o for o in engine.step() if o.request_id == req.request_id] == []
