"""`coserve profile --from-steps`: a profile from a worker's step log, and clear errors for bad logs."""

from __future__ import annotations

from typer.testing import CliRunner

from app.cli import cli
from gpu_runtime.costmodel.features import BatchFeatures
from gpu_runtime.costmodel.profile import Profile
from gpu_runtime.vllm.step_log import StepLog, StepRecord


def test_profile_from_a_step_log(tmp_path):
    log_path = tmp_path / "steps.jsonl"
    log = StepLog(log_path)
    for i in range(30):
        f = BatchFeatures.of_shape(16 * (i % 4), 0, 1 + i % 5, 50)
        log.write(StepRecord(i * 0.05, 0.02 + 0.001 * f.total_tokens, 0.004 if i else None, f))
    log.close()
    out = tmp_path / "in-place.json"
    result = CliRunner().invoke(cli, ["profile", "--from-steps", str(log_path), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "29 in-place steps" in result.output and "host gap 4.0 ms" in result.output
    prof = Profile.load(out)
    assert prof.meta["source"] == "worker step log" and "fit" in prof.meta


def _words(output: str) -> str:
    """The error box's text as one line: where it wraps depends on the terminal and the temporary path's length."""
    return " ".join(output.replace("│", " ").split())


def test_missing_or_idle_logs_are_usage_errors(tmp_path):
    result = CliRunner().invoke(cli, ["profile", "--from-steps", str(tmp_path / "nope.jsonl")])
    assert result.exit_code == 2 and "no such step log" in _words(result.output)
    idle = tmp_path / "idle.jsonl"
    idle.write_text("")
    result = CliRunner().invoke(cli, ["profile", "--from-steps", str(idle)])
    assert result.exit_code == 2 and "was the worker busy" in _words(result.output), result.output
