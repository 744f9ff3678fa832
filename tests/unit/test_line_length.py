"""The house rule on line length: no line of a tracked ``.py`` file is longer than 120 characters."""

from __future__ import annotations

import subprocess

from tests.conftest import ROOT

MAX_LINE = 120


def tracked_python_files() -> list[str]:
    """The repository's ``.py`` files as git tracks them (CI runs the suite in a clone, so git knows them)."""
    listing = subprocess.run(["git", "ls-files", "-z", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    return [path for path in listing.stdout.split("\0") if path]


def long_lines(path: str) -> list[str]:
    """``path:line (length)`` for each line of ``path`` over ``MAX_LINE`` characters."""
    text = (ROOT / path).read_text(encoding="utf-8")
    return [f"{path}:{number} ({len(line)})" for number, line in enumerate(text.splitlines(), 1)
            if len(line) > MAX_LINE]


def test_no_tracked_python_line_is_over_120_characters():
    files = tracked_python_files()
    assert "tests/unit/test_line_length.py" in files  # the listing is the repository's, not an empty one
    over = [hit for path in files for hit in long_lines(path)]
    assert over == [], f"lines over {MAX_LINE} characters (wrap them): {over}"
