"""A benchmark measured on two checkouts of the code in one run: this one and a ``--baseline`` (the code before a
change, say). Each measurement runs in a process of its own that imports its checkout's code (``PYTHONPATH`` and
``COSERVE_CODE`` name it) and prints its figures on one ``RESULT`` line, which the parent reads back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from collections.abc import Callable
from typing import Any

RESULT = "RESULT "


def report(figures: dict[str, Any]) -> None:
    """A child's figures, for ``measure_in`` to read."""
    print(RESULT + json.dumps(figures), flush=True)


def checkouts(root: Path, baseline: str | None) -> list[tuple[str, str]]:
    """(label, code directory) of each checkout to measure: the baseline first, where there is one."""
    return ([("baseline", baseline)] if baseline else []) + [("this", str(root))]


def measure_in(script: str, code: str, args: list[str], what: str) -> dict[str, Any]:
    """Runs ``script`` with ``args`` in a process importing the checkout ``code`` and returns the figures it
    reported; exits saying ``what`` failed, with the child's output, where it reported none."""
    env = dict(os.environ, PYTHONPATH=code, COSERVE_CODE=code)
    proc = subprocess.run([sys.executable, str(Path(script).resolve()), *args], env=env, capture_output=True,
                          text=True, cwd=code)
    line = next((x for x in proc.stdout.splitlines() if x.startswith(RESULT)), None)
    if line is None:
        sys.exit(f"{what} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.loads(line[len(RESULT):])


def fresh_stack(prefix: str, context: int, redis_url: str | None = None) -> tuple[Path, Any, Any]:
    """A temporary directory with a migrated SQLite store, its API keys and the settings of a tiny model of
    ``context`` tokens, all from the code the child put first on ``sys.path`` (its checkout's): (dir, settings,
    keys)."""
    import tempfile

    from app.db.migrate import upgrade
    from tests.conftest import _tiny_llama, make_keys, make_settings

    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    db_url = f"sqlite:///{tmp / 'coserve.db'}"
    upgrade(db_url)
    keys = make_keys(db_url)
    return tmp, make_settings(tmp, db_url, redis_url, _tiny_llama(tmp / "model", context)), keys


def measured_rows(script: str, root: Path, baseline: str | None, runs: list[tuple[list[str], str]],
                  row: Callable[[str, dict[str, Any]], str]) -> list[str]:
    """Each run (the child's arguments, what it measures) on each checkout, the baseline first, as a table row
    (``row(label, figures)``), each printed as it comes."""
    rows = []
    for args, what in runs:
        for label, code in checkouts(root, baseline):
            rows.append(row(label, measure_in(script, code, args, f"{label} run of {what}")))
            print(rows[-1], flush=True)
    return rows
