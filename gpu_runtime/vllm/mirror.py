"""The policy's picture of a vLLM request: a coserve ``Request`` kept in step with it.

coserve's policies read a request's QoS, arrival, prompt progress, output count and token
times. vLLM's ``Request`` has the progress; the QoS comes from ``extra_args``; the token
times are when the scheduler saw each token come back. One mirror per vLLM request,
written only by the scheduler (the engine-core thread).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpu_runtime.request import Request, RequestStatus
from gpu_runtime.sampling import SamplingParams
from gpu_runtime.vllm.qos_args import parse_qos

if TYPE_CHECKING:
    from vllm.v1.request import Request as VLLMRequest


class Mirror(Request):
    """A vLLM request as the policy sees it."""

    def release_kv(self) -> None:
        """vLLM recomputes the prompt and every output (its last token samples the next one): the whole is the prefill
        the policy plans, where the own engine's recompute leaves the last output to the next decode."""
        super().release_kv()
        self.recomputed_outputs = self.num_output_tokens

    def recompute_late_outputs(self) -> bool:
        """Outputs that reached it after its KV was released (its step was in flight at the preemption: vLLM's async
        scheduling delivers them) are recomputed too; whether any came."""
        late = self.num_output_tokens > self.recomputed_outputs
        self.recomputed_outputs = self.num_output_tokens
        return late


def make_mirror(vreq: VLLMRequest) -> Request:
    """A mirror for a new vLLM request; raises ``QoSArgsError`` when its ``extra_args`` QoS is invalid."""
    sp = vreq.sampling_params
    q = parse_qos(sp.extra_args if sp is not None else None)
    prompt = vreq.prompt_token_ids if vreq.prompt_token_ids is not None else [0] * vreq.num_prompt_tokens
    return Mirror(vreq.request_id, prompt, SamplingParams(max_tokens=max(1, vreq.max_tokens)), q.qos,
                   arrival_time=vreq.arrival_time, app_id=q.app_id)


def sync_progress(mirror: Request, vreq: VLLMRequest) -> bool:
    """Tokens in the KV cache (prompt progress of a prefill, context of a decode), as vLLM counts them; False for
    a request vLLM has yet to (re)start, whose mirror counts its prefix-cache hit instead (vLLM counts it when it
    schedules the request)."""
    if not vreq.num_computed_tokens:
        return False
    mirror.num_computed_tokens = vreq.num_computed_tokens
    return True


def sync_outputs(mirror: Request, vreq: VLLMRequest, now: float) -> int:
    """Appends the output tokens vLLM committed since the last call, stamped ``now``; returns how many."""
    have = len(mirror.output_token_ids)
    new = vreq.output_token_ids[have:]
    if new:
        mirror.output_token_ids.extend(new)
        mirror.token_times.extend([now] * len(new))
    return len(new)


def finished_status(vreq: VLLMRequest) -> RequestStatus | None:
    """coserve's finished status for a finished vLLM request (None while it runs)."""
    from vllm.v1.request import RequestStatus as VStatus

    status = vreq.status
    if not VStatus.is_finished(status):
        return None
    if status == VStatus.FINISHED_LENGTH_CAPPED:
        return RequestStatus.FINISHED_LENGTH
    if status in (VStatus.FINISHED_ABORTED, VStatus.FINISHED_ERROR, VStatus.FINISHED_IGNORED):
        return RequestStatus.FINISHED_ABORTED  # its length says nothing about the app's outputs
    return RequestStatus.FINISHED_STOPPED
