"""Splitting and the map-reduce control loop (pure logic, a fake job backend)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest

from app.summarize.documents import Document, load_paths, specbench_summarization
from app.summarize.pipeline import (MAX_LEVELS, DocState, JobResult, Planner, SummarizeRun, advance_doc,
                                    levels_needed)
from app.summarize.split import split_text


def words(text: str) -> int:
    return len(text.split())


def test_split_respects_budget_and_overlaps():
    text = " ".join(f"Sentence number {i} is here." for i in range(40))  # 5 words each
    chunks = split_text(text, words, max_tokens=30, overlap=10)
    assert len(chunks) > 1 and all(words(c) <= 30 for c in chunks)
    for a, b in zip(chunks, chunks[1:], strict=False):
        assert a.split(". ")[-1].rstrip(".") in b  # the last sentence of a chunk opens the next
    assert "number 0 " in chunks[0] and "number 39 " in chunks[-1]
    assert split_text("short text.", words, 30, 10) == ["short text."]
    with pytest.raises(ValueError):
        split_text(text, words, 10, 10)


def test_split_cuts_overlong_sentences():
    long = " ".join(["word"] * 100) + "."
    chunks = split_text(long, words, 20, 0, hard_split=lambda s, n: [" ".join(s.split()[i:i + n])
                                                                        for i in range(0, words(s), n)])
    assert len(chunks) == 5 and all(words(c) <= 20 for c in chunks)


class FakeBackend:
    def __init__(self, fail_on: str | None = None):
        self.jobs: dict[str, tuple[str, str]] = {}
        self.prompts: list[str] = []
        self.fail_on = fail_on

    def submit(self, messages, max_tokens, deadline_at, app_id, prompt_tokens=None):
        job_id = f"j{len(self.jobs)}"
        prompt = messages[0]["content"]
        self.prompts.append(prompt)
        self.jobs[job_id] = ("failed" if self.fail_on and self.fail_on in prompt else "succeeded",
                             f"S{len(self.jobs)}.")
        return job_id

    def poll(self, ids):
        return {j: JobResult(*self.jobs[j]) for j in ids}


def test_map_reduce_levels():
    docs = [Document("short", "One short document."),
            Document("long", " ".join(f"Fact {i} about the topic." for i in range(30)))]
    run = SummarizeRun.create("r", docs, datetime(2030, 1, 1, tzinfo=UTC), 16)
    backend = FakeBackend()
    split = lambda t: split_text(t, words, 40, 5)  # noqa: E731
    steps = 0
    while not run.step(backend, split):
        steps += 1
        assert steps < 10
    results = {r["id"]: r for r in run.results()}
    assert run.status == "completed" and run.jobs_done == run.jobs_submitted == len(backend.jobs)
    assert results["short"]["chunks"] == 1 and results["short"]["jobs"] == 1
    # 30 sentences of 5 words: 6 per chunk, then 1 carried over + 5 new -> 6 chunks, + 1 final job
    assert results["long"]["chunks"] == 6 and results["long"]["levels"] == 2 and results["long"]["jobs"] == 7
    # the final job of the long document summarizes the six map outputs
    reduce_prompt = backend.prompts[-1]
    assert reduce_prompt.startswith("These are summaries") and reduce_prompt.count("S") >= 6
    assert results["long"]["summary"] == backend.jobs[f"j{len(backend.jobs) - 1}"][1]


def test_failed_chunk_fails_only_its_document():
    docs = [Document("ok", "Fine."), Document("bad", "POISON here.")]
    run = SummarizeRun.create("r", docs, datetime(2030, 1, 1, tzinfo=UTC), 16)
    backend = FakeBackend(fail_on="POISON")
    while not run.step(backend, lambda t: [t]):
        pass
    res = {r["id"]: r for r in run.results()}
    assert res["ok"]["summary"] and res["bad"]["error"].startswith("1 job(s) failed")
    assert run.status == "completed" and run.progress()["documents_failed"] == 1


class FlakyBackend:
    """Each job of a prompt holding a key of ``fails`` ends as that key's result until the key's count runs out."""

    def __init__(self, fails: dict[str, tuple[int, JobResult]]):
        self.fails = dict(fails)
        self.jobs: dict[str, JobResult] = {}

    def submit(self, messages, max_tokens, deadline_at, app_id, prompt_tokens=None):
        job_id, prompt = f"j{len(self.jobs)}", messages[0]["content"]
        result = JobResult("succeeded", f"S{len(self.jobs)}.")
        for key, (left, failure) in self.fails.items():
            if key in prompt and left > 0:
                self.fails[key], result = (left - 1, failure), failure
        self.jobs[job_id] = result
        return job_id

    def poll(self, ids):
        return {j: self.jobs[j] for j in ids}


def by_sentence(text: str) -> list[str]:
    """A document's sentences, one chunk each; the summaries (S1. S2. ...) one chunk."""
    return [text] if text.startswith("S") else [p.strip() + "." for p in text.split(".") if p.strip()]


def _run(backend, docs, job_retries: int) -> dict[str, dict]:
    run = SummarizeRun.create("r", docs, datetime(2030, 1, 1, tzinfo=UTC), 16)
    steps = 0
    while not run.step(backend, by_sentence, job_retries):
        steps += 1
        assert steps < 20
    assert run.jobs_done == run.jobs_submitted == len(backend.jobs)
    return {r["id"]: r for r in run.results()}


def test_a_failed_chunk_job_is_retried_up_to_the_limit_then_fails_its_document_naming_why():
    engine_error = JobResult("failed", None, "engine error (gave up after 5 attempts)")
    docs = [Document("flaky", "Part one. FLAKY part two. Part three."), Document("broken", "Fine. BROKEN here.")]
    res = _run(FlakyBackend({"FLAKY": (2, engine_error), "BROKEN": (9, JobResult("expired", None, "relegated"))}),
               docs, job_retries=2)
    flaky, broken = res["flaky"], res["broken"]
    # two failures, two retries: the third job of the chunk made its summary
    assert flaky["summary"] and flaky["error"] is None and flaky["retries"] == 2 and flaky["jobs"] == 3 + 2 + 1
    assert flaky["retry_errors"] == ["level 1 chunk 2: failed: engine error (gave up after 5 attempts)"] * 2
    assert broken["summary"] is None and broken["retries"] == 2
    assert broken["error"] == ("1 job(s) expired after 2 retried job(s); level 1 chunk 2: expired: relegated "
                               "(not retried: its chunk had 2 retries)"), broken["error"]


def test_a_cancelled_job_or_one_the_engine_refused_is_not_retried():
    refused = JobResult("failed", None, "prompt too long", "invalid_request")
    docs = [Document("refused", "One. REFUSED two."), Document("cancelled", "One. STOPPED two.")]
    res = _run(FlakyBackend({"REFUSED": (1, refused), "STOPPED": (1, JobResult("cancelled", None, "by hand"))}),
               docs, job_retries=2)
    assert res["refused"]["retries"] == 0 and res["refused"]["jobs"] == 2
    assert res["refused"]["error"].endswith("failed: prompt too long (not retried: the engine refused its request)")
    assert res["cancelled"]["retries"] == 0 and res["cancelled"]["error"].endswith("(not retried: it was cancelled)")
    off = _run(FlakyBackend({"FLAKY": (1, JobResult("failed", None, "boom"))}), [Document("d", "A. FLAKY b.")], 0)
    assert off["d"]["error"] == "1 job(s) failed; level 1 chunk 2: failed: boom (not retried: retries are off)"


def test_an_empty_summary_fails_its_document_naming_the_chunk_and_is_not_retried():
    # the model ended its answer at once (EOS first) or wrote only whitespace: no summary to give the user
    docs = [Document("eos", "One. EOS two."), Document("blank", "BLANK one."), Document("ok", "Fine.")]
    res = _run(FlakyBackend({"EOS": (9, JobResult("succeeded", "")), "BLANK": (9, JobResult("succeeded", " \n "))}),
               docs, job_retries=2)
    assert res["eos"]["summary"] is None and res["blank"]["summary"] is None and res["ok"]["summary"]
    assert res["eos"]["error"] == ("1 job(s) empty; level 1 chunk 2: empty: the model's answer had no text (not "
                                   "retried: its jobs are greedy, so a retry would answer the same)"), res["eos"]
    assert res["blank"]["error"].startswith("1 job(s) empty; level 1 chunk 1: empty")
    assert res["eos"]["retries"] == res["blank"]["retries"] == 0


def test_a_retry_waits_out_a_backoff_that_doubles():
    backend = FlakyBackend({"FLAKY": (5, JobResult("failed", None, "boom"))})
    t0 = datetime(2030, 1, 1, tzinfo=UTC)
    doc = DocState("d", text="A. FLAKY b.")

    def planner(now):
        return Planner(backend, by_sentence, 16, t0 + timedelta(hours=1), now=now, job_retries=3, retry_backoff_s=10)

    assert advance_doc(doc, {}, planner(t0)).submitted == 2
    first = list(doc.pending)
    assert advance_doc(doc, backend.poll(first), planner(t0)).submitted == 0  # failed: its retry waits 10 s
    assert doc.retry_at == t0 + timedelta(seconds=10) and doc.pending == first and not doc.done
    assert advance_doc(doc, backend.poll(first), planner(t0 + timedelta(seconds=9))).submitted == 0
    assert advance_doc(doc, backend.poll(first), planner(t0 + timedelta(seconds=10))).submitted == 1
    assert doc.pending[0] == first[0] and doc.pending[1] != first[1] and doc.attempts == [0, 1]
    t1 = t0 + timedelta(seconds=30)
    advance_doc(doc, backend.poll(doc.pending), planner(t1))  # failed again: 20 s
    assert doc.retry_at == t1 + timedelta(seconds=20) and doc.retry_at is not None and doc.retries == 1


def test_levels_needed_counts_the_levels_of_the_longest_summaries():
    assert levels_needed(1, 1024, 64, 128) == 1 and levels_needed(2, 1024, 64, 128) == 2
    assert levels_needed(500, 1024, 64, 128) == 5  # 500 -> 68 -> 10 -> 2 -> 1 (a 2 MB document, default sizes)
    assert levels_needed(32, 64, 0, 31) == MAX_LEVELS  # halving: 32 -> 16 -> 8 -> 4 -> 2 -> 1
    assert levels_needed(50, 64, 0, 32) > MAX_LEVELS and levels_needed(10**9, 64, 0, 32) == MAX_LEVELS + 1


def test_loaders(tmp_path):
    (tmp_path / "a.md").write_text("# A\nText.")
    (tmp_path / "docs.jsonl").write_text('{"id": "x", "text": "X text"}\n{"id": "y", "text": "Y"}\n')
    assert [d.id for d in load_paths([tmp_path])] == ["a", "x", "y"]
    (tmp_path / "bad.jsonl").write_text('{"id": "z"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_paths([tmp_path / "bad.jsonl"])
    docs = specbench_summarization()
    assert len(docs) == 80 and all(d.text for d in docs)


def test_folders_name_files_that_share_a_name_by_their_path_and_jsonl_lines_end_at_newlines(tmp_path):
    (tmp_path / "guide").mkdir()
    for name in ("intro.md", "guide/intro.md", "a.txt", "a.md", "solo.txt"):
        (tmp_path / name).write_text(f"Text of {name}.")
    (tmp_path / "more.jsonl").write_text(json.dumps({"id": "u", "text": "one\u2028two\u0085three"},
                                                    ensure_ascii=False) + "\n", encoding="utf-8")
    docs = {d.id: d.text for d in load_paths([tmp_path])}
    assert docs == {"a.md": "Text of a.md.", "a.txt": "Text of a.txt.", "guide/intro.md": "Text of guide/intro.md.",
                    "intro.md": "Text of intro.md.", "u": "one\u2028two\u0085three", "solo": "Text of solo.txt."}
    (tmp_path / "again.jsonl").write_text('{"id": "solo", "text": "x"}\n')
    with pytest.raises(ValueError, match="given more than once: 'solo'"):
        load_paths([tmp_path])


def test_a_folder_leaves_out_hidden_files_and_the_runs_own_output_and_names_a_bad_file(tmp_path):
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "description.txt").write_text("a repository")
    (tmp_path / ".notes.md").write_text("hidden")
    (tmp_path / "doc.md").write_text("Text.")
    (tmp_path / "summaries.jsonl").write_text('{"id": "doc", "summary": "from the last run", "error": null}\n')
    assert [d.id for d in load_paths([tmp_path], skip=[tmp_path / "summaries.jsonl"])] == ["doc"]
    (tmp_path / "blank.txt").write_text("  \n\n")
    with pytest.raises(ValueError, match=r"blank\.txt: no text to summarize"):
        load_paths([tmp_path], skip=[tmp_path / "summaries.jsonl"])
    (tmp_path / "blank.txt").write_bytes(b"\xff\xfe not text")
    with pytest.raises(ValueError, match=r"blank\.txt: not UTF-8 text"):
        load_paths([tmp_path / "blank.txt"])


class CountingTokenizer:
    """A Hugging Face tokenizer that counts its calls and the texts each measured."""

    def __init__(self, tokenizer):
        self.tok, self.calls = tokenizer, []

    def __call__(self, text, **kwargs):
        self.calls.append(1 if isinstance(text, str) else len(text))
        return self.tok(text, **kwargs)


def test_the_token_splitter_measures_sentences_in_batches_and_a_long_text_once(tiny_model_dir):
    """The split called the tokenizer once a sentence, and first measured the whole document (as costly as all its
    sentences): it measures them a batch a call, and the whole text only where it may fit one chunk; the chunks are
    the ones sentence-at-a-time measuring makes."""
    from app.services.model_info import get_tokenizer
    from app.summarize.split import TokenSplitter

    tok = CountingTokenizer(get_tokenizer(str(tiny_model_dir)))
    text = " ".join(f"Fact number {i} is about the topic of the document." for i in range(1200))
    splitter = TokenSplitter(tok, 120, 8)
    chunks = splitter(text)
    assert len(tok.calls) <= 5 and sum(tok.calls) == 1200, tok.calls  # 1,200 sentences in 3 calls, not 1,201
    one_by_one = split_text(text, splitter.count, 120, 8, splitter.hard_split)
    assert chunks == one_by_one and len(chunks) > 100
    short = "The cat sat on the mat. It was warm."
    assert splitter(short) == [short]


def test_a_file_or_line_the_api_would_refuse_is_named_before_anything_is_sent(tmp_path):
    """A file of UTF-16 text (no BOM) or a binary one reads as UTF-8 holding NUL bytes, and a JSONL line may escape
    one; a line's id may be null (sent as "None"), empty or too long. The API refused them as documents.<n>, leaving
    the user to count which file or line that was: the loader names it, and what to do."""
    (tmp_path / "notes.txt").write_bytes("Meeting notes. We agreed.".encode("utf-16-le"))
    with pytest.raises(ValueError, match=r"notes\.txt: holds NUL bytes .*UTF-16"):
        load_paths([tmp_path])
    lines = {"nul.jsonl": {"id": "n", "text": "a\u0000b"}, "null.jsonl": {"id": None, "text": "Text."},
             "empty.jsonl": {"id": "", "text": "Text."}, "long.jsonl": {"id": "x" * 201, "text": "Text."},
             "object.jsonl": {"id": {"a": 1}, "text": "Text."}}
    for name, line in lines.items():
        (tmp_path / name).write_text('{"id": "ok", "text": "Fine."}\n' + json.dumps(line) + "\n")
    (tmp_path / "surrogate.jsonl").write_text('{"id": "s", "text": "a\\ud800b"}\n')
    for name, says in (("nul", "'text' contains a NUL"), ("surrogate", "'text' contains a lone surrogate"),
                       ("null", "'id' must be"), ("empty", "'id' must be"), ("long", "at most 200"),
                       ("object", "'id'")):
        with pytest.raises(ValueError, match=rf"{name}\.jsonl:\d: .*{says}"):
            load_paths([tmp_path / f"{name}.jsonl"])
    (tmp_path / "numbered.jsonl").write_text('{"id": 7, "text": "Seven."}\n{"text": "No id."}\n')
    assert [d.id for d in load_paths([tmp_path / "numbered.jsonl"])] == ["7", "numbered-2"]
