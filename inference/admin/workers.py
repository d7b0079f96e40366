"""Admin of nodes and workers: live status lists, and the drain / restart actions.

Node is a model of the `nodes` app, but its admin shows the workers on it (inline, counts, CPU pinning
overlaps) and its actions move workers, so it is registered here, in the layer that knows both.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from django.conf import settings
from django.contrib import admin, messages
from django.contrib.admin.views.main import ChangeList
from django.db.models import Count, Q, QuerySet
from django.http import HttpRequest, HttpResponse
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.text import Truncator

from inference.actions import nodes as node_workers
from inference.actions import workers as worker_actions
from inference.controller.pinning import CpuOverlap, live_cpu_overlaps, overlapping_worker_ids
from inference.models import ACTIVE_WORKER_STATUSES, Worker, WorkerStatus
from nodes import actions as node_actions
from nodes.models import Node, NodeStatus

# The stylesheet that keeps the node and worker lists (and the deployment page's inlines) within the
# window: compact cells, long text cut with an ellipsis and shown whole on hover.
LIST_CSS = "inference/admin_lists.css"
# Characters of a worker's last /health JSON shown in the hover title of its list cell.
HEALTH_TITLE_CHARS = 1500

# Colours of the status badges (the admin's own palette: green, amber, red, grey).
_STATUS_COLOURS: dict[str, str] = {
    # Plain values as keys: NodeStatus and WorkerStatus share some ("draining").
    "online": "#2e7d32",
    "unreachable": "#b26a00",  # agent silent; its workers serve while their /health answers
    "offline": "#c62828",
    "running": "#2e7d32",
    "pending": "#607d8b",
    "starting": "#1565c0",
    "unhealthy": "#c62828",
    "draining": "#b26a00",
    "stopping": "#b26a00",
    "stopped": "#757575",
    "failed": "#c62828",
}


def heartbeat_timeout_s() -> float:
    """Seconds without a heartbeat after which a node's status is shown as stale."""
    return float(getattr(settings, "NODE_HEARTBEAT_TIMEOUT_S", 15.0))


def status_badge(value: str, label: str, *, stale: bool = False) -> SafeString:
    """A coloured badge for a status; a stale one (agent silent) is struck through and greyed."""
    colour = "#9e9e9e" if stale else _STATUS_COLOURS.get(value, "#607d8b")
    title = "no recent heartbeat: the agent may be down" if stale else label
    style = "text-decoration:line-through;" if stale else ""
    return format_html(
        '<span title="{}" style="background:{};color:#fff;padding:1px 6px;border-radius:8px;{}">{}</span>',
        title,
        colour,
        style,
        label,
    )


def age_text(moment: datetime | None, *, stale_after_s: float | None = None) -> SafeString | str:
    """'12s ago' style age of a timestamp, red once older than `stale_after_s`."""
    if moment is None:
        return "never"
    seconds = max((timezone.now() - moment).total_seconds(), 0.0)
    if seconds < 120:
        text = f"{seconds:.0f}s ago"
    elif seconds < 7200:
        text = f"{seconds / 60:.0f}m ago"
    elif seconds < 172800:
        text = f"{seconds / 3600:.0f}h ago"
    else:
        text = f"{seconds / 86400:.0f}d ago"
    if stale_after_s is not None and seconds > stale_after_s:
        return format_html('<span style="color:#c62828;font-weight:bold">{}</span>', text)
    return text


def first_number(data: Mapping[str, Any] | None, *keys: str) -> float | None:
    """The first of `keys` in `data` holding a number (agents and workers name metrics variously)."""
    if not isinstance(data, Mapping):
        return None
    for key in keys:
        value = data.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    return None


def percent(value: float | None) -> str:
    """A ratio (0..1) or a percentage (1..100) shown as a percentage."""
    if value is None:
        return "–"
    return f"{value * 100:.0f}%" if value <= 1.0 else f"{value:.0f}%"


def human_bytes(count: float | None) -> str:
    """Bytes in binary units (GiB, MiB, ...)."""
    if not count:
        return "–"
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{value:.0f} B"
        value /= 1024
    return f"{value:.1f} TiB"


def short_reason(note: str, limit: int = 48) -> str:
    """The headline of a reason for a list column: the text before its first parenthesis, cut at a word
    with an ellipsis past `limit` characters (the full text goes in the cell's title). A plain
    character cut made "No module named 'pyverbs'" read "No module named ", losing the name."""
    headline = note.split(" (", 1)[0].strip() or note.strip()
    return Truncator(headline).chars(limit)


def health_summary(health: Mapping[str, Any] | None) -> str:
    """One line from a worker's last /health answer: status, queue, running, KV usage, CPU/GPU."""
    if not isinstance(health, Mapping) or not health:
        return "–"
    parts = [str(health.get("status", "?"))]
    for key, label in (("queue_depth", "queue"), ("running", "running")):
        value = first_number(health, key)
        if value is not None:
            parts.append(f"{label} {value:g}")
    kv = first_number(health, "kv_usage")
    if kv is not None:
        parts.append(f"KV {percent(kv)}")
    gpu = first_number(health, "gpu_utilization")
    cpu = first_number(health, "cpu_utilization")
    if gpu is not None:
        parts.append(f"GPU {percent(gpu)}")
    elif cpu is not None:
        parts.append(f"CPU {percent(cpu)}")
    return " · ".join(parts)


def health_title(health: Mapping[str, Any] | None) -> str:
    """The whole last /health answer as JSON for a hover title, cut at HEALTH_TITLE_CHARS."""
    if not isinstance(health, Mapping) or not health:
        return ""
    text = json.dumps(health, sort_keys=True, default=str)
    return text if len(text) <= HEALTH_TITLE_CHARS else text[:HEALTH_TITLE_CHARS] + "…"


def cpu_ranges(cpu_ids: list[Any] | None) -> str:
    """CPU ids as compact ranges: [0, 1, 2, 5] -> "0-2,5" ("–" when not pinned)."""
    ids = sorted({int(c) for c in cpu_ids or [] if isinstance(c, int | str) and str(c).lstrip("-").isdigit()})
    if not ids:
        return "–"
    parts: list[str] = []
    start = prev = ids[0]
    for cpu in [*ids[1:], None]:
        if cpu is not None and cpu == prev + 1:
            prev = cpu
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if cpu is not None:
            start = prev = cpu
    return ",".join(parts)


def warn_overlaps(model_admin: admin.ModelAdmin, request: HttpRequest, overlaps: list[CpuOverlap]) -> None:
    """One admin warning per pair of workers pinned to shared CPUs."""
    for overlap in overlaps:
        model_admin.message_user(request, f"CPU pinning overlaps: {overlap.describe()}.", messages.WARNING)


class WorkerStateFilter(admin.SimpleListFilter):
    """Stopped workers are hidden unless asked for: every `make down` / `make up` leaves a set behind
    (they are pruned after WORKER_RETENTION_HOURS). Failed ones stay visible: they need a look."""

    title = "state"
    parameter_name = "state"
    DEFAULT_LABEL = "Not stopped"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        """The non-default choices (the default, no parameter, is "Not stopped")."""
        return [("active", "Active (live)"), ("stopped", "Stopped"), ("all", "All")]

    def choices(self, changelist: Any) -> Any:
        """The default entry reads "Not stopped" instead of Django's "All" (which is a choice here)."""
        for choice in super().choices(changelist):
            if choice.get("query_string") and self.value() is None and choice["display"] == "All" \
                    and "lookup" not in choice:
                choice["display"] = self.DEFAULT_LABEL
            yield choice

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        """Apply the choice; with none, drop stopped workers unless the status filter asks for them."""
        value = self.value()
        if value == "all":
            return queryset
        if value == "stopped":
            return queryset.filter(status=WorkerStatus.STOPPED)
        if value == "active":
            return queryset.filter(status__in=ACTIVE_WORKER_STATUSES)
        if "status__exact" in request.GET:
            return queryset
        return queryset.exclude(status=WorkerStatus.STOPPED)


class LiveWorkerInline(admin.TabularInline):
    """Live workers of a node or a deployment, read-only: the controller places them and the agents
    report their fields; stopped ones accumulate over time and are listed on the worker page."""

    model = Worker
    extra = 0
    can_delete = False
    show_change_link = True
    related: tuple[str, ...] = ()  # select_related for the columns shown

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        """Workers are placed by the controller (scale the deployment), not added by hand."""
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        """Read-only: the agents report these fields."""
        return False

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        """Only live workers."""
        return super().get_queryset(request).filter(status__in=ACTIVE_WORKER_STATUSES).select_related(*self.related)


class WorkerInline(LiveWorkerInline):
    """The node's live workers."""

    fk_name = "node"
    related = ("deployment",)
    fields = ["deployment", "role", "port", "status", "pid", "restarts", "last_seen"]
    readonly_fields = fields


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    """Hosts with their live status: heartbeat age, CPU, memory, GPUs, RDMA and worker count."""

    change_list_template = "admin/nodes/node/change_list.html"

    class Media:
        css = {"all": [LIST_CSS]}

    list_display = [
        "name",
        "address",
        "live_status",
        "heartbeat",
        "cpu",
        "memory",
        "gpu",
        "rdma",
        "worker_count",
    ]
    list_filter = ["status", "allow_cpu_oversubscription"]
    search_fields = ["name", "hostname", "address"]
    actions = ["drain_nodes", "activate_nodes", "mark_nodes_offline"]
    inlines = [WorkerInline]
    readonly_fields = [
        # Status changes go through the drain/activate actions, which also move the node's workers.
        "status",
        "hostname",
        "cpu_count",
        "memory_bytes",
        "gpus",
        "rdma_devices",
        "rdma_note",
        "last_heartbeat",
        "last_metrics",
        "registered_at",
    ]
    fieldsets = [
        (None, {"fields": ["name", "hostname", "address", "status", "labels"]}),
        # What the controller may place here (ports, and whether workers may share CPUs).
        ("Placement", {"fields": ["port_range_start", "port_range_end", "allow_cpu_oversubscription"]}),
        (
            "Registered resources and heartbeat",
            {"fields": ["cpu_count", "memory_bytes", "gpus", "rdma_devices", "rdma_note", "last_heartbeat",
                        "last_metrics", "registered_at"]},
        ),
    ]

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        """The list, with a warning for each pair of live workers pinned to shared CPUs."""
        if request.method == "GET":
            warn_overlaps(self, request, live_cpu_overlaps())
        return super().changelist_view(request, extra_context)

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        """Nodes with their count of live workers (one query for the whole list)."""
        return (
            super()
            .get_queryset(request)
            .annotate(live_workers=Count("workers", filter=Q(workers__status__in=ACTIVE_WORKER_STATUSES)))
        )

    @admin.display(description="status", ordering="status")
    def live_status(self, node: Node) -> SafeString:
        """The status, greyed out when the agent's heartbeat is stale (UNREACHABLE already says so)."""
        stale = node.status not in (NodeStatus.OFFLINE, NodeStatus.UNREACHABLE) and (
            node.last_heartbeat is None
            or (timezone.now() - node.last_heartbeat).total_seconds() > heartbeat_timeout_s()
        )
        return status_badge(node.status, node.get_status_display(), stale=stale)

    @admin.display(description="last heartbeat", ordering="last_heartbeat")
    def heartbeat(self, node: Node) -> SafeString | str:
        """Age of the last heartbeat, red when stale."""
        return age_text(node.last_heartbeat, stale_after_s=heartbeat_timeout_s())

    @admin.display(description="CPU")
    def cpu(self, node: Node) -> str:
        """CPU count and utilisation at the last heartbeat, and whether workers may share CPUs here."""
        used = first_number(node.last_metrics, "cpu_utilization", "cpu_percent")
        text = f"{node.cpu_count} CPUs" + (f", {percent(used)} busy" if used is not None else "")
        load = node.last_metrics.get("load_avg") if isinstance(node.last_metrics, Mapping) else None
        if isinstance(load, list) and load and isinstance(load[0], int | float):
            text += f", load {load[0]:g}"
        if node.allow_cpu_oversubscription:
            text += " (oversubscription allowed)"
        return text

    @admin.display(description="memory")
    def memory(self, node: Node) -> str:
        """Total memory and how much was in use at the last heartbeat."""
        total = node.memory_bytes
        used_pct = first_number(node.last_metrics, "memory_percent", "memory_utilization")
        if used_pct is None:
            available = first_number(node.last_metrics, "memory_available_bytes")
            used = first_number(node.last_metrics, "memory_used_bytes")
            if used is None and available is not None and total:
                used = total - available
            if used is not None and total:
                used_pct = used / total
        return f"{human_bytes(total)} ({percent(used_pct)} used)" if used_pct is not None else human_bytes(total)

    @admin.display(description="GPUs")
    def gpu(self, node: Node) -> str:
        """GPU count and model names, with utilisation when the agent reports it."""
        gpus = node.gpus if isinstance(node.gpus, list) else []
        if not gpus:
            return "none"
        names = sorted({str(g.get("name", "GPU")) for g in gpus if isinstance(g, Mapping)})
        used = first_number(node.last_metrics, "gpu_utilization", "gpu_percent")
        text = f"{len(gpus)} × {', '.join(names) or 'GPU'}"
        return f"{text} ({percent(used)})" if used is not None else text

    @admin.display(description="RDMA")
    def rdma(self, node: Node) -> SafeString | str:
        """RDMA devices, or why RDMA is unusable on this host."""
        devices = node.rdma_devices if isinstance(node.rdma_devices, list) else []
        if devices:
            names = [str(d.get("name", d)) if isinstance(d, Mapping) else str(d) for d in devices]
            return ", ".join(names)
        if node.rdma_note:
            return format_html('<span title="{}">no ({})</span>', node.rdma_note, short_reason(node.rdma_note))
        return "no"

    @admin.display(description="workers", ordering="live_workers")
    def worker_count(self, node: Node) -> SafeString:
        """Live workers on the node, linking to the worker list filtered by it."""
        url = reverse("admin:inference_worker_changelist") + f"?node__id__exact={node.pk}"
        return format_html('<a href="{}">{}</a>', url, getattr(node, "live_workers", 0))

    @admin.action(description="Drain node", permissions=["change"])
    def drain_nodes(self, request: HttpRequest, queryset: QuerySet) -> None:
        """Drain each selected node through inference.actions.nodes.drain_node."""
        for node in queryset:
            try:
                node_workers.drain_node(node)
            except Exception as exc:  # report each node's failure and carry on with the others
                self.message_user(request, f"Could not drain {node.name}: {exc}", messages.ERROR)
            else:
                self.message_user(request, f"Draining {node.name}.", messages.SUCCESS)

    @admin.action(description="Activate node (undo a drain)", permissions=["change"])
    def activate_nodes(self, request: HttpRequest, queryset: QuerySet) -> None:
        """Put each selected draining node back into service through nodes.actions.activate_node."""
        for node in queryset:
            if node.status != NodeStatus.DRAINING:
                self.message_user(request, f"{node.name} is {node.status}, not draining.", messages.WARNING)
                continue
            node_actions.activate_node(node)
            self.message_user(request, f"{node.name} takes new workers again.", messages.SUCCESS)

    @admin.action(description="Mark offline (re-place its workers elsewhere)", permissions=["change"])
    def mark_nodes_offline(self, request: HttpRequest, queryset: QuerySet) -> None:
        """Give up on each selected node through inference.actions.nodes.mark_node_offline (for a host known gone:
        an UNREACHABLE node's workers otherwise stay as long as their /health answers)."""
        for node in queryset:
            if node.status == NodeStatus.OFFLINE:
                self.message_user(request, f"{node.name} is offline already.", messages.WARNING)
                continue
            given_up = node_workers.mark_node_offline(node, reason=f"marked offline by {request.user}")
            self.message_user(
                request, f"{node.name} is offline; {len(given_up)} worker(s) re-placed elsewhere.", messages.SUCCESS
            )


class WorkerChangeList(ChangeList):
    """The worker list's rows, each told whether it shares a CPU with another live worker."""

    def get_results(self, request: HttpRequest) -> None:
        """Fetch the page, then set `cpu_overlap` on each row from the ids changelist_view found."""
        super().get_results(request)
        overlapping: set[int] = getattr(request, "cpu_overlaps", set())
        for worker in self.result_list:
            worker.cpu_overlap = worker.pk in overlapping


@admin.register(Worker)
class WorkerAdmin(admin.ModelAdmin):
    """Worker processes: deployment, node, role, URL, status, pid, restarts, health, last error."""

    change_list_template = "admin/inference/worker/change_list.html"

    class Media:
        css = {"all": [LIST_CSS]}

    list_display = [
        "id",
        "deployment",
        "node",
        "role",
        "url_link",
        "status_badge",
        "cpus",
        "process",
        "health",
        "error",
        "seen",
    ]
    list_filter = [WorkerStateFilter, "status", "role", "deployment", "node"]
    list_select_related = ["deployment", "node"]
    search_fields = ["deployment__name", "node__name", "last_error"]
    actions = ["restart_workers"]
    readonly_fields = [
        "deployment",
        "node",
        "role",
        "url_link",
        "port",
        "kv_port",
        "pid",
        "status",
        "restarts",
        "cpu_ids",
        "gpu_ids",
        "last_health",
        "last_metrics",
        "last_error",
        "last_seen",
        "created_at",
        "updated_at",
    ]
    fields = readonly_fields

    def has_add_permission(self, request: HttpRequest) -> bool:
        """Workers are placed by the controller (scale the deployment instead)."""
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Worker | None = None) -> bool:
        """Only stopped or failed workers' rows may be deleted: a live one still owns a process."""
        if obj is not None and obj.status not in (WorkerStatus.STOPPED, WorkerStatus.FAILED):
            return False
        return bool(super().has_delete_permission(request, obj))

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet) -> None:
        """Bulk delete only the stopped or failed rows among those selected."""
        queryset.filter(status__in=[WorkerStatus.STOPPED, WorkerStatus.FAILED]).delete()

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        """The list, with a warning for each pair of live workers pinned to shared CPUs (their CPU
        cells are marked too)."""
        if request.method == "GET":
            overlaps = live_cpu_overlaps()
            warn_overlaps(self, request, overlaps)
            # Per request (the ModelAdmin is shared by every thread): WorkerChangeList marks the rows.
            request.cpu_overlaps = overlapping_worker_ids(overlaps)  # type: ignore[attr-defined]
        return super().changelist_view(request, extra_context)

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        """The ChangeList that marks the rows of workers pinned to shared CPUs."""
        return WorkerChangeList

    @admin.display(description="URL")
    def url_link(self, worker: Worker) -> SafeString:
        """The worker's host:port (the scheme takes room and is always http), linking to its /health."""
        short = worker.url.removeprefix("http://")
        return format_html('<a href="{}/health" target="_blank" rel="noopener">{}</a>', worker.url, short)

    @admin.display(description="CPUs")
    def cpus(self, worker: Worker) -> SafeString | str:
        """The CPUs the worker is pinned to, marked when another live worker shares one."""
        text = cpu_ranges(worker.cpu_ids)
        if getattr(worker, "cpu_overlap", False):
            return format_html(
                '<span class="cpu-overlap" title="another live worker on this node is pinned to one of '
                'these CPUs">⚠ {}</span>', text,
            )
        return text

    @admin.display(description="pid · restarts", ordering="pid")
    def process(self, worker: Worker) -> str:
        """Process id and restart count in one column (the list must fit 1,400 px)."""
        return f"{worker.pid if worker.pid is not None else '–'} · {worker.restarts}"

    @admin.display(description="status", ordering="status")
    def status_badge(self, worker: Worker) -> SafeString:
        """The status as a coloured badge."""
        return status_badge(worker.status, worker.get_status_display())

    @admin.display(description="health")
    def health(self, worker: Worker) -> SafeString | str:
        """Summary of the last /health answer; the whole JSON on hover."""
        summary = health_summary(worker.last_health)
        title = health_title(worker.last_health)
        if not title:
            return summary
        return format_html('<span class="cell-clip" title="{}">{}</span>', title, summary)

    @admin.display(description="error")
    def error(self, worker: Worker) -> SafeString | str:
        """The last error's first line (full text on hover)."""
        if not worker.last_error:
            return "–"
        first = worker.last_error.strip().splitlines()[0] if worker.last_error.strip() else ""
        return format_html('<span class="cell-clip" title="{}">{}</span>', worker.last_error, first[:200])

    @admin.display(description="seen", ordering="last_seen")
    def seen(self, worker: Worker) -> SafeString | str:
        """Age of the agent's last report on the worker."""
        return age_text(worker.last_seen, stale_after_s=heartbeat_timeout_s())

    @admin.action(description="Restart worker", permissions=["change"])
    def restart_workers(self, request: HttpRequest, queryset: QuerySet) -> None:
        """Restart each selected worker through inference.actions.workers.restart_worker."""
        done: list[str] = []
        for worker in queryset.select_related("deployment", "node"):
            try:
                worker_actions.restart_worker(worker)
            except Exception as exc:  # report each worker's failure and carry on with the others
                self.message_user(request, f"Could not restart worker {worker.pk}: {exc}", messages.ERROR)
            else:
                done.append(str(worker.pk))
        if done:
            self.message_user(request, f"Restarting worker(s) {', '.join(done)}.", messages.SUCCESS)

