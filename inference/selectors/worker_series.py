"""Per-worker metric series of a deployment, bounded whatever its worker count.

The charts' series endpoint returned every worker's points: 11.5 MB for 5 minutes at 1,000 workers
(bench/sim/control_plane.py), 9-31 s for 60 minutes at 100. `worker_series` returns the series of at
most `max_workers` workers, the most loaded ones (mean `load` over the RANK_SPAN before the window's
newest raw sample, or its newest minute rollup when it holds no raw sample), each averaged by the
database into at most WORKER_MAX_POINTS time buckets (a line among 20 on a chart a few hundred pixels
wide); the per-role lines of the same charts come from the collector's per-role aggregates
(MetricSample), which cover every worker. The response says how many workers had samples and which
were drawn, so the page can say "20 of 1,000 workers".

Its cost is bounded by the workers drawn: one aggregate over the ranking span (indexed by deployment
and time) and the drawn workers' rows (indexed by worker and time), raw samples within
METRICS_RAW_RETENTION_HOURS and minute rollups before the oldest of them.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from itertools import chain
from typing import Any

from django.db.models import Avg, F, Func, IntegerField, Max, QuerySet

from inference.models import ROLES, Deployment, WorkerSample
from inference.models.samples import WorkerSampleRollup
from inference.selectors.charts import WORKER_FIELDS

# The span whose mean load ranks the workers: recent enough to show who is busy now, long enough that the
# choice does not flicker between two refreshes of the page.
RANK_SPAN = timedelta(minutes=5)
# Workers drawn unless asked otherwise: more lines than this make a chart unreadable anyway.
DEFAULT_MAX_WORKERS = 20
MAX_WORKERS_LIMIT = 200
# Points per worker line (the per-role lines keep the request's max_points).
WORKER_MAX_POINTS = 200

Columns = Callable[[list[tuple[Any, ...]], Sequence[str], datetime, datetime, int], dict[str, list[Any]]]


@dataclass
class WorkerSeries:
    """The drawn workers' series (each {"id", "name", "role", "url", "t", field: [...]}) and how many
    workers had samples in the ranking span."""

    workers: list[dict[str, Any]] = field(default_factory=list)
    total: int = 0


def _ranked(samples: QuerySet, limit: int) -> tuple[list[int], int]:
    """The ids of the `limit` workers of `samples` with the highest mean load (no load last), and the
    number of workers in `samples`."""
    means = (
        samples.values("worker_id").annotate(mean=Avg("load"))
        .order_by(F("mean").desc(nulls_last=True), "worker_id").values_list("worker_id", flat=True)
    )  # fmt: skip
    ids = list(means)
    return ids[:limit], len(ids)


def drawn_workers(deployment: Deployment, roles: Sequence[str], start: datetime, now: datetime,
                  max_workers: int) -> tuple[list[int], int]:
    """Which workers to draw (module doc) and how many had samples in the ranking span: the RANK_SPAN before
    the window's newest raw sample (or, in a window without raw samples, its newest minute rollup)."""
    for model, extra in ((WorkerSample, {}), (WorkerSampleRollup, {"resolution_s": 60})):
        samples = model.objects.filter(deployment=deployment, role__in=roles, at__gte=start, **extra)
        newest = samples.order_by("-at").values_list("at", flat=True).first()
        if newest is not None:
            return _ranked(samples.filter(at__gte=max(start, newest - RANK_SPAN)), max_workers)
    return [], 0


class TimeBucket(Func):
    """The index of a row's time bucket: floor((epoch(at) - epoch(since)) / width), in PostgreSQL or SQLite,
    so that the database averages each bucket instead of sending every row."""

    output_field = IntegerField()

    def __init__(self, at: str, since: datetime, width_s: float) -> None:
        super().__init__(F(at))
        self.since_epoch = since.timestamp()
        self.width_s = max(width_s, 1e-6)

    def as_sql(self, compiler: Any, connection: Any, **extra: Any) -> tuple[str, list[Any]]:  # type: ignore[override]
        """PostgreSQL (and any backend with EXTRACT(EPOCH ...))."""
        at_sql, at_params = compiler.compile(self.source_expressions[0])
        sql = f"CAST(FLOOR((EXTRACT(EPOCH FROM {at_sql}) - %s) / %s) AS BIGINT)"
        return sql, [*at_params, self.since_epoch, self.width_s]

    def as_sqlite(self, compiler: Any, connection: Any, **extra: Any) -> tuple[str, list[Any]]:
        """SQLite stores times as ISO text: julianday() reads them."""
        at_sql, at_params = compiler.compile(self.source_expressions[0])
        sql = f"CAST(((julianday({at_sql}) - 2440587.5) * 86400.0 - %s) / %s AS INTEGER)"
        return sql, [*at_params, self.since_epoch, self.width_s]


def _bucketed(samples: QuerySet, fields: Sequence[str], start: datetime, width_s: float) -> QuerySet:
    """One row per worker and time bucket: the bucket's last time, the worker's name, role and URL (fixed for
    a worker: its id, role, node and port), and each field's mean (NULLs ignored, as a chart skips them)."""
    return (
        samples.annotate(bucket=TimeBucket("at", start, width_s)).values("worker_id", "bucket")
        .annotate(last=Max("at"), wname=Max("name"), wrole=Max("role"), wurl=Max("url"),
                  **{f"mean_{f}": Avg(f) for f in fields})
        .order_by("bucket")
        .values_list("worker_id", "wname", "wrole", "wurl", "last", *(f"mean_{f}" for f in fields))
    )  # fmt: skip


def worker_series(deployment: Deployment, roles: Sequence[str], start: datetime, now: datetime, *,
                  max_points: int, max_workers: int, columns: Columns) -> WorkerSeries:
    """The series of the drawn workers since `start`, at most `max_points` (and WORKER_MAX_POINTS) time
    buckets each (averaged by the database, then shaped by `columns`), sorted by role then name."""
    ids, total = drawn_workers(deployment, roles, start, now, max_workers)
    if not ids:
        return WorkerSeries([], total)
    fields = list(WORKER_FIELDS)
    max_points = max(min(max_points, WORKER_MAX_POINTS), 1)
    width_s = max((now - start).total_seconds(), 1e-6) / max_points
    raw = WorkerSample.objects.filter(worker_id__in=ids, deployment=deployment, at__gte=start)
    # Raw samples are kept METRICS_RAW_RETENTION_HOURS: before the oldest one, the minute rollups
    # (inference.metrics.downsampling) carry each worker's series.
    oldest_raw = raw.order_by("at").values_list("at", flat=True).first() or now
    rolled_up = WorkerSampleRollup.objects.filter(worker_id__in=ids, deployment=deployment, resolution_s=60,
                                                  at__gte=start, at__lt=oldest_raw)  # fmt: skip
    per_worker: dict[int, list[tuple[Any, ...]]] = {}
    names: dict[int, tuple[str, str, str]] = {}
    for worker_id, name, role, url, *values in chain(_bucketed(rolled_up, fields, start, width_s),
                                                     _bucketed(raw, fields, start, width_s)):  # fmt: skip
        per_worker.setdefault(worker_id, []).append(tuple(values))
        names[worker_id] = (name, role, url)
    workers = [
        {"id": worker_id, "name": names[worker_id][0], "role": names[worker_id][1], "url": names[worker_id][2],
         **columns(rows, fields, start, now, max_points)}
        for worker_id, rows in per_worker.items()
    ]
    workers.sort(key=lambda w: (ROLES.index(w["role"]) if w["role"] in ROLES else len(ROLES), w["name"], w["id"]))
    return WorkerSeries(workers, total)
