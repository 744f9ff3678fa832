"""Summarization inputs: text/markdown files, folders of them, JSONL of ``{"id", "text"}``,
and SpecBench's summarization prompts (the demo)."""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from gpu_runtime.data import specbench_path

log = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt", ".md", ".markdown")


@dataclass(frozen=True)
class Document:
    id: str
    text: str


def _read(path: Path) -> str:
    """A file's text; ValueError naming the file where it is not UTF-8."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte {exc.start}); convert it or leave it out") from None


def _text_file(path: Path, doc_id: str) -> Document:
    text = _read(path)
    if not text.strip():
        raise ValueError(f"{path}: no text to summarize; leave it out")
    return Document(doc_id, text)


def load_jsonl(path: Path) -> list[Document]:
    docs = []
    # JSONL lines end at "\n" only (str.splitlines() would cut at a raw U+2028 inside a JSON string too)
    for i, line in enumerate(_read(path).split("\n"), 1):
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


def load_paths(paths: list[Path], skip: list[Path] | None = None) -> list[Document]:
    """Files (txt/md: one document each; jsonl: one per line) and folders of them. A folder's hidden files and
    folders (``.git``, ``.venv``) and the files in ``skip`` (the run's own output) are left out."""
    docs: list[Document] = []
    skipped = {p.resolve() for p in skip or []}
    for path in paths:
        if path.is_dir():
            docs += _load_folder(path, skipped)
        elif path.suffix.lower() == ".jsonl":
            docs += load_jsonl(path)
        elif path.is_file():
            docs.append(_text_file(path, path.stem))
        else:
            raise FileNotFoundError(path)
    seen = Counter(d.id for d in docs)
    if twice := sorted(i for i, n in seen.items() if n > 1):
        raise ValueError(f"document ids must be unique; given more than once: {', '.join(map(repr, twice[:5]))}")
    return docs


def _load_folder(folder: Path, skipped: set[Path]) -> list[Document]:
    """A folder's documents: a text file's id is its name without the suffix, or its path within the folder where
    two files share that name (``intro.md`` and ``guide/intro.md``, ``a.txt`` and ``a.md``)."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES + (".jsonl",)
                   and not any(part.startswith(".") for part in p.relative_to(folder).parts)
                   and p.resolve() not in skipped)
    stems = Counter(p.stem for p in files if p.suffix.lower() != ".jsonl")
    docs: list[Document] = []
    for p in files:
        if p.suffix.lower() == ".jsonl":
            docs += load_jsonl(p)
        else:
            docs.append(_text_file(p, p.stem if stems[p.stem] == 1 else p.relative_to(folder).as_posix()))
    return docs


def specbench_summarization(path: Path | None = None, limit: int | None = None) -> list[Document]:
    path = path or specbench_path()
    docs = []
    for line in path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        if row.get("category") == "summarization":
            docs.append(Document(f"specbench-{row['question_id']}", row["turns"][0]))
    return docs[:limit] if limit else docs
