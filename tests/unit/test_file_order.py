"""The suite's file order for pytest-xdist: the heaviest files first, each file's tests kept together in order."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tests.file_order import heaviest_files_first


@dataclass
class Item:
    """What the order reads of a pytest item: its node id and its marks."""

    nodeid: str
    marks: tuple[str, ...] = ()

    def get_closest_marker(self, name: str) -> pytest.Mark | None:
        return pytest.Mark(name, (), {}) if name in self.marks else None


def test_model_files_first_then_process_files_then_the_rest_by_size():
    items = [Item("tests/unit/test_a.py::one"), Item("tests/unit/test_a.py::two"), Item("tests/unit/test_a.py::three"),
             Item("tests/unit/test_b.py::one"),
             Item("tests/integration/test_c.py::one", ("integration",)),
             Item("tests/e2e/test_d.py::one", ("e2e",)), Item("tests/e2e/test_d.py::two", ("e2e",)),
             Item("tests/vllm/test_e.py::one", ("model", "integration")),
             Item("tests/vllm/test_f.py::one", ("model",)), Item("tests/vllm/test_f.py::two", ("model",)),
             Item("tests/vllm/test_f.py::Cls::three")]
    heaviest_files_first(items)
    assert [i.nodeid for i in items] == [
        "tests/vllm/test_f.py::one", "tests/vllm/test_f.py::two", "tests/vllm/test_f.py::Cls::three",  # 2 model tests
        "tests/vllm/test_e.py::one",  # 1 model test
        "tests/e2e/test_d.py::one", "tests/e2e/test_d.py::two",  # processes, 2 tests
        "tests/integration/test_c.py::one",
        "tests/unit/test_a.py::one", "tests/unit/test_a.py::two", "tests/unit/test_a.py::three",
        "tests/unit/test_b.py::one"]


def test_the_suites_conftest_orders_the_collected_files():
    """The collection hook of tests/conftest.py applies the order (scripts/test.sh keeps it for xdist)."""
    from tests import conftest

    items = [Item("tests/unit/test_a.py::one"), Item("tests/vllm/test_e.py::one", ("model",))]
    conftest.pytest_collection_modifyitems(items)
    assert [i.nodeid for i in items] == ["tests/vllm/test_e.py::one", "tests/unit/test_a.py::one"]
