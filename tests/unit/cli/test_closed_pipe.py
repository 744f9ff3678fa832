"""A command whose stdout reader goes away (`coserve keys list --json | head -1`) stops as a Unix tool does: quietly,
exit status 128 + SIGPIPE. A real pipe whose reading end is closed before the command writes (it starts up first)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from app.cli import cli
from app.cli.output import PIPE_CLOSED
from tests.conftest import ROOT


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A database with a few keys (`keys list` prints them without a server)."""
    path = tmp_path_factory.mktemp("pipe")
    for tenant in ("a", "b", "c"):
        res = CliRunner().invoke(cli, ["keys", "create", "--tenant", tenant], env={"COSERVE_DATA_DIR": str(path)})
        assert res.exit_code == 0, res.output
    return path


@pytest.mark.parametrize("args", [["keys", "list", "--json"], ["keys", "list"]], ids=["json", "table"])
def test_a_closed_stdout_pipe_ends_the_command_quietly_with_sigpipes_status(data_dir, args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("COSERVE_")}
    env.update(COSERVE_DATA_DIR=str(data_dir), PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", *args], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the command has written a byte
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert proc.wait(60) == PIPE_CLOSED == 141 and err == "", err
