"""Admin of nodes: live status list (heartbeat, resources, workers), and the drain / activate / offline actions.

Node is a model of the `nodes` app, but its admin shows the workers on it (inline, counts, CPU pinning
overlaps) and its actions move workers, so it is registered here, in the layer that knows both.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.contrib import admin, messages
from django.db.models import Count, Q, QuerySet
from django.http import HttpRequest, HttpResponse
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString

from inference.actions import nodes as node_workers
from inference.admin.display import (
    LIST_CSS,
    age_text,
    first_number,
    heartbeat_timeout_s,
    human_bytes,
    percent,
    short_reason,
    status_badge,
    warn_overlaps,
)
from inference.admin.tables import json_table
from inference.admin.workers import WorkerInline
from inference.controller.pinning import live_cpu_overlaps
from inference.models import (
    ACTIVE_WORKER_STATUSES,
)
from nodes import actions as node_actions
from nodes.models import Node, NodeStatus


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
        "memory_total",
        "gpus",
        "rdma_devices",
        "rdma_note",
        "last_heartbeat",
        "metrics_table",
        "registered_at",
    ]
    fieldsets = [
        (None, {"fields": ["name", "hostname", "address", "status", "labels"]}),
        # What the controller may place here (ports, and whether workers may share CPUs).
        ("Placement", {"fields": ["port_range_start", "port_range_end", "allow_cpu_oversubscription"]}),
        (
            "Registered resources and heartbeat",
            {"fields": ["cpu_count", "memory_total", "gpus", "rdma_devices", "rdma_note", "last_heartbeat",
                        "metrics_table", "registered_at"]},
        ),
    ]

    @admin.display(description="memory")
    def memory_total(self, node: Node) -> str:
        """The host's memory in binary units, with the byte count."""
        return f"{human_bytes(node.memory_bytes)} ({node.memory_bytes:,} bytes)".replace(",", " ")

    @admin.display(description="last metrics")
    def metrics_table(self, node: Node) -> SafeString | str:
        """The last heartbeat's host and worker-process metrics as a table, in units."""
        return json_table(node.last_metrics)

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
