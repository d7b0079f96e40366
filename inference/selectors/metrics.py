"""Reads of the inference app shared by the scaling rules, actions, the REST API and the admin.

Scaling state: who holds a role's replica count right now decides whether a manual scale would be
reverted: an active override (an operator's explicit count with an end time) first, else the active
schedule rule, else nobody (threshold rules and manual scales move it freely).

Metric series (`deployment_metric_series`, `metric_series_query`): the per-role, per-worker and
router samples the collector (inference.metrics.collector) stores, as the time series the admin's metrics
page and `GET /api/deployments/{id}/metrics/` return, with the charts the page draws (CHARTS).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, time, timedelta
from typing import Any
from zoneinfo import ZoneInfo

from django.conf import settings
from django.utils import timezone

from inference.models import (
    Deployment,
    MetricSample,
    RouterSample,
    RuleKind,
    ScaleEvent,
    ScaleOverride,
    ScalingRule,
    WorkerRole,
    WorkerSample,
)


def local_time(now: datetime) -> time:
    """Wall-clock time of `now` in settings.TIME_ZONE."""
    return now.astimezone(ZoneInfo(settings.TIME_ZONE)).time()


def _minutes(t: time) -> float:
    return t.hour * 60 + t.minute + t.second / 60 + t.microsecond / 60e6


def in_window(start: time, end: time, at: time) -> bool:
    """Whether `at` is in [start, end); the window wraps midnight when end < start; start == end is empty."""
    if start == end:
        return False
    if start < end:
        return start <= at < end
    return at >= start or at < end


def minutes_since_start(start: time, at: time) -> float:
    """Minutes from the window's start to `at`, going forward through midnight if needed."""
    return (_minutes(at) - _minutes(start)) % (24 * 60)


def active_schedule_rule(rules: Sequence[ScalingRule], now: datetime) -> ScalingRule | None:
    """The schedule rule holding a role now: of those whose window contains `now`, the latest started."""
    at = local_time(now)
    active = [
        r for r in rules
        if r.enabled and r.kind == RuleKind.SCHEDULE and r.start_time is not None and r.end_time is not None
        and r.target_replicas is not None and in_window(r.start_time, r.end_time, at)
    ]  # fmt: skip
    if not active:
        return None
    return min(active, key=lambda r: (minutes_since_start(r.start_time, at), r.name))  # type: ignore[arg-type]


def schedule_rule_holding(deployment: Deployment, role: str, now: datetime) -> ScalingRule | None:
    """The enabled schedule rule of the deployment's `role` whose window contains `now`, if any."""
    rules = ScalingRule.objects.filter(deployment=deployment, role=role, kind=RuleKind.SCHEDULE, enabled=True)
    return active_schedule_rule(list(rules.order_by("name")), now)


def active_override(deployment: Deployment, role: str, now: datetime) -> ScaleOverride | None:
    """The override holding the deployment's `role` at `now` (the most recent if several overlap)."""
    return (
        ScaleOverride.objects.select_related("rule")
        .filter(deployment=deployment, role=role, ends_at__gt=now)
        .order_by("-created_at", "-id")
        .first()
    )


def active_overrides(deployment: Deployment, now: datetime) -> list[ScaleOverride]:
    """The deployment's overrides still holding a role at `now`, one per role at most (newest wins)."""
    rows = ScaleOverride.objects.select_related("rule").filter(deployment=deployment, ends_at__gt=now)
    newest: dict[str, ScaleOverride] = {}
    for override in rows.order_by("-created_at", "-id"):
        newest.setdefault(override.role, override)
    return sorted(newest.values(), key=lambda o: o.role)


def window_text(rule: ScalingRule) -> str:
    """A schedule rule's window as people read it, e.g. "22:00–07:00 (Europe/Paris)"."""
    if rule.start_time is None or rule.end_time is None:
        return ""
    return f"{rule.start_time:%H:%M}–{rule.end_time:%H:%M} ({settings.TIME_ZONE})"


# ------------------------------------------------------------------------------------ metric series
ROLES: tuple[str, ...] = tuple(WorkerRole.values)

# Fields of MetricSample (one sample per role) the charts and the API return, with a label and unit.
SERIES_FIELDS: dict[str, dict[str, str]] = {
    "ttft_s": {"label": "Time to first token", "unit": "s"},
    "itl_s": {"label": "Inter-token latency", "unit": "s"},
    "throughput_tps": {"label": "Throughput", "unit": "tokens/s"},
    "queue_depth": {"label": "Queue depth", "unit": "requests"},
    "load": {"label": "Load", "unit": "ratio"},
    "cpu_utilization": {"label": "CPU utilisation", "unit": "ratio"},
    "gpu_utilization": {"label": "GPU utilisation", "unit": "ratio"},
    "running": {"label": "Running requests", "unit": "requests"},
    "kv_usage": {"label": "KV cache usage", "unit": "ratio"},
    "workers": {"label": "Workers", "unit": "workers"},
    "rss_bytes": {"label": "Resident memory (RSS)", "unit": "bytes"},
    "gpu_memory_bytes": {"label": "GPU memory", "unit": "bytes"},
    "kv_transfer_bytes_per_s": {"label": "KV transfer", "unit": "bytes/s"},
    "kv_transfer_s": {"label": "KV transfer time", "unit": "s"},
    "prefix_cache_hit_ratio": {"label": "Prefix-cache hit rate", "unit": "ratio"},
}

# Fields of WorkerSample (one sample per worker).
WORKER_FIELDS: dict[str, dict[str, str]] = {
    **{k: v for k, v in SERIES_FIELDS.items() if k != "workers"},
    "requests_per_s": {"label": "Requests sent by the router", "unit": "requests/s"},
    "request_share": {"label": "Share of the role's requests", "unit": "ratio"},
}

# Fields of RouterSample (what the router measured, as its clients see it).
ROUTER_FIELDS: dict[str, dict[str, str]] = {
    "requests_per_s": {"label": "Requests", "unit": "requests/s"},
    "error_rate": {"label": "Error rate (failed / all)", "unit": "ratio"},
    "rejected_per_s": {"label": "Rejected (429)", "unit": "requests/s"},
    "tokens_per_s": {"label": "Tokens streamed", "unit": "tokens/s"},
    "dispatch_p50_s": {"label": "Dispatch p50", "unit": "s"},
    "dispatch_p90_s": {"label": "Dispatch p90", "unit": "s"},
    "queue_wait_p50_s": {"label": "Queue wait p50", "unit": "s"},
    "queue_wait_p90_s": {"label": "Queue wait p90", "unit": "s"},
    "ttft_p50_s": {"label": "Client TTFT p50", "unit": "s"},
    "ttft_p90_s": {"label": "Client TTFT p90", "unit": "s"},
    "itl_p50_s": {"label": "Client ITL p50", "unit": "s"},
    "itl_p90_s": {"label": "Client ITL p90", "unit": "s"},
    "e2e_p50_s": {"label": "Request time p50", "unit": "s"},
    "e2e_p90_s": {"label": "Request time p90", "unit": "s"},
    "inflight": {"label": "In flight", "unit": "requests"},
    "queued": {"label": "Queued in the router", "unit": "requests"},
    "decode_slots": {"label": "Decode slots", "unit": "requests"},
}
# Router fields that add up over several routers of a deployment (the others: the worst router's).
_ROUTER_SUMS = {"requests_per_s", "rejected_per_s", "tokens_per_s", "inflight", "queued", "decode_slots"}


def _chart(chart_id: str, title: str, unit: str, source: str, fields: Sequence[str], **extra: Any) -> dict[str, Any]:
    return {"id": chart_id, "title": title, "unit": unit, "source": source, "fields": list(fields), **extra}


# The charts of the metrics page, in order. `source`: "router" (one line per field of the router's
# series), "role" (one line per role, or per worker when the page's toggle says so and the chart has
# `per_worker`), "worker" (one line per worker, always).
CHARTS: list[dict[str, Any]] = [
    _chart("router_overhead", "Router overhead (dispatch latency)", "s", "router",
           ["dispatch_p50_s", "dispatch_p90_s"]),
    _chart("client_ttft", "Client TTFT (at the router)", "s", "router", ["ttft_p50_s", "ttft_p90_s"]),
    _chart("client_itl", "Client ITL (at the router)", "s", "router", ["itl_p50_s", "itl_p90_s"]),
    _chart("error_rate", "Error rate (failed / all requests)", "ratio", "router", ["error_rate"]),
    _chart("rejected", "Requests and 429s per second", "requests/s", "router", ["requests_per_s", "rejected_per_s"]),
    _chart("router_queue", "Router queue and in flight", "requests", "router", ["queued", "inflight", "decode_slots"]),
    _chart("request_share", "Share of requests per worker", "ratio", "worker", ["request_share"]),
    _chart("load", "Load", "ratio", "role", ["load"], per_worker=True),
    _chart("ttft", "Time to first token (workers)", "s", "role", ["ttft_s"], per_worker=True),
    _chart("itl", "Inter-token latency (workers)", "s", "role", ["itl_s"], per_worker=True),
    _chart("throughput", "Throughput", "tokens/s", "role", ["throughput_tps"], per_worker=True),
    _chart("queue_depth", "Queue depth (workers)", "requests", "role", ["queue_depth"], per_worker=True),
    _chart("kv_usage", "KV cache usage", "ratio", "role", ["kv_usage"], per_worker=True),
    _chart("cpu_utilization", "CPU utilisation", "ratio", "role", ["cpu_utilization"], per_worker=True),
    _chart("gpu_utilization", "GPU utilisation", "ratio", "role", ["gpu_utilization"], per_worker=True),
    _chart("rss", "Resident memory (RSS)", "bytes", "role", ["rss_bytes"], per_worker=True),
    _chart("gpu_memory", "GPU memory", "bytes", "role", ["gpu_memory_bytes"], per_worker=True),
    _chart("kv_transfer", "KV transfer", "bytes/s", "role", ["kv_transfer_bytes_per_s"], per_worker=True),
    _chart("kv_transfer_time", "KV transfer time (mean)", "s", "role", ["kv_transfer_s"], per_worker=True),
    _chart("prefix_cache", "Prefix-cache hit rate", "ratio", "role", ["prefix_cache_hit_ratio"], per_worker=True),
    _chart("workers", "Workers", "workers", "role", ["workers"]),
]


class InvalidQuery(ValueError):
    """A metric-series query parameter with a bad value; `errors` maps the parameter to the message."""

    def __init__(self, errors: dict[str, str]) -> None:
        self.errors = errors
        super().__init__("; ".join(f"{k}: {v}" for k, v in errors.items()))


def validate_role(role: str) -> str:
    """Return `role` if it is a worker role, else raise ValueError naming the valid ones."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    return role


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
    rates and gauges add up, the error rate is weighted by requests, latencies are the worst router's."""
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
            elif field == "error_rate":
                weighted = [(r[column], r[1] or 0.0) for r in group if r[column] is not None]
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
            for name in ROLES
        },
    }


def deployment_metric_series(
    deployment: Deployment,
    since: datetime | timedelta,
    role: str | None = None,
    *,
    max_points: int = 600,
) -> dict[str, Any]:
    """Time series of a deployment's metrics since `since` (a datetime, or a timedelta back from now).

    Shape (JSON-safe; times in epoch milliseconds, a value None where nothing was measured)::

        {"deployment": {id, name, status, replicas: {role: {desired, min, max}}},
         "since": iso, "now": iso,
         "metrics": {field: {label, unit}},                 # of "series" (MetricSample)
         "series": {role: {"t": [...], field: [...]}},      # per role
         "worker_metrics": {field: {label, unit}},          # of "workers" (WorkerSample)
         "workers": [{"id", "name", "role", "url", "t": [...], field: [...]}],   # per worker
         "router_metrics": {field: {label, unit}},          # of "router" (RouterSample)
         "router": {"t": [...], field: [...]},              # the deployment's router(s)
         "charts": CHARTS,
         "events": [{t, role, from, to, source, reason}, ...]}

    `role` limits the roles and workers (not the router, which serves both). Each series has at most
    `max_points` points: longer windows are averaged into time buckets.
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

    worker_fields = list(WORKER_FIELDS)
    per_worker: dict[int, list[tuple[Any, ...]]] = {}
    names: dict[int, tuple[str, str, str]] = {}
    worker_rows = (
        WorkerSample.objects.filter(deployment=deployment, role__in=roles, at__gte=start)
        .order_by("at", "worker_id")
        .values_list("worker_id", "name", "role", "url", "at", *worker_fields)
    )
    for worker_id, name, worker_role, url, *values in worker_rows:
        per_worker.setdefault(worker_id, []).append(tuple(values))
        names[worker_id] = (name, worker_role, url)  # the newest name wins
    workers = [
        {"id": worker_id, "name": names[worker_id][0], "role": names[worker_id][1], "url": names[worker_id][2],
         **_columns(rows, worker_fields, start, now, max_points)}
        for worker_id, rows in per_worker.items()
    ]
    workers.sort(key=lambda w: (ROLES.index(w["role"]) if w["role"] in ROLES else len(ROLES), w["name"], w["id"]))

    router_fields = list(ROUTER_FIELDS)
    router_rows = (
        RouterSample.objects.filter(deployment=deployment, at__gte=start)
        .order_by("at", "router_id")
        .values_list("at", "requests_per_s", *router_fields)
    )
    router = _columns(_merge_routers(router_rows, router_fields), router_fields, start, now, max_points)

    events = [
        {"t": int(e.created_at.timestamp() * 1000), "role": e.role, "from": e.from_replicas, "to": e.to_replicas,
         "source": e.source, "reason": e.reason}
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
        "workers": workers,
        "router_metrics": ROUTER_FIELDS,
        "router": router,
        "charts": CHARTS,
        "events": events,
    }


def metric_series_query(deployment: Deployment, params: Mapping[str, Any]) -> dict[str, Any]:
    """`deployment_metric_series` for query parameters `minutes` (default 60), `role` and `max_points`
    (default 600), as the admin's metrics page and the REST API take them.

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
    role = text("role")
    if role is not None and role not in ROLES:
        errors["role"] = f"must be one of {', '.join(ROLES)}"
    if errors:
        raise InvalidQuery(errors)
    return deployment_metric_series(deployment, timedelta(minutes=minutes), role, max_points=max_points)
