"""bench/kv_routing_analysis.py: the chat workload's hit-ratio ceiling and the per-turn report."""
from __future__ import annotations

import pytest

from bench.kv_routing import Turn
from bench.kv_routing_analysis import Shape, hit_ratio_ceiling, read_steps, step_summary, turn_report


def test_the_ceiling_of_the_issue_19_workload_is_below_0_8_with_remote_prefill() -> None:
    """16 conversations x 4 turns, 256-token system prompt, 64-token user turns, 32-token replies, blocks of 16:
    prompts 320, 416, 512, 608 (29,696 tokens in all); a later turn can find the previous prompt
    (320 + 416 + 512 = 1,248 per conversation), a first turn the system prompt unless its worker computes it."""
    shape = Shape(conversations=16, turns=4, system=256, user=64, reply=32)
    two = hit_ratio_ceiling(shape, first_turn_workers=2)
    assert two["prompt_tokens"] == 29_696
    assert two["remote"] == pytest.approx((16 * 1_248 + 14 * 256) / 29_696)  # 0.793
    assert two["remote"] < 0.8
    assert two["remote_burst"] == pytest.approx(16 * 1_248 / 29_696)  # 0.672
    # A decode worker also holds the reply but its last token: one more full block per later turn.
    assert two["local"] == pytest.approx((16 * (1_248 + 3 * 16) + 14 * 256) / 29_696)  # 0.819
    assert hit_ratio_ceiling(shape, first_turn_workers=4)["remote"] < two["remote"]


def test_partial_blocks_are_not_counted() -> None:
    shape = Shape(conversations=1, turns=2, system=20, user=10, reply=5, block=16)
    # prompts 30 and 45: the second finds the first's one full block (16), not its 30 tokens.
    assert hit_ratio_ceiling(shape, first_turn_workers=1)["remote"] == pytest.approx(16 / 75)


def test_turn_report_counts_turns_kept_on_the_previous_prefill_worker() -> None:
    shape = Shape(conversations=2, turns=2, system=16, user=16, reply=16)
    turns = [
        Turn(0, 0, 32, ttft_s=1.0, prefill="p1", decode="d1", timings={"prefill_s": 0.6}),
        Turn(0, 1, 64, ttft_s=0.2, prefill="p1", decode="d1", timings={"prefill_s": 0.1}),
        Turn(1, 0, 32, ttft_s=2.0, prefill="p2", decode="d2", timings={"prefill_s": 1.5}),
        Turn(1, 1, 64, ttft_s=0.4, prefill="p1", decode="d2", timings={"prefill_s": 0.3}),
    ]
    report = turn_report(turns, shape)
    assert report[0]["n"] == 2 and "same_prefill" not in report[0]
    assert report[1]["same_prefill"] == 0.5 and report[1]["same_decode"] == 1.0
    assert report[1]["prefill_s_p50"] == pytest.approx(0.2)
    assert report[1]["ttft_minus_prefill_p50_s"] == pytest.approx(0.1)
    # A turn prefilled on its decode worker (no prefill worker) counts as local, not as a move.
    turns[3] = Turn(1, 1, 64, ttft_s=0.1, prefill="", decode="d2")
    report = turn_report(turns, shape)
    assert report[1]["local"] == 1 and report[1]["same_prefill"] == 1.0


def test_turn_report_splits_the_ttft_by_local_and_remote_prefill() -> None:
    shape = Shape(conversations=3, turns=1, system=16, user=16, reply=16)
    turns = [Turn(0, 0, 32, ttft_s=0.5, prefill="", decode="d1"), Turn(1, 0, 32, ttft_s=2.0, prefill="p1", decode="d1"),
             Turn(2, 0, 32, ttft_s=3.0, prefill="p2", decode="d2")]
    report = turn_report(turns, shape)[0]
    assert report["local"] == 1 and report["ttft_p50_local_s"] == pytest.approx(0.5)
    assert report["ttft_p50_remote_s"] == pytest.approx(2.5)


def test_step_summary_sums_the_prompt_steps_before_the_burst_ends() -> None:
    log = "100.0\t40.00\t320\t1\t0\tburst\t3\n100.1\t90.00\t192\t3\t1\t-\t0\n100.3\t10.00\t0\t0\t4\t-\t0\n"
    rows = read_steps(log)
    assert step_summary(rows, until=100.2) == {"steps": 2, "prompt_steps": 2, "prompt_tokens": 512, "prompts": 4,
                                               "busy_s": 0.13, "prompt_busy_s": 0.13, "max_step_ms": 90.0}
    assert step_summary(rows)["steps"] == 3 and step_summary(rows)["busy_s"] == pytest.approx(0.14)
