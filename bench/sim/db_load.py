"""A deployment's sample history written straight into PostgreSQL, and what it costs on disk.

`measure(deployment, raw_hours, rollup_hours)` writes, for every RUNNING worker of the deployment, one
raw WorkerSample per 5 s over the last `raw_hours` (the collector's rate) and one minute
WorkerSampleRollup per minute over the `rollup_hours` before them (INSERT ... SELECT over
generate_series: seconds for millions of rows, with realistic values and the NULLs a CPU worker has),
then times one downsampling pass over the raw hours (the hourly task's work) and reads the tables'
bytes per row (pg_total_relation_size: heap, TOAST and indexes). A day's size follows from the rates:
per worker 17,280 raw rows a day, 1,440 minute and 24 hour rollups.
"""
from __future__ import annotations

import time
from typing import Any

from django.conf import settings
from django.db import connection

from inference.metrics import downsampling
from inference.models import Deployment

SCRAPE_INTERVAL_S = 5.0
GB = 1e9

_RAW = """
INSERT INTO inference_workersample (deployment_id, worker_id, name, role, url, at, load, queue_depth, running,
    kv_usage, cpu_utilization, gpu_utilization, throughput_tps, ttft_s, itl_s, rss_bytes, gpu_memory_bytes,
    kv_transfer_bytes_per_s, kv_transfer_s, prefix_cache_hit_ratio, requests_per_s, request_share)
SELECT w.deployment_id, w.id, w.role || ' #' || w.id || ' @ ' || n.name || ':' || w.port, w.role,
    'http://' || n.address || ':' || w.port, t, random(), floor(random() * 4), floor(random() * 32), random(),
    random(), NULL, random() * 1000, random() * 0.1, random() * 0.02, 200000000 + (random() * 1e6)::bigint,
    NULL, random() * 1e6, random() * 0.01, random(), random() * 10, random() / 100
FROM nodes_worker w JOIN nodes_node n ON n.id = w.node_id,
    generate_series(now() - make_interval(secs => %(span)s), now(), make_interval(secs => %(step)s)) t
WHERE w.deployment_id = %(deployment)s AND w.status = 'running'
"""
_ROLLUP = """
INSERT INTO inference_workersamplerollup (deployment_id, worker_id, name, role, url, resolution_s, at, samples,
    load, load_max, queue_depth, running, kv_usage, cpu_utilization, gpu_utilization, throughput_tps, ttft_s,
    itl_s, rss_bytes, gpu_memory_bytes, kv_transfer_bytes_per_s, kv_transfer_s, prefix_cache_hit_ratio,
    requests_per_s, request_share)
SELECT w.deployment_id, w.id, w.role || ' #' || w.id || ' @ ' || n.name || ':' || w.port, w.role,
    'http://' || n.address || ':' || w.port, 60, t, 12, random(), random() + 1, random() * 4, random() * 32,
    random(), random(), NULL, random() * 1000, random() * 0.1, random() * 0.02,
    200000000 + (random() * 1e6)::bigint, NULL, random() * 1e6, random() * 0.01, random(), random() * 10,
    random() / 100
FROM nodes_worker w JOIN nodes_node n ON n.id = w.node_id,
    generate_series(date_trunc('minute', now()) - make_interval(secs => %(end)s),
                    date_trunc('minute', now()) - make_interval(secs => %(start)s), interval '1 minute') t
WHERE w.deployment_id = %(deployment)s AND w.status = 'running'
"""


def _bytes_per_row(table: str, where: str = "", params: tuple[Any, ...] = ()) -> tuple[int, float]:
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT count(*) FROM {table} {where}", params)  # noqa: S608  fixed table names
        rows = int(cursor.fetchone()[0])
        cursor.execute("SELECT pg_total_relation_size(%s)", [table])
        size = int(cursor.fetchone()[0])
    return rows, size / rows if rows else 0.0


def measure(deployment: Deployment, *, raw_hours: float, rollup_hours: float) -> dict[str, Any]:
    """Load the history (module doc), time a downsampling pass, and size a day at the retention settings."""
    if connection.vendor != "postgresql":
        raise RuntimeError("the database measurement needs PostgreSQL (DATABASE_URL)")
    workers = deployment.workers.filter(status="running").count()
    raw_s, rollup_s = raw_hours * 3600, rollup_hours * 3600
    with connection.cursor() as cursor:
        # Rows deleted by earlier runs still take space until a vacuum: bytes per row would count them.
        cursor.execute("VACUUM FULL inference_workersample, inference_workersamplerollup")
        start = time.perf_counter()
        cursor.execute(_RAW, {"span": raw_s, "step": SCRAPE_INTERVAL_S, "deployment": deployment.pk})
        raw_rows = cursor.rowcount
        # Minute rollups for the hours before the raw ones, ending a minute before them (a rolled-up past).
        cursor.execute(_ROLLUP, {"start": raw_s + 60, "end": raw_s + rollup_s, "deployment": deployment.pk})
        rollup_rows = cursor.rowcount
        load_s = time.perf_counter() - start
        cursor.execute("ANALYZE inference_workersample")
        cursor.execute("ANALYZE inference_workersamplerollup")
    start = time.perf_counter()
    minutes = downsampling.roll_up_minutes(now=_now())
    roll_up_s = time.perf_counter() - start
    start = time.perf_counter()
    hours = downsampling.roll_up_hours(now=_now())
    hours_s = time.perf_counter() - start
    _, raw_b = _bytes_per_row("inference_workersample")
    _, rollup_b = _bytes_per_row("inference_workersamplerollup")
    per_worker_day = {"raw": 86400 / SCRAPE_INTERVAL_S, "minute": 1440, "hour": 24}
    raw_keep_h = float(settings.METRICS_RAW_RETENTION_HOURS)
    minute_keep_d = float(settings.METRICS_RETENTION_HOURS) / 24
    hour_keep_d = float(settings.METRICS_ROLLUP_RETENTION_DAYS)
    day_history = workers * (per_worker_day["minute"] + per_worker_day["hour"]) * rollup_b
    return {
        "workers": workers,
        "loaded": {"raw_rows": raw_rows, "minute_rollup_rows": rollup_rows, "load_s": load_s},
        "downsample": {"minute_rollups": minutes, "minute_pass_s": roll_up_s, "raw_hours_rolled": raw_hours,
                       "hour_rollups": hours, "hour_pass_s": hours_s},
        "bytes_per_row": {"raw": raw_b, "rollup": rollup_b},
        "per_day": {
            # A day of history under the defaults: its minute and hour rollups (raw rows live 2 h only).
            "default_gb": day_history / GB,
            # Before: every raw sample kept for METRICS_RETENTION_HOURS.
            "raw_only_gb": workers * per_worker_day["raw"] * raw_b / GB,
        },
        "steady_state_gb": {
            "default": (workers * per_worker_day["raw"] * raw_keep_h / 24 * raw_b
                        + workers * per_worker_day["minute"] * minute_keep_d * rollup_b
                        + workers * per_worker_day["hour"] * hour_keep_d * rollup_b) / GB,
            "raw_only": workers * per_worker_day["raw"] * minute_keep_d * raw_b / GB,
            "retention": {"raw_hours": raw_keep_h, "minute_days": minute_keep_d, "hour_days": hour_keep_d},
        },
    }  # fmt: skip


def _now() -> Any:
    from django.utils import timezone

    return timezone.now()
