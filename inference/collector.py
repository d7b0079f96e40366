"""Metrics collection: scrape every RUNNING worker's /metrics and /health, store per-role samples.

`collect(now)` (Celery beat runs it every few seconds through inference.tasks.collect_metrics):
1. scrapes all RUNNING workers concurrently (HTTP only in the threads; the database is written from the
   calling thread), each request bounded by METRICS_SCRAPE_TIMEOUT_S;
2. stores per worker `last_health` (the /health answer) and `last_metrics`: the raw counters of this
   scrape ({"at", "pid", "counters", "gauges"}), which the next scrape subtracts;
3. records one MetricSample per active deployment and role (inference.actions.record_metric_sample):
   - ttft_s / itl_s: mean latency of the requests finished since the previous scrape, from the deltas of
     the histograms' _sum and _count (sum of Δsum over sum of Δcount across the role's workers; None when
     no request finished);
   - throughput_tps: Δworker_generation_tokens_total / Δt, summed over the role's workers;
   - queue_depth, running: sums over the workers; kv_usage, cpu/gpu utilisation: means;
   - load: inference.scaling.role_load (the number threshold rules compare).
   A counter that went down (the worker restarted, or its pid changed) counts from zero again.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import httpx
from django.conf import settings
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from inference import actions
from inference.models import Deployment, DeploymentStatus
from inference.scaling import role_load
from nodes.models import Worker, WorkerRole, WorkerStatus

logger = logging.getLogger(__name__)

# Sample names in the worker's Prometheus text → our keys.
COUNTERS = {
    "worker_time_to_first_token_seconds_sum": "ttft_sum",
    "worker_time_to_first_token_seconds_count": "ttft_count",
    "worker_inter_token_latency_seconds_sum": "itl_sum",
    "worker_inter_token_latency_seconds_count": "itl_count",
    "worker_generation_tokens_total": "generation_tokens",
}
GAUGES = {
    "worker_queue_depth": "queue_depth",
    "worker_running_requests": "running",
    "worker_kv_cache_usage_ratio": "kv_usage",
    "worker_cpu_utilization_ratio": "cpu_utilization",
    "worker_gpu_utilization_ratio": "gpu_utilization",
}
# Threads scraping at once; each request is bounded by the scrape timeout anyway.
MAX_SCRAPE_THREADS = 16


def parse_metrics(text: str) -> tuple[dict[str, float], dict[str, float]]:
    """(counters, gauges) from a worker's Prometheus text; samples of one name are summed over labels."""
    counters: dict[str, float] = {}
    gauges: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in COUNTERS:
                key = COUNTERS[sample.name]
                counters[key] = counters.get(key, 0.0) + float(sample.value)
            elif sample.name in GAUGES:
                key = GAUGES[sample.name]
                gauges[key] = gauges.get(key, 0.0) + float(sample.value)
    return counters, gauges


@dataclass
class Scrape:
    """One worker's scrape: its /health answer and parsed /metrics (None where the request failed)."""

    worker: Worker
    at: float
    health: dict[str, Any] | None = None
    counters: dict[str, float] | None = None
    gauges: dict[str, float] = field(default_factory=dict)
    error: str = ""


def scrape(worker: Worker, timeout: float) -> Scrape:
    """GET the worker's /metrics and /health (no database access: runs in a thread)."""
    result = Scrape(worker=worker, at=time.time())
    try:
        with httpx.Client(timeout=timeout) as client:
            metrics = client.get(worker.url + "/metrics")
            if metrics.status_code == 200:
                result.counters, result.gauges = parse_metrics(metrics.text)
            health = client.get(worker.url + "/health")
            if health.status_code == 200 and isinstance(health.json(), dict):
                result.health = health.json()
    except (httpx.HTTPError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def counter_deltas(previous: dict[str, Any] | None, current: Scrape) -> tuple[dict[str, float], float | None]:
    """(Δ per counter, Δt in seconds or None) between the stored previous scrape and this one."""
    counters = current.counters or {}
    if not previous or not isinstance(previous.get("counters"), dict):
        return {}, None
    restarted = previous.get("pid") != current.worker.pid
    deltas: dict[str, float] = {}
    for key, value in counters.items():
        before = float(previous["counters"].get(key, 0.0))
        deltas[key] = value if restarted or value < before else value - before
    try:
        dt = current.at - float(previous["at"])
    except (KeyError, TypeError, ValueError):
        dt = None
    return deltas, dt if dt and dt > 0 else None


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def collect(*, now: datetime | None = None) -> int:
    """Scrape, store per-worker results and record one MetricSample per active deployment and role."""
    now = now or timezone.now()
    timeout = float(settings.METRICS_SCRAPE_TIMEOUT_S)
    workers = list(
        Worker.objects.select_related("node", "deployment").filter(
            status=WorkerStatus.RUNNING, deployment__status=DeploymentStatus.ACTIVE
        )
    )
    scrapes: list[Scrape] = []
    if workers:
        with ThreadPoolExecutor(max_workers=min(MAX_SCRAPE_THREADS, len(workers))) as pool:
            scrapes = list(pool.map(lambda w: scrape(w, timeout), workers))
    per_role: dict[tuple[int, str], list[tuple[Scrape, dict[str, float], float | None]]] = {}
    for item in scrapes:
        worker = item.worker
        if item.counters is None and item.health is None:
            logger.info("scrape of worker #%s (%s) failed: %s", worker.pk, worker.url, item.error)
            continue
        deltas, dt = counter_deltas(worker.last_metrics, item)
        fields: dict[str, Any] = {}
        if item.counters is not None:
            fields["last_metrics"] = {
                "at": item.at, "pid": worker.pid, "counters": item.counters, "gauges": item.gauges,
            }
        if item.health is not None:
            fields["last_health"] = item.health
            fields["last_seen"] = now
        Worker.objects.filter(pk=worker.pk).update(**fields)
        per_role.setdefault((worker.deployment_id, worker.role), []).append((item, deltas, dt))
    recorded = 0
    for deployment in Deployment.objects.filter(status=DeploymentStatus.ACTIVE):
        for role in WorkerRole.values:
            items = per_role.get((deployment.pk, role), [])
            running_workers = sum(
                1 for w in workers if w.deployment_id == deployment.pk and w.role == role
            )
            actions.record_metric_sample(deployment, role, at=now, workers=running_workers,
                                         load=role_load(deployment, role, now=now) or 0.0, **aggregate(items))
            recorded += 1
    return recorded


def aggregate(items: list[tuple[Scrape, dict[str, float], float | None]]) -> dict[str, Any]:
    """The MetricSample fields of one role from its workers' scrapes and counter deltas (module doc)."""
    ttft_sum = sum(d.get("ttft_sum", 0.0) for _, d, _ in items)
    ttft_count = sum(d.get("ttft_count", 0.0) for _, d, _ in items)
    itl_sum = sum(d.get("itl_sum", 0.0) for _, d, _ in items)
    itl_count = sum(d.get("itl_count", 0.0) for _, d, _ in items)
    throughput = sum(d.get("generation_tokens", 0.0) / dt for _, d, dt in items if dt)
    gauges = [s.gauges for s, _, _ in items]
    health = [s.health or {} for s, _, _ in items]

    def gauge(key: str) -> list[float]:
        values = [float(g[key]) for g in gauges if key in g]
        if not values:  # fall back to the /health answer
            values = [float(h[key]) for h in health if isinstance(h.get(key), int | float)]
        return values

    gpu = [float(h["gpu_utilization"]) for h in health if isinstance(h.get("gpu_utilization"), int | float)]
    return {
        "ttft_s": ttft_sum / ttft_count if ttft_count > 0 else None,
        "itl_s": itl_sum / itl_count if itl_count > 0 else None,
        "throughput_tps": throughput,
        "queue_depth": sum(gauge("queue_depth")),
        "running": sum(gauge("running")),
        "kv_usage": _mean(gauge("kv_usage")) or 0.0,
        "cpu_utilization": _mean(gauge("cpu_utilization")),
        "gpu_utilization": _mean(gpu) if gpu else None,
    }
