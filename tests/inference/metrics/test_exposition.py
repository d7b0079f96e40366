"""inference.metrics.exposition.parse_metrics against prometheus_client's own parser (the oracle) on real
worker texts: the collector's line reader must read the same counters and gauges."""
from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from inference.metrics.exposition import COUNTERS, GAUGES, parse_metrics
from inference.server.metrics import WorkerMetrics


def _oracle(text: str) -> tuple[dict[str, float], dict[str, float]]:
    counters: dict[str, float] = {}
    gauges: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for names, out in ((COUNTERS, counters), (GAUGES, gauges)):
                if sample.name in names:
                    out[names[sample.name]] = out.get(names[sample.name], 0.0) + float(sample.value)
    return counters, gauges


def test_a_real_worker_text_reads_as_the_library_reads_it() -> None:
    metrics = WorkerMetrics("decode", 'odd "model" {name} with spaces')
    for value in (0.01, 0.2, 3.0):
        metrics.ttft.observe(value)
        metrics.itl.observe(value / 10)
    metrics.generation_tokens.inc(123)
    metrics.kv_transfer_bytes.inc(4_000_000)
    metrics.kv_transfer_seconds.observe(0.005)
    metrics.queue_depth.set(2)
    metrics.running.set(7)
    metrics.kv_usage.set(0.25)
    text = metrics.render().decode()
    assert parse_metrics(text) == _oracle(text)
    counters, gauges = parse_metrics(text)
    assert counters["generation_tokens"] == 123 and counters["ttft_count"] == 3
    assert gauges["running"] == 7 and gauges["rss_bytes"] > 0


def test_labels_are_summed_and_odd_lines_handled() -> None:
    text = (
        "# HELP worker_queue_depth queued\n# TYPE worker_queue_depth gauge\n"
        'worker_queue_depth{role="decode",note="a } b"} 2\n'
        'worker_queue_depth{role="prefill"} 3 1700000000000\n'
        "worker_generation_tokens_total 5e3\n"
        "worker_kv_cache_usage_ratio +Inf\n"
        "unrelated_metric{x=\"1\"} not-a-number\n"
    )
    counters, gauges = parse_metrics(text)
    assert gauges["queue_depth"] == 5 and counters["generation_tokens"] == 5000
    assert gauges["kv_usage"] == float("inf")
    with pytest.raises(ValueError):
        parse_metrics("worker_running_requests oops\n")
