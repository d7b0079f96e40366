"""The router's Prometheus metrics (GET /metrics): what clients see, and what the router costs.

One registry per router (not the global one), so several routers in a test process stay apart.
Times are measured at the router: TTFT and ITL as the client receives them, the wait in the
admission queue, and the dispatch latency (the router's own time before the decode worker is
asked: parsing, auth, choosing; queue wait excluded). With `--workers N` each gunicorn worker
process has its own registry; the deployment default is one.
"""
from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST

_FAST = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5)


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
        self.dispatch = Histogram(
            "router_dispatch_seconds", "Router time from a request's arrival to asking the decode worker, "
            "queue wait excluded", buckets=_FAST, registry=r)
        self.queue_wait = Histogram(
            "router_queue_wait_seconds", "Time a request waited for a decode slot", buckets=_LATENCY, registry=r)
        self.ttft = Histogram(
            "router_ttft_seconds", "Time to first token as the router's clients see it", buckets=_LATENCY, registry=r)
        self.itl = Histogram(
            "router_itl_seconds", "Time between streamed chunks per token, as clients see it",
            buckets=_ITL, registry=r)
        self.e2e = Histogram(
            "router_e2e_seconds", "Whole request time as clients see it", buckets=_LATENCY, registry=r)
        self.tokens = Counter("router_generation_tokens", "Tokens streamed to clients", registry=r)
        self.selections = Counter(
            "router_worker_selections", "Requests sent to each worker", ["role", "url"], registry=r)
        self.failures = Counter(
            "router_worker_failures", "Failed calls to each worker", ["role", "url"], registry=r)
        self.retries = Counter(
            "router_retries", "Requests retried on another worker before their first token", registry=r)
        self.migrations = Counter(
            "router_migrations", "Streams moved to another decode worker after their first token", registry=r)
        self.inflight = Gauge("router_inflight", "Generations in flight in this router", registry=r)
        self.queued = Gauge("router_queued", "Requests waiting for a decode slot", registry=r)
        self.capacity = Gauge("router_decode_slots", "Decode slots of the workers in rotation", registry=r)

    def bind_gauges(self, inflight: Callable[[], float], queued: Callable[[], float],
                    capacity: Callable[[], float]) -> None:
        """Read the gauges from the router's state at scrape time (nothing to update per request)."""
        self.inflight.set_function(inflight)
        self.queued.set_function(queued)
        self.capacity.set_function(capacity)

    def render(self) -> bytes:
        """The Prometheus text exposition of every series."""
        return generate_latest(self.registry)
