"""Decode-level simulation harness shared by the speculation benchmarks and grid search.

It drives the speculation policies exactly as ``Engine`` does (draft_plan -> draft ->
select -> verify -> observe -> maintain) on real ``Request`` objects, with
* step latencies from a roofline-shaped profile (flat while weight-bound, linear past
  the knee) for the target,
* a drafter (``DRAFTERS``): by default the engine's model-free ``PromptLookupDrafter``,
  whose acceptance is the measured one and whose cost is its measured CPU propose time;
  ``draft-model`` charges a draft model's roofline steps and uses an ASSUMED geometric
  acceptance (no draft model's acceptance has been measured), and
* draft trees / accepted nodes from ``gpu_runtime.sim.acceptance`` (measured
  per-category acceptance of the real default model when the data file exists).
Prefill is modelled as whole prompts joining the next step's batch (FCFS, capped
batch), which is all these benchmarks need to compare speculation policies under one
workload; the full co-serving stack is Engine + SimExecutor + scheduler.
"""

from __future__ import annotations

import csv
import logging
import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from gpu_runtime.data import specbench_path, trace_path
from gpu_runtime.executor.base import KVCapacity, StepResult
from gpu_runtime.qos import QoSClass, QoSSpec, TbtAnchor
from gpu_runtime.request import Request, RequestStatus
from gpu_runtime.sampling import SamplingParams
from gpu_runtime.sim.acceptance import DATA_FILE, AcceptanceModel, EmpiricalAcceptance, GeometricAcceptance
from gpu_runtime.speculation.base import SpeculationPolicy

log = logging.getLogger(__name__)


@dataclass
class RooflineProfile:
    """T(N_c, N_b) = max(weights_s, per_token_s * N_b) + per_context_s * N_c for target and draft."""

    weights_s: float = 0.030  # target pass bound by reading weights (a 70B-class TP shard)
    per_token_s: float = 0.030 / 192  # compute-bound slope past the knee (~192 tokens)
    per_context_s: float = 2e-8  # attention over cached context
    draft_weights_s: float = 0.003  # one draft step (a 1B-class draft)
    draft_per_token_s: float = 0.003 / 384
    draft_switch_s_per_token: float = 2e-5  # catching a stale draft KV up, per lagging token
    # KV memory (Nightjar section 5), in blocks of 16 tokens: the pool without a draft model, and what
    # loading the draft model takes from it (its weights, and its own KV beside each block). None: unbounded.
    kv_blocks: int | None = None
    draft_kv_blocks: int = 0
    draft_offload_s: float = 0.0  # engine stall while the KV pool expands into the draft's memory
    draft_reload_s: float = 0.0  # ... and while it contracts again (the weights copy back asynchronously)

    def target(self, num_context: int, num_tokens: int) -> float:
        return max(self.weights_s, self.per_token_s * num_tokens) + self.per_context_s * num_context

    def draft_step(self, num_context: int, num_tokens: int) -> float:
        return max(self.draft_weights_s, self.draft_per_token_s * num_tokens) + 0.1 * self.per_context_s * num_context

    def latency_curve(self, num_tokens: int) -> float:
        return self.target(0, num_tokens)


def kv_pool_blocks(device_bytes: float, weights_bytes: float, kv_bytes_per_token: int,
                   utilization: float = 0.9, activation_bytes: float = 1.5e9, block_size: int = 16) -> int:
    """KV blocks left on a device (vLLM's gpu_memory_utilization share) after weights and activations."""
    return int((device_bytes * utilization - weights_bytes - activation_bytes) // (kv_bytes_per_token * block_size))


# Nightjar's 7B + 0.5B on one RTX 4090 (24 GiB): DeepSeek-R1-Distill-Qwen-7B, 7.62e9 bf16 parameters,
# KV 2 x 28 layers x 4 heads x 128 x 2 B = 57,344 B per token; Qwen2.5-0.5B draft, 0.494e9 parameters,
# KV 2 x 24 x 2 x 64 x 2 B = 12,288 B per token (its cache has a block beside each of the target's).
_4090_KV = kv_pool_blocks(24 * 2**30, 7.62e9 * 2, 57_344)
_4090_KV_WITH_DRAFT = kv_pool_blocks(24 * 2**30, (7.62e9 + 0.494e9) * 2, 57_344 + 12_288)

PROFILES = {
    # AdaServe's setting: a 70B-class target (TP shard) + 1B-class draft; knee ~192 tokens.
    "a100-70b": RooflineProfile(),
    # Nightjar's setting: a 7B target + 0.5B draft on one RTX 4090; knee ~80 tokens.
    "4090-7b": RooflineProfile(weights_s=0.014, per_token_s=0.014 / 80, per_context_s=1e-8,
                               draft_weights_s=0.0012, draft_per_token_s=0.0012 / 256,
                               draft_switch_s_per_token=1e-5, kv_blocks=_4090_KV,
                               draft_kv_blocks=_4090_KV - _4090_KV_WITH_DRAFT,
                               # Nightjar Table 6 (30B, 2 L20): KV expansion 143.9 ms, contraction 11.9 ms
                               draft_offload_s=0.1439, draft_reload_s=0.0119),
}


@dataclass(frozen=True)
class DrafterSpec:
    """Which drafter a benchmark runs, what a draft step costs and whose acceptance it uses.

    The acceptance data (``gpu_runtime/speculation/data/acceptance.json``) is measured for
    the engine's model-free ``PromptLookupDrafter``: a consistent benchmark charges that
    drafter's cost, which is host CPU time (an n-gram scan of each request's context), not
    a draft model's forward passes. It holds no device memory, so it never lags behind the
    target (no catch-up prefill, Nightjar's c_prefill = 0) and there is nothing to offload.
    """

    name: str
    model: bool  # a draft model on the device: roofline draft steps, catch-up cost, offloadable
    cpu_s_per_request: float = 0.0  # host time per drafted request and step
    cpu_s_per_context_token: float = 0.0  # ... per token of that request's context
    acceptance: str = "measured"  # "measured" (acceptance.json) or "assumed" (stated in the output)
    assumed_alpha: float = 0.0  # draft-model: conditional acceptance per depth (assumed)

    def cost(self, profile: RooflineProfile, contexts: list[int], depth: int, width_tokens: int) -> float:
        """Seconds to draft ``depth`` levels for requests with these context lengths."""
        if not contexts:
            return 0.0
        if self.model:
            ctx = sum(contexts)
            return profile.draft_step(ctx, len(contexts)) + (depth - 1) * profile.draft_step(ctx, width_tokens)
        # One propose() call per request per step, run serially on the engine's host thread.
        return len(contexts) * self.cpu_s_per_request + self.cpu_s_per_context_token * sum(contexts)


# One decode step of the engine's prompt lookup (PromptLookupDrafter.draft: the request's n-gram
# index syncs the appended token and looks up the suffix; max_ngram 3, 16 matches), timed by
# `measure_prompt_lookup_cost` on SpecBench text on the 2-core dev host, three runs: 12.8-20.2 us
# fixed + 7.5-12.4 ns per context token (the check that the sequence still extends what was
# indexed). Until stop 12 this charged the stateless scan `propose` (3 us + 130 ns per context
# token), which the engine does not run per step: ~7x too much at 1,500 tokens of context.
# Rerun with `python ops/bench_spec_sim.py --measure-drafter`.
PROMPT_LOOKUP_CPU_S_PER_REQUEST = 1.6e-5
PROMPT_LOOKUP_CPU_S_PER_CONTEXT_TOKEN = 1.0e-8
DRAFTERS = {
    "prompt-lookup": DrafterSpec("prompt-lookup", model=False, cpu_s_per_request=PROMPT_LOOKUP_CPU_S_PER_REQUEST,
                                 cpu_s_per_context_token=PROMPT_LOOKUP_CPU_S_PER_CONTEXT_TOKEN),
    # No draft model's acceptance is measured in this repository: 0.7 per depth is an
    # assumption (typical of a 0.5-1B draft for a 7-70B target), printed as such.
    "draft-model": DrafterSpec("draft-model", model=True, acceptance="assumed", assumed_alpha=0.7),
}


def measure_prompt_lookup_cost(repeats: int = 20) -> tuple[float, float]:
    """(seconds per request, seconds per context token) of one decode step of the engine's
    prompt lookup, ``PromptLookupDrafter.draft``: its n-gram index syncs the token appended
    since the last step and looks up the suffix (the index is built once per request, not
    timed here). SpecBench prompts as word-level token ids; least squares over contexts."""
    import json
    import re
    import time

    import numpy as np

    from gpu_runtime.executor.base import DraftEntry
    from gpu_runtime.executor.drafters.prompt_lookup import PromptLookupDrafter

    class _Sequences:  # what ``draft`` reads from its executor: each request's tokens so far
        def __init__(self) -> None:
            self.seqs: dict[str, list[int]] = {}

        def token_ids(self, request_id: str) -> list[int]:
            return self.seqs[request_id]

    drafter, seqs, vocab, rows = PromptLookupDrafter(), _Sequences(), {}, []
    drafter.executor = seqs  # type: ignore[assignment]
    path = specbench_path()
    for qi, line in enumerate(path.read_text().splitlines()):
        q = json.loads(line)
        text = " ".join(t for t in q["turns"] if isinstance(t, str))
        ids = [vocab.setdefault(w, len(vocab)) for w in re.findall(r"\w+|[^\w\s]", text)]
        for cut in (len(ids) // 2, len(ids)):
            if cut < 4:
                continue
            for depth, width in ((1, 1), (4, 1), (4, 3)):
                rid = f"{qi}-{cut}-{depth}-{width}"
                seq = seqs.seqs[rid] = ids[:cut]
                entry = [DraftEntry(rid, depth, width)]
                drafter.draft(entry)  # builds the index
                elapsed = 0.0
                for step in range(repeats):
                    seq.append(ids[step % len(ids)])  # the token the last step accepted
                    t0 = time.perf_counter()
                    drafter.draft(entry)
                    elapsed += time.perf_counter() - t0
                rows.append((len(seq), elapsed / repeats))
                drafter.free(rid)
    x = np.array([[1.0, c] for c, _ in rows])
    coef, *_ = np.linalg.lstsq(x, np.array([t for _, t in rows]), rcond=None)
    return max(0.0, float(coef[0])), max(0.0, float(coef[1]))


def acceptance_for(drafter: DrafterSpec) -> AcceptanceModel:
    """The measured prompt-lookup acceptance, or the draft model's assumed geometric one."""
    if drafter.acceptance == "measured":
        return load_acceptance()
    return GeometricAcceptance(alphas=[drafter.assumed_alpha])


class HarnessExecutor:
    """What policies read from an executor in the harness: the profile and memory facts."""

    def __init__(self, profile: RooflineProfile, total_blocks: int = 4096, draft_blocks: int = 256,
                 drafter: DrafterSpec | None = None, draft_loaded: bool = True) -> None:
        """``total_blocks``: the pool with the draft on device; ``draft_loaded`` False: a deployment
        without speculation, which never loads a draft model (the whole pool is KV)."""
        self.profile = profile
        self.drafter = drafter or DRAFTERS["prompt-lookup"]
        self.latency_curve = profile.latency_curve
        self.total, self.used = total_blocks, 0
        self.draft_blocks = draft_blocks if self.drafter.model else 0
        self.draft_on_device = draft_loaded
        self.has_draft = True
        self.stall_s = 0.0  # engine time the last offload / reload cost (the simulation charges it)

    @property
    def draft_offloadable(self) -> bool:
        """Only a draft model holds device memory (Nightjar section 5)."""
        return self.drafter.model

    def draft_switch_cost(self, l_max: int, batch: int) -> float:
        if not self.drafter.model:
            return 0.0  # prompt lookup reads the request's tokens: nothing to catch up
        return self.profile.draft_switch_s_per_token * l_max * max(1, batch) ** 0.5

    def capacity(self) -> KVCapacity:
        total = self.total + (0 if self.draft_on_device else self.draft_blocks)
        return KVCapacity(total, max(0, total - self.used), 16)

    def offload_draft(self) -> int:
        self.draft_on_device = False
        self.stall_s += self.profile.draft_offload_s
        return self.draft_blocks

    def load_draft(self) -> bool:
        self.draft_on_device = True
        self.stall_s += self.profile.draft_reload_s
        return True


@dataclass
class Arrival:
    time: float
    prompt_len: int
    output_len: int
    category: str  # the measured acceptance category that stands in for its drafts (ACCEPTANCE_CATEGORY)
    qos: QoSSpec
    slo_category: str = ""  # the workload category its SLO is set by (coding, chat, ...); unset: ``category``


@dataclass
class RunMetrics:
    policy: str
    requests: int = 0
    attained: int = 0  # TPOT target met and first token within the TTFT target
    attained_tpot: int = 0  # the paper's definition alone: mean TPOT <= target (TTFT ignored)
    output_tokens: int = 0
    goodput_tokens: int = 0
    makespan_s: float = 0.0  # what goodput divides: an open-loop run's arrival span, a closed loop's whole run
    busy_s: float = 0.0
    steps: int = 0
    tokens_per_step: float = 0.0
    mean_tpot_s: float = 0.0
    by_category: dict[str, tuple[int, int]] = field(default_factory=dict)  # category -> (attained, total)
    tokens_by_phase: dict[int, int] = field(default_factory=dict)  # phase index -> output tokens (phase_s runs)
    # phase -> trace indices admitted (closed loop)
    admitted_by_phase: dict[int, list[int]] = field(default_factory=dict)
    processed_by_phase: dict[int, int] = field(default_factory=dict)  # phase -> prompt + output tokens computed

    @property
    def attainment(self) -> float:
        return self.attained / self.requests if self.requests else 0.0

    @property
    def attainment_tpot(self) -> float:
        return self.attained_tpot / self.requests if self.requests else 0.0

    @property
    def goodput(self) -> float:
        return self.goodput_tokens / self.makespan_s if self.makespan_s else 0.0

    @property
    def throughput(self) -> float:
        """Output tokens per second of busy engine time."""
        return self.output_tokens / self.busy_s if self.busy_s else 0.0


def load_acceptance(scale: float = 1.0) -> AcceptanceModel:
    if DATA_FILE.exists():
        return EmpiricalAcceptance.load(DATA_FILE)
    log.warning("no measured acceptance data at %s: using a geometric model", DATA_FILE)
    return GeometricAcceptance(alphas=[0.7 * scale])


def simulate(policy: SpeculationPolicy, arrivals: list[Arrival], profile: RooflineProfile,
             acceptance: AcceptanceModel, seed: int = 0, max_batch: int = 128,
             max_prefill_tokens: int = 4096, kv_blocks: int | None = None,
             concurrency: Callable[[float], int] | None = None, horizon_s: float | None = None,
             phase_s: float | None = None, drafter: DrafterSpec | None = None,
             phase_starts: list[int] | None = None) -> RunMetrics:
    """Open loop (arrivals at their times) or, with ``concurrency``, closed loop: requests
    are taken from ``arrivals`` in order whenever fewer than concurrency(now) are in flight,
    until ``horizon_s``. With ``phase_s``, output tokens are also counted per phase of that
    many simulated seconds (by the time each token is produced). With ``phase_starts`` too,
    phase k takes its requests from the time-ordered ``arrivals`` starting at index phase_starts[k] (cycling),
    so every policy admits the same requests in a phase however far it got in the earlier
    ones (paired phases: a faster policy does not meet other requests later).

    KV memory: ``kv_blocks`` (default the profile's; unbounded without one) is the pool with no
    draft model; a draft model takes ``profile.draft_kv_blocks`` of it while on device, except
    under the "none" policy, which never loads one. As the engine admits, a request starts
    only when its footprint (prompt + output, in blocks) fits beside the footprints admitted;
    a Nightjar offload gives the draft's blocks to the pool, and the offload / reload stall
    the engine for the profile's time."""
    rng = random.Random(seed)
    drafter = drafter or DRAFTERS["prompt-lookup"]
    pool = kv_blocks if kv_blocks is not None else (profile.kv_blocks or 1 << 30)
    draft_blocks = profile.draft_kv_blocks if drafter.model else 0
    ex = HarnessExecutor(profile, total_blocks=pool - draft_blocks, draft_blocks=draft_blocks, drafter=drafter,
                         draft_loaded=policy.name != "none")
    footprint: dict[str, int] = {}  # admitted request -> its reserved blocks
    policy.bind(ex)  # type: ignore[arg-type]
    pending = deque(sorted(arrivals, key=lambda a: a.time))
    ordered = list(pending)
    waiting: deque[tuple[Request, Arrival]] = deque()
    running: list[Request] = []
    info: dict[str, Arrival] = {}
    done: list[Request] = []
    now, busy, steps, step_tokens = 0.0, 0.0, 0, 0
    counter = 0
    by_phase: dict[int, int] = {}
    processed: dict[int, int] = {}
    synced: dict[str, tuple[int, int]] = {}  # draft model: request -> (step, tokens) when last drafted
    taken: dict[int, int] = {}  # phase -> requests it admitted (phase_starts)
    admitted: dict[int, list[int]] = {}  # phase -> indices into ``ordered`` of the requests it admitted

    def next_arrival() -> Arrival:
        """The next request to admit: the run's next one, or with ``phase_starts`` its phase's next one."""
        k = int(now // phase_s) if phase_s else 0
        if phase_starts:
            k = min(k, len(phase_starts) - 1)
            j = taken.get(k, 0)
            taken[k] = j + 1
            i = (phase_starts[k] + j) % len(ordered)
        else:
            pending.popleft()
            i = len(ordered) - len(pending) - 1
        admitted.setdefault(k, []).append(i)
        return ordered[i]

    while pending or waiting or running:
        if concurrency is not None:
            target = concurrency(now) if horizon_s is None or now < horizon_s else 0
            if target == 0 and not waiting and not running:
                break
            while (pending or phase_starts) and len(waiting) + len(running) < target:
                a = next_arrival()
                counter += 1
                req = Request(f"r{counter}", [1] * a.prompt_len,
                              SamplingParams(max_tokens=a.output_len, ignore_eos=True), a.qos, now, app_id=a.category)
                req.predicted_output_len = a.output_len
                info[req.request_id] = a
                waiting.append((req, a))
            if not waiting and not running:
                now += 0.01
                continue
        while concurrency is None and pending and pending[0].time <= now:
            a = pending.popleft()
            counter += 1
            req = Request(f"r{counter}", [1] * a.prompt_len, SamplingParams(max_tokens=a.output_len, ignore_eos=True),
                          a.qos, a.time, app_id=a.category)
            req.predicted_output_len = a.output_len
            info[req.request_id] = a
            waiting.append((req, a))
        if not waiting and not running:
            now = pending[0].time
            continue
        prefills, ptoks = [], 0
        while waiting and len(running) + len(prefills) < max_batch and ptoks + waiting[0][1].prompt_len <= max(
                max_prefill_tokens, waiting[0][1].prompt_len if not prefills else 0):
            a = waiting[0][1]
            need = -(-(a.prompt_len + a.output_len) // 16) + 1
            if footprint and ex.used + need > ex.capacity().total_blocks:
                break  # the KV pool is reserved: wait for a request to finish (or for more blocks)
            req, a = waiting.popleft()
            footprint[req.request_id] = need
            ex.used += need  # blocks reserved by the admitted requests
            prefills.append(req)
            ptoks += a.prompt_len
        decodes = list(running)
        ctx = sum(r.num_computed_tokens for r in decodes)
        policy.prefill_tokens_in_pass = ptoks  # as the engine does: B shares the pass with prefills
        entries = policy.draft_plan(decodes, now) if decodes and ex.has_draft else []
        trees, t_draft = {}, 0.0
        if entries:
            depth = max(e.depth for e in entries)
            width_tokens = sum(e.width for e in entries)
            by_id = {r.request_id: r for r in decodes}
            t_draft = ex.drafter.cost(profile, [by_id[e.request_id].num_computed_tokens for e in entries], depth,
                                      width_tokens)
            if ex.drafter.model:  # a draft model that skipped steps catches up first (c_prefill)
                lags = [by_id[e.request_id].num_computed_tokens - synced[e.request_id][1] for e in entries
                        if e.request_id in synced and synced[e.request_id][0] < steps - 1]
                if lags:
                    t_draft += ex.draft_switch_cost(max(lags), len(lags))
                for e in entries:
                    synced[e.request_id] = (steps, by_id[e.request_id].num_computed_tokens)
            for e in entries:
                trees[e.request_id] = acceptance.draft_tree(info[e.request_id].category, e.depth, e.width, rng)
        selected = policy.select(decodes, trees, now + t_draft) if entries else {}
        n_tokens = ptoks + len(decodes) + sum(len(t) for t in selected.values())
        t_step = profile.target(ctx + ptoks, n_tokens)
        accepted = {rid: acceptance.sample_accepted(t, info[rid].category, rng) for rid, t in selected.items()}
        now += t_draft + t_step
        busy += t_draft + t_step
        steps += 1
        tokens: dict[str, list[int]] = {}
        for req in prefills:
            req.num_computed_tokens = req.prompt_len
            req.status = RequestStatus.DECODING
            req.output_token_ids.append(0)
            req.token_times.append(now)
            running.append(req)
        for req in decodes:
            acc = accepted.get(req.request_id, [])
            new = min(1 + len(acc), req.sampling.max_tokens - req.num_output_tokens)
            req.num_computed_tokens += 1 + len(acc)
            req.output_token_ids.extend([0] * new)
            req.token_times.extend([now] * new)
            tokens[req.request_id] = [0] * new
            step_tokens += new
        if phase_s:
            k = int(now // phase_s)
            by_phase[k] = by_phase.get(k, 0) + len(prefills) + sum(len(t) for t in tokens.values())
            processed[k] = processed.get(k, 0) + ptoks + sum(len(t) for t in tokens.values())
        result = StepResult(tokens=tokens, accepted_nodes=accepted, latency_s=t_step)
        policy.observe(decodes, selected, result, t_draft, now)
        policy.maintain(ex, len(waiting))  # type: ignore[arg-type]
        if ex.stall_s:
            now += ex.stall_s
            busy += ex.stall_s
            ex.stall_s = 0.0
        still = []
        for req in running:
            if req.num_output_tokens >= req.sampling.max_tokens:
                req.status = RequestStatus.FINISHED_LENGTH
                req.finish_time = now
                done.append(req)
                ex.used -= footprint.pop(req.request_id, 0)
            else:
                still.append(req)
        running = still
    # closed loop: the run's own time; open loop: the arrivals' span, the same for every policy (its drain after the
    # last arrival would otherwise divide its goodput as well as cost it the requests that missed)
    span = now if concurrency is not None else arrival_span(arrivals)
    m = _metrics(policy.name, done, info, span, busy, steps, step_tokens)
    m.tokens_by_phase = by_phase
    m.admitted_by_phase = admitted
    m.processed_by_phase = processed
    return m


def arrival_span(arrivals: list[Arrival], until: float | None = None) -> float:
    """Seconds from the first arrival to the last (to ``until``, where later arrivals are load only): what an open-loop
    run's goodput is counted over, so that every policy given the same arrivals is divided by the same time."""
    start = min((a.time for a in arrivals), default=0.0)
    end = until if until is not None else max((a.time for a in arrivals), default=start)
    return max(end - start, 1e-9)


def _metrics(name, done, info, makespan, busy, steps, step_tokens) -> RunMetrics:
    """Attainment over every request given: one that produced no output or was aborted
    (rejected, never scheduled) is a violation, not left out.

    AdaServe counts a request as attained when its mean TPOT meets the target; its
    baselines never hold a request back. Here a scheduler may defer (QoServe relegates) a
    request past its TTFT target and serve it after the burst, when the batch is small and
    every TPOT is met: counting that as attained rewards a policy for slowing the system
    down. An interactive request therefore attains when its TTFT target is met too
    (DESIGN.md: interactive = TTFT and TBT targets); the TPOT-only share is kept as well."""
    m = RunMetrics(name, makespan_s=makespan, busy_s=busy, steps=steps)
    tpots = []
    for req in done:
        a = info[req.request_id]
        n = req.num_output_tokens
        tpot = (req.token_times[-1] - req.token_times[0]) / (n - 1) if n > 1 else 0.0
        if n:
            tpots.append(tpot)
        interactive = a.qos.qos_class is QoSClass.INTERACTIVE
        target = a.qos.tbt_s if interactive else None
        served = n > 0 and req.status is not RequestStatus.FINISHED_ABORTED
        ok_tpot = served and (target is None or tpot <= target)
        ttft_ok = not interactive or (served and req.token_times[0] - req.arrival_time <= a.qos.ttft_s)
        ok = ok_tpot and ttft_ok
        cat = a.slo_category or a.category  # reported by the category its SLO was set for
        got, tot = m.by_category.get(cat, (0, 0))
        m.by_category[cat] = (got + ok, tot + 1)
        m.requests += 1
        m.attained += ok
        m.attained_tpot += ok_tpot
        m.output_tokens += n
        m.goodput_tokens += n if ok else 0
    m.mean_tpot_s = sum(tpots) / len(tpots) if tpots else 0.0
    m.tokens_per_step = step_tokens / steps if steps else 0.0
    return m


# ---- workloads ----
ADASERVE_MIX = {"coding": 0.6, "chat": 0.2, "summarization": 0.2}  # paper section 6.1 mix
# Which measured acceptance category (acceptance.json, SpecBench prompts) stands in for each
# workload category. What was measured: summarization = CNN/DM (AdaServe's summarization
# set: exact), qa = Natural Questions, "mt_bench" = the first 8 MT-bench prompts, which are
# all *writing* prompts (ids 81-88; ops/measure_acceptance.py takes them in file order), plus
# translation, math_reasoning and rag. No coding prompt was measured, so no category is
# faithful for coding (HumanEval) or the Azure code trace: the open-ended-generation
# category, MT-bench writing, stands in; it is the lowest-acceptance category (1.18 tokens
# per step), so prompt lookup on code, which copies identifiers from the prompt, is likely
# understated. Chat (Alpaca) and the Azure conversation trace map to qa, the measured
# general-assistant questions. Measuring MT-bench's coding subcategory (or HumanEval)
# on the real model would replace the coding stand-in.
ACCEPTANCE_CATEGORY = {"coding": "mt_bench", "chat": "qa", "summarization": "summarization"}
TRACE_CATEGORY = {"code": ACCEPTANCE_CATEGORY["coding"], "conv": ACCEPTANCE_CATEGORY["chat"]}


def adaserve_slos(profile: RooflineProfile, batch_hint: int = 16) -> dict[str, float]:
    """Coding 1.2x baseline TPOT; chat 50 ms and summarization 150 ms, scaled so the
    paper's ~40 ms baseline TPOT maps to this profile's no-speculation step latency."""
    base = profile.target(batch_hint * 1500, batch_hint)
    scale = base / 0.040
    return {"coding": 1.2 * base, "chat": 0.050 * scale, "summarization": 0.150 * scale}


def poisson_arrivals(rps: float, duration_s: float, slos: dict[str, float], seed: int = 0,
                     mix: dict[str, float] = ADASERVE_MIX, tbt_anchor: TbtAnchor = TbtAnchor.ARRIVAL) -> list[Arrival]:
    rng = random.Random(seed)
    out, t = [], 0.0
    cats, weights = list(mix), list(mix.values())
    shapes = {"coding": (512, 192), "chat": (256, 256), "summarization": (1536, 128)}
    while True:
        t += rng.expovariate(rps)
        if t > duration_s:
            return out
        cat = rng.choices(cats, weights)[0]
        p, o = shapes[cat]
        qos = QoSSpec(QoSClass.INTERACTIVE, ttft_s=10.0, tbt_s=slos[cat], tbt_anchor=tbt_anchor)
        out.append(Arrival(t, max(16, int(rng.gauss(p, p / 4))), max(8, int(rng.gauss(o, o / 4))),
                           ACCEPTANCE_CATEGORY[cat], qos, cat))


def specbench_requests(seed: int = 0) -> list[tuple[int, str]]:
    """SpecBench's first turns as (prompt tokens, acceptance category), in a seeded shuffled
    order: prompt lengths under the default model's chat template (its tokenizer), categories
    as ``ops/measure_acceptance.py`` measured them (MT-bench's subcategories as "mt_bench")."""
    from measure_acceptance import default_model_dir, load_prompts
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir(), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    out = []
    for cat, texts in load_prompts(1 << 30).items():
        for text in texts:
            ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
            out.append((len(ids if isinstance(ids, list) else ids["input_ids"]), cat))
    random.Random(seed).shuffle(out)
    return out


def azure_arrivals(kind: str = "conv", start: int = 0, count: int = 600, time_scale: float = 1.0,
                   max_output: int = 512) -> list[Arrival]:
    """A segment of the Azure LLM trace (TIMESTAMP, ContextTokens, GeneratedTokens)."""
    from datetime import datetime

    path = trace_path(kind)
    rows = []
    with path.open() as f:
        for i, row in enumerate(csv.DictReader(f)):
            if i < start:
                continue
            if len(rows) >= count:
                break
            ts = datetime.fromisoformat(row["TIMESTAMP"][:26])
            rows.append((ts, int(row["ContextTokens"]), int(row["GeneratedTokens"])))
    t0 = rows[0][0]
    qos = QoSSpec(QoSClass.BATCH, ttlt_s=3600.0)
    cat = TRACE_CATEGORY[kind]  # the same stand-ins as AdaServe's coding / chat (ACCEPTANCE_CATEGORY)
    return [Arrival((ts - t0).total_seconds() * time_scale, max(1, min(c, 4096)), max(2, min(g, max_output)), cat, qos)
            for ts, c, g in rows]


def fmt_ratio(x: float, y: float) -> str:
    return f"{x / y:.2f}x" if y > 0 else ("inf" if x > 0 else "n/a")


def isfinite(x: float) -> bool:
    return not (math.isnan(x) or math.isinf(x))
