"""Admin of workers: the live worker list (status, health, CPU pinning overlaps), the restart action, and
the inlines that show a node's or a deployment's live workers.
"""
from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.views.main import ChangeList
from django.core.exceptions import PermissionDenied
from django.db.models import Case, IntegerField, QuerySet, When
from django.http import HttpRequest, HttpResponse, HttpResponseNotAllowed, HttpResponseRedirect
from django.shortcuts import get_object_or_404
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html
from django.utils.safestring import SafeString

from inference.actions import workers as worker_actions
from inference.admin.display import (
    LIST_CSS,
    age_text,
    cpu_ranges,
    health_summary,
    health_title,
    heartbeat_timeout_s,
    status_badge,
    warn_overlaps,
)
from inference.admin.lean_lists import LeanActionCheckbox, NamedRelatedFilter
from inference.admin.readonly_tables import ReadOnlyTableInline, TableFormSet
from inference.admin.tables import json_table
from inference.controller.pinning import live_cpu_overlaps, overlapping_worker_ids
from inference.models import (
    ACTIVE_WORKER_STATUSES,
    Worker,
    WorkerStatus,
)


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


# Live workers an inline shows: the deployment page rendered every one (2.4 s and 131 queries at 100
# workers on the loaded 2-core machine, growing with the count; bench/sim/control_plane.py); the worker
# list pages through them all.
LIVE_WORKERS_SHOWN = 50


class FirstLiveWorkersFormSet(TableFormSet):
    """The first LIVE_WORKERS_SHOWN live workers, those not serving (unhealthy, starting) first."""

    def get_queryset(self) -> QuerySet:
        """The live workers to show, capped; evaluated once (each form indexes it: a fresh slice would
        query again per form)."""
        if not hasattr(self, "_first_live"):
            serving_last = Case(When(status=WorkerStatus.RUNNING, then=1), default=0, output_field=IntegerField())
            live = super().get_queryset()
            # The ids first, then their rows joined: sorting the joined rows of 1,000 workers (each with its
            # node's row) took 16 ms in PostgreSQL, the ids alone then 50 joined rows 6.5 ms.
            ids = live.order_by(serving_last, "role", "id").values("pk")[:LIVE_WORKERS_SHOWN]
            first = live.filter(pk__in=ids).order_by(serving_last, "role", "id")
            len(first)  # fills its result cache
            self._first_live = first
        return self._first_live


class LiveWorkerInline(ReadOnlyTableInline):
    """Live workers of a node or a deployment, read-only: the controller places them and the agents
    report their fields; stopped ones accumulate over time and are listed on the worker page. At most
    LIVE_WORKERS_SHOWN of them (the worker list, filtered by deployment or node, has them all)."""

    model = Worker
    formset = FirstLiveWorkersFormSet
    show_change_link = True
    related: tuple[str, ...] = ()  # select_related for the columns shown

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        """Only live workers."""
        # Each row also shows the worker's name (its deployment's and node's names): joined, not a query each.
        live = super().get_queryset(request).filter(status__in=ACTIVE_WORKER_STATUSES)
        # The metrics blobs (the node's carries its workers' process stats) are not shown: not decoded either.
        return live.select_related("deployment", "node", *self.related).defer("last_metrics", "node__last_metrics")


class WorkerInline(LiveWorkerInline):
    """The node's live workers."""

    fk_name = "node"
    related = ("deployment",)
    fields = ["deployment", "role", "port", "status", "pid", "restarts", "last_seen"]
    readonly_fields = fields


class WorkerChangeList(ChangeList):
    """The worker list's rows, each told whether it shares a CPU with another live worker."""

    def get_queryset(self, request: HttpRequest, exclude_parameters: Any = None) -> QuerySet:
        """The listed workers; the metrics blobs (the node's carries its workers' process stats) are not
        shown in the list: not decoded either."""
        return super().get_queryset(request, exclude_parameters).defer("last_metrics", "node__last_metrics")

    def get_results(self, request: HttpRequest) -> None:
        """Fetch the page, then set `cpu_overlap` on each row from the ids changelist_view found."""
        super().get_results(request)
        overlapping: set[int] = getattr(request, "cpu_overlaps", set())
        for worker in self.result_list:
            worker.cpu_overlap = worker.pk in overlapping


@admin.register(Worker)
class WorkerAdmin(LeanActionCheckbox, admin.ModelAdmin):
    """Worker processes: deployment, node, role, URL, status, pid, restarts, health, last error."""

    change_list_template = "admin/inference/worker/change_list.html"
    change_form_template = "admin/inference/worker/change_form.html"

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
    list_filter = [
        WorkerStateFilter, "status", "role", ("deployment", NamedRelatedFilter), ("node", NamedRelatedFilter),
    ]
    list_select_related = ["deployment", "node"]
    # A filtered list is counted once (its pages), not a second time over the whole table for "N total".
    show_full_result_count = False
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
        "health_table",
        "metrics_table",
        "last_error",
        "last_seen",
        "created_at",
        "updated_at",
    ]
    fields = readonly_fields

    def has_change_permission(self, request: HttpRequest, obj: Worker | None = None) -> bool:
        """The worker page is read-only (no Save button): the controller and agents own the row. The list's
        "Restart worker" action still needs the change permission, asked without an object."""
        if obj is not None:
            return False
        return bool(super().has_change_permission(request, obj))

    def get_urls(self) -> list[URLPattern]:
        """Adds <id>/restart/ (the worker page's Restart button) before the defaults."""
        restart = path(
            "<path:object_id>/restart/", self.admin_site.admin_view(self.restart_view), name="inference_worker_restart"
        )
        return [restart, *super().get_urls()]

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        """The (read-only) worker page with a Restart button while the worker is live and a link to its charts."""
        worker = Worker.objects.filter(pk=object_id).first()
        context = dict(extra_context or {})
        if worker is not None:
            context["can_restart"] = self.has_change_permission(request) and worker.status in ACTIVE_WORKER_STATUSES
            context["charts_url"] = (
                reverse("admin:inference_deployment_metrics", args=[worker.deployment_id]) + "?split=worker"
            )
        return super().change_view(request, object_id, form_url, extra_context=context)

    def restart_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """POST: queue the restart of one worker for its node's agent (worker_actions.restart_worker), say so,
        record it in the worker's history, and go back to its page."""
        worker = get_object_or_404(Worker.objects.select_related("deployment", "node"), pk=object_id)
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        if not self.has_change_permission(request):
            raise PermissionDenied
        try:
            worker_actions.restart_worker(worker)
        except ValueError as exc:  # no longer live, or its node's agent is gone
            self.message_user(request, f"Not restarted: {exc}.", messages.ERROR)
        else:
            message = f"Restart of worker #{worker.pk} queued for the agent on {worker.node.name}"
            self.log_change(request, worker, message)
            self.message_user(request, f"{message}: it stops the process and starts it again (restarts + 1).",
                              messages.SUCCESS)
        return HttpResponseRedirect(reverse("admin:inference_worker_change", args=[worker.pk]))

    @admin.display(description="last health")
    def health_table(self, worker: Worker) -> SafeString | str:
        """The worker's last /health answer as a table, in units."""
        return json_table(worker.last_health)

    @admin.display(description="last metrics")
    def metrics_table(self, worker: Worker) -> SafeString | str:
        """The worker's last scraped metrics as a table, in units."""
        return json_table(worker.last_metrics)

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
