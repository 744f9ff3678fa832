"""Property-based tests of coserve's policies inside vLLM's v1 scheduler (``CoserveScheduler``), no model.

Hypothesis draws a scheduler (a small KV pool, so vLLM's and the policy's preemption happen) and a sequence of events:
requests of random tiers, QoS, prompt and output lengths and arrivals; steps answered with fake tokens after the
clock moved; aborts; an operator's resume and promote. After every step the invariants vLLM and QoServe promise are
checked (each property cites its rule: QoServe in /work/shared/ALGORITHMS.md, or vLLM's scheduler's own promise).
Dedicated strategies reach what random events rarely do: KV pressure (the policy's and vLLM's recompute
preemption), vLLM's prefix cache over shared system prompts, and draft tokens verified by each decode. A share of
the jobs run with one of three LoRA adapters on engines with fewer LoRA slots (vLLM's max_loras), and a share sample
with a seed (on the CPU a seeded prompt runs whole: vLLM-CPU cannot rewind its generator after a part of it). Structured
jobs wait some steps for their grammar to compile (or fail to), as vLLM's scheduler reads the compile's future; the
drafts of a structured request are those its grammar accepts (vLLM's update_draft_token_ids). On an engine with a
reasoning parser a structured job thinks first: its grammar masks, checks drafts and advances only after the thinking
ends. In every property test a share of the engines schedule asynchronously (vLLM's async_scheduling: a step is
scheduled before the last one is answered, ``Drive.pipeline``), and vllm-fcfs is compared with vLLM's AsyncScheduler
there; the main, KV-pressure, LoRA and speculation tests draw 2-3 pipeline stages too (that many batches in flight,
synchronous, as vLLM's batch queue keeps them; its engine core hands over a batch's drafts before its tokens).
Settings are deterministic (derandomize) and untimed; PROPS_EXAMPLES=300 searches harder locally.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field, replace

import pytest
from hypothesis import HealthCheck, Phase, event, example, given, note, settings, target
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

# first: it skips the module without vLLM
from tests.vllm.conftest import (GRAMMAR_ROW, THINK_END, TOOL_CALL, StubGrammar,  # noqa: I001
                                 compiling_grammar, vllm_request, with_reasoning_parser)
from vllm.sampling_params import StructuredOutputsParams  # noqa: E402

GRAMMAR = StructuredOutputsParams(regex="[0-9]+")


# no explain phase: it reruns a failing example hundreds of times (minutes here) to say what it already shows
PROPS = settings(max_examples=int(os.environ.get("PROPS_EXAMPLES", "10")), derandomize=True, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                        HealthCheck.function_scoped_fixture],
                 phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink])
# coserve's policies (gpu_runtime/scheduler/registry.py) as the vLLM backend runs them
POLICIES = ["qoserve", "sarathi-fcfs", "sarathi-edf", "sarathi-srpf"]
T0 = 1_000.0  # the fake clock's start: arrivals and deadlines are seconds around it (deterministic runs)
STALL_STEPS = 400  # drain steps with no token streamed and no request ended: a request is stuck


@dataclass(frozen=True)
class Job:
    prompt: int
    max_tokens: int
    extra_args: dict
    ago_s: float  # arrived this long before it was added
    shared: int = 0  # tokens of a system prompt every such job starts with (before its own ``prompt`` tokens)
    lora: int | None = None  # the id of the LoRA adapter it runs with (on an engine with LoRA slots)
    seed: int | None = None  # its sampling seed
    grammar: int | None = None  # structured output: the steps its grammar takes to compile (None: unstructured)
    bad_grammar: bool = False  # its grammar fails to compile (vLLM finishes the request as an error)
    # on an engine with a reasoning parser, the output token that ends its thinking (None: thinking off, its prompt
    # holds the end); its grammar applies to the tokens after it
    think: int | None = None
    # its thinking ends at a tool call's start (content, so its grammar applies from that token on) where the
    # engine's reasoning parser is a parser engine, else at the end of thinking
    tool_call: bool = False


@dataclass(frozen=True)
class Engine:
    blocks: int
    max_batched: int
    max_seqs: int
    prefix_caching: bool = False  # vLLM's enable_prefix_caching (jobs' shared prompt prefixes hit)
    spec_tokens: int = 0  # vLLM's draft tokens per decode (proposed every step, some accepted)
    max_loras: int | None = None  # vLLM's LoRA slots of a batch (None: LoRA off), fewer than the adapters drawn
    reasoning: bool = False  # a reasoning parser (COSERVE_REASONING_PARSER): structured requests think first
    async_scheduling: bool = False  # vLLM's async scheduling: a step is scheduled before the last one's answer
    # vLLM's structured_outputs_config.enable_in_reasoning: the grammar masks the thinking too (a reasoning parser)
    grammar_in_thinking: bool = False
    stages: int = 1  # pipeline parallelism: vLLM's engine core keeps this many batches in flight (synchronous)
    # the reasoning parser is a parser engine (vLLM's ParserEngineReasoningAdapter): a tool call ends the thinking
    parser_engine: bool = False


# pipeline parallelism's stages (vLLM's engine core keeps that many batches in flight); vLLM 0.32 combines them with
# LoRA and speculative decoding, not with async scheduling on its V1 model runner (it turns that off)
stages = st.sampled_from([1, 1, 2, 3])
# (stages, async_scheduling) as vLLM's V1 model runner runs them: async scheduling only on one stage. Drawn as a pair
# so that no draw is rejected (a filter of stages x booleans threw a quarter away, and gave up on some runs), in the
# proportions that filter kept: a third asynchronous, a third synchronous, a sixth each two and three stages
batch_queues = st.sampled_from([(1, False), (1, True), (1, False), (1, True), (2, False), (3, False)])


def v1_engines(*args, **kwargs) -> st.SearchStrategy:
    """``st.builds(Engine, ...)`` with its stages and async scheduling drawn from ``batch_queues``."""
    return st.tuples(st.builds(Engine, *args, **kwargs), batch_queues).map(
        lambda drawn: replace(drawn[0], stages=drawn[1][0], async_scheduling=drawn[1][1]))


adapters = st.sampled_from([None, None, 1, 2, 3])  # three LoRA adapters (vLLM's ids count from 1); engines have <3
seeds = st.sampled_from([None, None, None, 7])
jobs = st.builds(
    Job, st.integers(1, 200), st.integers(1, 40),
    st.one_of(
        st.fixed_dictionaries({"ttft_ms": st.sampled_from([50, 500, 2_000, 20_000]),
                               "tbt_ms": st.sampled_from([20, 100, 500]),
                               "tier": st.sampled_from(["free", "paid"]),
                               "tbt_anchor": st.sampled_from(["arrival", "first-token"])}),
        st.fixed_dictionaries({"qos_class": st.just("batch"), "deadline_s": st.sampled_from([1, 30, 600]),
                               "tier": st.sampled_from(["free", "paid"])})),
    st.sampled_from([0.0, 0.0, 0.5, 3.0]), st.just(0), adapters, seeds)
# one block of a 16-block pool is vLLM's null block: 15 x 16 = 240 tokens hold the longest job alone (200 + 40)
# an engine schedules synchronously, asynchronously or with 2-3 pipeline stages (vLLM runs no async scheduling with
# them on its V1 model runner): one, two or three batches in flight
engines = v1_engines(st.sampled_from([16, 16, 24, 40]), st.sampled_from([32, 64, 128, 512]), st.integers(2, 8),
                     max_loras=st.sampled_from([None, 1, 2]))
events = st.lists(st.one_of(
    st.tuples(st.just("add"), jobs),
    st.tuples(st.just("add"), jobs),
    st.tuples(st.just("step"), st.sampled_from([0.0, 0.02, 0.2, 2.0])),
    st.tuples(st.just("step"), st.sampled_from([0.0, 0.02])),
    st.tuples(st.just("abort"), st.integers(0, 30)),
    st.tuples(st.just("resume"), st.integers(0, 30)),
    st.tuples(st.just("promote"), st.integers(0, 30))), min_size=1, max_size=40)

LAX = {"ttft_ms": 20_000, "tbt_ms": 500, "tier": "free", "tbt_anchor": "first-token", "app_id": "chat"}


@st.composite
def kv_pressure(draw) -> list:  # noqa: ANN001
    """Three one-token answers of an app teach the policy that the app answers short (its decode-length
    prediction, QoServe 3.6), then long prompts of that app run to 20-40 tokens in a small pool: the footprints the
    policy reserved no longer hold them, so it preempts (recompute), or vLLM does when its blocks run out."""
    evs = []
    for prompt in draw(st.lists(st.integers(1, 16), min_size=3, max_size=3)):
        evs += [("add", Job(prompt, 1, LAX, 0.0)), ("step", 0.0)]
    tiers = st.sampled_from([LAX, {**LAX, "tier": "paid"}, {**LAX, "ttft_ms": 500, "tbt_ms": 100},
                             {"qos_class": "batch", "deadline_s": 600, "tier": "free", "app_id": "chat"}])
    # a share of them structured (a grammar compiled by the time they come, or a step later): preempted and
    # recomputed, a structured request keeps its grammar's state (vLLM's)
    for job in draw(st.lists(st.builds(Job, st.integers(40, 160), st.integers(20, 40), tiers, st.just(0.0),
                                       grammar=st.sampled_from([None, None, 0, 1])), min_size=2, max_size=5)):
        evs.append(("add", job))
        evs += [("step", 0.02)] * draw(st.integers(0, 3))
    return evs


def short_answers(prompts: list[int]) -> list:
    """Events: one-token answers of LAX's app, one a step, then a step that brings the last one in where it is
    still in flight (async scheduling): the app's history holds them all before what comes next."""
    return [ev for prompt in prompts for ev in (("add", Job(prompt, 1, LAX, 0.0)), ("step", 0.0))] + [("step", 0.0)]


@st.composite
def mass_preemption(draw) -> list:  # noqa: ANN001
    """As ``kv_pressure``, but 4-7 prompts of one length (or about one) come together and decode side by side, each
    block filling in the same step: at a block's end each needs one more, and the blocks one preempted request frees
    do not hold the rest, so the policy (or vLLM) preempts two or more in one pass (three or more where 6-7 one-block
    prompts fill an 8-block pool: each release gives one block); under async scheduling with their outputs still in
    flight (``Mirror.recompute_late_outputs``, ``stale``). The short answers are all in before the prompts come (under
    async scheduling too), so the policy admits the prompts side by side, not one at a time for want of history."""
    evs = short_answers(draw(st.lists(st.integers(1, 16), min_size=3, max_size=3)))
    tiers = st.sampled_from([LAX, {**LAX, "tier": "paid"}, {**LAX, "ttft_ms": 500, "tbt_ms": 100}])
    length, spread = draw(st.integers(8, 40)), draw(st.sampled_from([0, 2]))
    for job in draw(st.lists(st.builds(Job, st.integers(length, length + spread), st.integers(30, 40), tiers,
                                       st.just(0.0)), min_size=4, max_size=7)):
        evs.append(("add", job))
    evs += [("step", 0.02)] * draw(st.integers(0, 3))
    return evs


@st.composite
def lora_pressure(draw) -> list:  # noqa: ANN001
    """Prompts of three adapters, most longer than a step, arriving while others run on an engine with one or two
    LoRA slots: vLLM starts a prompt only while the running requests leave its adapter a slot, and a started prompt
    the policy sets aside for a step still holds its slot (the adapter's _within_lora_slots, _without_lora_slot)."""
    tiers = st.sampled_from([LAX, {**LAX, "tier": "paid"}, {**LAX, "ttft_ms": 500, "tbt_ms": 100},
                             {"qos_class": "batch", "deadline_s": 600, "tier": "free"}])
    evs = []
    for job in draw(st.lists(st.builds(Job, st.integers(1, 200), st.integers(1, 40), tiers, st.just(0.0), st.just(0),
                                       st.sampled_from([None, 1, 2, 3, 3]), seeds), min_size=2, max_size=6)):
        evs.append(("add", job))
        evs += [("step", 0.02)] * draw(st.integers(0, 2))
    return evs


@dataclass
class Drive:
    """A ``CoserveScheduler`` driven by events, every step checked; ``trace`` is what each step scheduled."""

    s: object
    policy: str
    clock: list = field(default_factory=lambda: [T0])
    ids: list = field(default_factory=list)  # every request added, in order
    finished: set = field(default_factory=set)  # reported finished to a client, or aborted by the test
    trace: list = field(default_factory=list)
    plans: list = field(default_factory=list)
    # request id -> the prompt left of each prompt the policy held waiting as it planned the step: less the
    # prefix-cache hit the adapter told it (``note_cached_prefix``), which vLLM counts computed only once it schedules
    prompt_left: dict = field(default_factory=dict)
    max_tokens: dict = field(default_factory=dict)  # request id -> its max_tokens
    streamed: dict = field(default_factory=dict)  # request id -> output tokens its client got
    ended: dict = field(default_factory=dict)  # request id -> its finish reason
    preempted: set = field(default_factory=set)  # KV released once at least (vLLM's or the policy's preemption)
    compiling: dict = field(default_factory=dict)  # request id -> [its grammar's future, steps until it compiled]
    ready: dict = field(default_factory=dict)  # request id -> the step its grammar was ready for
    began: dict = field(default_factory=dict)  # request id -> the first step that scheduled it
    failed: set = field(default_factory=set)  # structured requests whose grammar failed to compile
    # structured request id -> the output index of the token that ends its thinking (-1: its grammar applies from its
    # first output token: no reasoning parser, or thinking off)
    thinking: dict = field(default_factory=dict)
    implicit: set = field(default_factory=set)  # structured requests whose thinking a tool call ends (a content token)
    # async scheduling or pipeline stages (vLLM's batch queue): the steps in flight, oldest first (each its output,
    # draft counts, the requests that sample), the oldest answered once the queue is full
    in_flight: list = field(default_factory=list)
    most_preempted: int = 0  # the most requests one step preempted (vLLM and the policy together)

    def __post_init__(self) -> None:
        self.s.clock = lambda: self.clock[0]
        if self.s.coserve_policy is not None:  # the plan the policy made for each step, to compare with what vLLM ran
            schedule = self.s.coserve_policy.schedule

            def recorded(now):  # noqa: ANN001, ANN202
                self.prompt_left = {m.request_id: m.prefill_remaining for m in self.s.coserve_policy.waiting}
                plan = schedule(now)
                self.plans.append(plan)
                return plan

            self.s.coserve_policy.schedule = recorded

    def apply(self, event: tuple) -> None:
        kind, arg = event
        if kind == "add":
            rid = f"q{len(self.ids)}"
            self.ids.append(rid)
            self.max_tokens[rid] = arg.max_tokens
            own = 10_000 * len(self.ids)  # a job's own tokens differ from every other job's
            prompt = list(range(10, 10 + arg.shared)) + list(range(own, own + arg.prompt))
            if arg.grammar is not None:
                manager = self.s.structured_output_manager
                reasoning = manager.reasoner_cls is not None and not manager.enable_in_reasoning
                self.thinking[rid] = arg.think if reasoning and arg.think is not None else -1
                if self.thinking[rid] >= 0 and arg.tool_call and self.parser_engine():
                    self.implicit.add(rid)
                if reasoning and arg.think is None:  # thinking off: the chat template closed it in the prompt
                    prompt[-1] = THINK_END
            request = vllm_request(len(prompt), dict(arg.extra_args), arrival=self.clock[0] - arg.ago_s,
                                   max_tokens=arg.max_tokens, request_id=rid, prompt=prompt,
                                   hashed=self.s.kv_cache_manager.enable_caching, seed=arg.seed,
                                   lora=arg.lora if self.s.lora_config else None,
                                   structured=None if arg.grammar is None else GRAMMAR)
            if arg.grammar is not None:
                self.compile(request, arg.grammar, arg.bad_grammar)
            self.s.add_request(request)
        elif kind == "step":
            self.clock[0] += arg
            self.step()
        elif self.ids:
            rid = self.ids[arg % len(self.ids)]
            if kind == "abort":
                from vllm.v1.request import RequestStatus

                if rid in self.s.requests:
                    self.s.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
                    self.finished.add(rid)
            elif kind == "resume":
                self.s.resume(rid)
            elif self.s.coserve_policy is not None:
                from gpu_runtime.qos import Tier

                self.s.promote(rid, Tier.PAID)

    def compile(self, request, steps: int, bad: bool) -> None:  # noqa: ANN001 - vLLM's Request
        """The request's grammar compiles ``steps`` steps after it came (``compiling_grammar``), or fails then."""
        self.compiling[request.request_id] = [compiling_grammar(self.s, request), steps, bad]

    def compile_grammars(self) -> None:
        """The grammars whose compile time has passed are ready for this step (vLLM reads the future's result)."""
        for rid, pending in list(self.compiling.items()):
            future, steps, bad = pending
            if steps > 0:
                pending[1] -= 1
                continue
            del self.compiling[rid]
            if bad:  # as a backend's compile_grammar raises on a grammar it cannot compile
                future.set_exception(ValueError(f"{rid}: the grammar does not compile"))
                self.failed.add(rid)
            else:
                future.set_result(StubGrammar())
                self.ready[rid] = len(self.trace)

    def parser_engine(self) -> bool:
        """Whether the reasoning parser is a parser engine's (vLLM's ``ParserEngineReasoningAdapter``)."""
        from vllm.parser.engine.adapters import ParserEngineReasoningAdapter

        reasoner = self.s.structured_output_manager.reasoner_cls
        return reasoner is not None and issubclass(reasoner, ParserEngineReasoningAdapter)

    def token(self, rid: str, index: int) -> int:
        """The model's output token ``index`` of request ``rid``: 7, or the end of its thinking where it ends (a
        tool call's start where that ends it)."""
        if index != self.thinking.get(rid, -1) or index < 0:
            return 7
        return TOOL_CALL if rid in self.implicit else THINK_END

    def grammar_start(self, rid: str) -> int:
        """The output index of ``rid``'s first token its grammar takes: the one after its thinking's end, or that end
        itself where it is content (a tool call's start: vLLM's ``ConstraintBounds(end.offset, end.offset + 1)``)."""
        return self.thinking[rid] + (rid not in self.implicit)

    def next_tokens(self, rid: str, n: int) -> list[int]:
        """The ``n`` tokens the model samples next for ``rid`` (what a good drafter proposes)."""
        done = len(self.s.requests[rid].output_token_ids)
        return [self.token(rid, done + i) for i in range(n)]

    def thinking_drafts(self, rid: str, drafts: int) -> int:
        """How many of ``drafts`` draft tokens proposed after ``rid``'s outputs are its thinking (its end included,
        unless it is content): vLLM checks none of them against the grammar."""
        if rid not in self.thinking:
            return 0
        return max(0, min(drafts, self.grammar_start(rid) - len(self.s.requests[rid].output_token_ids)))

    def propose_drafts(self) -> None:
        """The drafter proposed drafts for each decode (an n-gram match, say): a request whose last step sampled
        a token, not one recomputing its prompt and outputs after a preemption; under pipeline stages one whose token
        is still in another stage's batch too (vLLM's engine core takes the drafts of the batch it just ran, in
        ``post_step``, before that batch's answer is in). vLLM keeps what the grammar of a
        structured request allows (``update_draft_token_ids``: the prefix ``validate_tokens`` accepts), the drafts
        of its thinking aside."""
        from vllm.v1.outputs import DraftTokenIds

        s = self.s
        ids = [r.request_id for r in s.running if r.num_computed_tokens >= max(r.num_prompt_tokens, r.num_tokens - 1)]
        if not ids or not s.num_spec_tokens:
            return
        proposed = [self.next_tokens(rid, s.num_spec_tokens) for rid in ids]
        s.update_draft_token_ids(DraftTokenIds(ids, [list(p) for p in proposed]))
        for rid, tokens in zip(ids, proposed):
            self.check_drafts(rid, tokens, list(s.requests[rid].spec_token_ids))

    def check_drafts(self, rid: str, proposed: list[int], kept: list[int]) -> None:
        """vLLM's structured output with a reasoning parser: the drafts of a request still thinking are not checked
        against its grammar (kept whole), those after its thinking ended are cut where the grammar refuses one
        (``kept``: -1 pads the cut drafts of a step already scheduled)."""
        r = self.s.requests[rid]
        if not r.use_structured_output or not isinstance(r.structured_output_request.grammar, StubGrammar):
            return
        if r.is_prefill_chunk:  # its last step ran a chunk short of its last token (a recompute's): vLLM drops them
            assert not kept, (rid, kept)
            return
        thought = self.thinking_drafts(rid, len(proposed))
        valid = proposed[:thought] + r.structured_output_request.grammar.validate_tokens(proposed[thought:])
        assert [t for t in kept if t != -1] == valid, (rid, proposed, kept, self.thinking[rid])
        if thought and currently_in_test_context():
            event("a thinking request's drafts were kept")

    def step(self) -> None:
        from vllm.sampling_params import SamplingType

        s = self.s
        self.compile_grammars()
        waiting_for_grammar = self.waiting_for_grammar()
        pool = s.kv_cache_manager.block_pool
        # a decode whose step in flight gives its last token (async scheduling, every draft rejected or not) has
        # no further step, and one whose token is in flight (pipeline stages) none in this one: vLLM schedules none
        ending = {r.request_id for r in s.running if r.num_output_placeholders
                  and len(r.output_token_ids) + 1 >= r.max_tokens
                  or not s.scheduler_config.async_scheduling and r.num_computed_tokens >= r.num_tokens}
        decoding = {rid for rid in (s.coserve_policy.running if s.coserve_policy is not None else ())} - ending
        free_before = pool.get_num_free_blocks()
        # a request's tokens count the placeholders of its step in flight (async scheduling)
        before = {rid: (r.num_computed_tokens, r.num_tokens + r.num_output_placeholders, r.num_prompt_tokens)
                  for rid, r in s.requests.items()}
        self.plans.clear()
        relegated = {r.request_id for r in s.coserve_policy.relegated} if s.coserve_policy is not None else set()
        # vLLM starts no prompt whose adapter finds no LoRA slot: the running requests hold max_loras others
        slots = {r.lora_request.lora_int_id for r in s.running if r.lora_request} if s.lora_config else set()
        no_slot = {r.request_id for r in s.waiting if r.lora_request and r.lora_request.lora_int_id not in slots
                   and len(slots) >= s.lora_config.max_loras}
        pipelined = s.vllm_config.max_concurrent_batches > 1
        # else the worker drafts, and vLLM schedules placeholders for the drafts
        if not s.scheduler_config.async_scheduling:
            self.propose_drafts()
        running = [r.request_id for r in s.running]
        victim = {rid: s.coserve_policy.victim_key(m) for rid in running if (m := s.mirrors.get(rid)) is not None} \
            if s.coserve_policy is not None else {}
        tight: list[bool] = []  # what coserve's _may_run_out said of the step (nothing: not asked, or vLLM's own)
        may_run_out = getattr(s, "_may_run_out", None)
        if may_run_out is not None:
            s._may_run_out = lambda *a: tight.append(may_run_out(*a)) or tight[-1]
        try:
            out = s.schedule()
        finally:
            if may_run_out is not None:
                del s._may_run_out
        sched = dict(out.num_scheduled_tokens)
        drafts = {rid: len(d) for rid, d in out.scheduled_spec_decode_tokens.items()}
        # vLLM's promise: a step runs at most max_num_batched_tokens tokens of at most max_num_seqs requests
        assert out.total_num_scheduled_tokens == sum(sched.values()) <= s.step_cap
        assert len(sched) <= s.max_num_running_reqs
        assert s.max_num_scheduled_tokens == s.step_cap  # the step's budget is restored after vLLM scheduled
        # the requests whose KV the policy released in this pass: one it restarts in the same step recomputes all
        released = set(s.kv.released) if s.coserve_policy is not None else set()
        for rid, n in sched.items():
            done, total, prompt = before[rid] if rid in before else (0, 0, 0)
            done = 0 if rid in released else done
            # vLLM's promise: a request gets 1.. the tokens it has left (its prompt's rest, or one decode token)
            # (a decode's n counts the drafts it verifies: its token and each draft)
            assert rid in before and 1 <= n <= total - done + drafts.get(rid, 0), (rid, n, before.get(rid))
            # no double counting of a prefix-cache hit: the hit and the tokens scheduled after it are at most the
            # request's tokens (its drafts aside)
            r = s.requests[rid]
            assert r.num_computed_tokens <= before[rid][1] + drafts.get(rid, 0), (rid, r.num_computed_tokens)
            # on the CPU a seeded request's prompt (and the outputs a preemption made it recompute) runs whole, never
            # a part: vLLM-CPU cannot rewind its generator (the step would fail, and every request in it)
            if getattr(s, "whole_seeded", False) and r.sampling_params.sampling_type is SamplingType.RANDOM_SEED:
                assert r.num_computed_tokens >= r.num_tokens, (rid, n, before[rid], r.num_computed_tokens)
                if n > 1 + drafts.get(rid, 0) and currently_in_test_context():
                    event("seeded prompt ran whole")
        if s.lora_config is not None:
            # vLLM's promise: a step's requests run with at most max_loras adapters
            stepped = {s.requests[rid].lora_request.lora_int_id for rid in sched if s.requests[rid].lora_request}
            assert len(stepped) <= s.lora_config.max_loras, (stepped, sched)
            # coserve's (vLLM asserts it as the next step begins): the running requests, those the policy set
            # aside for the step too, hold at most max_loras adapters; not one whose step in flight ends it: vLLM
            # schedules it no more, and counts only the adapters of the requests it schedules. One whose token is in
            # another pipeline stage's batch holds its adapter: it is scheduled again once the token is in. vLLM's
            # own scheduler (the vllm-fcfs baseline) does not keep that one's slot: it starts a prompt of another
            # adapter beside it
            held = {r.lora_request.lora_int_id for r in s.running if r.lora_request is not None
                    and not (r.request_id in ending and len(r.output_token_ids) + 1 >= r.max_tokens)}
            assert len(held) <= s.lora_config.max_loras or s.coserve_policy is None, (held, sched)
            if len(held) == s.lora_config.max_loras and currently_in_test_context() and any(
                    r.lora_request is not None and r.lora_request.lora_int_id not in held for r in s.waiting):
                event("a prompt waited for a LoRA slot")
        if self.plans:
            plan = self.plans[-1]
            chosen = {r.request_id for r in plan.decodes} | {p.request.request_id for p in plan.prefills}
            # Sarathi-Serve's token budget / QoServe's chunk C: the policy plans a step vLLM can run whole (its
            # decodes and chunks within max_num_batched_tokens), else vLLM cuts whatever the plan put last; a
            # decode's drafts are tokens of the step too (not the draft slots vLLM pads a prompt's last token with:
            # that prompt runs at most its chunk and them, checked below, and the step at most its cap, above)
            planned = len(plan.decodes) + sum(p.num_tokens for p in plan.prefills)
            decode_drafts = sum(drafts.get(r.request_id, 0) for r in plan.decodes)
            assert planned + decode_drafts <= s.step_cap, (planned, drafts, plan)
            # QoServe 3.4 / Alg. 1: vLLM runs only the policy's batch; a relegated job runs only where the policy
            # gave it spare budget (it is then in the plan's prefills), never on vLLM's own initiative
            assert set(sched) <= chosen, (set(sched) - chosen, sched)
            # a chunk vLLM runs is at most the policy's (a recompute's too: the prompt and every output), else vLLM
            # took the tokens from a chunk planned after it; the draft slots vLLM pads a prompt's last token with
            # aside, and a seeded prompt on the CPU, which runs its whole rest or waits (checked above); with the
            # prefix cache too, where the policy plans a new prompt with the hit vLLM finds (eviction shrinks one), and
            # the allocations vLLM makes before its turn in the step leave that hit cached (``keep_hits``)
            for q in plan.prefills:
                rid = q.request.request_id
                seeded = s.requests[rid].sampling_params.sampling_type is SamplingType.RANDOM_SEED
                whole = before[rid][1] - before[rid][0] if s.whole_seeded and seeded else 0
                assert sched.get(rid, 0) <= max(q.num_tokens, whole) + drafts.get(rid, 0), (
                    rid, q.num_tokens, sched, drafts)
            self.check_order(plan, before, relegated, no_slot | waiting_for_grammar)
            # where the scheduler saw room for the step's worst case, vLLM preempted none on its own (the order was
            # left as it stood); else the decodes went in the victim order
            assert any(tight) or not out.preempted_req_ids or out.preempted_req_ids <= released, (
                out.preempted_req_ids, released)
            # the started prompts the step runs, in the plan's order, and those whose chunk is less than their rest;
            # one of these planned after a new prompt waits a step (vLLM runs the running requests first)
            prompts = [q.request.request_id for q in plan.prefills if q.request.request_id in running]
            short = {q.request.request_id for q in plan.prefills if q.request.request_id in running
                     and q.num_tokens < before[q.request.request_id][1] - before[q.request.request_id][0]}
            if prompts and prompts[-1] in short and plan.prefills[-1].request.request_id == prompts[-1] and any(
                    q.request.request_id not in running for q in plan.prefills[:-1]):
                prompts.pop()
            self.check_running_order(running, {r.request_id for r in plan.decodes} | ending,
                                     victim if any(tight) else {}, prompts, short)
            # vLLM restarts no request whose output is still in flight (async scheduling: the policy preempted it
            # with its step in flight, in this pass): coserve plans no chunk of it, which vLLM would skip (the
            # step's tokens lost, or given to a chunk planned after it)
            stale = [q.request.request_id for q in plan.prefills if self.stale(q.request.request_id)]
            assert not stale, (stale, plan.prefills)
            # QoServe 3.2: every decode the policy runs gets its token (vLLM's KV preemption aside)
            for r in plan.decodes:
                assert r.request_id in sched or r.request_id in out.preempted_req_ids, (r.request_id, sched)
            # QoServe 3.2: decodes are never starved by prefill: each admitted decode runs when the KV holds one
            # more block for each of them
            if free_before >= len(decoding):
                assert decoding <= {r.request_id for r in plan.decodes}, (decoding, plan.decodes)
        policy_released = set(s.kv.released) if s.coserve_policy is not None else set()
        plan = self.plans[-1] if self.plans else None
        for what, happened in (("vLLM preempted", set(out.preempted_req_ids) - policy_released),
                               ("relegated", plan is not None and plan.relegated),
                               ("expired", plan is not None and plan.expired),
                               ("policy preempted", policy_released)):
            if happened and currently_in_test_context():
                event(what)  # what the search reached (--hypothesis-show-statistics)
        self.check_grammars(out, waiting_for_grammar)
        # the requests that sample a token in the step: past their prompt once it is scheduled
        samples = {rid for rid in sched if s.requests[rid].num_computed_tokens >= s.requests[rid].num_tokens}
        self.check_scheduled(out)
        if pipelined:
            outputs = self.pipeline(out, drafts, samples)
        else:
            self.check_bitmask(out)
            outputs = self.answer(out, drafts, samples)
        preempted = set(out.preempted_req_ids) | set(s.kv.released if s.coserve_policy is not None else ())
        self.preempted |= preempted
        self.most_preempted = max(self.most_preempted, len(preempted))
        if len(preempted) > 1 and currently_in_test_context():
            event("two or more preempted in one step" + (" with a step in flight" if pipelined else ""))
        for eco in outputs.values():
            for o in eco.outputs:
                self.streamed[o.request_id] = self.streamed.get(o.request_id, 0) + len(o.new_token_ids)
                if o.finish_reason is not None:
                    # no request is finished twice
                    assert o.request_id not in self.finished, o.request_id
                    self.finished.add(o.request_id)
                    self.ended[o.request_id] = o.finish_reason
        self.trace.append((self.clock[0], tuple(sorted(sched.items())), tuple(sorted(out.preempted_req_ids))))
        self.check_grammar_state()
        self.check_books()

    def check_scheduled(self, out) -> None:  # noqa: ANN001 - vLLM's SchedulerOutput
        """Checks of the step just scheduled against the plan it came from (with steps in flight, the step answered
        next is an older one): none here."""

    def stale(self, rid: str) -> bool:
        """Whether vLLM skips ``rid`` in its waiting queue for output still in flight (preempted with its step in
        flight: vLLM delivers that output before the request restarts)."""
        r = self.s.requests.get(rid)
        return r is not None and r.num_stale_output_tokens > 0 and not r.drop_stale_output

    def waiting_for_grammar(self) -> set:
        """The structured requests vLLM skips this step: their grammar has not compiled, or failed to (vLLM's
        ``_handle_blocked_waiting_request``; it ends those as errors)."""
        from vllm.v1.request import RequestStatus

        return {rid for rid, r in self.s.requests.items()
                if r.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
                and not isinstance(r.structured_output_request.grammar, StubGrammar)}

    def check_grammars(self, out, compiling: set) -> None:  # noqa: ANN001 - vLLM's SchedulerOutput
        """Structured output as vLLM runs it: a request whose grammar compiles waits, and the step's others run."""
        s, sched = self.s, out.num_scheduled_tokens
        plan = self.plans[-1] if self.plans else None
        for rid in compiling:
            # vLLM's promise: a request whose grammar is compiling is not scheduled, not running and holds no KV
            assert rid not in sched, (rid, sched)
            r = s.requests.get(rid)
            if r is None:  # the policy expired it
                continue
            assert r not in s.running and r.num_computed_tokens == 0, (rid, r.status, r.num_computed_tokens)
            assert not any(s.kv_cache_manager.get_block_ids(rid)), rid
            if plan is not None:
                # ... and coserve neither counts it a decode nor plans a chunk of it: vLLM would skip the chunk,
                # and the step's tokens and KV admission it took would be lost to the prompts that can run
                assert rid not in s.coserve_policy.running, rid
                assert rid not in {p.request.request_id for p in plan.prefills}, (rid, plan.prefills)
            if currently_in_test_context():
                event("a prompt waited for its grammar")
        for rid in sched:
            self.began.setdefault(rid, len(self.trace))
        if plan is not None and not sched and not any(step[0].num_scheduled_tokens for step in self.in_flight):
            # liveness: a step runs something while a prompt whose grammar compiled waits for it (not relegated),
            # unless a step is in flight (async scheduling: its requests may hold every seat until it is answered)
            waiting = s.coserve_policy.waiting
            idle = [rid for rid in self.ready if rid not in self.began and waiting.get(rid) is not None]
            assert not idle, (idle, plan)

    def pipeline(self, out, drafts: dict, samples: set) -> dict:  # noqa: ANN001 - vLLM's SchedulerOutput
        """Async scheduling or pipeline stages as vLLM's engine core runs them (``step_with_batch_queue``): the step
        just scheduled goes out, and the oldest in flight is answered once ``max_concurrent_batches`` are; a step
        with a structured request whose last token is not in yet (``pending_structured_output_tokens``) gets its
        bitmask after that answer, its drafts (the worker's, as placeholders until then) checked against the grammar
        first (``update_draft_token_ids_in_output``)."""
        from vllm.v1.outputs import DraftTokenIds

        deferred = out.pending_structured_output_tokens
        if not deferred:
            self.check_bitmask(out)
        self.in_flight.append((out, drafts, samples))
        full = len(self.in_flight) >= self.s.vllm_config.max_concurrent_batches
        outputs = self.answer(*self.in_flight.pop(0)) if full or not self.s.has_requests() else {}
        if deferred:
            ids = [rid for rid in out.scheduled_spec_decode_tokens if rid in self.s.requests]
            proposed = [self.next_tokens(rid, len(out.scheduled_spec_decode_tokens[rid])) for rid in ids]
            if ids:
                self.s.update_draft_token_ids_in_output(DraftTokenIds(ids, [list(p) for p in proposed]), out)
            for rid, tokens in zip(ids, proposed):
                self.check_drafts(rid, tokens, list(out.scheduled_spec_decode_tokens[rid]))
            self.check_bitmask(out)
            if currently_in_test_context():
                event("a structured step waited for the step in flight")
        return outputs

    def check_bitmask(self, out) -> None:  # noqa: ANN001 - vLLM's SchedulerOutput
        """vLLM's bitmask covers the scheduled structured requests past their prompt: a row for each draft and one
        for the bonus token, the grammar's where the token it samples comes after the request's thinking (a free
        row while it thinks, with a reasoning parser), and each draft past the thinking is one its grammar accepts."""
        s, spec = self.s, out.scheduled_spec_decode_tokens
        grammar = s.get_grammar_bitmask(out)
        structured = [rid for rid in out.num_scheduled_tokens if rid in s.requests  # (not ended by the answer)
                      and s.requests[rid].use_structured_output and not s.requests[rid].is_prefill_chunk]
        assert (grammar.structured_output_request_ids if grammar else []) == structured, (grammar, structured)
        row = 0
        for rid in structured:
            drafts, done = list(spec.get(rid, ())), len(s.requests[rid].output_token_ids)
            for i in range(len(drafts) + 1):
                # the token sampled at row i is output done + i: masked once the thinking ended before it (vLLM
                # frees the rows after a draft the grammar refused, padded -1: the worker drops them)
                masked = done + i > self.thinking[rid] and -1 not in drafts[:i]
                assert (grammar.grammar_bitmask[row] == (GRAMMAR_ROW if masked else -1)).all(), (
                    rid, i, done, drafts, self.thinking[rid], grammar.grammar_bitmask[row])
                if not masked and -1 not in drafts[:i] and currently_in_test_context():
                    event("a thinking request sampled unmasked")
                row += 1
            drafts = [t for t in drafts if t != -1]
            past = drafts[self.thinking_drafts(rid, len(drafts)):]
            assert s.requests[rid].structured_output_request.grammar.validate_tokens(past) == past, (rid, drafts)
            if drafts and currently_in_test_context():
                event("a structured request verified drafts")
        assert row == (len(grammar.grammar_bitmask) if grammar else 0)

    def check_grammar_state(self) -> None:
        """vLLM advances a structured request's grammar by the tokens it output after its thinking, none before."""
        for rid, r in self.s.requests.items():
            grammar = r.structured_output_request.grammar if r.use_structured_output else None
            if isinstance(grammar, StubGrammar):
                past = len(r.output_token_ids) - self.grammar_start(rid)
                assert grammar.accepted == max(0, past), (rid, grammar.accepted, r.output_token_ids)
                if rid in self.implicit and past > 0 and currently_in_test_context():
                    event("a tool call ended the thinking (its grammar took it)")

    def check_order(self, plan, before: dict, relegated: set, no_slot: set) -> None:  # noqa: ANN001 - a plan
        """Of two new prompts of free interactive jobs, waiting (not relegated), the one strictly first in the
        policy's order with no more prompt left and no larger KV footprint goes first: it is never left waiting while
        the other starts. QoServe Alg. 1 lines 10-23 with eq. 4 (a >= 0: the earlier deadline and no more work has
        the lower priority value), Sarathi-EDF by deadline alone, Sarathi-FCFS by arrival, Sarathi-SRPF by the prompt
        left. The paths out of that order are outside the pair:
        selective preemption and the continuing of started prompts run started ones, the paid guard paid ones, and
        eager relegation and overload yielding move a job to the relegated queue (excluded), and a prompt whose LoRA
        adapter finds no slot or whose grammar is compiling cannot start (``no_slot``: excluded); and what fits the
        policy's KV admission and slots for the larger fits them for the smaller."""
        from gpu_runtime.qos import QoSClass, Tier
        from gpu_runtime.scheduler.base import footprint_blocks
        from gpu_runtime.scheduler.priority import first_deadline

        p = self.s.coserve_policy

        def new(m) -> bool:  # noqa: ANN001
            return (before.get(m.request_id, (1,))[0] == 0 and not m.output_token_ids
                    and m.qos.qos_class is QoSClass.INTERACTIVE and m.qos.tier is Tier.FREE)

        def size(m) -> tuple:  # noqa: ANN001
            # the prompt left as it stood when the policy chose (a planned one advanced since), its cached prefix
            # aside: the work the policy orders by (SRPF, eq. 4's prefill term)
            left = self.prompt_left[m.request_id]
            return left, footprint_blocks(m, p._reserved_output(m), 16, p._footprint_slots)

        first = {"sarathi-fcfs": lambda m: m.arrival_time, "sarathi-srpf": lambda m: size(m)[0]}.get(
            self.policy, first_deadline)
        started = [q.request for q in plan.prefills if new(q.request) and q.request.request_id not in relegated]
        planned = {q.request.request_id for q in plan.prefills}
        waiting = [m for m in p.waiting if new(m) and m.request_id not in planned | no_slot]
        if started and waiting and currently_in_test_context():
            event("order compared")
        for b in started:
            for a in waiting:
                sa, sb = size(a), size(b)
                assert not (first(a) < first(b) and sa[0] <= sb[0] and sa[1] <= sb[1]), (
                    a.request_id, first(a), sa, "waits while", b.request_id, first(b), sb)

    def check_running_order(self, before: list, stay: set, victim: dict, prompts: list, short: set) -> None:
        """vLLM's running order: vLLM preempts from the end of ``running`` where it finds no KV the policy counted
        (their counts part), so the requests that run on are in the policy's victim order from the end (``victim``:
        each one's ``victim_key`` as the step began; empty where no allocation could fail, and the order stays), its
        first victim last; those the policy does not know first, and equals, in their order as the step began
        (``before``), then the started prompts in the plan's (``prompts``). A started prompt whose chunk is less than
        its rest (``short``) comes after them all, where vLLM gives it exactly the budget's last tokens. The prompts the
        step started come after them. Those that run on are the policy's decodes, the requests vLLM skips for their
        step in flight (``stay``) and the started prompts the plan runs; a started prompt the policy did not choose
        steps aside for the step (put back last)."""
        after = [r.request_id for r in self.s.running]
        kept = [rid for rid in before if rid in stay and rid in after]
        prompts = [rid for rid in prompts if rid in after]  # vLLM preempted none of them
        if victim:
            kept += [rid for rid in prompts if rid not in short]
            kept = [rid for rid in kept if rid not in victim] + sorted((rid for rid in kept if rid in victim),
                                                                        key=victim.get, reverse=True)
            kept += [rid for rid in prompts if rid in short]
        else:
            kept += prompts
        placed = [rid for rid in after if rid in kept]
        assert placed == kept, ("running order", before, after)
        started = [i for i, rid in enumerate(after) if rid not in before]
        assert not started or not kept or after.index(kept[-1]) < started[0], ("started before", before, after)

    def answer(self, out, drafts: dict, samples: set) -> dict:  # noqa: ANN001 - vLLM's SchedulerOutput
        """The model runner's answer: a token for each request that ``samples`` (past its prompt), after the first
        of its drafts it accepted (how many varies by step and request, deterministically)."""
        from vllm.v1.outputs import ModelRunnerOutput

        ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            accepted = (len(self.trace) + len(rid)) % (drafts.get(rid, 0) + 1)
            live = rid in samples and rid in self.s.requests  # not aborted while the step ran
            sampled.append(self.next_tokens(rid, 1 + accepted) if live else [])
        return self.s.update_from_output(out, ModelRunnerOutput(req_ids=ids, req_id_to_index={
            rid: i for i, rid in enumerate(ids)}, sampled_token_ids=sampled))

    def check_books(self) -> None:
        s = self.s
        pool = s.kv_cache_manager.block_pool
        # vLLM's promise: blocks in use never exceed the pool (one block is the null block, never handed out)
        assert 0 <= pool.get_num_free_blocks() <= pool.num_gpu_blocks - 1
        waiting = [r.request_id for r in s.waiting]
        running = [r.request_id for r in s.running]
        for rid in self.ids:
            # no request is lost or duplicated: an unfinished one sits once in vLLM's waiting or running queue
            if rid in self.finished:
                assert rid not in s.requests and rid not in waiting and rid not in running, rid
                assert rid not in s.mirrors, rid
            else:
                assert rid in s.requests, rid
                assert waiting.count(rid) + running.count(rid) == 1, (rid, waiting, running)
                if s.coserve_policy is not None:
                    p = s.coserve_policy
                    # QoServe 3.1: the policy holds each job in exactly one queue (prefill, decode, relegated)
                    where = [p.waiting.get(rid) is not None, rid in p.running, p.relegated.get(rid) is not None]
                    assert sum(where) == 1, (rid, where)

    def progress(self) -> tuple[int, int]:
        """The tokens streamed to clients and the requests ended so far: each grows while the engine is live."""
        return sum(self.streamed.values()), len(self.finished)

    def drain(self) -> None:
        """Steps until every request finished, resuming relegated ones (an operator's resume): each fits the KV
        alone, so each finishes. It stops short where STALL_STEPS steps streamed no token and ended no request (a
        request stuck); a load's length is not: with three pipeline stages a lone decode gets a token every third
        step (vLLM schedules nothing of a request whose token is in flight), and jobs admitted one at a time (KV)
        run hundreds of steps."""
        stalled = 0
        while self.s.requests and stalled < STALL_STEPS:
            before = self.progress()
            if self.s.coserve_policy is not None:
                for r in list(self.s.coserve_policy.relegated):
                    self.s.resume(r.request_id)
            self.clock[0] += 0.02
            self.step()
            stalled = 0 if self.progress() != before else stalled + 1
        # liveness: every request finished once the events stopped; all KV blocks are free again
        assert not self.s.requests, {rid: (r.status, r.num_computed_tokens, r.num_tokens)
                                     for rid, r in self.s.requests.items()}
        assert set(self.ids) == self.finished
        from vllm.v1.engine import FinishReason

        for rid, why in self.ended.items():
            # a request that ran to max_tokens streamed each token once, however often it was preempted and
            # recomputed (vLLM's recompute preemption keeps the tokens already sent; QoServe 3.4: only the KV goes)
            if why == FinishReason.LENGTH:
                assert self.streamed.get(rid, 0) == self.max_tokens[rid], (rid, self.streamed.get(rid))
        for rid in self.failed:
            # vLLM's promise: a request whose grammar failed to compile ends as an error (or the policy's expiry),
            # having run nothing
            assert self.ended.get(rid, FinishReason.ERROR) in (FinishReason.ERROR, FinishReason.ABORT), (
                rid, self.ended[rid])
            assert rid not in self.began, rid
            if self.ended.get(rid) == FinishReason.ERROR and currently_in_test_context():
                event("a grammar failed")
        pool = self.s.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1


def _drive(make_scheduler, policy: str, engine: Engine, evs: list) -> Drive:
    s = make_scheduler(policy, max_batched=engine.max_batched, blocks=engine.blocks, max_seqs=engine.max_seqs,
                       prefix_caching=engine.prefix_caching, spec_tokens=engine.spec_tokens,
                       max_loras=engine.max_loras, async_scheduling=engine.async_scheduling, stages=engine.stages)
    if engine.reasoning:
        with_reasoning_parser(s, engine.grammar_in_thinking, engine.parser_engine)
    d = Drive(s, policy)
    for ev in evs:
        d.apply(ev)
    d.drain()
    return d


@pytest.mark.parametrize("policy", POLICIES)
@PROPS
@given(engine=engines, evs=events)
def test_every_step_keeps_vllms_caps_the_policys_batch_and_the_books(make_scheduler, policy, engine, evs):
    # Alg. 1 as a whole inside vLLM: the invariants hold every step, every job finishes, the same events give the
    # same steps (determinism)
    note(f"{policy} {engine} {evs}")
    first = _drive(make_scheduler, policy, engine, evs)
    assert first.trace == _drive(make_scheduler, policy, engine, evs).trace


# a system prompt of 0-4 blocks shared by the jobs that have one, their own prompt after it (at most 240 tokens with
# the output: each fits the 16-block pool alone)
shared_jobs = st.builds(Job, st.integers(1, 136), st.integers(1, 40), jobs.map(lambda j: j.extra_args),
                        st.sampled_from([0.0, 0.5]), st.sampled_from([0, 32, 48, 64]),
                        adapters, seeds)
cached_events = st.lists(st.one_of(st.tuples(st.just("add"), shared_jobs), st.tuples(st.just("add"), shared_jobs),
                                   st.tuples(st.just("step"), st.sampled_from([0.0, 0.02, 0.2])),
                                   st.tuples(st.just("abort"), st.integers(0, 30))), min_size=1, max_size=30)


@pytest.mark.parametrize("policy", POLICIES)
@PROPS
@given(engine=st.builds(Engine, st.sampled_from([16, 24]), st.sampled_from([32, 64, 512]), st.integers(2, 8),
                        st.booleans(), st.sampled_from([0, 2, 4]), st.sampled_from([None, 1, 2]),
                        async_scheduling=st.booleans()), evs=cached_events)
def test_prefix_cache_hits_and_drafts_keep_the_step_and_the_books(make_scheduler, policy, engine, evs):
    # every step's invariants (above) with vLLM's prefix cache over shared system prompts and its draft tokens
    # verified by each decode (some accepted): the step's budget counts the drafts, a hit is not computed twice
    note(f"{policy} {engine} {evs}")
    _drive(make_scheduler, policy, engine, evs)


@pytest.mark.parametrize("policy", POLICIES)
@PROPS
@given(engine=v1_engines(st.sampled_from([16, 24]), st.sampled_from([32, 64, 512]), st.integers(2, 8),
                         st.just(False), st.sampled_from([0, 0, 4])), evs=kv_pressure())
def test_under_kv_pressure_preempted_requests_resume_and_finish_whole(make_scheduler, policy, engine, evs):
    # QoServe 3.4 / vLLM's recompute preemption: a preempted request is requeued, not lost; it resumes, streams
    # each of its tokens once and ends; every block is free again (the invariants of every step hold meanwhile)
    note(f"{policy} {engine} {evs}")
    d = _drive(make_scheduler, policy, engine, evs)
    assert d.preempted <= d.finished


@pytest.mark.parametrize("policy", POLICIES)
@PROPS
# an 8-block pool (7 and the null block) holds the longest job alone: 42 + 40 tokens, 6 blocks
@given(engine=st.builds(Engine, st.sampled_from([8, 16, 24]), st.sampled_from([128, 512]), st.integers(7, 8),
                        async_scheduling=st.sampled_from([True, True, False])), evs=mass_preemption())
def test_two_requests_preempted_in_one_pass_resume_and_finish_whole(make_scheduler, policy, engine, evs):
    # QoServe 3.4 / vLLM's recompute preemption, several at once: each preempted request (its output in flight or
    # not) is requeued once, recomputes what it had (the late outputs too), streams each token once and ends
    note(f"{policy} {engine} {evs}")
    d = _drive(make_scheduler, policy, engine, evs)
    target(float(d.most_preempted), label="preempted in one step")  # the search heads for more at once
    assert d.preempted <= d.finished


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_seven_one_block_prompts_filling_the_pool_preempt_three_or_more_in_one_pass(make_scheduler, policy,
                                                                                    async_scheduling):
    """The mass-preemption strategy's far end, pinned: seven 16-token prompts of an app that answers short, one
    block each, fill the 7-block pool; their first decodes each need a second block and each release frees one, so
    one pass preempts three or more (the search of the strategy before it reached two at most). Each resumes,
    recomputes and streams its 40 tokens once, every step's invariants holding."""
    evs = short_answers([4, 8, 12]) + [("add", Job(16, 40, LAX, 0.0))] * 7
    d = _drive(make_scheduler, policy, Engine(blocks=8, max_batched=128, max_seqs=8,
                                              async_scheduling=async_scheduling), evs)
    assert d.most_preempted >= 3, (d.most_preempted, d.trace)
    assert d.preempted <= d.finished == set(d.ids)
    assert [d.streamed[rid] for rid in d.ids[3:]] == [40] * 7, d.streamed


@pytest.mark.parametrize("policy", POLICIES)
@PROPS
@given(engine=v1_engines(st.sampled_from([24, 40]), st.sampled_from([32, 64]), st.integers(2, 8),
                         st.just(False), st.sampled_from([0, 2]), st.sampled_from([1, 2])), evs=lora_pressure())
def test_prompts_of_more_adapters_than_lora_slots_all_run_within_the_slots(make_scheduler, policy, engine, evs):
    # vLLM's LoRA slots: the running requests never hold more adapters than max_loras, the policy's plan is what
    # vLLM runs though a prompt of an adapter with no slot cannot start, and every job finishes
    note(f"{policy} {engine} {evs}")
    _drive(make_scheduler, policy, engine, evs)


def test_kv_pressure_reaches_the_policys_and_vllms_preemption(make_scheduler):
    """The pressure strategy's ground, pinned: the policy reserved a one-token answer for each long prompt (its
    app's history), so both run; their 40-token outputs outgrow the pool (2 x 8 blocks of 15), and one is preempted,
    then recomputed and finished."""
    short = [("add", Job(4, 1, LAX, 0.0)), ("step", 0.0)] * 3
    evs = short + [("add", Job(80, 40, LAX, 0.0)), ("step", 0.0), ("add", Job(80, 40, LAX, 0.0)), ("step", 0.0)]
    for policy in ("qoserve", "sarathi-edf"):
        d = _drive(make_scheduler, policy, Engine(blocks=16, max_batched=512, max_seqs=4), evs)
        assert {"q3", "q4"} & d.preempted, policy
        assert d.finished == set(d.ids) and d.streamed["q3"] == d.streamed["q4"] == 40


# found by PROPS_EXAMPLES=150: under two pipeline stages vLLM started q3 (adapter 1) on the one LoRA slot while q1
# (adapter 2) waited for its token in the other stage's batch; vLLM counts the adapters of the requests it schedules
@example(engine=Engine(blocks=16, max_batched=32, max_seqs=2, max_loras=1, stages=2),
         evs=[("add", Job(1, 1, {"ttft_ms": 50, "tbt_ms": 20, "tier": "free", "tbt_anchor": "arrival"}, 0.0)),
              ("add", Job(1, 4, {"qos_class": "batch", "deadline_s": 1, "tier": "free"}, 0.0, lora=2)),
              ("add", Job(1, 1, {"ttft_ms": 50, "tbt_ms": 20, "tier": "free", "tbt_anchor": "arrival"}, 0.0)),
              ("add", Job(1, 1, {"qos_class": "batch", "deadline_s": 1, "tier": "free"}, 0.0, lora=1))])
@PROPS
@given(engine=engines, evs=events)
def test_vllm_fcfs_schedules_as_vllms_own_scheduler(make_scheduler, engine, evs):
    # the baseline (policy vllm-fcfs) is vLLM's own v1 scheduler: the same tokens each step on the same events (the
    # one vLLM picks: its AsyncScheduler where the engine schedules asynchronously, SchedulerConfig.get_scheduler_cls)
    from vllm.v1.structured_output import StructuredOutputManager

    note(f"{engine} {evs}")
    ours = _drive(make_scheduler, "vllm-fcfs", engine, evs)
    s = make_scheduler("vllm-fcfs", max_batched=engine.max_batched, blocks=engine.blocks, max_seqs=engine.max_seqs,
                       max_loras=engine.max_loras, async_scheduling=engine.async_scheduling, stages=engine.stages)
    vllms_own = s.scheduler_config.get_scheduler_cls()
    plain = vllms_own(vllm_config=s.vllm_config, kv_cache_config=s.kv_cache_config,
                      structured_output_manager=StructuredOutputManager(s.vllm_config), block_size=16)
    plain.coserve_policy, plain.mirrors, plain.step_cap = None, {}, s.step_cap
    plain.resume = plain.promote = lambda *a: None
    theirs = Drive(plain, "vllm")
    for ev in evs:
        theirs.apply(ev)
    theirs.drain()
    assert ours.trace == theirs.trace


# structured output: a share of the jobs waits a few steps for its grammar (a regex) to compile; on an engine with
# a reasoning parser a job thinks first, its thinking ending at a drawn output token (or past its max_tokens): the
# end of thinking, or where the parser is a parser engine a tool call's start (an implicit end: content)
structured_jobs = st.builds(Job, st.integers(1, 200), st.integers(1, 40), jobs.map(lambda j: j.extra_args),
                            st.sampled_from([0.0, 0.5]), st.just(0), st.just(None), st.just(None),
                            st.sampled_from([None, 0, 1, 3, 8]), st.sampled_from([False, False, False, True]),
                            st.sampled_from([None, 0, 1, 2, 5, 12, 60]), st.booleans())
structured_events = st.lists(st.one_of(st.tuples(st.just("add"), structured_jobs),
                                       st.tuples(st.just("add"), structured_jobs),
                                       st.tuples(st.just("step"), st.sampled_from([0.0, 0.02, 0.2])),
                                       st.tuples(st.just("abort"), st.integers(0, 30))), min_size=1, max_size=30)


@pytest.mark.parametrize("policy", POLICIES)
@PROPS
@given(engine=st.builds(Engine, st.sampled_from([16, 24, 40]), st.sampled_from([32, 64, 512]), st.integers(2, 8),
                        st.booleans(), st.sampled_from([0, 2, 4]), st.just(None), st.booleans(), st.booleans(),
                        st.booleans(), parser_engine=st.booleans()),
       evs=structured_events)
def test_structured_requests_wait_for_their_grammar_while_the_step_runs_the_others(make_scheduler, policy, engine,
                                                                                   evs):
    # vLLM's structured output: a request waits (WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR) until its grammar compiled,
    # unplanned, unscheduled and with no KV, then starts; its drafts are those its grammar accepts; with a reasoning
    # parser its grammar masks and checks only what follows its thinking; every step's invariants hold meanwhile and
    # every job finishes
    note(f"{policy} {engine} {evs}")
    _drive(make_scheduler, policy, engine, evs)


# ---- coserve's speculation policy trimming vLLM's drafts (COSERVE_SPEC_POLICY) ----

STEP_S = (0.004, 0.0005)  # the fake model's step: seconds a step, and a scheduled token, on the step timer
SPEC_POLICIES = ["chain-1", "chain-2", "chain-3", "static-tree", "adaserve", "adaspec", "nightjar"]
STATIC_SHAPES = {"chain-1", "chain-2", "chain-3", "static-tree"}  # the drafts they keep are known before the plan


@dataclass
class TrimmedDrive(Drive):
    """A ``Drive`` whose scheduler runs a coserve speculation policy over vLLM's drafts (``DraftLengths.trim``).
    The drafter proposes what ``drafter`` would: n-gram and draft-model drafts of ``num_speculative_tokens`` (or
    none), suffix drafts of any length up to it. Each step also checks what a trimmed draft must keep consistent:
    the drafts kept are a prefix of the proposal, the step runs each decode's token and its kept drafts (no more, no
    fewer), vLLM's budget counts no trimmed draft, the KV allocated covers no trimmed draft, and the rejection
    sampler's bookkeeping leaves each decode one token ahead of its KV."""

    drafter: str = "ngram"
    proposed: dict = field(default_factory=dict)  # request id -> the drafts the policy chose from this step
    arranged: dict = field(default_factory=dict)  # request id -> its drafts as vLLM is shown the step (trimmed)
    budget: list = field(default_factory=list)  # vLLM's token budget of each step (max_num_scheduled_tokens)
    blocks: dict = field(default_factory=dict)  # request id -> blocks it held before the step
    # the step timer the policies learn step times from: it moves only as the fake model's steps take time
    # (``STEP_S``), so a run makes the choices every run of it makes
    device: list = field(default_factory=lambda: [0.0])
    most: int | None = None  # the most drafts a decode keeps, as the policy told the plan of the step
    choices: list = field(default_factory=list)  # each step's drafts kept, by request

    def __post_init__(self) -> None:
        super().__post_init__()
        s = self.s
        assert s.drafts is not None, s.spec_not_running  # the policy runs (synchronous scheduling)
        s.drafts.clock = lambda: self.device[0]
        keep_hits, restore, most_kept = s.kv.keep_hits, s._restore, s.drafts.policy.most_kept

        def told(decodes):  # noqa: ANN001, ANN202 - what the policy told the plan of the step
            self.most = most_kept(decodes)
            return self.most

        def arranged(prompts):  # noqa: ANN001, ANN202 - the step as _arrange shows it to vLLM, drafts trimmed
            self.arranged = {r.request_id: list(r.spec_token_ids) for r in s.running}
            return keep_hits(prompts)

        def restored(held, stashed):  # noqa: ANN001, ANN202 - vLLM scheduled under the budget _arrange set
            self.budget.append(s.max_num_scheduled_tokens)
            return restore(held, stashed)

        s.kv.keep_hits, s._restore, s.drafts.policy.most_kept = arranged, restored, told

    def draft_length(self, rid: str) -> int:
        """How many drafts the drafter proposes for ``rid`` this step: n-gram and draft-model ones all or (no match)
        none, suffix ones any length."""
        k, turn = self.s.num_spec_tokens, len(self.trace) * 7 + int(rid[1:])
        return turn % (k + 1) if self.drafter == "suffix" else (0 if turn % 5 == 0 else k)

    def propose_drafts(self) -> None:
        from vllm.v1.outputs import DraftTokenIds

        super().propose_drafts()
        s = self.s
        ids = [r.request_id for r in s.running if r.spec_token_ids]
        if ids:  # the drafter's own length (vLLM's grammar check keeps a prefix of a prefix)
            s.update_draft_token_ids(DraftTokenIds(ids, [list(s.requests[rid].spec_token_ids[:self.draft_length(rid)])
                                                         for rid in ids]))
        self.proposed = {r.request_id: list(r.spec_token_ids) for r in s.running if r.spec_token_ids}
        self.blocks = {r.request_id: len(s.kv_cache_manager.get_block_ids(r.request_id)[0]) for r in s.running}

    def check_scheduled(self, out) -> None:  # noqa: ANN001 - vLLM's SchedulerOutput
        self.check_trim(out)
        self.choices.append(tuple(sorted(self.s.drafts.kept.items())))

    def answer(self, out, drafts: dict, samples: set) -> dict:  # noqa: ANN001 - vLLM's SchedulerOutput
        self.device[0] += STEP_S[0] + STEP_S[1] * out.total_num_scheduled_tokens
        # (not one aborted while its step was in flight)
        before = {rid: len(self.s.requests[rid].output_token_ids) for rid in out.num_scheduled_tokens
                  if rid in self.s.requests}
        outputs = super().answer(out, drafts, samples)
        self.check_rejections(out, before)
        return outputs

    def check_trim(self, out) -> None:  # noqa: ANN001 - vLLM's SchedulerOutput
        s, kept = self.s, self.s.drafts.kept
        sched, spec = out.num_scheduled_tokens, out.scheduled_spec_decode_tokens
        plan = self.plans[-1] if self.plans else None
        decodes = [m.request_id for m in plan.decodes] if plan is not None else []
        for rid in decodes:
            if rid not in self.arranged:
                continue
            # the policy keeps a prefix of the drafts proposed, and vLLM is shown only those (num_tokens_with_spec)
            assert self.arranged[rid] == self.proposed.get(rid, [])[:kept.get(rid, 0)], (
                rid, self.arranged[rid], self.proposed.get(rid), kept.get(rid))
            # the chunk rule sized the step with the drafts the policy may keep (``most_kept``): the proposal cut to
            # that bound, never fewer than it kept, and for a static shape (a chain's, the static tree's depth) none
            # it trims
            counted, proposed = s.coserve_policy.decode_drafts.get(rid, 0), len(self.proposed.get(rid, []))
            assert counted == (proposed if self.most is None else min(proposed, self.most)), (
                rid, counted, proposed, self.most)
            assert counted >= len(self.arranged[rid]), (rid, s.drafts.name, counted, self.arranged[rid])
            assert counted == len(self.arranged[rid]) or s.drafts.name not in STATIC_SHAPES, (
                rid, s.drafts.name, counted, self.arranged[rid], self.proposed.get(rid))
            if rid not in sched:
                continue
            # the step runs the decode's token and each draft it kept: 1 + its kept drafts
            assert list(spec.get(rid, [])) == self.arranged[rid], (rid, spec.get(rid), self.arranged[rid])
            assert sched[rid] == 1 + len(self.arranged[rid]), (rid, sched[rid], self.arranged[rid])
            r = s.requests[rid]
            assert r.spec_token_ids == [] and r.num_tokens_with_spec == r.num_tokens, rid  # vLLM took them
            # KV: the blocks cover the decode's tokens and its kept drafts (and a drafter's lookahead), not one
            # block more for a draft the policy trimmed
            need = -(-min(r.num_computed_tokens + s.num_lookahead_tokens, s.max_model_len) // 16)
            held = len(s.kv_cache_manager.get_block_ids(rid)[0])
            assert held == max(self.blocks.get(rid, 0), need), (rid, held, self.blocks.get(rid), need)
            if currently_in_test_context() and self.proposed.get(rid):
                trimmed = len(self.proposed[rid]) > len(self.arranged[rid])
                event(f"{s.drafts.name}: " + ("kept none" if not self.arranged[rid] else "trimmed" if trimmed
                                               else "kept all"))
        if plan is not None and self.budget:
            # vLLM's budget: the decodes' tokens and kept drafts, and the chunks (what vLLM pads a new prompt's
            # last token with aside): no draft the policy trimmed is counted, so no chunk grows into it
            decode_tokens = sum(1 + len(self.arranged[rid]) for rid in decodes if rid in self.arranged)
            chunks = sum(n for rid, n in sched.items() if rid not in decodes)
            pad = s.num_spec_tokens
            assert self.budget[-1] <= decode_tokens + max(chunks, sum(p.num_tokens for p in plan.prefills)) + pad, (
                self.budget[-1], decode_tokens, chunks, plan)

    def check_rejections(self, out, before: dict) -> None:  # noqa: ANN001 - vLLM's SchedulerOutput
        """vLLM's rejection bookkeeping over the kept drafts: a decode that ran k drafts gained 1..k+1 tokens, and
        its computed tokens are its tokens less the one just sampled (the rejected drafts rolled back)."""
        s = self.s
        for rid, drafts in out.scheduled_spec_decode_tokens.items():
            r = s.requests.get(rid)
            if r is None or r.is_finished():
                continue
            gained = len(r.output_token_ids) - before[rid]
            assert 1 <= gained <= 1 + len(drafts), (rid, gained, drafts)
            assert r.num_computed_tokens == r.num_tokens - 1, (rid, r.num_computed_tokens, r.num_tokens)


def _drive_trimmed(make_scheduler, monkeypatch, spec: str, drafter: str, policy: str, engine: Engine,
                   evs: list, **spec_config) -> TrimmedDrive:
    """``spec_config``: fields of the speculation policy's config set by hand (vLLM's adapter takes the defaults)."""
    monkeypatch.setenv("COSERVE_SPEC_POLICY", spec)
    s = make_scheduler(policy, max_batched=engine.max_batched, blocks=engine.blocks, max_seqs=engine.max_seqs,
                       prefix_caching=engine.prefix_caching, spec_tokens=engine.spec_tokens, drafter=drafter,
                       max_loras=engine.max_loras, stages=engine.stages)
    if engine.reasoning:
        with_reasoning_parser(s, parser_engine=engine.parser_engine)
    d = TrimmedDrive(s, policy, drafter=drafter)
    for name, value in spec_config.items():
        setattr(s.drafts.policy.config, name, value)
    for ev in evs:
        d.apply(ev)
    d.drain()
    return d


speculating_engines = st.builds(Engine, st.sampled_from([16, 24, 40]), st.sampled_from([32, 64, 512]),
                                st.integers(2, 8), st.booleans(), st.sampled_from([1, 2, 4, 8, 12]), st.just(None),
                                st.booleans(), parser_engine=st.booleans(), stages=stages)


@pytest.mark.parametrize("policy", POLICIES)
@PROPS
@given(spec=st.sampled_from(SPEC_POLICIES), drafter=st.sampled_from(["ngram", "suffix", "draft_model"]),
       engine=speculating_engines, evs=st.one_of(structured_events, kv_pressure()))
def test_a_speculation_policys_trimmed_drafts_keep_the_step_the_kv_and_the_grammar(make_scheduler, monkeypatch,
                                                                                  policy, spec, drafter, engine, evs):
    # COSERVE_SPEC_POLICY inside vLLM: each decode verifies the prefix of vLLM's drafts its policy keeps; the step
    # runs 1 + those per decode, vLLM's budget, its KV and a structured request's grammar count no trimmed draft,
    # every step's invariants (Drive.step) hold and every job finishes
    note(f"{policy} {spec} {drafter} {engine} {evs}")
    first = _drive_trimmed(make_scheduler, monkeypatch, spec, drafter, policy, engine, evs)
    if spec not in STATIC_SHAPES:  # an adaptive policy learns from the steps' times: the same ones, the same choices
        again = _drive_trimmed(make_scheduler, monkeypatch, spec, drafter, policy, engine, evs)
        assert (first.choices, first.trace) == (again.choices, again.trace)


# ---- counterexamples the search found, pinned ----

def test_a_planned_prompt_vllm_did_not_start_keeps_no_kv_reservation(make_scheduler):
    """Sarathi's chunk (256) passes vLLM's step (32 tokens): the policy planned the urgent 32-token prompt and the
    batch job's 1-token prompt, vLLM ran the first only. The policy kept the batch job as started (its footprint
    reserved, an admission slot taken) though vLLM held no KV for it, and the next urgent prompt's footprint no
    longer fit beside that phantom reservation: nothing ran again (each job fits the cache alone, so each must end)."""
    batch = Job(1, 32, {"qos_class": "batch", "deadline_s": 1, "tier": "free"}, 0.0)
    urgent = {"ttft_ms": 50, "tbt_ms": 20, "tier": "free", "tbt_anchor": "arrival"}
    evs = [("add", batch), ("add", Job(32, 1, urgent, 0.0)), ("step", 0.0), ("add", Job(121, 40, urgent, 0.0))]
    d = _drive(make_scheduler, "sarathi-edf", Engine(blocks=16, max_batched=32, max_seqs=2), evs)
    assert d.finished == {"q0", "q1", "q2"}


def test_a_started_prompt_continues_while_the_prompt_ahead_of_it_cannot_be_admitted(make_scheduler):
    """QoServe took 32 of the lax prompt's 33 tokens, then relegated the urgent prompt (its 50 ms TTFT was lost);
    resumed, the urgent prompt heads the queue, but its footprint does not fit beside the started prompt's
    reservation. The pass stopped at it, so the started prompt never got its last token and freed nothing: both
    waited for ever. The started prompt continues instead, as vLLM runs started requests first."""
    lax = Job(33, 32, {"ttft_ms": 20_000, "tbt_ms": 20, "tier": "free", "tbt_anchor": "arrival"}, 0.0)
    urgent = Job(89, 40, {"ttft_ms": 50, "tbt_ms": 20, "tier": "free", "tbt_anchor": "arrival"}, 0.0)
    evs = [("add", lax), ("add", urgent)]
    d = _drive(make_scheduler, "qoserve", Engine(blocks=16, max_batched=32, max_seqs=2), evs)
    assert d.finished == {"q0", "q1"}


def test_a_decode_whose_next_tokens_fit_the_blocks_it_holds_runs_with_no_block_free(make_scheduler):
    """vLLM allocates a decode's draft slots ahead of its tokens: the 200-token prompt with 26 tokens to give held
    all 15 blocks of the pool at its last token. The policy counted a request's blocks from its computed tokens,
    so it saw that token needing a 16th block, none free, and planned nothing for ever (found in CI)."""
    short = {"qos_class": "batch", "deadline_s": 1, "tier": "free"}
    evs = [("add", Job(1, 1, {"ttft_ms": 50, "tbt_ms": 20, "tier": "free", "tbt_anchor": "arrival"}, 0.0)),
           ("add", Job(1, 1, short, 0.0)), ("add", Job(1, 1, short, 0.0)), ("add", Job(136, 26, short, 0.0, 64))]
    d = _drive(make_scheduler, "qoserve", Engine(blocks=16, max_batched=32, max_seqs=2, spec_tokens=2), evs)
    assert d.finished == {"q0", "q1", "q2", "q3"}


def test_a_lone_decode_whose_drafts_pass_the_pool_gets_them_cut_at_the_context(make_scheduler):
    """The 200-token prompt with 40 tokens to give fills the 240-token pool at its last token. With a context longer
    than the pool its 2 drafts needed a 16th block none could free (the policy never preempts its last decode), so
    it waited for ever; vLLM's engine refuses such a pool at start, and within the context it cuts the drafts."""
    batch = {"qos_class": "batch", "deadline_s": 1, "tier": "free"}
    evs = [("add", Job(1, 1, batch, 0.0)), ("add", Job(136, 40, batch, 0.0, 64))]
    d = _drive(make_scheduler, "qoserve", Engine(blocks=16, max_batched=32, max_seqs=2, spec_tokens=2), evs)
    assert d.s.max_model_len == 240 and d.finished == {"q0", "q1"}


@pytest.mark.parametrize("asked", [None, 1_000, 16])
def test_sarathis_token_budget_is_at_most_vllms_step(make_scheduler, monkeypatch, asked):
    """Sarathi's chunk (256 by default, or the operator's) planned 33 tokens of a prompt into vLLM's 32-token step;
    vLLM cut it: the plan and the step differed. The budget is now capped at the step (an operator's smaller one
    stays)."""
    if asked is not None:
        monkeypatch.setenv("COSERVE_SCHEDULER_CONFIG", f'{{"chunk_size": {asked}}}')
    urgent = {"ttft_ms": 50, "tbt_ms": 20, "tier": "free", "tbt_anchor": "arrival"}
    d = _drive(make_scheduler, "sarathi-edf", Engine(blocks=16, max_batched=32, max_seqs=2),
               [("add", Job(33, 1, urgent, 0.0)), ("step", 0.0)])
    assert d.s.coserve_policy.config.chunk_size == min(asked or 256, 32)
    assert d.trace[0][1] == (("q0", min(asked or 256, 32)),)


def test_qoserves_chunk_and_decodes_fit_vllms_step(make_scheduler):
    """QoServe's chunk ceiling is vLLM's 32-token step, and with a decode running the policy still planned a 32-token
    chunk: 33 tokens, of which vLLM cut the chunk's last. The decodes take their tokens of the step first."""
    batch = Job(1, 2, {"qos_class": "batch", "deadline_s": 1, "tier": "free"}, 0.0)
    urgent = Job(63, 1, {"ttft_ms": 50, "tbt_ms": 20, "tier": "free", "tbt_anchor": "arrival"}, 0.0)
    d = _drive(make_scheduler, "qoserve", Engine(blocks=16, max_batched=32, max_seqs=2),
               [("add", batch), ("add", urgent)])
    assert d.finished == {"q0", "q1"}


@pytest.mark.parametrize("policy", ["qoserve", "sarathi-edf"])
def test_the_decodes_drafts_count_against_the_step(make_scheduler, policy):
    """A decode verifying vLLM's 2 draft tokens beside a 65-token prompt in a 32-token step: the policy gave the
    prompt 31 tokens (the step less one per decode), vLLM ran the decode's 3 and cut the chunk to 29. The budget
    now leaves the drafts their tokens."""
    evs = [("add", Job(1, 8, LAX, 0.0)), ("step", 0.0), ("add", Job(1, 1, LAX, 0.0, shared=64)), ("step", 0.0)]
    d = _drive(make_scheduler, policy, Engine(blocks=16, max_batched=32, max_seqs=2, spec_tokens=2), evs)
    assert d.trace[1][1] == (("q0", 3), ("q1", 29))  # the plan, as vLLM ran it (Drive.step compares them)


@pytest.mark.parametrize("policy", ["qoserve", "sarathi-edf"])
def test_of_two_prompts_only_one_fits_the_earlier_deadline_starts(make_scheduler, policy):
    """QoServe eq. 4 / Sarathi-EDF: the KV holds one of two equal prompts (9 blocks of 15 each); the one that came
    second with the earlier deadline starts, the other waits (Drive.check_order checks every step)."""
    lax, tight = {**LAX, "app_id": None}, {**LAX, "app_id": None, "ttft_ms": 2_000}
    d = _drive(make_scheduler, policy, Engine(blocks=16, max_batched=512, max_seqs=4),
               [("add", Job(100, 40, lax, 0.0)), ("add", Job(100, 40, tight, 0.0)), ("step", 0.0)])
    assert d.trace[0][1] == (("q1", 100),)


def test_a_prompt_whose_prefix_cache_hit_was_evicted_runs_what_the_policy_planned(make_scheduler):
    """Found with the chunk check on under the prefix cache: q3 (a 48-token system prompt and 1 token) counted a
    48-token hit; the 106-token batch job's blocks evicted the hit's last block (vLLM frees a request's blocks last
    first), and the policy kept the hit it had counted (only a growing hit was looked for). It planned q3's last
    token and q7's one; vLLM found 32 cached and ran 2 tokens of q3, taking q7's (Drive.step compares the plan with
    the step)."""
    urgent = {"ttft_ms": 50, "tbt_ms": 20, "tier": "free", "tbt_anchor": "arrival"}
    batch = {"qos_class": "batch", "deadline_s": 1, "tier": "free"}
    evs = [("add", Job(1, 1, urgent, 0.0)), ("add", Job(1, 1, urgent, 0.0)), ("add", Job(1, 1, urgent, 0.0)),
           ("add", Job(1, 1, {**urgent, "ttft_ms": 2000}, 0.0, 48)), ("add", Job(9, 40, urgent, 0.0)),
           ("add", Job(1, 1, batch, 0.0, 64)), ("add", Job(106, 40, batch, 0.5)),
           ("add", Job(1, 1, {**urgent, "ttft_ms": 20_000}, 0.0))]
    d = _drive(make_scheduler, "qoserve", Engine(blocks=16, max_batched=32, max_seqs=2, prefix_caching=True), evs)
    assert d.finished == set(d.ids)


def test_a_prompt_planned_one_token_that_vllm_pads_nothing_leaves_the_step_no_room(make_scheduler):
    """With 2 draft tokens the policy planned 1 of a 2-token prompt's tokens (the step's last) beside a decode and a
    prompt: the step kept room for vLLM to pad a prompt with one token left to a whole draft step, but this one had
    two left, so vLLM padded nothing and ran both of its tokens in that room (found with the prefix cache on)."""
    evs = [('add', Job(2, 1, {'qos_class': 'batch', 'deadline_s': 1, 'tier': 'free'}, 0.0)),
           ('add', Job(15, 1, {'ttft_ms': 50, 'tbt_ms': 20, 'tier': 'free', 'tbt_anchor': 'arrival'}, 0.0)),
           ('add', Job(32, 2, {'ttft_ms': 50, 'tbt_ms': 20, 'tier': 'paid', 'tbt_anchor': 'arrival'}, 0.0))]
    _drive(make_scheduler, "qoserve", Engine(blocks=16, max_batched=32, max_seqs=3, prefix_caching=True,
                                             spec_tokens=2), evs)


def test_a_prompt_that_finds_its_prefix_cached_in_the_step_it_runs_is_padded_within_its_chunk(make_scheduler):
    """Both prompts planned whole in one step (94 + 33 of 128 tokens); vLLM cached the first one's blocks as it
    allocated them, so the second found 32 of its tokens cached and ran its last one padded with 2 draft slots (3 of
    its planned 33). The check counted those slots on top of the whole plan (127 + 2 past the 128-token step) as
    if they were a decode's drafts; they came out of the prompt's own chunk."""
    evs = [('add', Job(46, 1, {'ttft_ms': 50, 'tbt_ms': 20, 'tier': 'free', 'tbt_anchor': 'arrival'}, 0.0, 48)),
           ('add', Job(1, 1, {'ttft_ms': 50, 'tbt_ms': 20, 'tier': 'free', 'tbt_anchor': 'arrival'}, 0.0, 32))]
    _drive(make_scheduler, "sarathi-edf", Engine(blocks=16, max_batched=128, max_seqs=2, prefix_caching=True,
                                                 spec_tokens=2), evs)


@pytest.mark.parametrize("policy", ["qoserve", "sarathi-edf"])
def test_a_prompt_whose_adapter_finds_no_lora_slot_waits_while_a_later_one_without_an_adapter_starts(
        make_scheduler, policy):
    """Found once the search drew LoRA jobs: one slot, held by q0's adapter while it decodes; q1 (another adapter,
    the earlier deadline) cannot start, so q2 (no adapter) starts beside q0 and q1 runs once q0 freed the slot.
    vLLM would skip q1 whatever the policy planned; the order check leaves such a prompt out of its pairs."""
    evs = [("add", Job(1, 2, LAX, 0.0, lora=2)), ("add", Job(1, 1, LAX, 0.0, lora=1)), ("step", 0.02),
           ("add", Job(1, 1, LAX, 0.0))]
    d = _drive(make_scheduler, policy, Engine(blocks=24, max_batched=32, max_seqs=2, max_loras=1), evs)
    assert [step[1] for step in d.trace] == [(("q0", 1),), (("q0", 1), ("q2", 1)), (("q1", 1),)]


def test_a_prompts_cached_prefix_outlives_the_allocations_before_its_turn(make_scheduler):
    """Not reached by the search (PROPS_EXAMPLES=150 passed without the fix), so pinned here: q3's 32-token hit (the
    system prompt q0 ran) holds the oldest free blocks after q1 ran and freed its own. FCFS plans q3 (1 token) after
    q2's 40-token prompt; vLLM allocated q2's three blocks first, from the free queue's head, which evicted the hit's
    second block: vLLM found 16 cached and ran 17 tokens of q3, taking 16 of q4's (Drive.step compares the plan with
    the step)."""
    evs = [("add", Job(1, 1, LAX, 0.0, 47)), ("step", 0.0), ("add", Job(190, 1, LAX, 0.0)), ("step", 0.0),
           ("add", Job(40, 1, LAX, 2.0)), ("add", Job(1, 1, LAX, 1.0, 32)), ("add", Job(40, 1, LAX, 0.0)),
           ("step", 0.0)]
    d = _drive(make_scheduler, "sarathi-fcfs", Engine(blocks=16, max_batched=256, max_seqs=4, prefix_caching=True),
               evs)
    assert d.trace[2][1] == (("q2", 40), ("q3", 1), ("q4", 40))


def test_srpf_starts_the_prompt_whose_cached_prefix_leaves_it_the_least_to_compute(make_scheduler):
    """Sarathi-SRPF orders prompts by the prompt left less the prefix-cache hit the adapter told it: q2's 64-token
    system prompt is cached (q0 ran it), so 10 of its 74 tokens are left against q1's 30, and q2 takes the one seat
    q0 leaves. The order check compared the prompts whole (74 against 30) and called that an inversion (vLLM counts a
    hit computed only once it schedules the prompt): it compares the prompt left the policy planned with now."""
    evs = [("add", Job(1, 40, LAX, 0.0, 64)), ("step", 0.0), ("step", 0.0),
           ("add", Job(30, 1, LAX, 0.0)), ("add", Job(10, 1, LAX, 0.0, 64)), ("step", 0.0)]
    d = _drive(make_scheduler, "sarathi-srpf", Engine(blocks=24, max_batched=128, max_seqs=2, prefix_caching=True),
               evs)
    assert d.trace[2][1] == (("q0", 1), ("q2", 10))


def test_a_decode_the_policy_preempts_and_restarts_in_one_pass_recomputes_all_its_tokens(make_scheduler):
    """Found by PROPS_EXAMPLES=150 (the mass preemption): five decodes fill the pool and four of them need a block
    more; SRPF released q3 and q4 and, in the same pass, restarted q3 (the shortest prompt left: its 48 tokens) in
    the blocks freed beyond what the decodes need. The step check measured q3's tokens left from before the
    release (1 of 48) and called the recompute too long; a request the policy released in the pass has all left."""
    evs = [("add", Job(1, 1, LAX, 0.0)), ("step", 0.0)] * 3 + [
        ("add", Job(prompt, 30, LAX, 0.0)) for prompt in (33, 34, 34, 35, 35)]
    d = _drive(make_scheduler, "sarathi-srpf", Engine(blocks=16, max_batched=128, max_seqs=7), evs)
    assert any(("q3", 48) in step[1] for step in d.trace) and {"q3", "q4"} <= d.preempted


def test_a_later_prompts_chunk_does_not_grow_into_a_compiling_prompts_tokens(make_scheduler):
    """Found once the search drew structured jobs: Sarathi's 256-token budget planned q0 (119 tokens, its grammar
    compiling) and 137 of q1's 138; vLLM skipped q0 and gave q1 the tokens q0 left, 138: more than the policy's
    chunk (Drive.step compares the plan with the step). q0 is set aside while its grammar compiles now."""
    batch = {"qos_class": "batch", "deadline_s": 1, "tier": "free"}
    evs = [("add", Job(119, 1, batch, 0.0, grammar=1)), ("add", Job(138, 1, batch, 0.0))]
    d = _drive(make_scheduler, "sarathi-edf", Engine(blocks=24, max_batched=512, max_seqs=2), evs)
    assert d.trace[0][1] == (("q1", 138),) and d.began["q0"] == 1 and d.ready["q0"] == 1


@pytest.mark.parametrize("policy", ["qoserve", "sarathi-edf"])
def test_a_decode_whose_step_in_flight_ends_it_takes_no_tokens_of_the_next_step(make_scheduler, policy):
    """Found once the search drew async scheduling: q0's one token was in flight when the next step was scheduled,
    and vLLM schedules no further step of a request its step in flight ends (max_tokens). The policy planned it as
    a decode and the step's budget counted its token, which vLLM gave the 48-token prompt's chunk instead: 17
    tokens where the policy planned 16 (Drive.step compares the plan with the step)."""
    urgent = {"ttft_ms": 50, "tbt_ms": 20, "tier": "free", "tbt_anchor": "arrival"}
    evs = [("add", Job(1, 1, urgent, 0.0)), ("add", Job(48, 1, urgent, 0.0))]
    d = _drive(make_scheduler, policy, Engine(blocks=16, max_batched=32, max_seqs=2, async_scheduling=True), evs)
    assert d.finished == {"q0", "q1"}


def test_a_started_prompt_relegated_behind_a_job_it_blocks_runs_on(make_scheduler):
    """Found once the search drew thinking and async engines (sync here): QoServe relegated q3, a started prompt one
    token from its end holding 10 of the 15 blocks, behind q2 (paid, so first in the relegated queue), whose
    footprint did not fit beside q3's. The spare budget stopped at q2, and q4 could not be admitted either: nothing
    ran again (without an operator's resume, never). The started prompts behind the relegated head continue, as
    they do behind a waiting prompt that cannot be admitted (Drive.step's liveness check)."""
    urgent = {"ttft_ms": 50, "tbt_ms": 20, "tier": "free", "tbt_anchor": "arrival"}
    evs = [("add", Job(1, 1, urgent, 0.0)), ("add", Job(39, 7, urgent, 0.0)),
           ("add", Job(42, 40, {**urgent, "tier": "paid"}, 0.0, grammar=8)),
           ("add", Job(121, 25, {**urgent, "ttft_ms": 500, "tbt_ms": 100}, 0.0, grammar=1)),
           ("add", Job(42, 40, {"qos_class": "batch", "deadline_s": 30, "tier": "paid"}, 0.0, grammar=1))]
    d = _drive(make_scheduler, "qoserve", Engine(blocks=16, max_batched=32, max_seqs=2), evs)
    assert d.finished == set(d.ids)


@pytest.mark.parametrize("policy", ["qoserve", "sarathi-edf"])
def test_the_static_trees_decodes_count_no_draft_past_its_depth_against_the_step(make_scheduler, monkeypatch, policy):
    """Found once the search drew coserve's speculation policies: under static-tree a decode verifies at most the
    tree's depth (8) of vLLM's 12 drafts, but the plan counted all 12 against the 32-token step: the prompt beside it
    got 19 tokens where 23 fit (with suffix decoding's 32 drafts a step of 16 decodes ran no prompt at all). The
    step now counts the drafts the tree keeps (TrimmedDrive checks every step)."""
    evs = [("add", Job(1, 8, LAX, 0.0)), ("step", 0.0), ("add", Job(1, 1, LAX, 0.0, shared=64)), ("step", 0.0)]
    d = _drive_trimmed(make_scheduler, monkeypatch, "static-tree", "ngram", policy,
                       Engine(blocks=16, max_batched=32, max_seqs=2, spec_tokens=12), evs)
    assert d.trace[1][1] == (("q0", 9), ("q1", 23))


# a decode with vLLM's 12 drafts (its first step that has some) beside a 65-token prompt in a 32-token step
ADAPTIVE_STEP = [("add", Job(1, 8, LAX, 0.0)), ("step", 0.0), ("add", Job(1, 1, LAX, 0.0, shared=64)), ("step", 0.0)]


@pytest.mark.parametrize("policy", ["qoserve", "sarathi-edf"])
@pytest.mark.parametrize(("spec", "kept"), [("nightjar", 0), ("adaspec", 1), ("adaserve", 3)])
def test_an_adaptive_policys_decodes_count_no_draft_past_what_it_can_keep_against_the_step(
        make_scheduler, monkeypatch, policy, spec, kept):
    """The adaptive policies choose their lengths after the plan, and the plan counted every draft vLLM proposed (12)
    against the 32-token step: the prompt beside the decode got 19 tokens where more fit. Known before the plan:
    Nightjar's bandit plays gamma 0 first in a bucket with no reward (its longest playable arm), AdaSpec's first
    warm-up step drafts 1 token, and AdaServe with B fixed at 4 verifies at most B less the decode's root."""
    d = _drive_trimmed(make_scheduler, monkeypatch, spec, "ngram", policy,
                       Engine(blocks=16, max_batched=32, max_seqs=2, spec_tokens=12), ADAPTIVE_STEP,
                       **({"budget": 4} if spec == "adaserve" else {}))
    assert d.trace[1][1] == (("q0", 1 + kept), ("q1", 31 - kept))


@pytest.mark.parametrize("spec", ["adaspec", "nightjar"])
def test_an_adaptive_policy_chooses_the_same_drafts_however_fast_the_machine_runs(make_scheduler, monkeypatch, spec):
    """The adaptive policies learn from each step's time, which the vLLM adapter read from time.perf_counter: the
    same events on a machine whose other processes took the core now and then made other choices (AdaSpec's and
    Nightjar's differed here), so a failing example of the search did not replay. The step's
    time now comes from the adapter's clock, which the drive moves with the fake model's steps alone (the search
    runs each adaptive example twice and compares, AdaServe's too)."""
    evs = [("add", Job(8, 40, LAX, 0.0)), ("add", Job(24, 40, LAX, 0.0)), ("add", Job(3, 40, LAX, 0.0)),
           *[("step", 0.02)] * 30]
    runs = []
    for pace in (0.0, 1.0):  # how unevenly the machine runs the Python between two reads of the wall clock
        wall, jitter = [0.0], random.Random(7)

        def read(wall=wall, jitter=jitter, pace=pace) -> float:  # noqa: ANN001
            wall[0] += 1e-5 + pace * jitter.expovariate(100.0)  # another process takes the core now and then
            return wall[0]

        monkeypatch.setattr("time.perf_counter", read)
        d = _drive_trimmed(make_scheduler, monkeypatch, spec, "suffix", "qoserve",
                           Engine(blocks=40, max_batched=64, max_seqs=4, spec_tokens=8), evs)
        runs.append((d.choices, d.trace))
    assert runs[0] == runs[1]


def test_the_decodes_a_step_in_flight_ends_leave_the_live_decode_its_kv(make_scheduler):
    """Found once the KV-pressure search drew async scheduling: q5 and q7 each had their last token in flight (vLLM
    schedules neither again) and q6 decoded on, its next token within the blocks it held, one block free. The policy
    still counted q5's and q7's next tokens: the free block held neither, so it preempted q6, the one decode that
    ran on, to make room for two that never run again, and planned its recompute in the same step (Drive.step: every
    decode the policy holds runs while the KV holds a block for each)."""
    urgent = {**LAX, "ttft_ms": 500, "tbt_ms": 100}
    evs = [("add", Job(1, 1, LAX, 0.0)), ("step", 0.0)] * 3 + [
        ("add", Job(40, 20, LAX, 0.0)), ("add", Job(40, 20, LAX, 0.0)), ("add", Job(121, 24, urgent, 0.0)),
        ("add", Job(65, 25, urgent, 0.0)), ("step", 0.02), ("add", Job(92, 21, urgent, 0.0))]
    d = _drive(make_scheduler, "sarathi-edf", Engine(blocks=24, max_batched=32, max_seqs=3, async_scheduling=True),
               evs)
    assert not d.preempted and d.finished == set(d.ids)


def test_a_decode_preempted_with_its_step_in_flight_recomputes_the_token_that_step_brings(make_scheduler):
    """Found once the KV-pressure search drew async scheduling: the policy preempted q3 (57 of its tokens computed,
    the 58th in flight) to make room for the other decodes. vLLM delivers the token in flight after the preemption,
    and recomputes it with the prompt and the other outputs: 59 tokens. The mirror counted the outputs at the
    preemption only, so the policy planned 26 of the 27 left and vLLM ran 27, taking one of q4's (Drive.step
    compares the plan with the step)."""
    urgent = {**LAX, "ttft_ms": 500, "tbt_ms": 100}
    evs = [("add", Job(1, 1, LAX, 0.0)), ("step", 0.0)] * 3 + [("add", Job(40, 20, LAX, 0.0))] * 3 + [
        ("add", Job(58, 24, urgent, 0.0)), ("step", 0.02), ("add", Job(60, 22, urgent, 0.0))]
    d = _drive(make_scheduler, "sarathi-edf", Engine(blocks=16, max_batched=32, max_seqs=3, async_scheduling=True),
               evs)
    assert "q3" in d.preempted and d.finished == set(d.ids) and d.streamed["q3"] == 20


def test_a_request_whose_step_in_flight_ends_it_holds_no_lora_slot_of_the_next_step(make_scheduler):
    """Found once the vllm-fcfs comparison drew async scheduling (the check was wrong, not coserve): one LoRA slot,
    q0's one token in flight; vLLM schedules q0 no more, counts the adapters of the requests it schedules only, and
    starts q1 with the other adapter while q0 is still running. Drive.step's LoRA check now leaves q0 out."""
    batch = {"qos_class": "batch", "deadline_s": 1, "tier": "free"}
    evs = [("add", Job(1, 1, batch, 0.0, lora=1)), ("add", Job(1, 1, batch, 0.0, lora=2))]
    d = _drive(make_scheduler, "vllm-fcfs", Engine(blocks=16, max_batched=32, max_seqs=2, max_loras=1,
                                                   async_scheduling=True), evs)
    assert [step[1] for step in d.trace[:2]] == [(("q0", 1),), (("q1", 1),)]


def test_a_decode_preempted_with_its_step_in_flight_is_not_planned_in_the_same_step(make_scheduler):
    """Found by searching the KV-pressure events under async scheduling for the state (not a failing check): q4's
    144-token prompt ran, its first token in flight; the next pass the policy preempted it (KV for the decodes) and
    planned its whole recompute in the same pass, which its released blocks held again. vLLM restarts no request
    whose output is in flight (``num_stale_output_tokens``): it skipped the chunk, and the step lost it (the tokens
    would have gone to a chunk planned after it). The policy now leaves it for the next step (Drive.step: no chunk
    of a request with output in flight is planned); it recomputes then, the token in flight delivered (145)."""
    evs = [("add", Job(1, 1, LAX, 0.0)), ("step", 0.0)] * 3 + [("add", Job(40, 20, LAX, 0.0)), ("step", 0.02),
           ("add", Job(144, 20, LAX, 0.0)), ("add", Job(160, 20, LAX, 0.0))]
    d = _drive(make_scheduler, "qoserve", Engine(blocks=24, max_batched=512, max_seqs=3, async_scheduling=True), evs)
    assert "q4" in d.preempted and d.finished == set(d.ids) and d.streamed["q4"] == 20


@pytest.mark.parametrize("policy", ["qoserve", "sarathi-edf"])
def test_a_prompt_takes_the_lora_slot_of_a_request_whose_step_in_flight_ends_it(make_scheduler, policy):
    """As vLLM counts it (the test above): q0's last token is in flight, so it holds no LoRA slot of the next step,
    and q1 with the other adapter starts then. The adapter counted q0's adapter among the slots held and set q1 aside
    for a step more."""
    batch = {"qos_class": "batch", "deadline_s": 1, "tier": "free"}
    evs = [("add", Job(1, 1, batch, 0.0, lora=1)), ("add", Job(1, 1, batch, 0.0, lora=2))]
    d = _drive(make_scheduler, policy, Engine(blocks=16, max_batched=32, max_seqs=2, max_loras=1,
                                              async_scheduling=True), evs)
    assert [step[1] for step in d.trace[:2]] == [(("q0", 1),), (("q1", 1),)]


@pytest.mark.parametrize("policy", POLICIES)
def test_a_decode_whose_token_is_in_flight_in_another_pipeline_stage_is_not_planned(make_scheduler, policy):
    """Found once the search drew pipeline parallelism (two batches in flight, synchronous scheduling, as
    ``--pipeline-parallel-size 2`` runs): q0's prompt ran and its first token was still in flight when the next batch
    was scheduled; vLLM schedules nothing of a request whose tokens are all computed. The policy planned q0 as a
    decode (only async scheduling's steps in flight were looked at), which vLLM skipped: the step lost its token
    (q1 got 31 of the 32, QoServe's plan 16) and the policy counted a decode that did not run (Drive.step: every
    decode planned runs). q1 now gets the whole step."""
    urgent = {"ttft_ms": 50, "tbt_ms": 20, "tier": "free", "tbt_anchor": "arrival"}
    evs = [("add", Job(1, 2, urgent, 0.0)), ("step", 0.0), ("add", Job(48, 1, urgent, 0.0))]
    d = _drive(make_scheduler, policy, Engine(blocks=16, max_batched=32, max_seqs=2, stages=2), evs)
    assert d.trace[1][1] == (("q1", 32),) and d.finished == {"q0", "q1"}


@pytest.mark.parametrize("policy", ["qoserve", "sarathi-srpf"])
def test_a_request_whose_token_is_in_another_pipeline_stage_keeps_its_lora_slot(make_scheduler, policy):
    """Found once the LoRA strategy drew pipeline stages: one LoRA slot, q0 (adapter 2) decoding, its token in the
    other stage's batch. The adapter counted no slot for q0 (as for a request whose step in flight ends it) and
    started q1's prompt with adapter 1 (Drive.step's LoRA check: two adapters held); once q0's token was in, q0's
    decode and q1's last chunk were planned together, and vLLM's scheduler failed its own assertion
    (``len(scheduled_loras) <= max_loras``), the engine with it. q1 now starts once q0 has ended."""
    evs = [("add", Job(1, 3, LAX, 0.0, lora=2)), ("step", 0.02), ("add", Job(33, 1, LAX, 0.0, lora=1))]
    d = _drive(make_scheduler, policy, Engine(blocks=24, max_batched=32, max_seqs=2, max_loras=1, stages=2), evs)
    began = {rid: next(i for i, step in enumerate(d.trace) if rid in dict(step[1])) for rid in ("q0", "q1")}
    last = max(i for i, step in enumerate(d.trace) if "q0" in dict(step[1]))
    assert began["q1"] > last and d.finished == {"q0", "q1"}


@pytest.mark.parametrize("policy", POLICIES)
def test_a_decode_whose_token_is_in_another_pipeline_stage_keeps_its_seat(make_scheduler, policy):
    """Found once the speculation strategy drew pipeline stages: two seats (max_num_seqs), q0's first token in the
    other stage's batch, q1's prompt half done. The policy set q0 aside for the step and gave its seat to q2's
    prompt, which vLLM started (it saw q1 stepped aside); once q0's token was in, three requests ran and vLLM's
    scheduler failed its own assertion (``len(self.running) <= self.max_num_running_reqs``). q0 keeps its seat now
    (``set_aside``'s ``holding``): q1 finishes its prompt and q2 waits for a seat."""
    evs = [("add", Job(1, 2, LAX, 0.0)), ("add", Job(63, 1, LAX, 0.0)), ("add", Job(1, 1, LAX, 0.0))]
    d = _drive(make_scheduler, policy, Engine(blocks=16, max_batched=32, max_seqs=2, stages=2), evs)
    assert "q2" not in dict(d.trace[1][1]) and d.finished == {"q0", "q1", "q2"}


def test_a_request_whose_last_token_is_in_flight_keeps_its_seat_until_it_is_in(make_scheduler):
    """Found by a longer search of the main property test (three stages): q0's last token is in flight, q2's
    prompt (paid) runs in chunks, stepped aside for a step. The policy gave q0's seat to q1's prompt, which vLLM
    started (it saw one running request); with three batches in flight q0's token was still out at the next step,
    and vLLM's scheduler failed its own assertion (``len(self.running) <= self.max_num_running_reqs``). q0 keeps
    its seat until its token is in."""
    urgent = {"ttft_ms": 50, "tbt_ms": 20, "tier": "free", "tbt_anchor": "arrival"}
    evs = [("add", Job(1, 1, urgent, 0.0)), ("add", Job(1, 24, urgent, 0.0)),
           ("add", Job(122, 1, {**urgent, "tier": "paid"}, 0.0))]
    d = _drive(make_scheduler, "qoserve", Engine(blocks=16, max_batched=32, max_seqs=2, stages=3), evs)
    assert d.trace[2][1] == (("q2", 32),) and d.finished == {"q0", "q1", "q2"}


def test_requests_that_run_one_at_a_time_under_three_pipeline_stages_all_finish(make_scheduler):
    """Found by a longer search of the main property test (three stages, two seats, a 15-block pool): each prompt
    reserves 8 blocks for its prompt and max_tokens (QoServe's KV admission), so they run one at a time, and a lone
    decode gets a token every third step: vLLM's synchronous scheduler schedules nothing of a request whose token is
    in another stage's batch (``num_new_tokens == 0``, "PP>1 ... not finished yet"), and its engine core queues the
    empty steps too (``step_with_batch_queue``). Every request was live, but the drain gave up after a fixed 400
    steps with the last one's tokens still coming; it drains while a token comes or a request ends."""
    evs = [("add", Job(87, 40, LAX, 0.0)) for _ in range(4)]
    d = _drive(make_scheduler, "qoserve", Engine(blocks=16, max_batched=32, max_seqs=2, stages=3), evs)
    steps = [i for i, (_, sched, _) in enumerate(d.trace) if "q3" in dict(sched)]
    assert {b - a for a, b in zip(steps[-39:], steps[-38:])} == {3}  # its decodes, one in each stage's turn
    assert d.finished == set(d.ids) and all(d.streamed[rid] == 40 for rid in d.ids)


@pytest.mark.parametrize("policy", POLICIES)
def test_drafts_taken_while_the_token_is_in_another_pipeline_stage_run_after_it(make_scheduler, monkeypatch,
                                                                               policy):
    """Found once the speculation strategy drew pipeline stages: vLLM's engine core hands the scheduler the drafts
    of the batch it just ran (``post_step``) while that batch's tokens are still in flight. q0's prompt ran, its first
    token in flight, its draft in: the adapter planned q0 as a decode with its draft, and vLLM ran the draft alone
    in the place of the token it did not have (1 token scheduled, not 1 + 1: vLLM issue 52071). q0 now waits for
    its token and verifies the draft after it in the next step."""
    from vllm.v1.outputs import DraftTokenIds

    monkeypatch.setenv("COSERVE_SPEC_POLICY", "chain-1")
    s = make_scheduler(policy, max_batched=32, blocks=16, max_seqs=2, spec_tokens=1, stages=2)
    d = Drive(s, policy)
    d.apply(("add", Job(1, 3, LAX, 0.0)))
    first = s.schedule()
    s.update_draft_token_ids(DraftTokenIds(["q0"], [[7]]))  # post_step: the draft after q0's token in flight
    assert "q0" not in s.schedule().num_scheduled_tokens
    assert s.requests["q0"].spec_token_ids == [7]  # kept for the step after its token
    d.answer(first, {}, {"q0"})
    third = s.schedule()
    assert third.num_scheduled_tokens["q0"] == 2 and third.scheduled_spec_decode_tokens["q0"] == [7]


@pytest.mark.parametrize("policy", POLICIES)
def test_a_request_vllm_skips_for_its_step_in_flight_keeps_its_place_in_running(make_scheduler, policy):
    """q0's one token is in flight (async scheduling), so vLLM schedules it no more, while q1 decodes and q2's prompt
    starts. The adapter moved q0 behind the decodes (and, as 7146b5b shadowed ``_arrange``'s ``ending``, behind the
    prompt the step started): vLLM preempts from the end of ``running``, so a request moved back is preempted
    before those that started after it (Drive.check_running_order checks every step)."""
    urgent = {"ttft_ms": 50, "tbt_ms": 20, "tier": "free", "tbt_anchor": "arrival"}
    evs = [("add", Job(1, 1, urgent, 0.0)), ("add", Job(1, 5, urgent, 0.0)), ("step", 0.0),
           ("add", Job(8, 1, urgent, 0.0)), ("step", 0.0)]
    d = _drive(make_scheduler, policy, Engine(blocks=16, max_batched=32, max_seqs=4, async_scheduling=True), evs)
    assert d.trace[1][1] == (("q1", 1), ("q2", 8)) and d.finished == {"q0", "q1", "q2"}


@pytest.mark.parametrize("spec_tokens", [0, 2])
def test_a_tool_call_that_ends_the_thinking_is_the_grammars_first_token(make_scheduler, spec_tokens):
    """A parser engine's reasoning adapter (vLLM's ParserEngineReasoningAdapter) ends the thinking implicitly at a
    tool call's start, which is content: vLLM's grammar takes that token itself (ConstraintBounds(end.offset,
    end.offset + 1)) and checks the drafts from it on, not from the token after it as for the end of thinking.
    q0 thinks for 3 tokens, then calls a tool (Drive.check_grammar_state, check_drafts and check_bitmask)."""
    evs = [("add", Job(4, 12, LAX, 0.0, grammar=0, think=3, tool_call=True)), ("step", 0.0)]
    d = _drive(make_scheduler, "qoserve", Engine(blocks=16, max_batched=32, max_seqs=2, spec_tokens=spec_tokens,
                                                 reasoning=True, parser_engine=True), evs)
    assert d.implicit == {"q0"} and d.finished == {"q0"} and d.streamed["q0"] == 12
