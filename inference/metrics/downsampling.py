"""Downsampling of per-worker samples: per-minute and per-hour rollups, kept longer than raw samples.

The collector writes one WorkerSample per worker per scrape (every 5 s: 17,280 rows a day per worker,
17 million at 1,000 workers). `downsample(now)` (run by the hourly prune_metrics task, before the
pruning) averages the raw samples of every closed minute into one WorkerSampleRollup per worker
(resolution 60 s), and the minute rollups of every closed hour into one per worker (3600 s); `prune`
then deletes raw samples older than METRICS_RAW_RETENTION_HOURS, minute rollups older than
METRICS_RETENTION_HOURS and hour rollups older than METRICS_ROLLUP_RETENTION_DAYS.

Each pass starts after the newest bucket already rolled up (or at the oldest sample), so a run
covers what arrived since the previous one; buckets are unique per worker, so a bucket written
twice (two runs at once, a retry) is kept once. An hour rollup averages its minutes' means
weighted by their sample counts.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.db.models import Avg, Count, F, FloatField, Max, Q, Sum
from django.db.models.functions import Trunc
from django.utils import timezone

from inference.models import MetricSample, RouterSample, WorkerSample
from inference.models.samples import WorkerSampleRollup

logger = logging.getLogger(__name__)

MINUTE_S = 60  # RollupResolution.MINUTE
HOUR_S = 3600  # RollupResolution.HOUR

# The WorkerSample fields a rollup averages (its fields of the same names).
MEAN_FIELDS: tuple[str, ...] = (
    "load", "queue_depth", "running", "kv_usage", "cpu_utilization", "gpu_utilization", "throughput_tps",
    "ttft_s", "itl_s", "rss_bytes", "gpu_memory_bytes", "kv_transfer_bytes_per_s", "kv_transfer_s",
    "prefix_cache_hit_ratio", "requests_per_s", "request_share",
)  # fmt: skip
INTEGER_FIELDS = frozenset({"rss_bytes", "gpu_memory_bytes"})
# Rows per INSERT: a closed hour at 1,000 workers is 60,000 minute rollups.
BATCH_SIZE = 2000
# A run rolls up at most this much history (the first run after an upgrade meets up to 3 days of raw samples).
MAX_SPAN = timedelta(days=4)


@dataclass
class DownsampleResult:
    """Rollups written per resolution by one run."""

    minute: int = 0
    hour: int = 0


def _floor(at: datetime, seconds: int) -> datetime:
    epoch = int(at.timestamp())
    return datetime.fromtimestamp(epoch - epoch % seconds, tz=UTC)


def _start(resolution: int, oldest: datetime | None) -> datetime | None:
    """The first bucket not rolled up yet: after the newest rollup of `resolution`, else the oldest source row."""
    newest = (
        WorkerSampleRollup.objects.filter(resolution_s=resolution).order_by("-at").values_list("at", flat=True).first()
    )
    if newest is not None:
        return newest + timedelta(seconds=resolution)
    return _floor(oldest, resolution) if oldest is not None else None


def _value(field: str, value: Any) -> Any:
    if value is None:
        return None
    return int(value) if field in INTEGER_FIELDS else float(value)


def roll_up_minutes(now: datetime) -> int:
    """One rollup per worker and closed minute of raw samples since the newest minute rollup."""
    oldest = WorkerSample.objects.order_by("at").values_list("at", flat=True).first()
    start = _start(MINUTE_S, oldest)
    end = _floor(now, MINUTE_S)
    if start is None or start >= end:
        return 0
    start = max(start, end - MAX_SPAN)
    rows = (
        WorkerSample.objects.filter(at__gte=start, at__lt=end)
        .annotate(bucket=Trunc("at", "minute", tzinfo=UTC))
        .values("deployment_id", "worker_id", "role", "bucket")
        .annotate(n=Count("id"), peak=Max("load"), last_name=Max("name"), last_url=Max("url"),
                  **{f"mean_{f}": Avg(f) for f in MEAN_FIELDS})
        .order_by()
    )  # fmt: skip
    rollups = [
        WorkerSampleRollup(
            deployment_id=row["deployment_id"], worker_id=row["worker_id"], role=row["role"], name=row["last_name"],
            url=row["last_url"], resolution_s=MINUTE_S, at=row["bucket"], samples=row["n"],
            load_max=row["peak"], **{f: _value(f, row[f"mean_{f}"]) for f in MEAN_FIELDS},
        )
        for row in rows.iterator(chunk_size=BATCH_SIZE)
    ]  # fmt: skip
    WorkerSampleRollup.objects.bulk_create(rollups, batch_size=BATCH_SIZE, ignore_conflicts=True)
    return len(rollups)


def roll_up_hours(now: datetime) -> int:
    """One rollup per worker and closed hour of minute rollups since the newest hour rollup."""
    minutes = WorkerSampleRollup.objects.filter(resolution_s=MINUTE_S)
    oldest = minutes.order_by("at").values_list("at", flat=True).first()
    start = _start(HOUR_S, oldest)
    end = _floor(now, HOUR_S)
    if start is None or start >= end:
        return 0
    start = max(start, end - MAX_SPAN)

    def weighted(field: str) -> Any:
        # Σ mean·n / Σ n over the minutes that had the field (NULL means stay out of both sums).
        return Sum(F(field) * F("samples"), output_field=FloatField())

    rows = (
        minutes.filter(at__gte=start, at__lt=end)
        .annotate(bucket=Trunc("at", "hour", tzinfo=UTC))
        .values("deployment_id", "worker_id", "role", "bucket")
        .annotate(n=Sum("samples"), peak=Max("load_max"), last_name=Max("name"), last_url=Max("url"),
                  **{f"sum_{f}": weighted(f) for f in MEAN_FIELDS},
                  **{f"n_{f}": Sum("samples", filter=Q(**{f"{f}__isnull": False})) for f in MEAN_FIELDS})
        .order_by()
    )  # fmt: skip
    rollups = []
    for row in rows.iterator(chunk_size=BATCH_SIZE):
        values = {
            f: _value(f, row[f"sum_{f}"] / row[f"n_{f}"]) if row[f"n_{f}"] and row[f"sum_{f}"] is not None else None
            for f in MEAN_FIELDS
        }
        rollups.append(WorkerSampleRollup(
            deployment_id=row["deployment_id"], worker_id=row["worker_id"], role=row["role"], name=row["last_name"],
            url=row["last_url"], resolution_s=HOUR_S, at=row["bucket"], samples=row["n"] or 0,
            load_max=row["peak"], **values,
        ))  # fmt: skip
    WorkerSampleRollup.objects.bulk_create(rollups, batch_size=BATCH_SIZE, ignore_conflicts=True)
    return len(rollups)


def downsample(now: datetime | None = None) -> DownsampleResult:
    """Roll up the closed minutes, then the closed hours (module doc)."""
    now = now or timezone.now()
    result = DownsampleResult(minute=roll_up_minutes(now))
    result.hour = roll_up_hours(now)
    if result.minute or result.hour:
        logger.info("downsampled worker samples: %d minute and %d hour rollups", result.minute, result.hour)
    return result


def prune(now: datetime | None = None) -> int:
    """Delete raw worker samples, rollups and the other samples past their retention; returns how many."""
    now = now or timezone.now()
    retention = timedelta(hours=settings.METRICS_RETENTION_HOURS)
    deleted = 0
    for query in (
        WorkerSample.objects.filter(at__lt=now - timedelta(hours=settings.METRICS_RAW_RETENTION_HOURS)),
        WorkerSampleRollup.objects.filter(resolution_s=MINUTE_S, at__lt=now - retention),
        WorkerSampleRollup.objects.filter(
            resolution_s=HOUR_S, at__lt=now - timedelta(days=settings.METRICS_ROLLUP_RETENTION_DAYS)
        ),
        MetricSample.objects.filter(at__lt=now - retention),
        RouterSample.objects.filter(at__lt=now - retention),
    ):
        count, _ = query.delete()
        deleted += int(count)
    return deleted
