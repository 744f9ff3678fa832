"""Which token ids a model takes, bounded as vLLM 0.32 bounds them: a prompt's (and /detokenize's) by
``max(tokenizer.max_token_id, vocab_size - 1)`` (``validate_token_ids``: a model whose embedding is padded past its
tokenizer, as Qwen's, takes ids the tokenizer lacks), the sampling parameters' by the model's vocab_size (they
index its logits)."""

from __future__ import annotations

import pytest

from app.services.jobs import JobValidationError, check_token_ids
from app.services.model_info import get_tokenizer

PAD = 64  # the embedding's rows past the tokenizer's ids


@pytest.fixture(scope="module")
def padded_model(tmp_path_factory) -> str:
    """A 1-layer random Llama whose vocab_size is the default model's tokenizer's size padded by ``PAD``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = get_tokenizer("smollm2-135m")
    path = tmp_path_factory.mktemp("padded-llama")
    cfg = LlamaConfig(vocab_size=len(tok) + PAD, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("param", ["prompt", "tokens", "stop_token_ids", "allowed_token_ids", "logit_bias"])
def test_an_id_of_the_padded_vocabulary_is_taken(padded_model, param):
    size = len(get_tokenizer(padded_model))
    check_token_ids(padded_model, [0, size, size + PAD - 1], param)  # past the tokenizer, within the model's


@pytest.mark.parametrize("param", ["prompt", "tokens", "stop_token_ids", "allowed_token_ids", "logit_bias"])
def test_an_id_past_the_models_vocabulary_is_a_400_naming_the_bound(padded_model, param):
    bound = len(get_tokenizer(padded_model)) + PAD
    with pytest.raises(JobValidationError, match=rf"\[0, {bound}\)") as exc:
        check_token_ids(padded_model, [bound], param)
    assert exc.value.param == param
