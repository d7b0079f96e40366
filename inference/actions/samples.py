"""Metric samples written by the collector (per role, per worker, per router) and pruned by age.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import datetime, timedelta

from django.conf import settings
from django.utils import timezone

from inference.models import (
    Deployment,
    MetricSample,
    RouterSample,
    WorkerSample,
    validate_role,
)

logger = logging.getLogger(__name__)

def record_metric_sample(
    deployment: Deployment | int,
    role: str,
    *,
    at: datetime | None = None,
    workers: int = 0,
    load: float = 0.0,
    ttft_s: float | None = None,
    itl_s: float | None = None,
    throughput_tps: float = 0.0,
    queue_depth: float = 0.0,
    running: float = 0.0,
    kv_usage: float = 0.0,
    cpu_utilization: float | None = None,
    gpu_utilization: float | None = None,
    rss_bytes: int | None = None,
    gpu_memory_bytes: int | None = None,
    kv_transfer_bytes_per_s: float | None = None,
    kv_transfer_s: float | None = None,
    prefix_cache_hit_ratio: float | None = None,
) -> MetricSample:
    """Store one role-level metrics sample of a deployment (timestamped now unless `at` is given)."""
    validate_role(role)
    deployment_id = deployment if isinstance(deployment, int) else deployment.pk
    return MetricSample.objects.create(
        deployment_id=deployment_id,
        role=role,
        at=at or timezone.now(),
        workers=workers,
        load=load,
        ttft_s=ttft_s,
        itl_s=itl_s,
        throughput_tps=throughput_tps,
        queue_depth=queue_depth,
        running=running,
        kv_usage=kv_usage,
        cpu_utilization=cpu_utilization,
        gpu_utilization=gpu_utilization,
        rss_bytes=rss_bytes,
        gpu_memory_bytes=gpu_memory_bytes,
        kv_transfer_bytes_per_s=kv_transfer_bytes_per_s,
        kv_transfer_s=kv_transfer_s,
        prefix_cache_hit_ratio=prefix_cache_hit_ratio,
    )


def record_worker_samples(samples: Iterable[WorkerSample]) -> int:
    """Store per-worker samples (built by the collector) in one statement; returns how many."""
    rows = list(samples)
    for row in rows:
        validate_role(row.role)
    WorkerSample.objects.bulk_create(rows)
    return len(rows)


def record_router_sample(sample: RouterSample) -> RouterSample:
    """Store one router sample (built by the collector)."""
    sample.save()
    return sample


def prune_metric_samples(older_than: timedelta | None = None) -> int:
    """Delete metric samples (per role, per worker, router) older than `older_than` (default:
    settings.METRICS_RETENTION_HOURS).

    Returns how many were deleted. The sample models have no dependants: one DELETE statement each.
    """
    if older_than is None:
        older_than = timedelta(hours=settings.METRICS_RETENTION_HOURS)
    cutoff = timezone.now() - older_than
    deleted = 0
    for model in (MetricSample, WorkerSample, RouterSample):
        count, _ = model.objects.filter(at__lt=cutoff).delete()
        deleted += int(count)
    return deleted
