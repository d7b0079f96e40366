"""Metrics collection: scrape the RUNNING workers and the routers of active deployments, store samples.

`collect(now)` (Celery beat runs it every few seconds through inference.tasks.collect_metrics):
1. scrapes all RUNNING workers (/metrics and /health) and all enabled routers of active deployments
   (RouterEndpoint, /metrics) concurrently: HTTP only in at most MAX_SCRAPE_THREADS threads sharing
   one HTTP client, each request bounded by METRICS_SCRAPE_TIMEOUT_S; the database is written from the
   calling thread, the workers' scrape state and samples in one transaction (bulk UPDATE and INSERT);
2. stores per worker `last_health` (the /health answer) and `last_metrics`: the raw counters of this
   scrape ({"at", "pid", "counters", "gauges"}), which the next scrape subtracts; per router its
   cumulative series in `RouterEndpoint.last_metrics` likewise;
3. records per router a RouterSample (what its clients saw between the two scrapes):
   - requests_per_s, rejected_per_s (429 answers, router_rejected), tokens_per_s: counter deltas / Δt;
   - error_rate: Δ requests with outcome "failed" over Δ all requests (None when none finished);
   - dispatch (the router's own overhead), queue wait, TTFT, ITL and whole-request p50/p90: quantiles
     of the histograms' bucket deltas, interpolated within a bucket as Prometheus'
     histogram_quantile does (None when nothing was observed);
   - inflight, queued, decode_slots: the gauges now;
   - worker_share: {role: {url: Δ router_worker_selections of the worker / Δ of its role}};
4. records per worker a WorkerSample: load ((running + queue) / batch size, as the scaling rules
   see it), queue, running, KV usage, CPU/GPU utilisation, mean TTFT/ITL and throughput from counter
   deltas, RSS (process_resident_memory_bytes, else what the node's agent reported), GPU memory
   (worker_gpu_memory_bytes; None on a CPU worker), KV transfer bytes/s and mean transfer time
   (worker_kv_transfer_bytes_total, worker_kv_transfer_seconds), the prefix-cache hit ratio, and the
   requests the router(s) sent it (per second, and as its share of its role's);
5. records one MetricSample per active deployment and role (inference.actions.samples.record_metric_sample):
   - ttft_s / itl_s: mean latency of the requests finished since the previous scrape (sum of Δsum
     over sum of Δcount across the role's workers; None when no request finished);
   - throughput_tps and kv_transfer_bytes_per_s: sums over the role's workers; kv_transfer_s: mean;
   - queue_depth, running, rss_bytes, gpu_memory_bytes: sums; kv_usage, CPU/GPU utilisation and
     prefix-cache hit ratio: means;
   - load: inference.scaling.signals.role_load (the number threshold rules compare).
A counter that went down (the worker or router restarted, or the worker's pid changed) counts from
zero again. Metrics text is parsed with prometheus_client's parser.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import ssl
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import httpx
from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from inference.actions import samples as sample_actions
from inference.metrics.exposition import (
    counter_delta,
    parse_metrics,
    parse_router_metrics,
    router_changes,
    worker_share,
)
from inference.models import (
    Deployment,
    DeploymentStatus,
    RouterEndpoint,
    RouterSample,
    Worker,
    WorkerRole,
    WorkerSample,
    WorkerStatus,
)
from inference.scaling.signals import role_load, worker_load

logger = logging.getLogger(__name__)

MAX_SCRAPE_THREADS = 16
# Worker rows per executemany when the round's scrape state is written.
UPDATE_BATCH = 500


# -------------------------------------------------------------------------------------------- scrapes
@dataclass
class Scrape:
    """One worker's scrape: its /health answer and parsed /metrics (None where the request failed)."""

    worker: Worker
    at: float
    health: dict[str, Any] | None = None
    counters: dict[str, float] | None = None
    gauges: dict[str, float] = field(default_factory=dict)
    error: str = ""


@dataclass
class RouterScrape:
    """One router's scrape: its parsed /metrics with the time ("at"), or the error."""

    router: RouterEndpoint
    at: float
    state: dict[str, Any] | None = None
    error: str = ""


def scrape_client(timeout: float, threads: int) -> httpx.Client:
    """One HTTP client for a whole round, shared by its threads (httpx.Client is thread-safe), with the
    TLS context built once (a client per scrape loaded the CA bundle each time)."""
    limits = httpx.Limits(max_connections=threads, max_keepalive_connections=threads)
    return httpx.Client(timeout=timeout, limits=limits, trust_env=False, verify=_tls_context())


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """The default TLS context, built once: loading the CA bundle cost 0.5-0.8 s of CPU per round."""
    return ssl.create_default_context()


def scrape(worker: Worker, timeout: float, client: httpx.Client | None = None) -> Scrape:
    """GET the worker's /metrics and /health (no database access: runs in a thread)."""
    result = Scrape(worker=worker, at=time.time())
    try:
        with contextlib.ExitStack() as stack:
            if client is None:
                client = stack.enter_context(scrape_client(timeout, 1))
            metrics = client.get(worker.url + "/metrics")
            if metrics.status_code == 200:
                result.counters, result.gauges = parse_metrics(metrics.text)
            health = client.get(worker.url + "/health")
            if health.status_code == 200 and isinstance(health.json(), dict):
                result.health = health.json()
    except (httpx.HTTPError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def scrape_router(router: RouterEndpoint, timeout: float, client: httpx.Client | None = None) -> RouterScrape:
    """GET the router's /metrics (no database access: runs in a thread)."""
    result = RouterScrape(router=router, at=time.time())
    try:
        with contextlib.ExitStack() as stack:
            if client is None:
                client = stack.enter_context(scrape_client(timeout, 1))
            response = client.get(router.url.rstrip("/") + "/metrics")
        if response.status_code != 200:
            result.error = f"HTTP {response.status_code} from {router.url}/metrics"
        else:
            result.state = {**parse_router_metrics(response.text), "at": result.at}
    except (httpx.HTTPError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def counter_deltas(previous: dict[str, Any] | None, current: Scrape) -> tuple[dict[str, float], float | None]:
    """(Δ per counter, Δt in seconds or None) between the stored previous scrape and this one.

    A counter the previous scrape did not report (an older worker, or this collector's previous
    version) has no delta yet, unless the worker restarted (then it counts from zero)."""
    counters = current.counters or {}
    if not previous or not isinstance(previous.get("counters"), dict):
        return {}, None
    restarted = previous.get("pid") != current.worker.pid
    deltas: dict[str, float] = {}
    for key, value in counters.items():
        if restarted:
            deltas[key] = value
        elif key in previous["counters"]:
            deltas[key] = counter_delta(value, float(previous["counters"][key]), False)
    try:
        dt = current.at - float(previous["at"])
    except (KeyError, TypeError, ValueError):
        dt = None
    return deltas, dt if dt and dt > 0 else None


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


@dataclass
class WorkerReading:
    """One worker's scrape turned into sample values (the WorkerSample fields) and counter deltas."""

    scrape: Scrape
    deltas: dict[str, float]
    dt: float | None
    values: dict[str, Any]


def read_worker(item: Scrape, deltas: dict[str, float], dt: float | None, batch_size: int) -> WorkerReading:
    """The WorkerSample values of one scrape (router fields filled in later)."""
    worker = item.worker
    health = item.health or {}
    gauges = item.gauges

    def gauge(key: str) -> float | None:
        if key in gauges:
            return float(gauges[key])
        return _number(health.get(key))  # the /health answer when /metrics failed

    queue, running = gauge("queue_depth"), gauge("running")
    # The scaling rules' number for this worker (its /health answer; the gauges when /health failed).
    load = worker_load(health or {"running": running or 0.0, "queue_depth": queue or 0.0}, batch_size, worker.role)
    rss = gauge("rss_bytes")
    if rss is None:  # what the node's agent reported for the process
        per_worker = ((worker.node.last_metrics or {}).get("workers") or {}).get(str(worker.pk)) or {}
        rss = _number(per_worker.get("rss_bytes"))
    gpu_memory = gauges.get("gpu_memory_bytes")
    values = {
        "load": load if (queue is not None or running is not None) else None,
        "queue_depth": queue,
        "running": running,
        "kv_usage": gauge("kv_usage"),
        "cpu_utilization": gauge("cpu_utilization"),
        # From /health only: the gauge exists (at 0) on CPU workers too, /health has it on GPU workers.
        "gpu_utilization": _number(health.get("gpu_utilization")),
        "throughput_tps": deltas["generation_tokens"] / dt if dt and "generation_tokens" in deltas else None,
        "ttft_s": _ratio(deltas.get("ttft_sum"), deltas.get("ttft_count")),
        "itl_s": _ratio(deltas.get("itl_sum"), deltas.get("itl_count")),
        "rss_bytes": int(rss) if rss is not None else None,
        "gpu_memory_bytes": int(gpu_memory) if gpu_memory is not None else None,
        "kv_transfer_bytes_per_s": deltas["kv_bytes"] / dt if dt and "kv_bytes" in deltas else None,
        "kv_transfer_s": _ratio(deltas.get("kv_transfer_sum"), deltas.get("kv_transfer_count")),
        "prefix_cache_hit_ratio": gauges.get("prefix_cache_hit_ratio"),
        "requests_per_s": None,
        "request_share": None,
    }
    return WorkerReading(scrape=item, deltas=deltas, dt=dt, values=values)


def worker_name(worker: Worker) -> str:
    """How charts name a worker: "decode #12 @ node-1:30001"."""
    return f"{worker.role} #{worker.pk} @ {worker.node.name}:{worker.port}"


# -------------------------------------------------------------------------------------------- collect
def collect(*, now: datetime | None = None) -> int:
    """Scrape workers and routers, store their samples and one MetricSample per active deployment and
    role; returns how many MetricSamples were recorded."""
    now = now or timezone.now()
    timeout = float(settings.METRICS_SCRAPE_TIMEOUT_S)
    workers = list(
        Worker.objects.select_related("node", "deployment").filter(
            status=WorkerStatus.RUNNING, deployment__status=DeploymentStatus.ACTIVE
        )
    )
    routers = list(
        RouterEndpoint.objects.select_related("deployment").filter(
            enabled=True, deployment__status=DeploymentStatus.ACTIVE
        )
    )
    scrapes: list[Scrape] = []
    router_scrapes: list[RouterScrape] = []
    jobs = len(workers) + len(routers)
    if jobs:
        threads = min(MAX_SCRAPE_THREADS, jobs)
        with scrape_client(timeout, threads) as client, ThreadPoolExecutor(max_workers=threads) as pool:
            router_futures = [pool.submit(scrape_router, r, timeout, client) for r in routers]
            scrapes = list(pool.map(lambda w: scrape(w, timeout, client), workers))
            router_scrapes = [f.result() for f in router_futures]

    # Routers first: their selection deltas say what share of requests each worker got.
    sent: dict[int, dict[str, float]] = {}  # deployment id → worker url → requests per second
    shares: dict[int, dict[str, float]] = {}  # deployment id → worker url → share of its role
    for router_scrape in router_scrapes:
        changes = _store_router(router_scrape, now)
        if changes is None:
            continue
        deployment_id = router_scrape.router.deployment_id
        rates = sent.setdefault(deployment_id, {})
        for per_url in changes["selections"].values():
            for url, n in per_url.items():
                rates[url] = rates.get(url, 0.0) + n / changes["interval_s"]
    for deployment_id, rates in sent.items():
        roles: dict[str, dict[str, float]] = {}
        for worker in workers:
            if worker.deployment_id == deployment_id and worker.url in rates:
                roles.setdefault(worker.role, {})[worker.url] = rates[worker.url]
        shares[deployment_id] = {url: n for per_url in worker_share(roles).values() for url, n in per_url.items()}

    per_role: dict[tuple[int, str], list[WorkerReading]] = {}
    samples: list[WorkerSample] = []
    updates: dict[tuple[str, ...], list[Worker]] = {}  # the fields a scrape refreshed → those workers
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
        for name, value in fields.items():
            setattr(worker, name, value)
        updates.setdefault(tuple(fields), []).append(worker)
        reading = read_worker(item, deltas, dt, worker.deployment.batch_size)
        if worker.deployment_id in sent:
            reading.values["requests_per_s"] = sent[worker.deployment_id].get(worker.url, 0.0)
            reading.values["request_share"] = shares.get(worker.deployment_id, {}).get(worker.url)
        per_role.setdefault((worker.deployment_id, worker.role), []).append(reading)
        samples.append(
            WorkerSample(deployment_id=worker.deployment_id, worker_id=worker.pk, name=worker_name(worker),
                         role=worker.role, url=worker.url, at=now, **reading.values)
        )  # fmt: skip
    with transaction.atomic():  # one commit for the round's rows, not one per worker
        for names, changed in updates.items():
            _update_workers(changed, names)
        sample_actions.record_worker_samples(samples)

    recorded = 0
    for deployment in Deployment.objects.filter(status=DeploymentStatus.ACTIVE):
        for role in WorkerRole.values:
            items = per_role.get((deployment.pk, role), [])
            running_workers = sum(1 for w in workers if w.deployment_id == deployment.pk and w.role == role)
            if role == WorkerRole.BOTH and not running_workers and not deployment.both_replicas:
                continue  # a disaggregated deployment has no `both` workers: no series for them
            sample_actions.record_metric_sample(deployment, role, at=now, workers=running_workers,
                                         load=role_load(deployment, role, now=now) or 0.0, **aggregate(items))
            recorded += 1
    return recorded


def _update_workers(workers: list[Worker], names: tuple[str, ...]) -> None:
    """Write the fields `names` of every worker: one prepared UPDATE sent for all rows (psycopg pipelines
    executemany). Django's bulk_update built a CASE per field and row, most of a round's CPU at 1,000 workers;
    the fields' own get_db_prep_value adapts JSON and datetimes for the backend."""
    fields = [Worker._meta.get_field(name) for name in names]
    quote = connection.ops.quote_name
    sql = (
        f"UPDATE {quote(Worker._meta.db_table)} SET {', '.join(f'{quote(f.column)} = %s' for f in fields)} "
        f"WHERE {quote(Worker._meta.pk.column)} = %s"
    )
    rows = [[f.get_db_prep_value(getattr(w, f.attname), connection, prepared=False) for f in fields] + [w.pk]
            for w in workers]  # fmt: skip
    with connection.cursor() as cursor:
        for start in range(0, len(rows), UPDATE_BATCH):
            cursor.executemany(sql, rows[start : start + UPDATE_BATCH])


def _store_router(item: RouterScrape, now: datetime) -> dict[str, Any] | None:
    """Save the router's scrape state and its RouterSample; returns router_changes (None: no deltas)."""
    router = item.router
    if item.state is None:
        logger.info("scrape of router %s failed: %s", router.url, item.error)
        RouterEndpoint.objects.filter(pk=router.pk).update(last_error=item.error[:2000])
        return None
    changes = router_changes(router.last_metrics, item.state)
    RouterEndpoint.objects.filter(pk=router.pk).update(last_metrics=item.state, last_scraped_at=now, last_error="")
    gauges = item.state["gauges"]
    sample = RouterSample(
        deployment_id=router.deployment_id, router=router, at=now,
        inflight=gauges.get("inflight"), queued=gauges.get("queued"), decode_slots=gauges.get("decode_slots"),
    )  # fmt: skip
    if changes is not None:
        for key, value in changes.items():
            if key == "selections":
                sample.worker_share = worker_share(value)
            else:
                setattr(sample, key, value)
    sample_actions.record_router_sample(sample)
    return changes


def aggregate(items: list[WorkerReading]) -> dict[str, Any]:
    """The MetricSample fields of one role from its workers' readings (module doc)."""
    deltas = [r.deltas for r in items]
    values = [r.values for r in items]

    def total(key: str) -> float:
        return sum(d.get(key, 0.0) for d in deltas)

    def known(key: str) -> list[float]:
        return [float(v[key]) for v in values if v.get(key) is not None]

    rss, gpu_memory, kv_rate = known("rss_bytes"), known("gpu_memory_bytes"), known("kv_transfer_bytes_per_s")
    return {
        "ttft_s": total("ttft_sum") / total("ttft_count") if total("ttft_count") > 0 else None,
        "itl_s": total("itl_sum") / total("itl_count") if total("itl_count") > 0 else None,
        "throughput_tps": sum(known("throughput_tps")),
        "queue_depth": sum(known("queue_depth")),
        "running": sum(known("running")),
        "kv_usage": _mean(known("kv_usage")) or 0.0,
        "cpu_utilization": _mean(known("cpu_utilization")),
        "gpu_utilization": _mean(known("gpu_utilization")),
        "rss_bytes": int(sum(rss)) if rss else None,
        "gpu_memory_bytes": int(sum(gpu_memory)) if gpu_memory else None,
        "kv_transfer_bytes_per_s": sum(kv_rate) if kv_rate else None,
        "kv_transfer_s": (
            total("kv_transfer_sum") / total("kv_transfer_count") if total("kv_transfer_count") > 0 else None
        ),
        "prefix_cache_hit_ratio": _mean(known("prefix_cache_hit_ratio")),
    }
