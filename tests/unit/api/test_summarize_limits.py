"""The request's bound on a run's first-level jobs (``limits.least_jobs``: a token a word at least) against the default
model's tokenizer: its tokens do span whitespace (runs of spaces, " \\n"), but only whitespace, so the bound never
refuses a run that the first step's exact count (``check_jobs`` over the split) accepts."""

from __future__ import annotations

import pytest

from app.services.model_info import get_tokenizer, token_counts
from app.summarize.limits import check_jobs, check_least_jobs, least_jobs
from app.summarize.split import TokenSplitter


@pytest.fixture(scope="module")
def tok():
    return get_tokenizer("smollm2-135m")


def test_the_default_tokenizer_has_whitespace_tokens_but_none_holds_two_words(tok):
    assert token_counts(tok, ["a \n b", "a" + " " * 8 + "b"]) == [3, 3]  # " \n" and a run of spaces: a token each
    two_words = [s for i in range(len(tok)) if len((s := tok.decode([i])).split()) > 1]
    assert two_words == []  # so a text holds at least a token per word


@pytest.mark.parametrize("gap", [" ", "  ", " \n", "\n \n", "\t\t", " \n\n ", "\x1f", "\u3000", "\xa0 "])
def test_the_request_bound_accepts_every_run_the_first_steps_exact_count_accepts(tok, gap):
    words = [f"w{i % 7}" if i % 3 else "." for i in range(600)]
    text = gap.join(words)
    chunks = TokenSplitter(tok, 64, 0)(text)
    assert least_jobs([text], 64) <= len(chunks)
    check_jobs(len(chunks), len(chunks), 64)  # the exact count at its limit: accepted
    check_least_jobs([text], len(chunks), 64)  # and so by the bound
