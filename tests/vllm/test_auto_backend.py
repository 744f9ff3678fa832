"""vLLM's ``auto`` structured-output backend, which a worker leaves to vLLM for a Mistral tokenizer: the worker
publishes it (``grammar_backend``: ``auto`` for a Tekken tokenizer, ``auto-outlines`` for an older one), and the
API's check under it (``app.output_constraints``) takes what vLLM's own validation under ``auto`` takes
(``SamplingParams._validate_structured_outputs``), with the bundled tokenizers of mistral_common."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from app import output_constraints

_SCHEMA = output_constraints.schema_text
# constraints whose fate under auto differs by who takes them: xgrammar, guidance, outlines or none
CASES = {
    "regex-xgrammar": ("regex", "[a-z]+"),
    "regex-guidance-only": ("regex", r"\p{L}+"),
    "regex-neither": ("regex", "(?=a)a"),
    "lark-xgrammar-only": ("grammar", '?start: "a"'),
    "lark-guidance-only": ("grammar", 'start: A\nA: /\\p{L}+/'),
    "lark-both": ("grammar", 'start: "a" | "b"'),
    "ebnf": ("grammar", 'root ::= "a" | "b"'),
    "schema-xgrammar": ("json", _SCHEMA({"type": "object", "properties": {"a": {"type": "string"}}})),
    "schema-multipleOf": ("json", _SCHEMA({"type": "integer", "multipleOf": 5})),
    "schema-uniqueItems": ("json", _SCHEMA({"type": "array", "uniqueItems": True})),
    "tag-uniqueItems": ("structural_tag", json.dumps({"structures": [{"begin": "<a>", "end": "</a>", "schema": {
        "type": "array", "uniqueItems": True}}], "triggers": ["<a"]})),
}


@pytest.fixture(scope="module")
def mistral_configs(tmp_path_factory, tiny_model_dir) -> dict[str, object]:
    """vLLM configs of the tiny model under auto with mistral_common's bundled tokenizers: ``tekken`` and ``spm``
    (SentencePiece)."""
    import mistral_common
    from vllm.config import ModelConfig, VllmConfig

    data = Path(mistral_common.__file__).parent / "data"
    configs = {}
    for kind, source, name in (("tekken", "tekken_240911.json", "tekken.json"),
                               ("spm", "mistral_instruct_tokenizer_240323.model.v3", "tokenizer.model.v3")):
        folder = tmp_path_factory.mktemp(f"mistral-{kind}")
        shutil.copy(data / source, folder / name)
        configs[kind] = VllmConfig(model_config=ModelConfig(model=str(tiny_model_dir), tokenizer=str(folder),
                                                            tokenizer_mode="mistral", max_model_len=512))
    return configs


def _published(config) -> str | None:  # noqa: ANN001 - vLLM's VllmConfig
    from vllm.v1.structured_output import StructuredOutputManager

    from gpu_runtime.vllm.scheduler import grammar_backend, pin_grammar_backend

    manager = StructuredOutputManager(config)
    pin_grammar_backend(manager, config)  # leaves auto to vLLM for a Mistral tokenizer
    assert manager.backend is None
    return grammar_backend(manager, config)


def _vllm_takes(config, kind: str, text: str) -> bool:  # noqa: ANN001 - vLLM's VllmConfig
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams
    from vllm.v1.structured_output import StructuredOutputManager

    params = SamplingParams(structured_outputs=StructuredOutputsParams(**{kind: text}))
    try:
        params._validate_structured_outputs(config.model_config, config.structured_outputs_config,
                                            StructuredOutputManager(config).tokenizer)
    except (VLLMValidationError, ValueError):
        return False
    return True


def test_a_worker_publishes_auto_as_vllm_picks_for_its_mistral_tokenizer(mistral_configs):
    assert _published(mistral_configs["tekken"]) == output_constraints.AUTO  # xgrammar, else guidance
    assert _published(mistral_configs["spm"]) == output_constraints.AUTO_OUTLINES  # xgrammar, else outlines


def _api_answer(config, kind: str, text: str) -> str | None:
    """The API's refusal of a constraint where the one live worker runs ``config`` (None: taken)."""
    backends = output_constraints.backends_of([_published(config)])  # as the API reads the workers' heartbeats
    return output_constraints.outcomes([(kind, text)], backends)[(kind, text)]


@pytest.mark.parametrize("case", list(CASES))
def test_the_api_takes_what_vllms_auto_takes_for_a_tekken_tokenizer(mistral_configs, case):
    config = mistral_configs["tekken"]
    kind, text = CASES[case]
    answer = _api_answer(config, kind, text)
    assert (answer is None) == _vllm_takes(config, kind, text), answer


@pytest.mark.parametrize("case", list(CASES))
def test_the_api_refuses_only_what_vllms_auto_refuses_for_an_older_mistral_tokenizer(mistral_configs, case):
    """Outlines, auto's fallback there, is not checked at the API: it refuses nothing vLLM takes."""
    config = mistral_configs["spm"]
    kind, text = CASES[case]
    answer = _api_answer(config, kind, text)
    assert answer is None or not _vllm_takes(config, kind, text), answer


def test_a_worker_publishes_the_backend_vllms_auto_made_at_its_first_constraint(mistral_configs):
    """vLLM's engine has one structured-output backend, made for the first constrained request it meets
    (``StructuredOutputManager.grammar_init``) and kept: under ``auto`` for a Mistral tokenizer, a later constraint
    vLLM's validation sends to guidance is compiled with the xgrammar made for a schema before it, and fails there.
    The worker published ``auto`` for good (read once at its engine's start), so the API kept taking a Lark grammar
    only guidance compiles. It publishes the backend once the engine made it, and the API refuses that grammar then,
    naming xgrammar."""
    from types import SimpleNamespace

    from vllm.sampling_params import StructuredOutputsParams
    from vllm.v1.structured_output import StructuredOutputManager
    from vllm.v1.structured_output.backend_types import StructuredOutputOptions

    from gpu_runtime.vllm.engine import VLLMEngine
    from gpu_runtime.vllm.scheduler import pin_grammar_backend
    from tests.vllm.conftest import vllm_request

    config = mistral_configs["tekken"]
    manager = StructuredOutputManager(config)
    pin_grammar_backend(manager, config)  # leaves auto to vLLM
    engine = VLLMEngine.__new__(VLLMEngine)  # its heartbeat's fields, over the engine core's scheduler
    engine.llm, engine.core_scheduler = SimpleNamespace(vllm_config=config), SimpleNamespace(
        structured_output_manager=manager, grammar_unavailable=None)
    assert engine.grammar_backend == output_constraints.AUTO
    kind, lark = CASES["lark-guidance-only"]
    assert _vllm_takes(config, kind, lark)  # vLLM's auto validation sends it to guidance
    assert output_constraints.outcomes([(kind, lark)], (engine.grammar_backend,))[(kind, lark)] is None
    first = vllm_request(4, structured=StructuredOutputsParams(json={"type": "object"}))
    first.sampling_params._validate_structured_outputs(config.model_config, config.structured_outputs_config,
                                                       manager.tokenizer)
    manager.grammar_init(first)  # as vLLM's engine core does at the first constrained request
    compiled = first.structured_output_request._grammar  # its compile in vLLM's thread pool
    assert not isinstance(compiled.result() if hasattr(compiled, "result") else compiled, Exception)
    with pytest.raises(Exception):  # noqa: B017 - whatever xgrammar raises: the engine fails the job with it
        manager.backend.compile_grammar(StructuredOutputOptions.GRAMMAR, lark)
    assert engine.grammar_backend == output_constraints.XGRAMMAR
    answer = output_constraints.outcomes([(kind, lark)], (engine.grammar_backend,))[(kind, lark)]
    assert answer is not None and "under xgrammar" in answer, answer
