"""The router's Prometheus metrics (GET /metrics): what clients see, and what the router costs.

One registry per router (not the global one), so several routers in a test process stay apart.
Times are measured at the router: TTFT and ITL as the client receives them, the wait in the
admission queue, and the dispatch latency (the router's own time before the decode worker is
asked: parsing, auth, choosing; queue wait excluded). With `--workers N` each gunicorn worker
process has its own registry; the deployment default is one.
"""
from __future__ import annotations

import bisect
import functools
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, ProcessCollector, generate_latest
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.utils import floatToGoString

CONTENT_TYPE = CONTENT_TYPE_LATEST

_FAST = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5)


class LoopHistogram:
    """A Prometheus histogram observed from one event loop thread (the router's): no lock, and a
    bisect for the bucket.

    prometheus_client's Histogram takes a lock per observation and walks its buckets in Python;
    ITL is observed once per streamed chunk, and that cost was measured at several microseconds per
    token. Rendered by the same loop (GET /metrics), so a scrape sees a consistent snapshot. The
    exposition is the same: `<name>_bucket{le=...}`, `<name>_count`, `<name>_sum`.
    """

    def __init__(self, name: str, documentation: str, buckets: Sequence[float], registry: CollectorRegistry) -> None:
        self.name = name
        self.documentation = documentation
        self._bounds = [float(b) for b in buckets]
        self._counts = [0] * (len(self._bounds) + 1)  # the last one is +Inf
        self._sum = 0.0
        registry.register(self)

    def observe(self, value: float) -> None:
        """Count one observation (seconds)."""
        self._counts[bisect.bisect_left(self._bounds, value)] += 1
        self._sum += value

    def collect(self) -> Iterator[Metric]:
        """The histogram's samples, buckets cumulative as Prometheus expects."""
        family = HistogramMetricFamily(self.name, self.documentation)
        buckets: list[tuple[str, float]] = []
        total = 0
        for bound, count in zip([*self._bounds, float("inf")], self._counts, strict=True):
            total += count
            buckets.append((floatToGoString(bound), total))
        family.add_metric([], buckets, self._sum)
        yield family

    def describe(self) -> Iterator[Metric]:
        """The family without samples (registration checks names with it)."""
        yield HistogramMetricFamily(self.name, self.documentation)


def _nth(counts: Callable[[str], tuple[int, ...]], role: str, n: int) -> float:
    return float(counts(role)[n])


class RouterMetrics:
    """Counters, histograms and gauges of one router."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "router_requests", "Generation requests by endpoint and outcome "
            "(ok, client_error, rejected, failed, aborted)", ["endpoint", "outcome"], registry=r)
        self.rejected = Counter(
            "router_rejected", "Requests answered 429, by reason (queue_timeout, queue_full, inflight, busy)",
            ["reason"], registry=r)
        self.dispatch = LoopHistogram(
            "router_dispatch_seconds", "Router time from a request's arrival to asking the decode worker, "
            "queue wait excluded", _FAST, r)
        self.queue_wait = LoopHistogram(
            "router_queue_wait_seconds", "Time a request waited for a decode slot", _LATENCY, r)
        self.ttft = LoopHistogram(
            "router_ttft_seconds", "Time to first token as the router's clients see it", _LATENCY, r)
        self.itl = LoopHistogram(
            "router_itl_seconds", "Time between streamed chunks per token, as clients see it", _ITL, r)
        self.e2e = LoopHistogram("router_e2e_seconds", "Whole request time as clients see it", _LATENCY, r)
        self.tokens = Counter("router_generation_tokens", "Tokens streamed to clients", registry=r)
        self.selections = Counter(
            "router_worker_selections", "Requests sent to each worker", ["role", "url"], registry=r)
        self.failures = Counter(
            "router_worker_failures", "Failed calls to each worker", ["role", "url"], registry=r)
        self.retries = Counter(
            "router_retries", "Requests retried on another worker before their first token", registry=r)
        self.prefill_where = Counter(
            "router_prefill_where", "Prompts prefilled on the decode worker itself (local) or by a prefill "
            "worker (remote)", ["where"], registry=r)
        self.prompt_tokens = Counter(
            "router_prompt_tokens", "Prompt tokens of the generations that finished", registry=r)
        self.cached_prompt_tokens = Counter(
            "router_cached_prompt_tokens", "Prompt tokens of the generations that finished that no worker "
            "computed (the workers' reports: usage.prompt_tokens_details.cached_tokens)", registry=r)
        self.migrations = Counter(
            "router_migrations", "Streams moved to another decode worker after their first token", registry=r)
        self.inflight = Gauge("router_inflight", "Generations in flight in this router", registry=r)
        self.queued = Gauge("router_queued", "Requests waiting for a decode slot", registry=r)
        self.capacity = Gauge("router_decode_slots", "Decode slots of the workers in rotation", registry=r)
        self.kv_prompt_tokens = Gauge(
            "router_kv_prompt_tokens", "Prompt tokens the kv-aware policy routed, per role (since start)",
            ["role"], registry=r)
        self.kv_predicted_cached_tokens = Gauge(
            "router_kv_predicted_cached_tokens", "Prompt tokens the kv-aware policy predicted cached on the "
            "chosen worker, per role (since start; what the workers' engines then reused is their "
            "worker_prefilled_reused_tokens_total)",
            ["role"], registry=r)
        self.kv_reported_cached_tokens = Gauge(
            "router_kv_reported_cached_tokens", "Prompt tokens the chosen workers reported they held (decode: "
            "KV not sent, or not computed by a local prefill) or reused (prefill), per role, from the requests "
            "that finished (since start; under every policy)",
            ["role"], registry=r)
        # process_resident_memory_bytes, process_cpu_seconds_total, ... of this router process (Linux).
        ProcessCollector(registry=r)

    def bind_gauges(self, inflight: Callable[[], float], queued: Callable[[], float],
                    capacity: Callable[[], float]) -> None:
        """Read the gauges from the router's state at scrape time (nothing to update per request)."""
        self.inflight.set_function(inflight)
        self.queued.set_function(queued)
        self.capacity.set_function(capacity)

    def bind_kv(self, counts: Callable[[str], tuple[int, int, int]], roles: Sequence[str]) -> None:
        """Read the KV counts at scrape time: `counts(role)` is (prompt tokens the kv-aware policy routed,
        cached tokens it predicted, cached tokens the workers reported)."""
        for role in roles:
            self.kv_prompt_tokens.labels(role).set_function(functools.partial(_nth, counts, role, 0))
            self.kv_predicted_cached_tokens.labels(role).set_function(functools.partial(_nth, counts, role, 1))
            self.kv_reported_cached_tokens.labels(role).set_function(functools.partial(_nth, counts, role, 2))

    def render(self) -> bytes:
        """The Prometheus text exposition of every series."""
        return generate_latest(self.registry)
