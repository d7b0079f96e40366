"""Prometheus metrics of a worker: latency histograms, queue and KV gauges, transfer counters, memory.

Memory: `process_resident_memory_bytes` (and the other process_* series of prometheus_client's
ProcessCollector, on Linux) and, on a GPU worker, `worker_gpu_memory_bytes` (what PyTorch's caching
allocator holds on each device this process uses; absent on a CPU worker).
"""
from __future__ import annotations

import sys
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class GPUMemoryCollector(Collector):
    """`worker_gpu_memory_bytes{device}`: bytes PyTorch holds (reserved) on each CUDA device in use.

    Reads torch only when this process already imported it and initialised CUDA: a CPU worker
    exports nothing here (so the collector stores no GPU memory for it), and a scrape never
    initialises CUDA itself.
    """

    def __init__(self, labels: dict[str, str]) -> None:
        self.labels = labels

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """One gauge family with a sample per initialised CUDA device (nothing on a CPU worker)."""
        torch = sys.modules.get("torch")
        if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return
        family = GaugeMetricFamily(
            "worker_gpu_memory_bytes", "GPU memory PyTorch holds (reserved) on each device",
            labels=[*self.labels, "device"],
        )
        for index in range(torch.cuda.device_count()):
            family.add_metric([*self.labels.values(), str(index)], float(torch.cuda.memory_reserved(index)))
        yield family


class WorkerMetrics:
    """One worker's metrics in its own registry (so several workers can live in one test process)."""

    def __init__(self, role: str, model: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"role": role, "model": model}
        self._labels = labels
        r = self.registry
        self.requests = Counter(
            "worker_requests", "Requests handled, by outcome", ["role", "model", "outcome"], registry=r
        )
        self.ttft = Histogram(
            "worker_time_to_first_token_seconds",
            "Request receipt to first token (decode) / prompt processed (prefill)",
            ["role", "model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        ).labels(**labels)
        self.itl = Histogram(
            "worker_inter_token_latency_seconds",
            "Gap between consecutive output tokens",
            ["role", "model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        ).labels(**labels)
        self.e2e = Histogram(
            "worker_e2e_request_latency_seconds",
            "Request receipt to completion",
            ["role", "model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        ).labels(**labels)
        self.prompt_tokens = Counter(
            "worker_prompt_tokens", "Prompt tokens processed", ["role", "model"], registry=r
        ).labels(**labels)
        self.generation_tokens = Counter(
            "worker_generation_tokens", "Tokens generated", ["role", "model"], registry=r
        ).labels(**labels)
        self.kv_transfer_bytes = Counter(
            "worker_kv_transfer_bytes", "KV bytes sent (prefill) or received (decode)", ["role", "model"],
            registry=r,
        ).labels(**labels)
        self.kv_transfer_seconds = Histogram(
            "worker_kv_transfer_seconds",
            "Duration of one KV transfer",
            ["role", "model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        ).labels(**labels)
        self.queue_depth = Gauge(
            "worker_queue_depth",
            "Sequences waiting for a batch slot (KV arrived, or queued for prefill)",
            ["role", "model"],
            registry=r,
        ).labels(**labels)
        self.reserved = Gauge(
            "worker_reserved_requests",
            "Decode requests holding reserved KV blocks, waiting for their KV",
            ["role", "model"],
            registry=r,
        ).labels(**labels)
        self.running = Gauge(
            "worker_running_requests", "Sequences in the running batch", ["role", "model"], registry=r
        ).labels(**labels)
        self.kv_usage = Gauge(
            "worker_kv_cache_usage_ratio", "Fraction of KV blocks in use", ["role", "model"], registry=r
        ).labels(**labels)
        self.prefix_cache_hit_ratio = Gauge(
            "worker_prefix_cache_hit_ratio",
            "Share of admitted prompt tokens served from cached KV blocks (prefix caching)",
            ["role", "model"],
            registry=r,
        ).labels(**labels)
        # The prompts this worker prefilled itself (a prefill worker: every prompt; a decode worker: its
        # local prefills, not the reservations a prefill worker fills), and two counts of their tokens
        # whose KV was cached; summed over every worker, a deployment's prefix hit ratio wherever it
        # prefilled. `cached` is the prediction at receipt (what the cache held when the request came:
        # the local-prefill decision's figure); `reused` is what the engine actually did not compute,
        # counted when it scheduled the prefill: a burst of prompts sharing a system prompt finds nothing
        # at receipt, yet the engine computes the shared blocks once and the others reuse them.
        self.prefilled_prompt_tokens = Counter(
            "worker_prefilled_prompt_tokens", "Prompt tokens of the prompts this worker prefilled itself",
            ["role", "model"], registry=r,
        ).labels(**labels)
        self.prefilled_cached_tokens = Counter(
            "worker_prefilled_cached_tokens",
            "Prompt tokens of the prompts this worker prefilled itself that its prefix cache held at receipt "
            "(a prediction; worker_prefilled_reused_tokens is what the engine reused)",
            ["role", "model"], registry=r,
        ).labels(**labels)
        self.prefilled_reused_tokens = Counter(
            "worker_prefilled_reused_tokens",
            "Prompt tokens of the prompts this worker prefilled itself that the engine did not compute: their "
            "KV was cached when the prefill was scheduled (an earlier request's, or a shared prefix an earlier "
            "prompt of the same burst computed)",
            ["role", "model"], registry=r,
        ).labels(**labels)
        self.cpu_utilization = Gauge(
            "worker_cpu_utilization_ratio", "Busy fraction of the worker's CPUs", ["role", "model"], registry=r
        ).labels(**labels)
        self.gpu_utilization = Gauge(
            "worker_gpu_utilization_ratio", "Busy fraction of the worker's GPU", ["role", "model"], registry=r
        ).labels(**labels)
        ProcessCollector(registry=r)  # process_resident_memory_bytes, process_cpu_seconds_total, ...
        r.register(GPUMemoryCollector(labels))

    def outcome(self, outcome: str) -> None:
        """Count a finished request by outcome (ok, error, aborted, rejected, ...)."""
        self.requests.labels(outcome=outcome, **self._labels).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
