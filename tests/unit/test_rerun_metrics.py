"""A rerun that went on from an earlier attempt's streamed tokens is one answer to its client: its metrics (TTFT,
TBT, SLO met) are counted over the whole stream (``gpu_runtime.metrics``), on hand-built requests."""

from dataclasses import replace

import numpy as np
import pytest

from gpu_runtime.metrics import request_metrics
from gpu_runtime.request import RequestStatus
from tests.unit.scheduler.helpers import interactive


def finished_rerun(own_times: list[float], delivered_times: list[float] | None = None):
    """TTFT 2 s, TBT 0.2 s, arrived at 0; the client got 10 tokens at 0.5, 0.7, ... 2.3 from attempt 1."""
    req = interactive("r", arrival=0.0, prompt=110, ttft=2.0, tbt=0.2, max_tokens=60)
    req.qos = replace(req.qos, delivered=10, first_token_s=0.5)
    req.delivered_times = [0.5 + 0.2 * i for i in range(10)] if delivered_times is None else delivered_times
    req.output_token_ids, req.token_times = [7] * len(own_times), list(own_times)
    req.status, req.finish_time = RequestStatus.FINISHED_LENGTH, own_times[-1]
    return req


def test_a_rerun_on_pace_meets_its_slo_with_its_earlier_attempts_first_token():
    # answer token 11 is due at 2 + 10 x 0.2 = 4 s: the rerun's first at 3 s is on time, though past the 2 s TTFT
    m = request_metrics(finished_rerun([3.0, 3.2]))
    assert m.ttft_s == 0.5 and m.slo_met is True and m.num_output_tokens == 2
    # the 0.7 s gap between the attempts, as the client waited, among the 0.2 s ones
    assert m.tbt_p99_s == pytest.approx(np.percentile([0.2] * 10 + [0.7], 99))
    assert m.mean_tpot_s == pytest.approx((3.2 - 0.5) / 11)


def test_a_rerun_that_stalled_misses_at_the_answers_token_where_the_client_waited_too_long():
    m = request_metrics(finished_rerun([6.0, 6.2]))
    assert m.ttft_s == 0.5 and m.slo_met is False
    assert (m.slo_miss.token, m.slo_miss.due_s, m.slo_miss.at_s) == (11, pytest.approx(4.0), 6.0)
    assert m.tbt_p99_s == pytest.approx(np.percentile([0.2] * 10 + [3.7], 99))


def test_a_rerun_whose_earlier_token_times_are_unknown_keeps_its_first_token_and_pace():
    m = request_metrics(finished_rerun([3.0, 3.2], delivered_times=[]))
    assert m.ttft_s == 0.5 and m.slo_met is True
    assert m.tbt_p50_s == pytest.approx(0.2)  # only the gaps known: the rerun's own
