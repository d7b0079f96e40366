"""Admin of the metric samples (per role, per worker, per router): read-only history, pruned by age.

Every column and detail field is shown in its unit, one unit per quantity across the console: latencies in
ms, ratios as percentages, bytes in binary units, rates per second; the router's per-worker shares (JSON) as a
table. The lists keep to the columns that fit 1,400 px; a sample's page shows every field.
"""
from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from django.contrib import admin
from django.core.paginator import Paginator
from django.db import connection
from django.db.models import Count, Max, Min, Q, QuerySet
from django.utils import timezone
from django.utils.functional import cached_property
from django.utils.safestring import SafeString
from django.utils.translation import gettext as _

from inference.admin.display import (
    ReadOnlyAdmin,
    human_bytes,
)
from inference.admin.tables import json_table
from inference.models import (
    MetricSample,
    RouterSample,
    WorkerRole,
    WorkerSample,
)

# Below this many rows (by the planner's estimate) a sample list is counted exactly.
EXACT_COUNT_BELOW = 100_000


class EstimatedCountPaginator(Paginator):
    """Pages of a sample list whose unfiltered count is PostgreSQL's estimate (pg_class.reltuples): the
    paginator's COUNT(*) over 1.44 M raw samples (2 h at 1,000 workers) took 2 s of a 2.1 s page
    (bench/sim/control_plane.py). Filtered lists, small tables and other databases are counted exactly."""

    @cached_property
    def count(self) -> int:
        """The estimate for an unfiltered list of a large table, else the exact count."""
        query = getattr(self.object_list, "query", None)
        if query is not None and not query.where and connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute("SELECT reltuples FROM pg_class WHERE oid = %s::regclass", [query.model._meta.db_table])
                row = cursor.fetchone()
            if row is not None and row[0] >= EXACT_COUNT_BELOW:
                return int(row[0])
        return int(super().count)


class RoleListFilter(admin.ChoicesFieldListFilter):
    """A sample list's role filter offering the worker roles: Django's filter of a plain field lists the
    values present, a SELECT DISTINCT over every sample (255 ms of the raw sample list's page over 1.44 M
    rows, bench/sim/control_plane.py)."""

    ROLES = [(role, role) for role in WorkerRole.values]

    def get_facet_counts(self, pk_attname: str, filtered_qs: Any) -> dict[str, Any]:
        """A count per role (the list's "show counts" toggle)."""
        return {f"{i}__c": Count(pk_attname, filter=Q((self.lookup_kwarg, role)))
                for i, (role, _title) in enumerate(self.ROLES)}  # fmt: skip

    def choices(self, changelist: Any) -> Any:
        """All, then each role, as the values of the field's own filter read."""
        counts = self.get_facet_queryset(changelist) if changelist.add_facets else None
        yield {"selected": self.lookup_val is None, "display": _("All"),
               "query_string": changelist.get_query_string(remove=[self.lookup_kwarg, self.lookup_kwarg_isnull])}
        for i, (role, title) in enumerate(self.ROLES):
            yield {"selected": self.lookup_val is not None and role in self.lookup_val,
                   "display": f"{title} ({counts[f'{i}__c']})" if counts is not None else title,
                   "query_string": changelist.get_query_string({self.lookup_kwarg: role}, [self.lookup_kwarg_isnull])}


# At most this many days (or months) between a list's first and last sample are probed one by one.
MAX_DATE_PROBES = 400


class SampleQuerySet(QuerySet):
    """Samples whose date drill-down (the list's date_hierarchy) finds the days, or months, that hold samples
    with an indexed probe per day between the first and the last sample, instead of Django's SELECT DISTINCT
    date_trunc over every sample (365 ms of the raw sample list's page over 1.44 M rows, under load)."""

    def datetimes(self, field_name: str, kind: str, order: str = "ASC", tzinfo: Any = None) -> Any:
        """As QuerySet.datetimes (in the current time zone) for days and months: those holding a sample."""
        if kind not in ("day", "month") or tzinfo is not None or order != "ASC":
            return super().datetimes(field_name, kind, order, tzinfo)
        span = self.aggregate(first=Min(field_name), last=Max(field_name))
        if span["first"] is None:
            return []
        first, last = timezone.localtime(span["first"]), timezone.localtime(span["last"])
        start = first.replace(day=1 if kind == "month" else first.day, hour=0, minute=0, second=0, microsecond=0)
        bounds: list[tuple[datetime, datetime]] = []
        while start <= last and len(bounds) <= MAX_DATE_PROBES:
            after = start + timedelta(days=1) if kind == "day" else (start + timedelta(days=32)).replace(day=1)
            bounds.append((start, timezone.make_aware(after.replace(tzinfo=None))))
            start = bounds[-1][1]
        if len(bounds) > MAX_DATE_PROBES:  # a long history: one scan is cheaper than the probes
            return super().datetimes(field_name, kind, order, tzinfo)
        return [begin for begin, end in bounds
                if self.filter(**{f"{field_name}__gte": begin, f"{field_name}__lt": end}).exists()]


def ms(seconds: float | None) -> str:
    """Seconds as milliseconds, the console's one unit for latencies ("12.5 ms", "850 ms")."""
    if seconds is None:
        return "–"
    value = seconds * 1000
    return f"{value:.1f} ms" if value < 100 else f"{value:,.0f} ms".replace(",", " ")


def pct(ratio: float | None) -> str:
    """A 0..1 ratio as a percentage."""
    return "–" if ratio is None else f"{ratio * 100:.1f} %"


def bytes_(count: float | None) -> str:
    """Bytes in binary units ("0 B" for zero)."""
    if count is None:
        return "–"
    return human_bytes(count) if count else "0 B"


def per_s(unit: str) -> Callable[[float | None], str]:
    """A rate in `unit`/s with three significant digits."""
    return lambda value: "–" if value is None else f"{value:.3g} {unit}/s"


def number(value: float | None) -> str:
    """A count or gauge with up to three significant digits."""
    return "–" if value is None else f"{value:.3g}"


def byte_rate(value: float | None) -> str:
    """Bytes per second in binary units."""
    return "–" if value is None else f"{bytes_(value)}/s"


def at_second(moment: Any) -> str:
    """A sample's time in the platform's zone, to the second."""
    return f"{timezone.localtime(moment):%Y-%m-%d %H:%M:%S}"


# How each sample field is shown (its unit), by name; the label says the unit where the value does not.
FORMATS: dict[str, tuple[str, Callable[[Any], str]]] = {
    "workers": ("workers", number),
    "load": ("load", lambda v: "–" if v is None else f"{v:.2f}"),
    "ttft_s": ("TTFT", ms),
    "itl_s": ("ITL", ms),
    "throughput_tps": ("throughput", per_s("tok")),
    "queue_depth": ("queue", number),
    "running": ("running", number),
    "kv_usage": ("KV used", pct),
    "cpu_utilization": ("CPU", pct),
    "gpu_utilization": ("GPU", pct),
    "rss_bytes": ("RSS", bytes_),
    "gpu_memory_bytes": ("GPU memory", bytes_),
    "kv_transfer_bytes_per_s": ("KV transfer", byte_rate),
    "kv_transfer_s": ("KV transfer time", ms),
    "prefix_cache_hit_ratio": ("prefix hits", pct),
    "requests_per_s": ("requests", per_s("req")),
    "request_share": ("share", pct),
    "interval_s": ("interval", ms),
    "error_rate": ("errors", pct),
    "rejected_per_s": ("429s", per_s("req")),
    "tokens_per_s": ("tokens", per_s("tok")),
    "dispatch_p50_s": ("dispatch p50", ms),
    "dispatch_p90_s": ("dispatch p90", ms),
    "queue_wait_p50_s": ("queue wait p50", ms),
    "queue_wait_p90_s": ("queue wait p90", ms),
    "ttft_p50_s": ("TTFT p50", ms),
    "ttft_p90_s": ("TTFT p90", ms),
    "itl_p50_s": ("ITL p50", ms),
    "itl_p90_s": ("ITL p90", ms),
    "e2e_p50_s": ("request p50", ms),
    "e2e_p90_s": ("request p90", ms),
    "inflight": ("in flight", number),
    "queued": ("queued", number),
    "decode_slots": ("decode slots", number),
    "prompt_tokens_per_s": ("prompt tokens", per_s("tok")),
    "cached_prompt_tokens_per_s": ("prompt tokens cached", per_s("tok")),
    "prompt_cached_ratio": ("prompt cached", pct),
    "local_prefills_per_s": ("prefilled locally", per_s("req")),
    "remote_prefills_per_s": ("prefilled remotely", per_s("req")),
}


def _column(field: str) -> Callable[[Any, Any], str]:
    label, fmt = FORMATS[field]

    @admin.display(description=label, ordering=field)
    def show(model_admin: Any, sample: Any) -> str:
        return fmt(getattr(sample, field))

    show.__name__ = f"{field}_shown"
    return show


class SampleAdmin(ReadOnlyAdmin):
    """A sample list whose numeric columns (`shown`) are formatted in their units; the sample's page shows
    every field formatted (no form inputs: samples are history)."""

    shown: list[str] = []
    show_full_result_count = False  # the tables grow by rows every few seconds: skip the exact total count
    paginator = EstimatedCountPaginator
    date_hierarchy = "at"
    list_select_related = ["deployment"]

    def get_queryset(self, request: Any) -> QuerySet:
        """The samples, with the date drill-down's probes (SampleQuerySet)."""
        queryset = super().get_queryset(request)
        return SampleQuerySet(queryset.model, query=queryset.query, using=queryset.db)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A formatted column for every field FORMATS knows (the list uses `shown`, the detail page all)."""
        super().__init_subclass__(**kwargs)
        for field in FORMATS:
            setattr(cls, f"{field}_shown", _column(field))

    @admin.display(description="at", ordering="at")
    def at_shown(self, sample: Any) -> str:
        """The time, to the second."""
        return at_second(sample.at)

    def get_fields(self, request: Any, obj: Any = None) -> list[str]:
        """Every field of the model, the formatted ones through their column."""
        names = []
        for f in self.model._meta.get_fields():
            if not getattr(f, "concrete", False) or f.name == "id":
                continue
            names.append(f"{f.name}_shown" if f.name in FORMATS or f.name == "at" else f.name)
        return names

    def get_readonly_fields(self, request: Any, obj: Any = None) -> list[str]:
        """All of them: history."""
        return self.get_fields(request, obj)


@admin.register(MetricSample)
class MetricSampleAdmin(SampleAdmin):
    """Role-level metric samples, in units (charts are on each deployment's metrics page)."""

    shown = ["workers", "load", "ttft_s", "itl_s", "throughput_tps", "queue_depth", "kv_usage", "cpu_utilization",
             "gpu_utilization", "rss_bytes"]  # fmt: skip
    list_display = ["at_shown", "deployment", "role", *[f"{f}_shown" for f in shown]]
    list_filter = [("role", RoleListFilter), "deployment"]


@admin.register(WorkerSample)
class WorkerSampleAdmin(SampleAdmin):
    """Per-worker metric samples, in units (charted per worker on each deployment's metrics page)."""

    shown = ["load", "queue_depth", "running", "kv_usage", "rss_bytes", "gpu_memory_bytes",
             "kv_transfer_bytes_per_s", "prefix_cache_hit_ratio", "request_share"]  # fmt: skip
    list_display = ["at_shown", "name", "role", *[f"{f}_shown" for f in shown]]
    list_filter = [("role", RoleListFilter), "deployment"]
    search_fields = ["name", "url"]


@admin.register(RouterSample)
class RouterSampleAdmin(SampleAdmin):
    """Router samples: what the router measured between two scrapes, in units (charted on the metrics page)."""

    shown = ["requests_per_s", "error_rate", "rejected_per_s", "dispatch_p50_s", "dispatch_p90_s", "ttft_p90_s",
             "itl_p90_s", "queued"]  # fmt: skip
    list_display = ["at_shown", "deployment", *[f"{f}_shown" for f in shown]]
    list_filter = ["deployment"]
    list_select_related = ["deployment", "router"]

    @admin.display(description="share of each role's requests per worker")
    def worker_share_shown(self, sample: RouterSample) -> SafeString | str:
        """{role: {worker url: share}} as a table, shares as percentages."""
        return json_table({role: {url: pct(v) for url, v in shares.items()} if isinstance(shares, dict) else shares
                           for role, shares in (sample.worker_share or {}).items()})

    def get_fields(self, request: Any, obj: Any = None) -> list[str]:
        """Every field, the per-worker shares as a table."""
        return [("worker_share_shown" if f == "worker_share" else f) for f in super().get_fields(request, obj)]
