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


def test_no_decodes_gives_the_top_of_the_space_and_a_decode_about_to_miss_the_smallest():
    budget = ChunkBudget(COST, [64, 128, 256])
    assert budget.choose([], now=0.0).budget == 256
    tight = decoding(interactive("a", ttft=1.0, tbt=0.05), outputs=1, times=[0.9])
    assert budget.choose([tight], now=1.04).budget == 64  # D_2 = 1.05: 10 ms left fits nothing


def test_a_decode_behind_schedule_keeps_one_tbt_of_slack_instead_of_pinning_the_floor():
    # 4 s past its eq. 2 deadline: raw slack would be -3.95 s and pin the budget to 64 forever.
    late = decoding(interactive("a", ttft=1.0, tbt=0.05), outputs=1, times=[0.9])
    assert math.isclose(decode_slack(late, now=5.0), 0.05)
    # Produced its last token late but the next one is due within one TBT of it.
    behind = decoding(interactive("b", ttft=1.0, tbt=0.05), outputs=2, times=[0.9, 4.98])
    assert math.isclose(decode_slack(behind, now=5.0), 0.05)  # floor; max(D_3, 4.98 + 0.05) - now = 0.03
    relegated = decoding(interactive("c", ttft=1.0, tbt=0.05), outputs=1, times=[0.9])
    relegated.relegation_count = 1
    assert decode_slack(relegated, now=0.0) == 1.05  # plenty of slack stays plenty
    # A batch job past its TTLT (or relegated) cannot be helped by small chunks: it leaves the minimum.
    gone = decoding(batch("d", arrival=0.0, ttlt=10.0), outputs=1, times=[9.0])
    assert decode_slack(gone, now=11.0) == math.inf
    budget = ChunkBudget(COST, [64, 128, 256])
    assert budget.choose([late, behind, gone], now=5.0).budget == 256  # 0.0357 * 1.2 <= 0.05


def test_overload_cascade_keeps_prefill_throughput():
    """Bursty overload: every decode is already late. The budget must stay where one TBT fits,
    not collapse to the floor (which would slow prefills further and make every later job late)."""
    budget = ChunkBudget(COST, [16, 64, 128, 256, 512], safety=1.2)
    late = [decoding(interactive(f"i{k}", arrival=0.0, ttft=1.0, tbt=0.05), outputs=3, times=[2.0, 2.2, 2.4])
            for k in range(8)]
    late += [decoding(batch(f"b{k}", arrival=0.0, ttlt=2.0), outputs=2, times=[2.5, 2.6]) for k in range(4)]
    on_time = decoding(interactive("ok", arrival=2.0, ttft=1.0, tbt=0.05), outputs=1, times=[2.9])
    for now in (3.0, 10.0, 100.0):
        choice = budget.choose(late, now)
        assert choice.budget == 256 and choice.budget > 16
    # ... while a job still on schedule keeps its protection.
    assert budget.choose(late + [on_time], now=3.04).budget == 16


def test_min_slack_matches_decode_slack():
    reqs = [decoding(interactive("a", ttft=1.0, tbt=0.05), outputs=1, times=[0.9]),
            decoding(interactive("b", ttft=1.0, tbt=0.05), outputs=2, times=[0.9, 4.98]),
            decoding(batch("c", ttlt=100.0, max_tokens=11), outputs=1, times=[1.0])]
    for now in (0.5, 1.0, 1.04, 5.0, 50.0):
        assert math.isclose(min_slack(reqs, now), min(decode_slack(r, now) for r in reqs))


def test_budget_prediction_counts_the_prompt_already_computed():
    from gpu_runtime.costmodel.linear import PiecewiseLinearCostModel

    attn = PiecewiseLinearCostModel([0.010, 0.0, 1e-4, 0.0, 0.0, 1e-7], 0.0)  # + 1e-7 s per query-key pair
    budget = ChunkBudget(attn, [64, 128, 256, 512], safety=1.0)
    r = decoding(interactive("a", ttft=1.0, tbt=0.05), outputs=1, times=[0.9])
    fresh = budget.choose([r], now=1.0, prefill_start=0)
    cont = budget.choose([r], now=1.0, prefill_start=4000)
    assert cont.budget < fresh.budget  # the continued chunk attends to 4000 cached tokens
    assert cont.predicted_s * 1.0 <= 0.05


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


def test_first_token_anchor_keeps_the_stream_at_its_pace():
    """Eq. 2 lets a first token that came 0.6 s early bank 0.6 s for the chunks after it; with
    the first-token anchor the next token is due one TBT after the last on-pace one."""
    from gpu_runtime.qos import TbtAnchor

    times = [0.4, 0.45, 0.5]  # first token 0.6 s before D_1 = 1.0, then on pace
    banked = decoding(interactive("a", ttft=1.0, tbt=0.05), outputs=3, times=times)
    paced = decoding(interactive("b", ttft=1.0, tbt=0.05, anchor=TbtAnchor.FIRST_TOKEN), outputs=3, times=times)
    assert math.isclose(decode_slack(banked, now=0.5), 0.65)  # D_4 = 1.0 + 3 * 0.05
    assert math.isclose(decode_slack(paced, now=0.5), 0.05)  # D_4 = 0.4 + 3 * 0.05
    for now in (0.5, 0.52, 0.56, 2.0):
        assert math.isclose(min_slack([paced], now), decode_slack(paced, now))
        assert math.isclose(min_slack([banked, paced], now), min(decode_slack(banked, now), decode_slack(paced, now)))
    budget = ChunkBudget(COST, [64, 128, 256, 512, 1024], safety=1.2)
    assert budget.choose([banked], now=0.5).budget == 1024
    assert budget.choose([paced], now=0.5).budget == 256  # 0.0357 * 1.2 <= 0.05 < 0.0613 * 1.2
    # A first token later than D_1 keeps eq. 2: the anchor never loosens a deadline.
    late = decoding(interactive("c", ttft=1.0, tbt=0.05, anchor=TbtAnchor.FIRST_TOKEN), outputs=1, times=[1.2])
    assert math.isclose(late.next_token_deadline(), 1.05)


def test_the_pass_predicted_runs_no_more_prompt_than_is_queued():
    budget = ChunkBudget(COST, [64, 128, 256, 512, 1024], safety=1.2)
    # no decodes: the budget is the top of the space, but a 100-token queue makes a 100-token pass
    alone = budget.choose([], now=0.0, queued_tokens=100)
    assert alone.budget == 1024
    assert math.isclose(alone.predicted_s, 0.010 + 1e-4 * 100)  # time(c) = 0.010 + 1e-4 * tokens
    assert math.isclose(budget.choose([], now=0.0, queued_tokens=5000).predicted_s, 0.010 + 1e-4 * 1024)
    # with a decode and nothing queued, the pass is the decode alone: the slack above it is spare
    r = decoding(interactive("a", ttft=1.0, tbt=0.05), outputs=1, times=[0.9])
    idle = budget.choose([r], now=1.0, queued_tokens=0)
    assert idle.budget == 256 and math.isclose(idle.predicted_s, 0.010 + 1e-4)
    assert math.isclose(budget.choose([r], now=1.0).predicted_s, 0.010 + 1e-4 * 257)  # unknown queue: the budget
