"""The tests' tiny random Llamas: ``writing_tiny_model_dir`` answers a summarization prompt greedily with visible
text, where ``tiny_model_dir`` answers whitespace only (a summary of nothing, which fails its document)."""

from __future__ import annotations

import pytest

from app.summarize.pipeline import MAP_PROMPT, REDUCE_PROMPT, SINGLE_PROMPT

PROMPTS = [p.format(text="The cat sat on the mat. It was warm.") for p in (MAP_PROMPT, SINGLE_PROMPT, REDUCE_PROMPT)]


def greedy_answers(model_dir) -> list[tuple[str, int]]:  # noqa: ANN001 - a folder
    """What the model at ``model_dir`` answers each of ``PROMPTS`` greedily in 16 tokens at most, and in how many."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok, model = AutoTokenizer.from_pretrained(model_dir), LlamaForCausalLM.from_pretrained(model_dir)
    answers = []
    for prompt in PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        out = model.generate(ids, max_new_tokens=16, do_sample=False)  # as the workers run summaries: greedy
        new = out[0, ids.shape[1]:]
        answers.append((tok.decode(new, skip_special_tokens=True), len(new)))
    return answers


@pytest.mark.parametrize("fixture, writes", [("tiny_model_dir", False), ("writing_tiny_model_dir", True)])
def test_only_the_writing_tiny_model_answers_a_summarization_prompt_with_text(fixture, writes, request):
    answers = greedy_answers(request.getfixturevalue(fixture))
    assert [bool(text.strip()) for text, _ in answers] == [writes] * len(PROMPTS), answers
    if writes:  # it never ends early either: its EOS is never the greedy choice
        assert [tokens for _, tokens in answers] == [16] * len(PROMPTS), answers
