"""Sampling parameters beyond temperature and top-p: top_k, min_p and the penalties, and which engine takes them."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from pydantic import ValidationError

from app.services.jobs import engine_refusal
from app.settings import Settings
from gpu_runtime.engine import Engine
from gpu_runtime.executor.sim import SimExecutor
from gpu_runtime.executor.torch.sampler import target_probs
from gpu_runtime.qos import QoSClass, QoSSpec, Tier
from gpu_runtime.request import Request
from gpu_runtime.sampling import OutputConstraint, SamplingParams
from gpu_runtime.scheduler.registry import create_scheduler
from tests.unit.scheduler.helpers import COST

LOGITS = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))


@pytest.mark.parametrize("field,value", [("top_k", -1), ("min_p", 1.5), ("presence_penalty", 2.5),
                                         ("frequency_penalty", -3.0), ("repetition_penalty", 0.0),
                                         ("repetition_penalty", float("nan"))])
def test_out_of_range_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_logit_bias_round_trips_from_the_job_and_stays_in_range():
    from app.schemas import JobCreate

    sampling = JobCreate(prompt="x", logit_bias={"7": 2.5, 3: -100}).sampling(16)
    assert sampling["logit_bias"] == {"7": 2.5, "3": -100.0}  # JSON keys: text
    assert SamplingParams.from_job(sampling, 16).logit_bias == ((3, -100.0), (7, 2.5))
    assert SamplingParams.from_job({"max_tokens": 4}, 16).logit_bias == ()  # a job stored before it existed
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=((1, 100.5),))
    for bad in ({"-1": 1.0}, {"x": 1.0}, {"1": float("inf")}):
        with pytest.raises(ValueError, match="logit_bias"):
            JobCreate(prompt="x", logit_bias=bad)


def test_penalized_is_true_only_off_the_neutral_values():
    assert not SamplingParams().penalized and not SamplingParams(top_k=3, min_p=0.1).penalized
    for field, value in (("presence_penalty", 0.1), ("frequency_penalty", -0.5), ("repetition_penalty", 1.1)):
        assert SamplingParams(**{field: value}).penalized


def test_top_k_keeps_the_k_most_likely_tokens_renormalized():
    probs = target_probs(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))


def test_min_p_drops_tokens_below_its_share_of_the_most_likely():
    probs = target_probs(LOGITS, SamplingParams(temperature=1.0, min_p=0.25))  # keeps p >= 0.125
    assert torch.allclose(probs, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)


def test_top_p_applies_to_what_top_k_left():
    # after top_k=3: 0.526, 0.316, 0.158; top_p 0.8 keeps the first two (0.526 alone is short of it)
    probs = target_probs(LOGITS, SamplingParams(temperature=1.0, top_k=3, top_p=0.8))
    assert torch.allclose(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))


def test_own_engine_refuses_penalties_at_admission():
    ex = SimExecutor(COST, kv_blocks=64, block_size=16)
    engine = Engine(ex, create_scheduler("qoserve", cost_model=COST, executor=ex))
    qos = QoSSpec(QoSClass.INTERACTIVE, Tier.PAID, ttft_s=1.0, tbt_s=0.1)
    with pytest.raises(ValueError, match="vLLM backend"):
        engine.add_request(Request("r", [1] * 8, SamplingParams(max_tokens=4, frequency_penalty=0.5), qos, 0.0))
    with pytest.raises(ValueError, match="vLLM backend"):
        engine.add_request(Request("s", [1] * 8, SamplingParams(structured=OutputConstraint("regex", "a+")), qos, 0.0))
    engine.add_request(Request("ok", [1] * 8, SamplingParams(max_tokens=4, top_k=5, min_p=0.1), qos, 0.0))


SAMPLING = dataclasses.asdict(SamplingParams())


@pytest.mark.parametrize("backend,spec,sampling,refused", [
    ("torch", "none", {"repetition_penalty": 1.2}, "repetition_penalty"),
    ("torch", "none", {"top_k": 4, "min_p": 0.2}, None),  # the own sampler applies both
    ("vllm", "none", {"presence_penalty": -1.0, "min_p": 0.2}, None),
    ("vllm", "nightjar", {"min_p": 0.2}, "min_p"),  # vLLM refuses min_p with speculative decoding
    ("vllm", "nightjar", {"frequency_penalty": 1.0}, None),
    ("torch", "none", {"structured_outputs": {"json_object": True}}, "structured_outputs"),
    ("torch", "none", {"structured_outputs": {"structural_tag": '{"format": {}}'}}, "structured_outputs"),
    ("vllm", "none", {"structured_outputs": {"structural_tag": '{"format": {}}'}}, None),
    ("vllm", "adaspec", {"structured_outputs": {"regex": "[0-9]+"}}, None),
    ("torch", "none", {"logit_bias": {"5": 3.0}}, "logit_bias"),
    ("vllm", "none", {"logit_bias": {"5": -100.0}}, None),
    ("vllm", "nightjar", {"logit_bias": {"5": 3.0}}, "logit_bias"),  # vLLM's sampler drops it while speculating
    ("torch", "none", {"min_tokens": 4}, "min_tokens"), ("torch", "none", {"stop_token_ids": [2]}, "stop_token_ids"),
    ("vllm", "nightjar", {"min_tokens": 4, "stop_token_ids": [2]}, None),
    ("torch", "none", {"allowed_token_ids": [5, 6]}, "allowed_token_ids"), ("torch", "none", {"bad_words": ["no"]},
                                                                            "bad_words"),
    ("torch", "none", {"include_stop_str_in_output": True}, None),  # the own engine keeps the stop string too
    ("vllm", "nightjar", {"allowed_token_ids": [5], "bad_words": ["no"]}, None),  # vLLM's rejection sampler applies
])
def test_the_api_refuses_what_the_servers_engine_cannot_apply(backend, spec, sampling, refused):
    settings = Settings(backend=backend, spec_policy=spec)
    got = engine_refusal(settings, {**SAMPLING, **sampling})
    assert (got and got[0]) == refused


@pytest.mark.parametrize("fields", [{"json": {"type": "object", "properties": {"a": {"type": "integer"}}}},
                                    {"choice": ["yes", "no"]}, {"regex": "[a-z]{3}"}, {"json_object": True},
                                    {"grammar": 'root ::= "a" | "b"'},
                                    {"structural_tag": '{"type": "structural_tag", "format": {"type": "const_string", '
                                                       '"value": "a"}}'}])
def test_an_output_constraint_keeps_vllms_field_form(fields):
    assert OutputConstraint.of(fields).fields() == fields


def test_openai_response_format_becomes_the_jobs_constraint():
    from app.openai_schemas import ChatCompletionRequest, OpenAIError

    def constraint(**body):
        req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **body})
        req.check()
        return req.job_spec(messages=req.chat_messages()).sampling(8)["structured_outputs"]

    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    assert constraint(response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}) == {
        "json": schema}
    assert constraint(response_format={"type": "json_object"}) == {"json_object": True}
    assert constraint(response_format={"type": "text"}) is None and constraint() is None
    assert constraint(response_format={"type": "text", "name": "ignored"}) is None
    assert constraint(structured_outputs={"choice": ["yes", "no"]}) == {"choice": ["yes", "no"]}
    for body in ({"response_format": {"type": "json_schema", "json_schema": {"name": "p"}}},
                 {"response_format": {"type": "json_schema", "json_schema": {"schema": {"maximum": float("nan")}}}},
                 {"response_format": {"type": "yaml"}},
                 {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}):
        with pytest.raises(OpenAIError) as exc:
            constraint(**body)
        assert exc.value.status_code == 400 and exc.value.param == "response_format"


def test_response_format_and_structured_outputs_of_one_kind_merge_as_vllm_merges_them():
    """vLLM's structured_outputs_from_response_format: response_format's constraint replaces structured_outputs'
    one of the same kind and keeps its options (coserve refused the pair); two kinds are a 400 saying what to send."""
    from app.openai_schemas import ChatCompletionRequest, OpenAIError

    def constraint(**body):
        req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **body})
        req.check()
        return req.job_spec(messages=req.chat_messages()).sampling(8)["structured_outputs"]

    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}
    loose = {"json": {"type": "object"}, "disable_any_whitespace": True}
    assert constraint(response_format=fmt, structured_outputs=loose) == {"json": schema, "disable_any_whitespace": True}
    assert constraint(response_format={"type": "json_object"}, structured_outputs={
        "json_object": True, "whitespace_pattern": " ?"}) == {"json_object": True, "whitespace_pattern": " ?"}
    with pytest.raises(OpenAIError) as exc:
        constraint(response_format={"type": "json_object"}, structured_outputs={"regex": "a"})
    assert exc.value.status_code == 400 and exc.value.param == "response_format"
    assert ("response_format constrains the text to json_object and structured_outputs to regex: send one of them, "
            "or a structured_outputs.json_object (with its options) beside response_format") in exc.value.message


WEATHER_TAG = {"type": "triggered_tags", "triggers": ["<function="], "tags": [
    {"begin": "<function=get_weather>", "end": "</function>",
     "content": {"type": "json_schema",
                 "json_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}}]}


def test_a_structural_tag_becomes_the_jobs_constraint_as_vllm_passes_it_on():
    from app.openai_schemas import ChatCompletionRequest, OpenAIError

    def constraint(**body):
        req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **body})
        req.check()
        return req.job_spec(messages=req.chat_messages()).sampling(8)["structured_outputs"]

    tag = {"type": "structural_tag", "format": WEATHER_TAG}
    assert json.loads(constraint(response_format=tag)["structural_tag"]) == tag
    legacy = {"type": "structural_tag", "triggers": ["<f"],
              "structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}]}
    assert json.loads(constraint(response_format=legacy)["structural_tag"]) == legacy
    assert constraint(structured_outputs={"structural_tag": json.dumps(tag)}) == {"structural_tag": json.dumps(tag)}
    for fmt, why in (({"type": "structural_tag"}, "format: Field required"),
                     ({"type": "structural_tag", "triggers": ["<f"]}, "structures: Field required"),
                     ({"type": "structural_tag", "format": {"type": "nope"}}, "Format type not recognized: nope"),
                     ({**legacy, "triggers": ["<g"]}, "does not match any trigger")):
        with pytest.raises(OpenAIError) as exc:
            constraint(response_format=fmt)
        assert exc.value.status_code == 400 and exc.value.param == "response_format" and why in exc.value.message
    for text, why in (("", "empty"), ("{", "not valid JSON"), ("[1]", "JSON object"),
                      ('{"format": {"type": "nope"}}', "Format type not recognized"),
                      ('{"structures": [{"begin": "<f>"}], "triggers": []}', "legacy form needs structures")):
        with pytest.raises(ValidationError, match=why):
            constraint(structured_outputs={"structural_tag": text})


def test_a_schema_with_a_number_json_cannot_carry_is_refused():
    from app.schemas import JobCreate

    for schema in ({"maximum": float("inf")}, '{"minimum": NaN}', {"anyOf": [{"const": [1.0, float("nan")]}]}):
        with pytest.raises(ValidationError, match="not finite"):
            JobCreate(prompt="x", structured_outputs={"json": schema})


def test_a_speculating_vllm_engine_refuses_what_its_sampler_would_drop():
    from gpu_runtime.vllm.engine import admission_error

    qos = QoSSpec(QoSClass.INTERACTIVE, Tier.PAID, ttft_s=1.0, tbt_s=0.1)
    biased = Request("r", [1] * 8, SamplingParams(max_tokens=4, logit_bias=((5, 3.0),)), qos, 0.0)
    assert admission_error(biased, 2048, speculating=False) is None
    assert "logit_bias" in admission_error(biased, 2048, speculating=True)
    min_p = Request("m", [1] * 8, SamplingParams(max_tokens=4, min_p=0.1), qos, 0.0)
    assert "min_p" in admission_error(min_p, 2048, speculating=True)
    assert "context of 10" in admission_error(min_p, 10, speculating=False)


def test_vllm_cpu_refuses_a_clients_seed_it_could_not_keep_instead_of_dropping_it():
    from gpu_runtime.vllm.engine import seed_refusal

    qos = QoSSpec(QoSClass.INTERACTIVE, Tier.PAID, ttft_s=1.0, tbt_s=0.1)

    def job(prompt: int, max_tokens: int = 16, temperature: float = 1.0, drawn: bool = False) -> Request:
        return Request("r", [1] * prompt, SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=3,
                                                         seed_drawn=drawn), qos, 0.0)

    assert seed_refusal(job(496), whole_seeded=True, native=False, step=512) is None  # 496 + 16: one step
    said = seed_refusal(job(497), whole_seeded=True, native=False, step=512)
    assert "prompt (497 tokens) and max_tokens (16) pass a step's 512 tokens" in said and "seed unset" in said
    assert "vLLM's own scheduling policy" in seed_refusal(job(10), whole_seeded=True, native=True, step=512)
    # greedy (no generator), a seed the server drew (it goes unapplied), or a GPU (it can rewind): all run
    assert seed_refusal(job(497, temperature=0.0), whole_seeded=True, native=True, step=512) is None
    assert seed_refusal(job(497, drawn=True), whole_seeded=True, native=True, step=512) is None
    assert seed_refusal(job(497), whole_seeded=False, native=True, step=512) is None


def test_min_tokens_and_stop_token_ids_round_trip_and_are_checked():
    from app.schemas import JobCreate

    sampling = JobCreate(prompt="x", max_tokens=8, min_tokens=3, stop_token_ids=[2, 7]).sampling(16)
    params = SamplingParams.from_job(sampling, 16)
    assert (params.min_tokens, params.stop_token_ids) == (3, (2, 7))
    assert SamplingParams.from_job({"max_tokens": 4}, 16).min_tokens == 0  # a job stored before they existed
    with pytest.raises(ValueError, match="min_tokens"):
        JobCreate(prompt="x", max_tokens=2, min_tokens=3)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3)
    with pytest.raises(ValueError):
        JobCreate(prompt="x", stop_token_ids=[-1])



def test_vllms_vocabulary_and_stop_string_options_round_trip():
    from app.schemas import JobCreate

    sampling = JobCreate(prompt="x", stop=["."], include_stop_str_in_output=True, allowed_token_ids=[3, 9],
                         bad_words=["never", " never"]).sampling(16)
    params = SamplingParams.from_job(sampling, 16)
    assert (params.include_stop_str_in_output, params.allowed_token_ids, params.bad_words) == \
        (True, (3, 9), ("never", " never"))
    old = SamplingParams.from_job({"max_tokens": 4}, 16)  # a job stored before they existed
    assert (old.include_stop_str_in_output, old.allowed_token_ids, old.bad_words) == (False, (), ())
    with pytest.raises(ValueError):
        JobCreate(prompt="x", allowed_token_ids=[])  # an empty vocabulary could generate nothing


def test_vllms_options_of_a_constraint_reach_the_engine_beside_it():
    """vLLM's StructuredOutputsParams takes disable_any_whitespace, disable_additional_properties and
    whitespace_pattern beside its constraint: the job keeps them and the worker's engine gets them."""
    from app.openai_schemas import ChatCompletionRequest
    from gpu_runtime.sampling import SamplingParams

    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    options = {"disable_any_whitespace": True, "disable_additional_properties": True, "whitespace_pattern": " ?"}
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                                "structured_outputs": {"json": schema, **options}})
    req.check()
    kept = req.job_spec(messages=req.chat_messages()).sampling(8)["structured_outputs"]
    assert kept == {"json": schema, **options}
    assert SamplingParams.from_job({"structured_outputs": kept}, 8).structured.fields() == kept
    unset = req.model_validate({"messages": [{"role": "user", "content": "x"}],
                                "structured_outputs": {"regex": "[0-9]+", "disable_any_whitespace": False}})
    assert unset.job_spec(messages=unset.chat_messages()).sampling(8)["structured_outputs"] == {"regex": "[0-9]+"}
    with pytest.raises(ValueError, match="give exactly one of json"):  # options alone constrain nothing (vLLM's too)
        req.model_validate({"messages": [{"role": "user", "content": "x"}],
                            "structured_outputs": {"disable_any_whitespace": True}})
