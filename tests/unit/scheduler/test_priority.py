from gpu_runtime.scheduler.priority import LoadAdaptiveAlpha, hybrid_priority
from gpu_runtime.scheduler.request_queue import create_queue

from tests.unit.scheduler.helpers import batch, interactive


def test_eq4_interactive_priority():
    r = interactive("a", arrival=2.0, prompt=500, ttft=6.0)
    assert hybrid_priority(r, 0.008) == 2.0 + 6.0 + 0.008 * 500


def test_eq5_batch_priority_counts_predicted_decode():
    r = batch("b", arrival=1.0, prompt=100, ttlt=600.0, max_tokens=300)
    r.predicted_output_len = 50
    assert hybrid_priority(r, 0.001) == 1.0 + 600.0 + 0.001 * (100 + 50)


def test_alpha_zero_is_edf_and_large_alpha_is_shortest_first():
    long_early = interactive("long", arrival=0.0, prompt=4000, ttft=6.0)
    short_late = interactive("short", arrival=1.0, prompt=100, ttft=6.0)
    edf = sorted([short_late, long_early], key=lambda r: hybrid_priority(r, 0.0))
    assert [r.request_id for r in edf] == ["long", "short"]
    srpf = sorted([short_late, long_early], key=lambda r: hybrid_priority(r, 0.008))
    assert [r.request_id for r in srpf] == ["short", "long"]


def test_load_adaptive_alpha_switches_with_hysteresis():
    a = LoadAdaptiveAlpha(low_ms=1.0, high_ms=8.0, overload_at=1.0, underload_at=0.5)
    assert a.alpha_s == 0.001
    assert a.update(2.0) and a.alpha_s == 0.008
    assert not a.update(0.7) and a.alpha_s == 0.008  # between thresholds: stays high
    assert a.update(0.2) and a.alpha_s == 0.001


def test_priority_queue_pops_in_key_order_with_lazy_removal():
    q = create_queue("priority", lambda r: r.prompt_len)
    reqs = [interactive(f"r{n}", prompt=n) for n in (30, 10, 20, 40)]
    for r in reqs:
        q.push(r)
    assert q.remove("r10") is not None and "r10" not in q
    assert [q.pop().request_id for _ in range(3)] == ["r20", "r30", "r40"]
    assert q.pop() is None and len(q) == 0


def test_fcfs_and_deadline_queues():
    a = interactive("a", arrival=0.0, ttft=10.0)
    b = batch("b", arrival=1.0, ttlt=2.0)
    fcfs, edf = create_queue("fcfs"), create_queue("deadline")
    for r in (b, a):
        fcfs.push(r)
        edf.push(r)
    assert fcfs.pop() is a
    assert edf.pop() is b  # deadline 3.0 < 10.0
