"""The compose image's build context: what the Dockerfile copies is sent, the local environment is not."""

from __future__ import annotations

import fnmatch
import re

from tests.conftest import ROOT


def _ignored(path: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatch(path, p) or fnmatch.fnmatch(path.split("/")[0], p) for p in patterns)


def test_the_build_context_holds_what_the_image_copies_and_leaves_the_environment_out():
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    copied = [src for line in (ROOT / "ops/compose/Dockerfile").read_text().splitlines()
              if (m := re.match(r"COPY\s+(.+)\s+\S+$", line)) for src in m.group(1).split()]
    assert copied and not [src for src in copied if _ignored(src, patterns)]
    assert all(_ignored(p, patterns) for p in (".venv", ".git", "data", "app/__pycache__"))
