import math

from gpu_runtime.scheduler.chunking import ChunkBudget, build_search_space, decode_slack, min_slack

from tests.unit.scheduler.helpers import COST, batch, decoding, interactive


def test_slack_of_interactive_decode_is_next_token_deadline_minus_now():
    r = decoding(interactive("a", arrival=0.0, ttft=1.0, tbt=0.05), outputs=3, times=[0.5, 0.55, 0.6])
    # next token is the 4th: D_4 = 0 + 1.0 + 3*0.05 = 1.15
    assert math.isclose(decode_slack(r, now=1.0), 0.15)


def test_slack_of_batch_decode_is_time_left_per_remaining_token():
    r = decoding(batch("b", arrival=0.0, ttlt=100.0, max_tokens=11), outputs=1, times=[1.0])
    r.predicted_output_len = 11
    assert math.isclose(decode_slack(r, now=50.0), 5.0)  # 50 s left / 10 tokens


def test_min_slack_without_decodes_is_infinite():
    assert min_slack([], 0.0) == math.inf


def test_budget_is_largest_chunk_whose_predicted_time_with_safety_fits_slack():
    budget = ChunkBudget(COST, [64, 128, 256, 512, 1024], safety=1.2)
    r = decoding(interactive("a", ttft=1.0, tbt=0.05), outputs=1, times=[0.9])
    # slack at now=1.0: D_2 = 1.05 -> 0.05 s; time(c) = 0.010 + 1e-4*(c+1); *1.2 <= 0.05 -> c <= 315
    choice = budget.choose([r], now=1.0)
    assert choice.budget == 256
    assert math.isclose(choice.min_slack_s, 0.05)
    # more slack -> bigger chunk
    assert budget.choose([r], now=0.9).budget == 1024


def test_no_decodes_gives_the_top_of_the_space_and_late_decodes_the_smallest():
    budget = ChunkBudget(COST, [64, 128, 256])
    assert budget.choose([], now=0.0).budget == 256
    late = decoding(interactive("a", ttft=1.0, tbt=0.05), outputs=1, times=[0.9])
    assert budget.choose([late], now=5.0).budget == 64


def test_short_kv_searches_only_the_lower_half():
    budget = ChunkBudget(COST, [64, 128, 256, 512], kv_short_fraction=0.1)
    assert budget.choose([], 0.0, kv_free_fraction=0.5).budget == 512
    assert budget.choose([], 0.0, kv_free_fraction=0.05).budget == 128


def test_search_space_is_profile_driven():
    # linear model: throughput keeps rising towards 1/1e-4 -> saturation is large; with a
    # bigger fixed cost it saturates later.
    small = build_search_space(COST, floor=16, max_tokens=8192)
    assert small[0] == 16 and small == sorted(small)
    from gpu_runtime.costmodel.linear import PiecewiseLinearCostModel

    heavy = PiecewiseLinearCostModel([0.100, 0.0, 1e-4, 0.0, 0.0, 0.0], 0.0)
    assert build_search_space(heavy)[-1] > small[-1]
