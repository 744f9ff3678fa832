"""ops/bench_spec_vllm.py's table: paired rounds, the median speed-up over none's run of the same round."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

OPS = Path(__file__).resolve().parents[3] / "ops"


def _run(tok_s: float, tokens: list[int]) -> dict:
    return {"output_tokens": 100, "elapsed_s": 100 / tok_s, "tokens": {"p0": tokens}, "speculation": {"gamma": 0}}


def test_speed_ups_are_paired_by_round(monkeypatch):
    monkeypatch.syspath_prepend(str(OPS))
    import bench_spec_vllm

    results = {"none": [{"8": _run(10.0, [1])}, {"8": _run(20.0, [1])}, {"8": _run(10.0, [1])}],
               "nightjar": [{"8": _run(10.5, [1])}, {"8": _run(19.0, [1])}, {"8": _run(10.1, [1])}]}
    args = argparse.Namespace(batch=[8], policies=["none", "nightjar"], raw=False, max_tokens=96, dtype=None,
                              drafter="ngram", repeats=3)
    table = bench_spec_vllm.speedup_table(results, args)
    rows = list(zip(*(c._cells for c in table.columns)))
    assert rows[1][:6] == ("8", "nightjar", "10.5", "1.010", "0.950-1.050", "True")  # 1.05, 0.95, 1.01 paired
    assert rows[0][3] == "1.000"
    sys.modules.pop("bench_spec_vllm", None)
