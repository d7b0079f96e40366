"""Admin of the metric samples (per role, per worker, per router): read-only history, pruned by age.
"""
from __future__ import annotations

from django.contrib import admin

from inference.admin.display import (
    ReadOnlyAdmin,
)
from inference.models import (
    MetricSample,
    RouterSample,
    WorkerSample,
)


@admin.register(MetricSample)
class MetricSampleAdmin(ReadOnlyAdmin):
    """Raw role-level metric samples (charts are on each deployment's metrics page)."""

    list_display = [
        "at",
        "deployment",
        "role",
        "workers",
        "load",
        "ttft_s",
        "itl_s",
        "throughput_tps",
        "queue_depth",
        "kv_usage",
        "cpu_utilization",
        "gpu_utilization",
    ]
    list_filter = ["role", "deployment"]
    list_select_related = ["deployment"]
    date_hierarchy = "at"
    # The table grows by a row per role every few seconds: skip the exact total count.
    show_full_result_count = False


@admin.register(WorkerSample)
class WorkerSampleAdmin(ReadOnlyAdmin):
    """Raw per-worker metric samples (charted per worker on each deployment's metrics page)."""

    list_display = [
        "at", "deployment", "name", "role", "load", "queue_depth", "running", "kv_usage", "rss_bytes",
        "gpu_memory_bytes", "kv_transfer_bytes_per_s", "prefix_cache_hit_ratio", "request_share",
    ]  # fmt: skip
    list_filter = ["role", "deployment"]
    list_select_related = ["deployment"]
    search_fields = ["name", "url"]
    date_hierarchy = "at"
    show_full_result_count = False


@admin.register(RouterSample)
class RouterSampleAdmin(ReadOnlyAdmin):
    """Raw router samples: what the router measured between two scrapes (charted on the metrics page)."""

    list_display = [
        "at", "deployment", "router", "requests_per_s", "error_rate", "rejected_per_s", "dispatch_p50_s",
        "dispatch_p90_s", "ttft_p90_s", "itl_p90_s", "queued",
    ]  # fmt: skip
    list_filter = ["deployment"]
    list_select_related = ["deployment", "router"]
    date_hierarchy = "at"
    show_full_result_count = False
