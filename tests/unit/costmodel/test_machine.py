"""Which machine a profile was measured on, and the vLLM profile ``auto`` picks for this one."""

from __future__ import annotations

import json

import pytest

from gpu_runtime.costmodel.machine import Machine, cpu_machine, isa_of, match_score

AMX_CPUINFO = """processor	: 0
vendor_id	: GenuineIntel
model name	: Intel(R) Xeon(R) Processor
flags		: fpu sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8
"""


def test_the_widest_instruction_set_names_the_cpu():
    assert isa_of({"avx2", "avx512f", "amx_bf16"}) == "amx"
    assert isa_of({"sse2", "avx2", "avx512f"}) == "avx512"
    assert isa_of({"sse2", "avx2"}) == "avx2"
    assert isa_of({"asimd"}) == "neon"
    assert isa_of({"sse2"}) == ""


def test_cpu_machine_reads_model_and_flags_from_cpuinfo():
    m = cpu_machine(AMX_CPUINFO)
    assert m == Machine("cpu", "Intel(R) Xeon(R) Processor", "amx")
    assert Machine.from_dict(m.as_dict()) == m
    assert Machine.from_dict(None) is None and Machine.from_dict({}) is None


def test_match_prefers_the_same_cpu_then_the_same_instruction_set():
    here = Machine("cpu", "Xeon A", "amx")
    assert match_score(Machine("cpu", "Xeon A", "amx"), here) == 3
    assert match_score(Machine("cpu", "Xeon B", "amx"), here) == 2
    assert match_score(Machine("cpu", "Xeon A", "avx512"), here) == 1
    assert match_score(Machine("cuda", "NVIDIA H100"), here) == 0
    assert match_score(None, here) == 0
    gpu = Machine("cuda", "NVIDIA H100 80GB HBM3")
    assert match_score(Machine("cuda", "NVIDIA H100 80GB HBM3"), gpu) == 3
    assert match_score(Machine("cuda", "NVIDIA A100-SXM4-80GB"), gpu) == 1


def _write(folder, name: str, machine: dict | None, engine: str = "vllm") -> None:
    meta = {"engine": engine, **({"machine": machine} if machine else {})}
    (folder / f"{name}.json").write_text(json.dumps({"name": name, "meta": meta, "samples": []}))


@pytest.fixture()
def shipped(tmp_path):
    _write(tmp_path, "cpu-smollm2-135m-vllm", None)  # the first one: no machine recorded
    _write(tmp_path, "cpu-amx-smollm2-135m-vllm", {"device": "cpu", "model": "Xeon A", "isa": "amx"})
    _write(tmp_path, "cpu-smollm2-135m", {"device": "cpu", "model": "Xeon A", "isa": "amx"}, engine="torch")
    return tmp_path


def test_auto_picks_the_profile_of_a_cpu_like_this_one(shipped):
    from gpu_runtime.vllm.profiling import default_profile

    assert default_profile(Machine("cpu", "Xeon A", "amx"), shipped).endswith("cpu-amx-smollm2-135m-vllm.json")
    assert default_profile(Machine("cpu", "Xeon C", "amx"), shipped).endswith("cpu-amx-smollm2-135m-vllm.json")


def test_auto_falls_back_to_the_unrecorded_cpu_profile_and_says_so(shipped, caplog):
    from gpu_runtime.vllm.profiling import default_profile

    with caplog.at_level("WARNING"):
        chosen = default_profile(Machine("cpu", "EPYC", "avx512"), shipped)
    assert chosen.endswith("cpu-smollm2-135m-vllm.json")
    assert "coserve profile --backend vllm" in caplog.text and "EPYC" in caplog.text


def test_a_gpu_plans_only_with_a_profile_of_the_same_gpu(shipped):
    from gpu_runtime.vllm.profiling import default_profile

    assert default_profile(Machine("cuda", "NVIDIA H100"), shipped) is None
    _write(shipped, "cuda-h100-llama-vllm", {"device": "cuda", "model": "NVIDIA H100", "isa": ""})
    assert default_profile(Machine("cuda", "NVIDIA H100"), shipped).endswith("cuda-h100-llama-vllm.json")
    assert default_profile(Machine("cuda", "NVIDIA L4"), shipped) is None
