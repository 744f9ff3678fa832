"""README.md names every setting app/settings.py reads and every COSERVE_ variable the code reads from the environment
outside it, and every COSERVE_ variable README.md or an operator's doc (ops/compose/*.md) names is one that is read,
so a deployment's operator finds each knob in the README and no documented knob is silently ignored."""

from __future__ import annotations

import re

from app.settings import Settings
from tests.conftest import ROOT

# `COSERVE_VLLM_*` is the README's name for the vLLM settings as a group
GROUPS = {"COSERVE_VLLM_"}
# read from the environment but no operator's knob: the benchmarks' hook that swaps a worker's engine stack
INTERNAL = {"COSERVE_ENGINE_FACTORY"}
# a variable read outside the settings object: os.environ / getenv in Python, ${NAME in a shell script
ENV_READ = re.compile(r"""(?:environ(?:\.get)?[(\[]|getenv\()["'](COSERVE_[A-Z0-9_]+)|\$\{(COSERVE_[A-Z0-9_]+)""")
# the test suite's own switches a user runs it with (README's set-up part names them)
TEST_SWITCHES = (ROOT / "tests" / "postgres.py",)
OPERATOR_DOCS = ("README.md", *sorted(str(p.relative_to(ROOT)) for p in ROOT.joinpath("ops/compose").glob("*.md")))


def _variable(name: str) -> str:
    alias = Settings.model_fields[name].validation_alias
    return alias if isinstance(alias, str) else f"COSERVE_{name.upper()}"


def _settings() -> set[str]:
    return {_variable(n) for n in Settings.model_fields}


def _read_elsewhere() -> set[str]:
    """The COSERVE_ variables the service, the workers, the runtime, the scripts and the suite's switches read from
    the environment."""
    files = [p for d in ("app", "workers", "gpu_runtime", "scripts") for p in ROOT.joinpath(d).rglob("*")
             if p.suffix in (".py", ".sh")] + list(TEST_SWITCHES)
    return {a or b for p in files for a, b in ENV_READ.findall(p.read_text())} - _settings()


def test_every_setting_is_in_the_readme():
    readme = ROOT.joinpath("README.md").read_text()
    missing = [v for v in sorted(_settings()) if not re.search(rf"\b{v}\b", readme)]
    assert missing == [], f"README.md does not name these settings (app/settings.py): {missing}"


def test_every_variable_read_outside_the_settings_is_in_the_readme():
    readme = ROOT.joinpath("README.md").read_text()
    missing = [v for v in sorted(_read_elsewhere() - INTERNAL) if not re.search(rf"\b{v}\b", readme)]
    assert missing == [], f"README.md does not name these variables the code reads: {missing}"


def test_every_coserve_variable_the_docs_name_is_read():
    read = _settings() | _read_elsewhere() | GROUPS
    for doc in OPERATOR_DOCS:
        unread = sorted(set(re.findall(r"\bCOSERVE_[A-Z0-9_]+", ROOT.joinpath(doc).read_text())) - read)
        assert unread == [], f"{doc} names variables nothing reads: {unread}"


# "`COSERVE_LEASE_SECONDS` (30: ...", "`COSERVE_MAX_LORAS` (default 4)", "`COSERVE_STREAM_OUTAGE_S` (default 60 s)"
STATED_DEFAULT = re.compile(r"`(COSERVE_[A-Z0-9_]+)`,? \((?:default )?([0-9][0-9,.]*)(?: s)?[:),;]")


def test_the_defaults_the_docs_state_are_the_settings_defaults():
    defaults = {_variable(n): f.default for n, f in Settings.model_fields.items()}
    checked = 0
    for doc in OPERATOR_DOCS:
        text = " ".join(ROOT.joinpath(doc).read_text().split())  # a statement may wrap
        stated = [(name, value) for name, value in STATED_DEFAULT.findall(text) if name in defaults]
        wrong = [(name, value, defaults[name]) for name, value in stated
                 if float(value.replace(",", "")) != defaults[name]]
        assert wrong == [], f"{doc} states defaults the settings do not have: {wrong}"
        checked += len(stated)
    assert checked >= 10  # the pattern still finds the statements (19 when it was written)


def test_the_readme_names_the_worker_id_coserve_up_gives_its_worker():
    """README said a worker's id is `host-pid`, and so it is for `coserve worker`; the worker `coserve up` starts is
    `host-<pid of coserve up>` (unless COSERVE_WORKER_ID), so that each one it starts again takes up its
    predecessor's queue (tests/integration/test_embedded_up.py checks the id itself)."""
    text = " ".join(ROOT.joinpath("README.md").read_text().split())  # a statement may wrap
    stated = text[text.index("`COSERVE_WORKER_ID` (") :].split("),", 1)[0]
    assert "`host-pid` by default" in stated and "`coserve up` starts is `host-<pid of coserve up>`" in stated
