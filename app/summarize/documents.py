"""Summarization inputs: text/markdown files, folders of them, JSONL of ``{"id", "text"}``,
and SpecBench's summarization prompts (the demo)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from gpu_runtime.data import specbench_path

log = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt", ".md", ".markdown")


@dataclass(frozen=True)
class Document:
    id: str
    text: str


def load_jsonl(path: Path) -> list[Document]:
    docs = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{i}: not valid JSON ({exc.msg})") from exc
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str) or not obj["text"].strip():
            raise ValueError(f"{path}:{i}: each line needs a non-empty 'text' (and an 'id')")
        docs.append(Document(str(obj.get("id", f"{path.stem}-{i}")), obj["text"]))
    return docs


def load_paths(paths: list[Path]) -> list[Document]:
    """Files (txt/md: one document each; jsonl: one per line) and folders of them."""
    docs: list[Document] = []
    for path in paths:
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.suffix.lower() in TEXT_SUFFIXES + (".jsonl",))
            docs += load_paths(files)
        elif path.suffix.lower() == ".jsonl":
            docs += load_jsonl(path)
        elif path.is_file():
            docs.append(Document(path.stem, path.read_text(encoding="utf-8")))
        else:
            raise FileNotFoundError(path)
    ids = [d.id for d in docs]
    if len(set(ids)) != len(ids):
        raise ValueError("document ids must be unique")
    return docs


def specbench_summarization(path: Path | None = None, limit: int | None = None) -> list[Document]:
    path = path or specbench_path()
    docs = []
    for line in path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        if row.get("category") == "summarization":
            docs.append(Document(f"specbench-{row['question_id']}", row["turns"][0]))
    return docs[:limit] if limit else docs
