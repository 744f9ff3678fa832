"""``coserve --help`` and every command's help: each option says what it is, and a paragraph of a docstring wraps as
one paragraph (Typer's rich help kept a docstring's line breaks, leaving a short line where the source broke)."""

from __future__ import annotations

import typer.main
from typer.testing import CliRunner

from app.cli import cli


def _commands(cmd, path=()):
    if hasattr(cmd, "commands"):
        for name, sub in cmd.commands.items():
            yield from _commands(sub, (*path, name))
    else:
        yield " ".join(path), cmd


def test_every_option_and_argument_has_help():
    missing = {path: names for path, cmd in _commands(typer.main.get_command(cli))
               if (names := [p.name for p in cmd.params if p.name != "help" and not getattr(p, "help", None)])}
    assert missing == {}


def test_a_docstring_paragraph_wraps_as_one():
    runner = CliRunner()
    out = runner.invoke(cli, ["--help"], env={"COLUMNS": "200", "TERMINAL_WIDTH": "200"}).output
    assert "coserve batch create or coserve summarize talk to it (credentials from coserve up" in out, out
    limits = runner.invoke(cli, ["keys", "limits", "--help"], env={"COLUMNS": "200", "TERMINAL_WIDTH": "200"}).output
    assert "API processes apply a rate limit's change within seconds" in limits, limits


def test_up_and_worker_say_what_their_options_default_to():
    """`coserve up --help` named no host, port or data directory, so a user had to read the code to learn that it
    serves 127.0.0.1:8000 from ./data (or what COSERVE_* says)."""
    runner = CliRunner()
    env = {"COLUMNS": "200", "TERMINAL_WIDTH": "200"}
    up = " ".join(runner.invoke(cli, ["up", "--help"], env=env).output.split())
    for shown in ("default: COSERVE_HOST, else 127.0.0.1", "default: COSERVE_PORT, else 8000",
                  "default: COSERVE_DATA_DIR, else ./data", "default: COSERVE_MODEL, else smollm2-135m",
                  "default: COSERVE_DEVICE, else auto"):
        assert shown in up, up
    worker = " ".join(runner.invoke(cli, ["worker", "--help"], env=env).output.split())
    assert "default: COSERVE_MODEL, else smollm2-135m" in worker and "COSERVE_WORKER_ID, else host-pid" in worker


def test_submit_says_where_the_targets_it_leaves_out_come_from():
    """`coserve submit --batch` without --deadline-s, or an interactive job without --ttft-ms / --tbt-ms, runs with
    the API's defaults; the help named none of them."""
    out = CliRunner().invoke(cli, ["submit", "--help"], env={"COLUMNS": "200", "TERMINAL_WIDTH": "200"}).output
    flat = " ".join(out.split())
    for setting in ("COSERVE_DEFAULT_TBT_MS", "COSERVE_DEFAULT_TTFT_MS", "COSERVE_DEFAULT_BATCH_WINDOW_S"):
        assert f"(default: the API's {setting})" in flat, out


def test_the_waiting_batch_commands_name_their_exit_statuses():
    """A script using `batch create --wait` (or `batch status --follow`) must know what each exit status means."""
    env = {"COLUMNS": "200", "TERMINAL_WIDTH": "200"}
    for command in (["batch", "create", "--help"], ["batch", "status", "--help"]):
        out = " ".join(CliRunner().invoke(cli, command, env=env).output.split())
        assert "0 every request succeeded; 1 the batch failed, expired or was cancelled, or not one of its requests " \
               "succeeded; 3 it completed with some requests failed" in out, out


def test_profile_profiles_the_model_and_device_the_worker_serves_unless_told(tmp_path, monkeypatch):
    """`coserve profile` defaulted to smollm2-135m on auto whatever COSERVE_MODEL said, while `coserve worker` serves
    COSERVE_MODEL: the profile the README says to point COSERVE_COST_PROFILE at was of another model."""
    from app.cli import runtime_cmds

    seen = {}
    monkeypatch.setattr(runtime_cmds, "_profile_vllm",  # the engine build and the timing (minutes) left out
                        lambda _console, model, _out, device, *_rest: seen.update(model=model, device=device))
    model_dir = tmp_path / "my-model"
    model_dir.mkdir()
    env = {"COSERVE_MODEL": str(model_dir), "COSERVE_DEVICE": "cpu", "COLUMNS": "200", "TERMINAL_WIDTH": "200"}
    out = str(tmp_path / "p.json")
    res = CliRunner().invoke(cli, ["profile", "--backend", "vllm", "--out", out], env=env)
    assert res.exit_code == 0 and seen == {"model": str(model_dir), "device": "cpu"}, (res.output, seen)
    res = CliRunner().invoke(cli, ["profile", "--backend", "vllm", "--out", out, "--model", "smollm2-135m"], env=env)
    assert res.exit_code == 0 and seen["model"] == "smollm2-135m", res.output  # the option wins over the setting
    shown = " ".join(CliRunner().invoke(cli, ["profile", "--help"], env=env).output.split())
    assert "default: COSERVE_MODEL, else smollm2-135m" in shown and "default: COSERVE_DEVICE, else auto" in shown


def test_every_command_that_shows_a_resource_says_what_its_json_prints():
    """`batch create|status|cancel` and `submit` had no --json; each --json help says what it prints (and that the
    waiting commands print the object as it ended)."""
    env = {"COLUMNS": "200", "TERMINAL_WIDTH": "200"}
    for command, says in ((["batch", "create"], "print the batch the API created (with --wait: as it ended) as JSON"),
                          (["batch", "status"], "print the batch (with --follow: once, as it ended) as the API's JSON"),
                          (["batch", "cancel"], "print the batch the API answered (cancelling or cancelled) as JSON"),
                          (["submit"],
                           "print the job as submitted (with --wait: as it ended, its text in output_text)"),
                          (["jobs"], "print the API's JSON instead of a table"),
                          (["summarize"], "print the run as the API answered it, alone on stdout: as it ended"),
                          (["keys", "create"], "print the new key as the admin API answers it"),
                          (["keys", "limits"], "print the tenant as the admin API answers it")):
        out = " ".join(CliRunner().invoke(cli, [*command, "--help"], env=env).output.split())
        assert says in out, (command, out)
