"""docs/CLI.md, the reference of every command and option, is what Typer's docs generator makes of the CLI now: a
command or option added, renamed or re-described without regenerating it fails here."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT

REGENERATE = [sys.executable, "-m", "typer", "app.cli", "utils", "docs", "--name", "coserve",
              "--title", "coserve's command line"]


def test_the_cli_reference_is_the_clis_own_help():
    made = subprocess.run(REGENERATE, cwd=ROOT, capture_output=True, text=True, check=True, timeout=120).stdout
    written = ROOT.joinpath("docs/CLI.md").read_text()
    assert made.strip() == written.strip(), (
        "docs/CLI.md is out of date; regenerate it: .venv/bin/python -m typer app.cli utils docs --name coserve "
        "--title \"coserve's command line\" --output docs/CLI.md")
