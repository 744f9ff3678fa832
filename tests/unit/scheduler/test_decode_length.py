import statistics

from gpu_runtime.scheduler.decode_length import DecodeLengthHistory
from gpu_runtime.scheduler.registry import create_scheduler

from tests.unit.scheduler.helpers import COST, batch


def test_prediction_is_mean_plus_two_std_capped_by_max_tokens():
    h = DecodeLengthHistory(min_samples=3)
    data = [10, 20, 30, 40]
    for x in data:
        h.record("app", x)
    expected = statistics.mean(data) + 2 * statistics.stdev(data)
    assert h.predict("app", 1000) == int(-(-expected // 1))
    assert h.predict("app", 30) == 30
    assert h.predict("other", 77) == 77  # no history: max_tokens


def test_scheduler_sets_predicted_length_of_batch_jobs_from_finished_ones():
    s = create_scheduler("qoserve", cost_model=COST)
    for i, n in enumerate((5, 5, 5)):
        s.history.record("summ", n)
    r = batch("x", max_tokens=500, app="summ")
    s.add_request(r)
    assert r.predicted_output_len == 5
