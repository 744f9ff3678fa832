"""Summarization inputs: text/markdown files, folders of them, JSONL of ``{"id", "text"}``,
and SpecBench's summarization prompts (the demo)."""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from app.wire import find_unstorable, unstorable_message
from gpu_runtime.data import specbench_path

log = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt", ".md", ".markdown")
MAX_ID_CHARS = 200  # as the API takes a document's id


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
    if (at := text.find("\x00")) >= 0:  # valid UTF-8, but no text file holds one: the API refuses it
        raise ValueError(f"{path}: holds NUL bytes (the first at character {at}): a binary file, or UTF-16 text; "
                         "convert it to UTF-8 or leave it out")
    return Document(doc_id, text)


def _line_id(path: Path, number: int, obj: dict) -> str:
    """A JSONL line's ``id`` (a string, or a number as its digits; the file's stem and the line's number without
    one); ValueError naming the line where the API would refuse it."""
    doc_id = obj.get("id", f"{path.stem}-{number}")
    if isinstance(doc_id, int | float) and not isinstance(doc_id, bool):
        doc_id = str(doc_id)
    if not isinstance(doc_id, str) or not doc_id:
        raise ValueError(f"{path}:{number}: 'id' must be a non-empty string (or leave it out: the line is then "
                         f"{path.stem}-{number}); it is {json.dumps(doc_id)}")
    if len(doc_id) > MAX_ID_CHARS:
        raise ValueError(f"{path}:{number}: 'id' is {len(doc_id)} characters; give one of at most {MAX_ID_CHARS}")
    return doc_id


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
        if found := find_unstorable({k: obj.get(k) for k in ("id", "text")}):  # what the API would refuse
            where, char = found
            raise ValueError(f"{path}:{i}: its {where[0]!r} {unstorable_message(char)}")
        docs.append(Document(_line_id(path, i, obj), obj["text"]))
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
