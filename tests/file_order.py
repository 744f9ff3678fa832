"""The order the suite's test files run in: the heaviest first, so that pytest-xdist's two processes (``--dist
loadfile --no-loadscope-reorder``, scripts/test.sh) finish together. A file that starts late on one process while
the other runs out of files idles that one for the rest of it (longest-processing-time-first scheduling)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def file_rank(tests: Sequence[Any]) -> tuple[int, int, int]:
    """How early a file of ``tests`` (pytest items) runs, smallest first: files running the real model (the
    ``model`` mark: tens of seconds a test) by how many such tests they hold, then the ones starting real processes
    (``integration``, ``e2e``), then the rest; within each, the most tests first (pytest-xdist's own order)."""
    model = sum(1 for t in tests if t.get_closest_marker("model"))
    processes = any(t.get_closest_marker("integration") or t.get_closest_marker("e2e") for t in tests)
    return (-model, 0 if model or processes else 1, -len(tests))


def heaviest_files_first(items: list[Any]) -> None:
    """Reorders ``items`` in place: whole files by ``file_rank``, each file's tests in their own order."""
    files: dict[str, list[Any]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    items[:] = [t for tests in sorted(files.values(), key=file_rank) for t in tests]
