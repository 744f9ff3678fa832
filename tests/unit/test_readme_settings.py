"""README.md names every setting app/settings.py reads, and every COSERVE_ variable it names is one that is read, so
a deployment's operator finds each knob in the README and no documented knob is silently ignored."""

from __future__ import annotations

import re

from app.settings import Settings
from tests.conftest import ROOT

# read outside the settings object: the log level (app/observability/logs.py) and the test runner's processes
# (scripts/test.sh); `COSERVE_VLLM_*` is the README's name for the vLLM settings as a group
READ_ELSEWHERE = {"COSERVE_LOG_LEVEL", "COSERVE_TEST_PROCESSES", "COSERVE_VLLM_"}


def _variable(name: str) -> str:
    alias = Settings.model_fields[name].validation_alias
    return alias if isinstance(alias, str) else f"COSERVE_{name.upper()}"


def test_every_setting_is_in_the_readme():
    readme = ROOT.joinpath("README.md").read_text()
    missing = [_variable(n) for n in Settings.model_fields if not re.search(rf"\b{_variable(n)}\b", readme)]
    assert missing == [], f"README.md does not name these settings (app/settings.py): {missing}"


def test_every_coserve_variable_the_readme_names_is_read():
    readme = ROOT.joinpath("README.md").read_text()
    read = {_variable(n) for n in Settings.model_fields} | READ_ELSEWHERE
    unread = sorted(set(re.findall(r"\bCOSERVE_[A-Z0-9_]+", readme)) - read)
    assert unread == [], f"README.md names variables nothing reads: {unread}"
