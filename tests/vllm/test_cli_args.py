"""vLLM engine options on a worker's command line, as `vllm serve` takes them: read with vLLM's own parser into
the engine arguments they set, refused before anything starts when vLLM's parser or coserve refuses them."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from app.cli import cli
from gpu_runtime.vllm.build import engine_args
from gpu_runtime.vllm.cli_args import engine_cli_args, operator_engine_args


def test_the_flags_set_only_the_fields_they_name():
    got = engine_cli_args("--tensor-parallel-size 2 --gpu-memory-utilization=0.85 --no-enable-prefix-caching "
                          "--speculative-config '{\"method\": \"ngram\", \"num_speculative_tokens\": 3}'")
    assert got == {"tensor_parallel_size": 2, "gpu_memory_utilization": 0.85, "enable_prefix_caching": False,
                   "speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}
    assert engine_cli_args("") == engine_cli_args([]) == {}
    # what the flags leave alone stays the worker's (max_model_len), not vLLM's default
    args = engine_args("smollm2-135m", max_model_len=2048, max_num_seqs=16,
                       overrides=engine_cli_args(["--max-num-seqs", "7", "--block-size", "64"]))
    assert (args.max_num_seqs, args.block_size, args.max_model_len) == (7, 64, 2048)


def test_the_flags_win_over_the_json_engine_args():
    both = operator_engine_args({"max_num_seqs": 9, "block_size": 32}, "--max-num-seqs 7")
    assert both == {"max_num_seqs": 7, "block_size": 32}


@pytest.mark.parametrize(("argv", "message"), [
    ("--tensor-paralel-size 2", "unrecognized arguments: --tensor-paralel-size 2"),
    ("--max-num-seqs lots", "argument --max-num-seqs: invalid int value: 'lots'"),
    ("stray", "unrecognized arguments: stray"),
])
def test_a_flag_vllm_refuses_is_named(argv, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        engine_cli_args(argv)


def test_a_flag_coserve_sets_itself_is_refused():
    with pytest.raises(ValueError, match=re.escape("may not set 'scheduler_cls'")):
        engine_args("smollm2-135m", overrides=engine_cli_args("--scheduler-cls some.Scheduler"))


def test_coserve_worker_passes_its_trailing_flags_to_the_engine(monkeypatch):
    import workers.gpu_worker

    started = []
    monkeypatch.setattr(workers.gpu_worker, "run_worker", started.append)
    monkeypatch.setenv("COSERVE_BACKEND", "vllm")
    monkeypatch.setenv("COSERVE_VLLM_ARGS", "--max-num-seqs 9 --block-size 32")
    res = CliRunner().invoke(cli, ["worker", "--worker-id", "w9", "--max-num-seqs", "7", "--enforce-eager"])
    assert res.exit_code == 0, res.output
    (settings,) = started
    assert settings.worker_id == "w9"
    assert settings.vllm_args == "--max-num-seqs 9 --block-size 32 --max-num-seqs 7 --enforce-eager"
    # the command line's flags come last: they win over the environment's
    assert operator_engine_args({}, settings.vllm_args) == {"max_num_seqs": 7, "block_size": 32,
                                                           "enforce_eager": True}


@pytest.mark.parametrize("command", ["worker", "up"])
def test_a_refused_flag_stops_the_command_before_anything_starts(monkeypatch, tmp_path, command):
    import workers.gpu_worker

    monkeypatch.setattr(workers.gpu_worker, "run_worker", lambda _s: pytest.fail("the worker started"))
    monkeypatch.setenv("COSERVE_BACKEND", "vllm")
    res = CliRunner().invoke(cli, [command, "--max-num-seqs", "lots"], env={"COSERVE_DATA_DIR": str(tmp_path)})
    assert res.exit_code == 2, res.output
    assert "invalid int value: 'lots'" in " ".join(res.output.split())
    assert not (tmp_path / "logs").exists()  # `up` started nothing
    # what vLLM takes but coserve refuses (a worker is one replica; coserve sets the scheduler) stops it there too
    for flags, message in ((["--data-parallel-size", "2"], "run a worker per replica"),
                           (["--scheduler-cls", "some.Scheduler"], "may not set 'scheduler_cls'")):
        res = CliRunner().invoke(cli, [command, *flags], env={"COSERVE_DATA_DIR": str(tmp_path)})
        assert res.exit_code == 2 and message in " ".join(res.output.replace("│", " ").split()), res.output
    assert not (tmp_path / "logs").exists()
    monkeypatch.setenv("COSERVE_BACKEND", "torch")
    res = CliRunner().invoke(cli, [command, "--max-num-seqs", "4"], env={"COSERVE_DATA_DIR": str(tmp_path)})
    assert res.exit_code == 2 and "need the vLLM backend" in " ".join(res.output.split()), res.output


def test_the_flags_context_length_holds_jobs_on_the_api_and_the_worker(tmp_path, tiny_model_dir):
    from app.cli.service_cmds import _split_env
    from app.services.model_info import context_length
    from tests.conftest import make_settings

    settings = make_settings(tmp_path, "sqlite://", "", tiny_model_dir).model_copy(update={"backend": "vllm"})
    assert context_length(settings) == 512  # the tiny model's
    assert context_length(settings.model_copy(update={"vllm_args": "--max-model-len 100"})) == 100  # a worker's
    # `coserve up --max-model-len 100`: the worker takes the flags, the API the context length alone
    flags = "--max-model-len 100 --max-num-seqs 8"
    api, worker = _split_env({"PATH": "/bin"}, flags, engine_cli_args(flags))
    assert api == {"PATH": "/bin", "COSERVE_VLLM_ARGS": "", "COSERVE_VLLM_MAX_MODEL_LEN": "100"}
    assert worker == {"PATH": "/bin", "COSERVE_VLLM_ARGS": flags}
    assert _split_env({}, "--max-num-seqs 8", {"max_num_seqs": 8})[0] == {"COSERVE_VLLM_ARGS": ""}


def test_the_flags_lora_rank_holds_adapter_loads_on_the_api():
    """`coserve up --max-lora-rank 8`: the engine serves runtime adapters up to rank 8, and the API, which does not
    read the flags, is told that rank (COSERVE_MAX_LORA_RANK): a rank-16 adapter is refused at load."""
    from app.cli.service_cmds import _split_env
    from app.settings import Settings
    from gpu_runtime.vllm.lora import runtime_rank_limit

    flags = "--max-lora-rank 8"
    api, worker = _split_env({}, flags, engine_cli_args(flags))
    assert api == {"COSERVE_VLLM_ARGS": "", "COSERVE_MAX_LORA_RANK": "8"} and worker == {"COSERVE_VLLM_ARGS": flags}
    assert Settings(max_lora_rank=int(api["COSERVE_MAX_LORA_RANK"])).max_lora_rank == 8
    assert runtime_rank_limit(8, {}) == runtime_rank_limit(16, engine_cli_args(flags)) == 8


def test_up_reads_the_flags_of_the_environment_too(monkeypatch):
    """`COSERVE_VLLM_ARGS=--max-model-len 100 coserve up`: its API holds jobs to 100 tokens as with the flag given."""
    import click
    import typer

    from app.cli.options import vllm_flags
    from app.settings import Settings

    def ctx(*args: str) -> typer.Context:
        context = typer.Context(click.Command("up"), info_name="up")
        context.args = list(args)  # what click leaves of the command line after the command's own options
        return context

    settings = Settings(backend="vllm", vllm_args="--max-model-len 100")
    assert vllm_flags(ctx(), settings) == ("--max-model-len 100", {"max_model_len": 100})
    assert vllm_flags(ctx("--max-model-len", "64"), settings) == ("--max-model-len 100 --max-model-len 64",
                                                                  {"max_model_len": 64})
    assert vllm_flags(ctx(), Settings(backend="vllm")) == ("", {})


def test_the_api_holds_jobs_to_the_context_the_engine_gets(tmp_path, tiny_model_dir):
    """The operator's engine arguments win over COSERVE_VLLM_MAX_MODEL_LEN in the engine (engine_args), and so in
    the API's context length: a smaller setting beside them does not hold jobs to less than the engine serves."""
    from app.services.model_info import context_length
    from tests.conftest import make_settings

    settings = make_settings(tmp_path, "sqlite://", "", tiny_model_dir).model_copy(
        update={"backend": "vllm", "vllm_max_model_len": 64})
    assert context_length(settings) == 64
    assert context_length(settings.model_copy(update={"vllm_engine_args": {"max_model_len": 200}})) == 200
    both = settings.model_copy(update={"vllm_engine_args": {"max_model_len": 200}, "vllm_args": "--max-model-len 100"})
    assert context_length(both) == 100 == engine_args("smollm2-135m", max_model_len=64, overrides=operator_engine_args(
        both.vllm_engine_args, both.vllm_args)).max_model_len


def test_coserve_profile_takes_the_flags_the_worker_takes(monkeypatch, tmp_path):
    """`coserve profile --backend vllm` times the engine the worker's flags build; flags it cannot use stop it first."""
    import gpu_runtime.vllm.build

    built = []

    class Built(Exception):
        pass

    def build(model, device, scheduler_policy, overrides):  # the engine's arguments are what is checked here
        built.append(overrides)
        raise Built

    monkeypatch.setattr(gpu_runtime.vllm.build, "build_vllm_engine", build)
    monkeypatch.setenv("COSERVE_VLLM_ENGINE_ARGS", '{"max_num_seqs": 9, "block_size": 32}')
    monkeypatch.setenv("COSERVE_VLLM_ARGS", "--max-num-seqs 8")
    out = str(tmp_path / "p.json")
    res = CliRunner().invoke(cli, ["profile", "--backend", "vllm", "--device", "cpu", "--out", out,
                                   "--max-num-seqs", "7", "--enforce-eager"])
    assert isinstance(res.exception, Built), res.output
    assert built == [{"max_num_seqs": 7, "block_size": 32, "enforce_eager": True}]
    for argv, message in [(["--backend", "vllm", "--max-num-seqs", "lots"], "invalid int value: 'lots'"),
                          (["--backend", "torch", "--max-num-seqs", "4"], "need the vLLM backend"),
                          (["--from-steps", out, "--max-num-seqs", "4"], "it builds no engine")]:
        res = CliRunner().invoke(cli, ["profile", "--device", "cpu", "--out", out, *argv])
        assert res.exit_code == 2 and message in " ".join(res.output.replace("│", " ").split()), res.output
    assert len(built) == 1
