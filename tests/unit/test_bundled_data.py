"""The traces and SpecBench questions ship inside the package with their licenses, and
nothing looks for them outside the repository (a user's clone has nothing beside it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpu_runtime.data import DATA_DIR, specbench_path, trace_path

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["conv", "code"])
def test_traces_are_inside_the_package(name):
    path = trace_path(name)
    assert path.is_relative_to(REPO / "gpu_runtime")
    with path.open() as f:
        assert f.readline().strip() == "TIMESTAMP,ContextTokens,GeneratedTokens"
        assert f.readline().count(",") == 2


def test_unknown_trace_names_the_choices():
    with pytest.raises(ValueError, match="conv, code"):
        trace_path("chat")


def test_specbench_questions_are_inside_the_package():
    rows = [json.loads(line) for line in specbench_path().read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 480
    assert sum(r["category"] == "summarization" for r in rows) == 80


def test_licenses_and_citation_travel_with_the_data():
    assert "Apache License" in (DATA_DIR / "datasets" / "SPEC_BENCH_LICENSE").read_text()
    azure = (DATA_DIR / "traces" / "AzureLLMInferenceDataset2023.md").read_text()
    assert "CC-BY" in azure and "Splitwise" in azure
    readme = (DATA_DIR / "README.md").read_text()
    assert "Splitwise" in readme and "Apache-2.0" in readme


def test_data_paths_lie_inside_the_repository():
    # CI (.ci/run) runs the whole suite in a clone alone in an empty folder: a read from beside the
    # repository fails there; this names the loaders' own paths
    assert all(p.is_relative_to(REPO) for p in (DATA_DIR, trace_path("conv"), specbench_path()))
