"""Data files that ship inside the package: the Azure LLM inference traces (request
arrivals and token counts) and SpecBench's questions (real prompts). README.md in this
folder names their sources and licenses.

Every reader goes through these paths, so a clone or an installed wheel needs nothing
beside it; callers that take an explicit path still accept any other file."""

from __future__ import annotations

from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent
TRACES = ("conv", "code")  # the two Azure 2023 services: conversation and coding


def trace_path(name: str) -> Path:
    """The Azure LLM 2023 trace ``conv`` or ``code`` (CSV: TIMESTAMP, ContextTokens, GeneratedTokens)."""
    if name not in TRACES:
        raise ValueError(f"unknown trace {name!r}: one of {', '.join(TRACES)} (or pass a CSV path)")
    return DATA_DIR / "traces" / f"azure_llm_2023_{name}.csv"


def specbench_path() -> Path:
    """SpecBench's questions, one JSON object a line: question_id, category, turns."""
    return DATA_DIR / "datasets" / "spec_bench_questions.jsonl"
