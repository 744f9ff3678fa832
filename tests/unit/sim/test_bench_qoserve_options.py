"""ops/bench_qoserve.py's tier mix and SLO options: parsing, the defaults (QoServe's evaluation, runs of
120 simulated minutes) and the mix the simulator draws requests from."""

from __future__ import annotations

import argparse
import collections
import random

import pytest

from gpu_runtime.qos import QoSClass, Tier
from gpu_runtime.sim.workload import TraceRow, build_requests, paper_tiers
from tests.conftest import ops_script


@pytest.fixture(scope="module")
def bench():
    return ops_script("bench_qoserve")


def test_defaults_are_the_papers_tiers_and_two_hour_runs(bench):
    args = bench.build_parser().parse_args([])
    assert args.minutes == 120.0
    workload = bench.workload_from_args(args)
    assert workload == bench.Workload()
    # The defaults reproduce the fixed tiers the script used before the options (equal thirds, all paid).
    for scale in (1.0, 6.29):
        got, want = workload.tiers(scale), paper_tiers(scale)
        assert [(t.name, t.qos) for t in got] == [(t.name, t.qos) for t in want]
        assert [t.share for t in got] == pytest.approx([t.share for t in want])
    assert [(t.name, t.qos) for t in workload.tiers(free_share=0.2)] == \
        [(t.name, t.qos) for t in paper_tiers(free_share=0.2)]
    assert workload.machines("silo") == 3 and workload.machines("qoserve") == 1


def test_options_set_the_mix_free_share_and_every_slo(bench):
    args = bench.build_parser().parse_args(
        ["--mix", "2:1:1", "--free-share", "0.25", "--ttft", "3", "--tbt", "0.1", "--q2-ttlt", "300",
         "--q3-ttlt", "900", "--slo-scale", "0.5", "--minutes", "150"])
    assert args.minutes == 150.0
    w = bench.workload_from_args(args)
    assert w.mix == pytest.approx((0.5, 0.25, 0.25))
    tiers = {t.name: t for t in w.tiers(profile_scale=2.0)}  # 0.5 (--slo-scale) x 2.0 (profile) = x1
    assert set(tiers) == {f"Q{i}-{k}" for i in (1, 2, 3) for k in ("paid", "free")}
    assert tiers["Q1-paid"].share == pytest.approx(0.5 * 0.75) and tiers["Q1-free"].share == pytest.approx(0.125)
    assert tiers["Q3-free"].share == pytest.approx(0.25 * 0.25)
    assert sum(t.share for t in tiers.values()) == pytest.approx(1.0)
    q1 = tiers["Q1-free"].qos
    assert q1.qos_class is QoSClass.INTERACTIVE and q1.tier is Tier.FREE
    assert (q1.ttft_s, q1.tbt_s) == pytest.approx((3.0, 0.1))
    assert tiers["Q2-paid"].qos.ttlt_s == pytest.approx(300.0) and tiers["Q3-paid"].qos.ttlt_s == pytest.approx(900.0)
    assert tiers["Q2-paid"].qos.tier is Tier.PAID
    assert "Q1 50%" in w.describe() and "25% free" in w.describe()


@pytest.mark.parametrize("text", ["1:2", "1:1:1:1", "-1:1:1", "0:0:0", "a:b:c"])
def test_bad_mixes_are_refused(bench, text):
    with pytest.raises(argparse.ArgumentTypeError):
        bench.parse_mix(text)
    with pytest.raises(SystemExit):  # argparse reports it as a usage error
        bench.build_parser().parse_args(["--mix", text])


def test_bad_shares_and_slos_are_refused(bench):
    with pytest.raises(SystemExit):
        bench.build_parser().parse_args(["--free-share", "1.5"])
    with pytest.raises(ValueError):
        bench.Workload(tbt_s=0.0)
    with pytest.raises(ValueError):
        bench.Workload(mix=(0.5, 0.5, 0.5))


def test_a_bucket_without_share_is_left_out(bench):
    w = bench.Workload(mix=bench.parse_mix("1:0:1"))
    assert [t.name for t in w.tiers()] == ["Q1", "Q3"]
    assert w.machines("silo") == 2  # a silo needs no replica for a bucket with no requests


def test_requests_follow_the_mix(bench):
    w = bench.Workload(mix=bench.parse_mix("0.6,0.3,0.1"), free_share=0.2)
    rows = (TraceRow(0.0, 100, 10),)
    n = 20000
    reqs = build_requests(rows, [0.01 * i for i in range(n)], w.tiers(), random.Random(3))
    counts = collections.Counter((r.qos.qos_class, r.qos.ttlt_s, r.qos.tier) for r in reqs)
    for tier in w.tiers():
        key = (tier.qos.qos_class, tier.qos.ttlt_s, tier.qos.tier)
        assert counts[key] / n == pytest.approx(tier.share, abs=0.015), tier.name
    free = sum(1 for r in reqs if r.qos.tier is Tier.FREE)
    assert free / n == pytest.approx(0.2, abs=0.015)
