"""A database URL that does not answer (or cannot be used: not a URL, no driver for it) and a model coserve cannot
serve are one line and an exit status from the commands that need them, not a traceback; `coserve up` and
`coserve worker` say so before starting anything (real migrations against a real closed port; no server runs)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from app.cli import cli
from tests.conftest import free_port

KEYS_COMMANDS = (["keys", "list"], ["keys", "create", "--tenant", "a"], ["keys", "limits", "--tenant", "a"],
                 ["keys", "revoke", "key_x"])


def _said(output: str) -> str:
    return " ".join(output.replace("│", " ").split())


@pytest.mark.parametrize("args", KEYS_COMMANDS, ids=lambda args: "-".join(args[:2]))
def test_keys_commands_say_in_a_line_that_the_database_does_not_answer(tmp_path, args):
    """`coserve keys list` with COSERVE_DATABASE_URL at a PostgreSQL that is down printed a 477-line traceback."""
    url = f"postgresql+psycopg2://coserve:secret@127.0.0.1:{free_port()}/coserve"
    res = CliRunner().invoke(cli, args, env={"COSERVE_DATABASE_URL": url, "COSERVE_DATA_DIR": str(tmp_path),
                                             "COLUMNS": "300"})
    said = _said(res.output)
    assert res.exit_code == 1 and "does not answer" in said and "Connection refused" in said, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert len(res.output.strip().splitlines()) == 1 and "secret" not in res.output, res.output


@pytest.mark.parametrize(("url", "says"), [("not a url", "COSERVE_DATABASE_URL is not a database URL"),
                                           ("nosuchdb://h/x", "no SQLAlchemy dialect"),
                                           ("mysql://u:secret@127.0.0.1/x", "driver")],
                         ids=["unparsed", "unknown-dialect", "driver-missing"])
def test_a_database_url_coserve_cannot_use_is_a_usage_error(tmp_path, url, says):
    res = CliRunner().invoke(cli, ["keys", "list"], env={"COSERVE_DATABASE_URL": url,
                                                         "COSERVE_DATA_DIR": str(tmp_path), "COLUMNS": "300"})
    assert res.exit_code == 2 and says in _said(res.output), res.output
    assert "Traceback" not in res.output and "secret" not in res.output, res.output


def test_up_whose_database_does_not_answer_stops_before_starting_anything(tmp_path):
    url = f"postgresql+psycopg2://coserve@127.0.0.1:{free_port()}/coserve"
    res = CliRunner().invoke(cli, ["up", "--port", str(free_port()), "--data-dir", str(tmp_path)],
                             env={"COSERVE_DATABASE_URL": url, "REDIS_URL": None, "COLUMNS": "300"})
    said = _said(res.output)
    assert res.exit_code == 1 and "does not answer" in said, res.output
    assert "redis-server" not in said and not (tmp_path / "redis").exists(), res.output  # no Redis was started
    from app.embedded import hold_data_dir

    hold_data_dir(tmp_path, "http://127.0.0.1:1").close()  # the data directory is free again


@pytest.mark.parametrize("command", [["up", "--port", "0"], ["worker"], ["profile", "--backend", "torch"]],
                         ids=["up", "worker", "profile"])
def test_a_model_coserve_cannot_find_is_refused_before_anything_starts(tmp_path, command):
    """`coserve up --model nope` started Redis, the API and a worker, whose death it explained with a line of
    triton's exit noise ("See https://nanobind.readthedocs.io/..."); `coserve worker --model nope` asked for
    REDIS_URL first, then died in a traceback; `coserve profile --model nope` ended in transformers' traceback
    about reaching huggingface.co."""
    args = [*command, "--model", str(tmp_path / "nowhere")]
    if command[0] == "up":
        args[2] = str(free_port())
    res = CliRunner().invoke(cli, args, env={"COSERVE_DATA_DIR": str(tmp_path), "REDIS_URL": None, "COLUMNS": "300"})
    said = _said(res.output)
    assert res.exit_code == 2 and "neither a bundled name nor a checkpoint directory" in said, res.output
    assert "--model" in said, res.output
    assert not (tmp_path / "credentials.json").exists() and not (tmp_path / "redis").exists(), res.output
