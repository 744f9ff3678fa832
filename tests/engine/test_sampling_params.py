"""Sampling parameters through the whole Engine: stop strings (with the Detokenizer), seeds, top_p."""

from __future__ import annotations

import pytest

from gpu_runtime.detokenizer import Detokenizer
from gpu_runtime.engine import Engine
from gpu_runtime.executor.torch import TorchExecutor
from gpu_runtime.request import Request, RequestStatus
from tests.engine.conftest import hf_greedy, make_request, run_engine
from tests.engine.fcfs import FCFSTestScheduler
from tests.engine.spec_helpers import NoisyTreeDrafter, VerifyAll

PROMPT = [5, 17, 33, 8, 61, 12]


class CharTokenizer:
    """Token id i -> a two-character piece: multi-character tokens, so a stop string can end or
    start inside a token (the Detokenizer must cut the text, not the token list)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i % 26) + chr(ord("A") + i // 26) for i in ids)


def _run_with_text(ex: TorchExecutor, requests: list[Request], tokenizer) -> dict[str, tuple[str, RequestStatus]]:
    engine = Engine(ex, FCFSTestScheduler(ex, chunk=16), detokenizer=Detokenizer(tokenizer))
    for r in requests:
        engine.add_request(r)
    text = {r.request_id: "" for r in requests}
    status: dict[str, RequestStatus] = {}
    for out in engine.run_until_idle(max_steps=1000):
        text[out.request_id] += out.new_text
        if out.finished:
            status[out.request_id] = out.status
    return {rid: (text[rid], status[rid]) for rid in text}


def test_stop_string_cuts_text_and_finishes_stopped(tiny_model):
    tok = CharTokenizer()
    full_ids = hf_greedy(tiny_model, PROMPT, 12)
    full = tok.decode(full_ids)
    stop = full[9:12]  # starts inside token 4 and ends inside token 5: not a token boundary
    cut = full[: full.find(stop)]
    ex = TorchExecutor.from_model(tiny_model, kv_blocks=32, block_size=4)
    stopped = make_request(PROMPT, max_tokens=12, stop=(stop,))
    plain = make_request(PROMPT, max_tokens=12)
    out = _run_with_text(ex, [stopped, plain], tok)
    assert out[stopped.request_id] == (cut, RequestStatus.FINISHED_STOPPED)
    assert stopped.num_output_tokens < 12  # generation ended at the stop string, not at max_tokens
    assert out[plain.request_id] == (full, RequestStatus.FINISHED_LENGTH)
    assert ex.capacity().free_blocks == 32


def test_include_stop_str_in_output_keeps_the_stop_string(tiny_model):
    # vLLM's include_stop_str_in_output: the text ends after the stop string, which may end inside a token
    tok = CharTokenizer()
    full = tok.decode(hf_greedy(tiny_model, PROMPT, 12))
    stop = full[9:12]
    ex = TorchExecutor.from_model(tiny_model, kv_blocks=32, block_size=4)
    kept = make_request(PROMPT, max_tokens=12, stop=(stop,), include_stop_str_in_output=True)
    assert _run_with_text(ex, [kept], tok)[kept.request_id] == (full[: full.find(stop) + len(stop)],
                                                               RequestStatus.FINISHED_STOPPED)


def test_stop_string_with_speculation_cuts_inside_accepted_tokens(tiny_model):
    """A tree step commits several tokens at once; the stop string may sit in the middle of them."""
    tok = CharTokenizer()
    full_ids = hf_greedy(tiny_model, PROMPT, 16)
    full = tok.decode(full_ids)
    stop = full[14:17]
    drafter = NoisyTreeDrafter({len(PROMPT): full_ids}, vocab=97, hit=0.9, seed=3)
    ex = TorchExecutor.from_model(tiny_model, kv_blocks=32, block_size=4, drafter=drafter)
    req = make_request(PROMPT, max_tokens=16, stop=(stop,))
    engine = Engine(ex, FCFSTestScheduler(ex, chunk=16), VerifyAll(depth=4, width=2), Detokenizer(tok))
    engine.add_request(req)
    outs = engine.run_until_idle(max_steps=100)
    assert "".join(o.new_text for o in outs) == full[: full.find(stop)]
    assert req.status is RequestStatus.FINISHED_STOPPED
    assert ex.capacity().free_blocks == 32
    # the output ends at the token that completed the stop string, as it does one token a step: tokens accepted
    # after it in the same step are not output (nor counted, nor streamed)
    ends = next(k for k in range(1, 17) if stop in tok.decode(full_ids[:k]))
    assert req.output_token_ids == full_ids[:ends] == [t for o in outs for t in o.new_token_ids]
    assert len(req.token_times) == ends


def test_a_seed_samples_the_same_text_under_any_speculation(tiny_model):
    """Every output token takes the next uniform of the request's generator, however many tokens a step verifies:
    a seeded request samples the same tokens with speculation off and under any tree shape (the worker's rerun of a
    seeded job after a crash relies on it, whatever the adaptive policies choose)."""
    def sample(speculation, drafts: list[int]) -> list[int]:
        drafter = NoisyTreeDrafter({len(PROMPT): drafts}, vocab=97, hit=0.8, seed=5) if speculation else None
        ex = TorchExecutor.from_model(tiny_model, kv_blocks=32, block_size=4, drafter=drafter)
        req = make_request(PROMPT, max_tokens=24, temperature=1.0, seed=7)
        return run_engine(ex, [req], speculation=speculation)[req.request_id]

    plain = sample(None, [])
    for shape in (VerifyAll(depth=1, width=1), VerifyAll(depth=3, width=1), VerifyAll(depth=2, width=3)):
        assert sample(shape, plain) == plain, shape


@pytest.mark.parametrize("speculate", [False, True])
def test_same_seed_same_output_different_seed_different(tiny_model, speculate):
    def sample(seed: int) -> list[int]:
        drafter = NoisyTreeDrafter({}, vocab=97, hit=0.0, seed=1) if speculate else None
        ex = TorchExecutor.from_model(tiny_model, kv_blocks=32, block_size=4, drafter=drafter)
        req = make_request(PROMPT, max_tokens=24, temperature=1.0, seed=seed)
        return run_engine(ex, [req], speculation=VerifyAll(depth=2, width=2) if speculate else None)[req.request_id]

    first, again, other = sample(42), sample(42), sample(43)
    assert first == again
    assert first != other
    assert first != hf_greedy(tiny_model, PROMPT, 24)  # really sampled


def test_seeded_requests_are_independent_of_batch_neighbours(tiny_model):
    """A seeded request's output does not depend on which other requests share its batches."""
    ex = TorchExecutor.from_model(tiny_model, kv_blocks=64, block_size=4)
    alone = make_request(PROMPT, max_tokens=16, temperature=1.0, seed=7)
    solo = run_engine(ex, [alone])[alone.request_id]
    crowd = [make_request([9, 9, 9, i + 3], max_tokens=16, temperature=1.0) for i in range(4)]
    seeded = make_request(PROMPT, max_tokens=16, temperature=1.0, seed=7)
    assert run_engine(ex, [*crowd, seeded])[seeded.request_id] == solo


def test_tiny_top_p_is_greedy(tiny_model):
    ex = TorchExecutor.from_model(tiny_model, kv_blocks=32, block_size=4)
    ref = hf_greedy(tiny_model, PROMPT, 16)
    reqs = [make_request(PROMPT, max_tokens=16, temperature=1.5, top_p=1e-6, seed=s) for s in range(3)]
    out = run_engine(ex, reqs)
    assert all(out[r.request_id] == ref for r in reqs)  # the nucleus is the argmax alone, whatever the seed


def test_the_own_engine_refuses_a_lora_adapter_rather_than_serve_the_model_in_its_place(tiny_model):
    ex = TorchExecutor.from_model(tiny_model, kv_blocks=32, block_size=16)
    engine = Engine(ex, FCFSTestScheduler(ex, chunk=16))
    request = make_request(PROMPT, max_tokens=4)
    request.lora_name = "sql-lora"
    with pytest.raises(ValueError, match="adapters are served on the vLLM backend only"):
        engine.add_request(request)


class TaggedTokenizer(CharTokenizer):
    """Token 0 is a special token, ``<tool>``: left out of the text unless asked to keep it."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(("" if skip_special_tokens else "<tool>") if i == 0 else CharTokenizer.decode(self, [i])
                       for i in ids)


@pytest.mark.parametrize("skip, text", [(True, "bA"), (False, "<tool>bA")])
def test_special_tokens_stay_in_the_text_where_the_request_keeps_them(skip, text):
    """A job read by a tool-call or reasoning parser keeps special tokens (its tags may be some), as on vLLM."""
    req = make_request([5, 6], max_tokens=4, skip_special_tokens=skip)
    req.output_token_ids = [0, 1]
    assert Detokenizer(TaggedTokenizer()).update(req, finished=True) == (text, None)
