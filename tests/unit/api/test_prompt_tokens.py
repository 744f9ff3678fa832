"""The submit path counts prompt tokens with the Rust tokenizer directly; the ids must be
those of the transformers call the worker's engine would see."""

from __future__ import annotations

import json
from types import SimpleNamespace

from app.services.model_info import encode_input, get_tokenizer
from gpu_runtime.data import specbench_path

SPEC_BENCH = specbench_path()


def _prompts() -> list[str]:
    prompts = ["", " ", "héllo\n\n  wörld \U0001f916", "<|im_start|>user hi<|im_end|>", "a" * 3000, "x\ty\r\nz"]
    with SPEC_BENCH.open() as f:
        prompts += [json.loads(line)["turns"][0] for _, line in zip(range(120), f)]
    return prompts


def test_fast_prompt_ids_equal_the_transformers_call(tiny_model_dir):
    tok = get_tokenizer(str(tiny_model_dir))
    for prompt in _prompts():
        assert (encode_input(str(tiny_model_dir), prompt, None)
                == list(tok(prompt, add_special_tokens=True)["input_ids"]))


def test_add_special_tokens_tokenizes_the_input_as_vllm_does(bos_tiny_model_dir):
    # a completion's text: tok(prompt, add_special_tokens=flag), True unless the job says false; chat: the template
    # rendered to text, tokenized with the flag (False unless the job says true: the BOS then comes on top)
    model = str(bos_tiny_model_dir)
    tok = get_tokenizer(model)
    bare = list(tok("Hello world", add_special_tokens=False)["input_ids"])
    assert encode_input(model, "Hello world", None) == [tok.bos_token_id, *bare]
    assert encode_input(model, "Hello world", None, options={"add_special_tokens": False}) == bare
    assert encode_input(model, "Hello world", None, options={"add_special_tokens": True}) == [tok.bos_token_id, *bare]
    chat = [{"role": "user", "content": "Hello world"}]
    rendered = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    templated = list(tok(rendered, add_special_tokens=False)["input_ids"])
    assert encode_input(model, None, chat) == encode_input(model, None, chat, options={"add_special_tokens": False})
    assert encode_input(model, None, chat) == templated
    assert encode_input(model, None, chat, options={"add_special_tokens": True}) == [tok.bos_token_id, *templated]
    opened = encode_input(model, None, chat, options={"add_generation_prompt": False, "add_special_tokens": True})
    assert opened[0] == tok.bos_token_id and opened[1:] == encode_input(model, None, chat,
                                                                        options={"add_generation_prompt": False})


def test_a_job_keeps_add_special_tokens_only_where_the_request_gave_it():
    from app.schemas import ChatMessage, JobCreate

    chat = [ChatMessage(role="user", content="hi")]
    assert JobCreate(prompt="x").template_options() is None  # the row it always had
    assert JobCreate(messages=chat).template_options() is None
    assert JobCreate(prompt="x", add_special_tokens=False).template_options() == {"add_special_tokens": False}
    assert JobCreate(messages=chat, add_special_tokens=True, add_generation_prompt=False).template_options() == {
        "add_generation_prompt": False, "add_special_tokens": True}


def test_truncate_prompt_tokens_feeds_what_vllm_feeds_with_a_tokenizer_that_adds_bos(bos_tiny_model_dir, tmp_path):
    # vLLM cuts a text inside the tokenizer call (left side, max_length k): the special tokens it adds stay and
    # the text loses its first tokens, so a completion's prompt is its BOS and its last k-1 tokens; a chat's template
    # text (add_special_tokens false) its last k, the template's own BOS gone; token ids their last k
    from vllm.renderers.params import TokenizeParams
    from vllm.tokenizers import get_tokenizer as vllm_tokenizer

    from app.services.truncation import fed_prompt
    from app.settings import Settings

    model = str(bos_tiny_model_dir)
    settings = Settings(data_dir=tmp_path, model=model, model_name="tiny", backend="torch")
    engine_tok = vllm_tokenizer(model)  # as vLLM's generate runner loads it: truncation_side "left"
    prompt = "Name a city in the north of France, then one in the south"
    chat = [{"role": "user", "content": "Name a city"}]
    rendered = engine_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)  # vLLM's chat

    def vllm_fed(text: str, k: int, special: bool) -> list[int]:
        params = TokenizeParams(max_total_tokens=512, max_output_tokens=8, truncate_prompt_tokens=k,
                                add_special_tokens=special)
        ids = engine_tok(text, **params.get_encode_kwargs())["input_ids"]
        return params.apply_post_tokenization(engine_tok, {"prompt_token_ids": ids})["prompt_token_ids"]

    def fed(k: int, special: bool | None, **job) -> list[int]:
        return fed_prompt(settings, SimpleNamespace(**{
            "prompt": None, "messages": None, "tools": None, "prompt_token_ids": None, "endpoint": "/v1/jobs", **job,
            "template_options": None if special is None else {"add_special_tokens": special},
            "sampling": {"truncate_prompt_tokens": k, "max_tokens": 8}}))

    bos = engine_tok.bos_token_id
    for k in (1, 2, 5, 12):
        assert fed(k, None, prompt=prompt) == vllm_fed(prompt, k, True)
        assert fed(k, None, prompt=prompt)[0] == bos and len(fed(k, None, prompt=prompt)) == k
        assert fed(k, False, prompt=prompt) == vllm_fed(prompt, k, False)
        assert fed(k, None, messages=chat) == vllm_fed(rendered, k, False)
        assert fed(k, True, messages=chat) == vllm_fed(rendered, k, True)
        ids = encode_input(model, prompt, None)
        assert fed(k, None, prompt_token_ids=ids) == ids[-k:]  # token ids: fed as given, their last k
