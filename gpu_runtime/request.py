"""A request as the engine tracks it: prompt, progress, QoS and per-token timestamps.

The engine owns these objects; the scheduler reads and updates the scheduling fields,
speculation reads the decode progress, executors only ever see ids and token lists.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from gpu_runtime.qos import QoSClass, QoSSpec, completion_deadline, token_deadline
from gpu_runtime.sampling import SamplingParams


class RequestStatus(StrEnum):
    WAITING = "waiting"  # admitted, prefill not finished
    DECODING = "decoding"  # prompt fully in the KV cache, generating
    RELEGATED = "relegated"  # demoted under overload; runs only with spare budget
    FINISHED_STOPPED = "finished_stopped"  # EOS or stop string
    FINISHED_LENGTH = "finished_length"  # max_tokens reached
    FINISHED_ABORTED = "finished_aborted"  # cancelled by the user or an operator
    FINISHED_EXPIRED = "finished_expired"  # relegated under overload and given up on past its expiry

    @property
    def finished(self) -> bool:
        return self.value.startswith("finished")


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    qos: QoSSpec
    arrival_time: float  # engine clock, seconds
    app_id: str | None = None  # key for per-application decode-length history
    lora_name: str | None = None  # the LoRA adapter it runs with (the vLLM engine's), None: the model itself
    lora_path: str | None = None  # where an adapter loaded at runtime is (None: one the engine started with)
    lora_version: float = 0.0  # when that adapter was loaded: a reload from the same path is new weights
    cache_salt: str | None = None  # prefix-cache scope: only requests with the same salt share cached blocks
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # prompt (and later output) tokens already in the KV cache
    output_token_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # clock time each output token was produced
    # A rerun going on from an earlier attempt's streamed tokens (``qos.delivered``): when the client got each of
    # them (clock time), for the answer's metrics; empty where not known. The policy never reads it.
    delivered_times: list[float] = field(default_factory=list)
    relegation_count: int = 0
    was_preempted: bool = False  # prefill was preempted at least once (selective preemption)
    # Output tokens recomputed as part of the prefill after the request's KV was released under memory
    # pressure (vLLM-style recompute preemption): the prefill covers prompt + those outputs.
    recomputed_outputs: int = 0
    num_recomputes: int = 0  # times its KV was released and recomputed
    scheduled_time: float | None = None  # clock time its first prefill chunk was scheduled
    num_cached_tokens: int = 0  # prompt tokens the engine's prefix cache held when its prefill began
    num_cache_write_tokens: int = 0  # prompt tokens it computed and wrote to the prefix cache (vLLM's count)
    finish_time: float | None = None
    stop_reason: str | int | None = None  # what stopped it: the stop string or stop token id (None: EOS, length)
    # Filled by the scheduler: predicted remaining decode tokens (running mean + 2 std).
    predicted_output_len: int | None = None

    # ---- derived facts (cheap, used every iteration) ----
    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def prefill_target(self) -> int:
        """Tokens the prefill puts in the KV cache: the prompt, plus outputs being recomputed."""
        return len(self.prompt_token_ids) + self.recomputed_outputs

    @property
    def prefill_remaining(self) -> int:
        return max(0, self.prefill_target - self.num_computed_tokens)

    @property
    def in_prefill(self) -> bool:
        return self.num_computed_tokens < self.prefill_target

    def prefill_token_ids(self, start: int, n: int) -> list[int]:
        """Tokens ``start .. start+n`` of the prefill (prompt, then recomputed outputs)."""
        plen = len(self.prompt_token_ids)
        piece = self.prompt_token_ids[start:start + n]
        if start + n > plen:
            piece += self.output_token_ids[max(0, start - plen):start + n - plen]
        return piece

    def release_kv(self) -> None:
        """Forget the cached KV (its blocks were freed): the next prefill recomputes the prompt and every
        output but the last, which the next decode step feeds as usual."""
        self.recomputed_outputs = max(0, self.num_output_tokens - 1)
        self.num_computed_tokens = 0
        self.num_recomputes += 1

    @property
    def context_len(self) -> int:
        """Tokens whose KV is (or will be after this step) cached: prompt + outputs - 1 pending."""
        return self.prompt_len + self.num_output_tokens

    @property
    def first_token_time(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def first_token_out(self) -> bool:
        """The client has the answer's first token: from this attempt, or from an earlier one this rerun goes on from
        (``qos.delivered``). Its TTFT is settled; what is left is judged on pace (eq. 2/3)."""
        return bool(self.output_token_ids) or self.qos.delivered > 0

    @property
    def answer_tokens(self) -> int:
        """Output tokens of the whole answer so far: earlier attempts' (``qos.delivered``) and this attempt's."""
        return self.qos.delivered + len(self.output_token_ids)

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def next_token_deadline(self) -> float:
        """Deadline of the next output token (eq. 1/2 for interactive, eq. 3 for batch), counted over the whole
        answer: a rerun's tokens follow the ``qos.delivered`` ones, its stream began at their first."""
        q = self.qos
        first = self.first_token_time
        if q.delivered and q.first_token_s is not None:
            first = self.arrival_time + q.first_token_s
        return token_deadline(self.arrival_time, q, q.delivered + self.num_output_tokens + 1, first)

    def completion_deadline(self) -> float | None:
        return completion_deadline(self.arrival_time, self.qos)

    def tpot_target(self, now: float) -> float | None:
        """Per-token target for speculation (AdaServe): TBT, or what the batch deadline needs."""
        if self.qos.qos_class is QoSClass.INTERACTIVE:
            return self.qos.tbt_s
        deadline = self.completion_deadline()
        assert deadline is not None
        remaining = max(1, (self.predicted_output_len or self.sampling.max_tokens) - self.num_output_tokens)
        return max(1e-4, (deadline - now) / remaining)
