"""Metric series of a deployment: the per-role, per-worker and router samples the collector
(inference.metrics.collector) stores, as the time series the admin's metrics page and
`GET /api/deployments/{id}/metrics/` return (`deployment_metric_series`, `metric_series_query`),
downsampled to a number of points, with the charts to draw (inference.selectors.charts).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.utils import timezone

from inference.models import (
    ROLES,
    Deployment,
    MetricSample,
    RouterSample,
    ScaleEvent,
    validate_role,
)
from inference.selectors import worker_series
from inference.selectors.charts import CHARTS, ROUTER_FIELDS, SERIES_FIELDS, WORKER_FIELDS

# Router fields that add up over several routers of a deployment (the others: the worst router's).
_ROUTER_SUMS = {
    "requests_per_s", "rejected_per_s", "tokens_per_s", "inflight", "queued", "decode_slots",
    "prompt_tokens_per_s", "cached_prompt_tokens_per_s", "local_prefills_per_s", "remote_prefills_per_s",
}
# Ratios of several routers: weighted by the rate they are a share of (a field of the same row).
_ROUTER_WEIGHTED = {"prompt_cached_ratio": "prompt_tokens_per_s"}


class InvalidQuery(ValueError):
    """A metric-series query parameter with a bad value; `errors` maps the parameter to the message."""

    def __init__(self, errors: dict[str, str]) -> None:
        self.errors = errors
        super().__init__("; ".join(f"{k}: {v}" for k, v in errors.items()))


def _downsample(rows: list[tuple[Any, ...]], since: datetime, until: datetime, max_points: int) -> list[list[Any]]:
    """Average rows (timestamp first) into at most `max_points` equal time buckets, ignoring Nones."""
    if len(rows) <= max_points:
        return [list(row) for row in rows]
    span = max((until - since).total_seconds(), 1e-6)
    width = span / max_points
    buckets: dict[int, list[tuple[Any, ...]]] = {}
    for row in rows:
        index = min(int((row[0] - since).total_seconds() / width), max_points - 1)
        buckets.setdefault(max(index, 0), []).append(row)
    out: list[list[Any]] = []
    for index in sorted(buckets):
        group = buckets[index]
        point: list[Any] = [group[-1][0]]  # the bucket's last timestamp keeps "now" at the right edge
        for column in range(1, len(group[0])):
            values = [r[column] for r in group if r[column] is not None]
            point.append(sum(values) / len(values) if values else None)
        out.append(point)
    return out


def _columns(rows: list[tuple[Any, ...]], fields: Sequence[str], since: datetime, until: datetime,
             max_points: int) -> dict[str, list[Any]]:
    """{"t": [epoch ms], field: [value or None]} of rows (at, *fields), downsampled to max_points."""
    points = _downsample(rows, since, until, max_points)
    data: dict[str, list[Any]] = {"t": [int(p[0].timestamp() * 1000) for p in points]}
    for column, field in enumerate(fields, start=1):
        data[field] = [p[column] for p in points]
    return data


def _merge_routers(rows: Iterable[tuple[Any, ...]], fields: Sequence[str]) -> list[tuple[Any, ...]]:
    """One row per timestamp from the samples of several routers (rows (at, requests_per_s, *fields)):
    rates and gauges add up, the error rate is weighted by requests and the cached share of prompt tokens
    by prompt tokens, latencies are the worst router's."""
    by_time: dict[datetime, list[tuple[Any, ...]]] = {}
    for row in rows:
        by_time.setdefault(row[0], []).append(row)
    merged: list[tuple[Any, ...]] = []
    for at in sorted(by_time):
        group = by_time[at]
        if len(group) == 1:
            merged.append(group[0][:1] + group[0][2:])
            continue
        point: list[Any] = [at]
        for column, field in enumerate(fields, start=2):
            values = [r[column] for r in group if r[column] is not None]
            if not values:
                point.append(None)
            elif field in _ROUTER_SUMS:
                point.append(sum(values))
            elif field == "error_rate" or field in _ROUTER_WEIGHTED:
                by = 1 if field == "error_rate" else 2 + list(fields).index(_ROUTER_WEIGHTED[field])
                weighted = [(r[column], r[by] or 0.0) for r in group if r[column] is not None]
                total = sum(w for _, w in weighted)
                point.append(sum(v * w for v, w in weighted) / total if total else max(values))
            else:
                point.append(max(values))
        merged.append(tuple(point))
    return merged


def _deployment_summary(deployment: Deployment) -> dict[str, Any]:
    return {
        "id": deployment.pk,
        "name": deployment.name,
        "status": deployment.status,
        "replicas": {
            name: {"desired": deployment.replicas(name), "min": deployment.bounds(name)[0],
                   "max": deployment.bounds(name)[1]}
            for name in deployment.roles_in_use()
        },
    }


def deployment_metric_series(
    deployment: Deployment,
    since: datetime | timedelta,
    role: str | None = None,
    *,
    max_points: int = 600,
    max_workers: int = worker_series.DEFAULT_MAX_WORKERS,
) -> dict[str, Any]:
    """Time series of a deployment's metrics since `since` (a datetime, or a timedelta back from now).

    Shape (JSON-safe; times in epoch milliseconds, a value None where nothing was measured)::

        {"deployment": {id, name, status, replicas: {role: {desired, min, max}}},
         "since": iso, "now": iso,
         "metrics": {field: {label, unit}},                 # of "series" (MetricSample)
         "series": {role: {"t": [...], field: [...]}},      # per role
         "worker_metrics": {field: {label, unit}},          # of "workers" (WorkerSample)
         "workers": [{"id", "name", "role", "url", "t": [...], field: [...]}],   # per worker, at most
         "workers_total": n, "max_workers": k,              # max_workers, of the workers_total sampled
         "router_metrics": {field: {label, unit}},          # of "router" (RouterSample)
         "router": {"t": [...], field: [...]},              # the deployment's router(s)
         "charts": CHARTS,
         "events": [{t, role, from, to, source, refused, reason}, ...]}

    `role` limits the roles and workers (not the router, which serves both). Each series has at most
    `max_points` points: longer windows are averaged into time buckets. Per-worker series are drawn for
    the `max_workers` most loaded workers only (inference.selectors.worker_series): the size of the answer
    does not grow with the deployment's worker count.
    """
    now = timezone.now()
    start = now - since if isinstance(since, timedelta) else since
    roles = [validate_role(role)] if role else list(ROLES)
    max_points = max(int(max_points), 1)
    fields = list(SERIES_FIELDS)
    series: dict[str, dict[str, list[Any]]] = {}
    for name in roles:
        rows = list(
            MetricSample.objects.filter(deployment=deployment, role=name, at__gte=start)
            .order_by("at")
            .values_list("at", *fields)
        )
        series[name] = _columns(rows, fields, start, now, max_points)

    drawn = worker_series.worker_series(deployment, roles, start, now, max_points=max_points,
                                        max_workers=max_workers, columns=_columns)  # fmt: skip

    router_fields = list(ROUTER_FIELDS)
    router_rows = (
        RouterSample.objects.filter(deployment=deployment, at__gte=start)
        .order_by("at", "router_id")
        .values_list("at", "requests_per_s", *router_fields)
    )
    router = _columns(_merge_routers(router_rows, router_fields), router_fields, start, now, max_points)

    events = [
        {"t": int(e.created_at.timestamp() * 1000), "role": e.role, "from": e.from_replicas, "to": e.to_replicas,
         "source": e.source, "refused": e.refused, "reason": e.reason}
        for e in ScaleEvent.objects.filter(deployment=deployment, created_at__gte=start, role__in=roles)
        .order_by("created_at")[:500]
    ]  # fmt: skip
    return {
        "deployment": _deployment_summary(deployment),
        "since": start.isoformat(),
        "now": now.isoformat(),
        "metrics": SERIES_FIELDS,
        "series": series,
        "worker_metrics": WORKER_FIELDS,
        "workers": drawn.workers,
        "workers_total": drawn.total,
        "max_workers": max_workers,
        "router_metrics": ROUTER_FIELDS,
        "router": router,
        "charts": CHARTS,
        "events": events,
    }


def metric_series_query(deployment: Deployment, params: Mapping[str, Any]) -> dict[str, Any]:
    """`deployment_metric_series` for query parameters `minutes` (default 60), `role`, `max_points`
    (default 600) and `max_workers` (default 20, at most 200; 0: no per-worker series), as the admin's
    metrics page and the REST API take them.

    Out-of-range numbers are clamped (minutes to the retention period); a value that is not a number,
    a NUL character or an unknown role raises InvalidQuery naming the parameter.
    """
    errors: dict[str, str] = {}

    def text(name: str) -> str | None:
        raw = params.get(name)
        if raw in (None, ""):
            return None
        value = str(raw)
        if "\x00" in value or len(value) > 100:
            errors[name] = "must be a short text without NUL characters"
            return None
        return value

    def number(name: str, default: int, low: int, high: int) -> int:
        raw = text(name)
        if raw is None:
            return default
        try:
            return min(max(int(raw), low), high)
        except ValueError:
            errors[name] = f"must be an integer, got {raw!r}"
            return default

    minutes = number("minutes", 60, 1, int(settings.METRICS_RETENTION_HOURS) * 60)
    max_points = number("max_points", 600, 10, 5000)
    max_workers = number("max_workers", worker_series.DEFAULT_MAX_WORKERS, 0, worker_series.MAX_WORKERS_LIMIT)
    role = text("role")
    if role is not None and role not in ROLES:
        errors["role"] = f"must be one of {', '.join(ROLES)}"
    if errors:
        raise InvalidQuery(errors)
    return deployment_metric_series(deployment, timedelta(minutes=minutes), role, max_points=max_points,
                                    max_workers=max_workers)
