"""inference.server.load: the windowed readings a worker adds to /health for the autoscaler."""
from __future__ import annotations

import pytest

from inference.server.load import LoadSignals, percentile

pytestmark = pytest.mark.django_db(databases=[])


class Clock:
    """A settable monotonic clock, so the window arithmetic is checked exactly."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_pending_tokens_busy_ratio_and_sustained_rate() -> None:
    clock = Clock()
    signals = LoadSignals(window_s=10.0, busy_window_s=10.0, clock=clock)
    first = signals.snapshot()
    assert (first["prompt_tokens_pending"], first["prefill_tokens_per_s"], first["busy_ratio"]) == (0, None, 0.0)

    signals.prefill_started(300)
    signals.prefill_started(100)
    clock.now += 2.0
    busy = signals.snapshot()
    assert busy["prompt_tokens_pending"] == 400 and busy["busy_ratio"] == pytest.approx(0.2)
    signals.prefill_finished(300, computed=True)
    clock.now += 2.0
    signals.prefill_finished(100, computed=True)  # 400 tokens in 4 busy seconds
    clock.now += 4.0  # idle: busy 4 of the last 10 s
    done = signals.snapshot()
    assert done["prompt_tokens_pending"] == 0
    assert done["prefill_tokens_per_s"] == pytest.approx(100.0)
    assert done["busy_ratio"] == pytest.approx(0.4)
    assert LoadSignals(window_s=30.0, busy_window_s=60.0).busy_window_s == 30.0  # never longer than the window

    # A failed prompt leaves the queue without counting as computed work.
    signals.prefill_started(50)
    clock.now += 1.0
    signals.prefill_finished(50, computed=False)
    assert signals.snapshot()["prefill_tokens_per_s"] == pytest.approx(80.0)  # 400 tokens over 5 busy s

    # Long after: the window is empty, the lifetime rate is still reported, busy is 0.
    clock.now += 60.0
    later = signals.snapshot()
    assert later["busy_ratio"] == 0.0 and later["prefill_tokens_per_s"] == pytest.approx(80.0)


def test_latency_percentiles_cover_the_window_only() -> None:
    clock = Clock()
    signals = LoadSignals(window_s=30.0, clock=clock)
    for value in (0.1,) * 5:
        signals.observe("ttft", value)
    clock.now += 40.0  # those fall out of the window
    for value in (0.2, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2, 3.0):
        signals.observe("ttft", value)
    signals.observe("itl", 0.05)
    body = signals.snapshot()
    assert body["ttft_samples"] == 10 and body["ttft_p90_s"] == pytest.approx(0.2)
    signals.observe("ttft", 3.0)
    assert signals.snapshot()["ttft_p90_s"] == pytest.approx(3.0)  # 2 of 11 slow: p90 is slow
    assert body["itl_p90_s"] == pytest.approx(0.05) and body["itl_samples"] == 1
    assert percentile([], 0.9) is None and percentile([1.0, 2.0], 0.5) == 1.0
