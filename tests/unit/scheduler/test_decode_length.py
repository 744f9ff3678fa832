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


def test_a_job_past_its_prediction_is_re_estimated_from_longer_ones():
    h = DecodeLengthHistory(min_samples=3)
    for x in [10] * 40 + [100, 120, 140]:
        h.record("app", x)
    assert h.predict("app", 1000) < 100  # mean + 2 std of all: the long tail is above it
    longer = [100, 120, 140]
    expected = statistics.mean(longer) + 2 * statistics.stdev(longer)
    assert h.predict_beyond("app", 50, 1000) == int(-(-expected // 1))
    assert h.predict_beyond("app", 150, 1000) == 300  # nothing longer known: twice what it has
    assert h.predict_beyond("app", 600, 1000) == 1000  # capped at max_tokens
    assert h.predict_beyond("app", 1000, 1000) == 1000


def test_scheduler_re_predicts_a_decode_that_outlived_its_prediction():
    s = create_scheduler("qoserve", cost_model=COST)
    for _ in range(3):
        s.history.record("summ", 5)
    r = batch("x", prompt=10, max_tokens=500, app="summ", ttlt=100.0)
    s.add_request(r)
    assert r.predicted_output_len == 5
    out = s.schedule(now=0.0)
    for p in out.prefills:
        p.request.num_computed_tokens += p.num_tokens
        p.request.output_token_ids.append(7)
        p.request.token_times.append(0.1)
    s.update_from_output(out, 0.1)
    for i in range(5):
        out = s.schedule(now=0.2 + i)
        assert out.decodes == [r]
        r.num_computed_tokens += 1
        r.output_token_ids.append(7)
        r.token_times.append(0.3 + i)
        s.update_from_output(out, 0.3 + i)
    assert r.num_output_tokens == 6 and r.predicted_output_len == 10  # re-estimated at 5: doubled
