"""Admin of served models and deployments: replica cells, saves through the actions (ScaleEvents), the
scale actions (queued for the controller, as the REST API's), and the live metric charts page.
"""
from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied, ValidationError
from django.db.models import Count, Q, QuerySet
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html
from django.utils.safestring import SafeString

from inference import jobs
from inference.actions import deployments as deployment_actions
from inference.actions import scale as scale_actions
from inference.admin import rule_forms, scale_controls
from inference.admin.deployment_inlines import (
    DeploymentWorkerInline,
    RouterEndpointInline,
    ScaleEventInline,
    ScalingRuleInline,
)
from inference.models import (
    Deployment,
    WorkerRole,
    WorkerStatus,
)
from inference.models import Model as ServedModel
from inference.selectors import charts
from inference.selectors import metrics as metric_selectors


@admin.register(ServedModel)
class ServedModelAdmin(admin.ModelAdmin):
    """Model checkpoints, with how many deployments serve each."""

    list_display = ["name", "source", "source_ref", "path", "deployment_count", "created_at"]
    list_filter = ["source"]
    search_fields = ["name", "source_ref", "path"]

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        """Models with their deployment count."""
        return super().get_queryset(request).annotate(n_deployments=Count("deployments"))

    @admin.display(description="deployments", ordering="n_deployments")
    def deployment_count(self, model: ServedModel) -> int:
        """Deployments serving this model (it cannot be deleted while any does)."""
        return int(getattr(model, "n_deployments", 0))


class DeploymentAdminForm(forms.ModelForm):
    """The deployment form; an edited replica count that an active schedule rule holds elsewhere is
    refused here, naming the rule (saving it would be reverted silently at the rule's next run)."""

    class Meta:
        model = Deployment
        fields = "__all__"

    def clean(self) -> dict[str, Any]:
        """Refuse replica edits a schedule rule would revert (scale_actions.replica_edit_conflict)."""
        data = super().clean() or {}
        if self.instance.pk is None:
            return data
        for role in WorkerRole.values:
            field = f"{role}_replicas"
            if field in self.changed_data and data.get(field) is not None:
                conflict = scale_actions.replica_edit_conflict(self.instance, role, data[field])
                if conflict is not None:
                    raise ValidationError({field: str(conflict)})
        return data


@admin.register(Deployment)
class DeploymentAdmin(admin.ModelAdmin):
    """Deployments: replicas per role, rules, events, workers, scale actions and live metric charts."""

    form = DeploymentAdminForm
    change_form_template = "admin/inference/deployment/change_form.html"
    list_display = [
        "name",
        "model",
        "status",
        "prefill",
        "decode",
        "both",
        "router_policy",
        "kv_transport",
        "metrics_link",
    ]
    list_filter = ["status", "model", "router_policy", "kv_transport"]
    list_select_related = ["model"]
    search_fields = ["name", "model__name"]
    actions = ["scale_prefill_up", "scale_prefill_down", "scale_decode_up", "scale_decode_down"]
    inlines = [ScalingRuleInline, RouterEndpointInline, DeploymentWorkerInline, ScaleEventInline]
    readonly_fields = ["created_at", "updated_at"]
    fieldsets = [
        (None, {"fields": ["name", "model", "status", "router_policy", "kv_transport"]}),
        ("Prefill replicas", {"fields": [("prefill_replicas", "prefill_min", "prefill_max")]}),
        ("Decode replicas", {"fields": [("decode_replicas", "decode_min", "decode_max")]}),
        (
            "Prefill + decode replicas (--service-type both: no hop, for one host)",
            {"fields": [("both_replicas", "both_min", "both_max")]},
        ),
        ("Router", {"fields": [("kv_token_weight", "kv_load_weight"), "local_prefill_tokens"]}),
        (
            "Worker flags",
            {"fields": ["context_length", "max_sequence_length", "batch_size", "block_size", "threads_per_worker",
                        ("speculative", "num_speculative_tokens")]},
        ),
        ("History", {"fields": ["created_at", "updated_at"], "classes": ["collapse"]}),
    ]

    def formfield_for_dbfield(self, db_field: Any, request: HttpRequest, **kwargs: Any) -> Any:
        """Replica fields carry the value the page showed (a hidden "initial-" input), so that
        `form.changed_data` tells an operator's edit from an autoscale that happened meanwhile."""
        formfield = super().formfield_for_dbfield(db_field, request, **kwargs)
        if formfield is not None and db_field.name in {f"{role}_replicas" for role in WorkerRole.values}:
            formfield.show_hidden_initial = True
        return formfield

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        """Deployments with their running workers per role (one query for the list)."""
        running = {
            f"running_{role}": Count("workers", filter=Q(workers__role=role, workers__status=WorkerStatus.RUNNING))
            for role in WorkerRole.values
        }
        return super().get_queryset(request).annotate(**running)

    def _role_cell(self, deployment: Deployment, role: str) -> str:
        low, high = deployment.bounds(role)
        running = getattr(deployment, f"running_{role}", None)
        text = f"{deployment.replicas(role)} [{low}–{high}]"
        return f"{text} · {running} running" if running is not None else text

    @admin.display(description="prefill (desired [min–max])")
    def prefill(self, deployment: Deployment) -> str:
        """Desired prefill replicas, bounds and running workers."""
        return self._role_cell(deployment, "prefill")

    @admin.display(description="prefill + decode (desired [min–max])")
    def both(self, deployment: Deployment) -> str:
        """Desired `both` (colocated) replicas, bounds and running workers."""
        return self._role_cell(deployment, "both")

    @admin.display(description="decode (desired [min–max])")
    def decode(self, deployment: Deployment) -> str:
        """Desired decode replicas, bounds and running workers."""
        return self._role_cell(deployment, "decode")

    @admin.display(description="metrics")
    def metrics_link(self, deployment: Deployment) -> SafeString:
        """Link to the deployment's live charts."""
        url = reverse("admin:inference_deployment_metrics", args=[deployment.pk])
        return format_html('<a href="{}">charts</a>', url)

    # --- saving: through inference.actions so replica changes become ScaleEvents ---

    def save_model(self, request: HttpRequest, obj: Deployment, form: Any, change: bool) -> None:
        """Save through deployment_actions.save_deployment; replica counts not edited in the form keep their
        current value (an autoscale since the page was opened is not reverted)."""
        events = deployment_actions.save_deployment(
            obj,
            changed_fields=form.changed_data if change else None,
            source="manual",
            reason=f"{'edited' if change else 'created'} in the admin by {request.user}",
        )
        for event in events:
            self.message_user(
                request, f"{event.role}: {event.from_replicas} → {event.to_replicas} ({event.reason})", messages.INFO
            )

    def has_delete_permission(self, request: HttpRequest, obj: Deployment | None = None) -> bool:
        """A deployment with live workers cannot be deleted (stop it first)."""
        if obj is not None and deployment_actions.live_worker_count(obj):
            return False
        return bool(super().has_delete_permission(request, obj))

    def delete_model(self, request: HttpRequest, obj: Deployment) -> None:
        """Delete through deployment_actions.delete_deployment (refuses while workers are live)."""
        deployment_actions.delete_deployment(obj)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet) -> None:
        """Delete the selected deployments that have no live workers; report the others."""
        for deployment in queryset:
            try:
                deployment_actions.delete_deployment(deployment)
            except deployment_actions.DeploymentInUse as exc:
                self.message_user(request, str(exc), messages.ERROR)

    # --- scale actions ---

    def _scale(self, request: HttpRequest, queryset: QuerySet, role: str, delta: int) -> None:
        """Queue the scale through scale_actions.request_manual_scale, as the REST API does; the messages say
        what the controller is asked to do (it applies the change within seconds)."""
        for deployment in queryset:
            try:
                queued = scale_actions.request_manual_scale(
                    deployment, role, delta=delta, source="manual", actor=str(request.user),
                    reason=f"admin action {role} {delta:+d} by {request.user}",
                )  # fmt: skip
            except scale_actions.ScheduleConflict as exc:
                # Refused rather than applied and silently set back by the rule a moment later.
                self.message_user(request, f"{deployment.name}: {exc}", messages.ERROR)
                continue
            except jobs.JobNotQueued as exc:
                self.message_user(request, f"{deployment.name}: not scaled: {exc}", messages.ERROR)
                continue
            self.log_change(request, deployment, scale_controls.queued_message(deployment, queued))
            self.message_user(
                request, scale_controls.queued_message(deployment, queued),
                messages.SUCCESS if queued.changes else messages.WARNING,
            )

    @admin.action(description="Scale prefill +1", permissions=["change"])
    def scale_prefill_up(self, request: HttpRequest, queryset: QuerySet) -> None:
        """Add one prefill replica (within the deployment's max)."""
        self._scale(request, queryset, "prefill", +1)

    @admin.action(description="Scale prefill -1", permissions=["change"])
    def scale_prefill_down(self, request: HttpRequest, queryset: QuerySet) -> None:
        """Remove one prefill replica (within the deployment's min)."""
        self._scale(request, queryset, "prefill", -1)

    @admin.action(description="Scale decode +1", permissions=["change"])
    def scale_decode_up(self, request: HttpRequest, queryset: QuerySet) -> None:
        """Add one decode replica (within the deployment's max)."""
        self._scale(request, queryset, "decode", +1)

    @admin.action(description="Scale decode -1", permissions=["change"])
    def scale_decode_down(self, request: HttpRequest, queryset: QuerySet) -> None:
        """Remove one decode replica (within the deployment's min)."""
        self._scale(request, queryset, "decode", -1)

    # --- metrics page and its JSON ---

    def get_urls(self) -> list[URLPattern]:
        """Adds <id>/metrics/ (charts page) and <id>/metrics/data/ (its JSON) before the defaults."""
        extra = [
            path(
                "<path:object_id>/scale/",
                self.admin_site.admin_view(self.scale_view),
                name="inference_deployment_scale",
            ),
            path(
                "<path:object_id>/metrics/",
                self.admin_site.admin_view(self.metrics_view),
                name="inference_deployment_metrics",
            ),
            path(
                "<path:object_id>/metrics/data/",
                self.admin_site.admin_view(self.metrics_data_view),
                name="inference_deployment_metrics_data",
            ),
        ]
        return extra + list(super().get_urls())

    def scale_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """POST of the deployment page's scale form (inference.admin.scale_controls)."""
        return scale_controls.scale_view(self, request, object_id)

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        """The change page with the scale controls above the form."""
        deployment = Deployment.objects.filter(pk=object_id).first()
        context = dict(extra_context or {})
        if deployment is not None and self.has_change_permission(request, deployment):
            context["scale_panels"] = scale_controls.role_panels(deployment)
        context["rule_kinds"] = [(kind, title) for kind, title, _ in rule_forms.ADD_CHOICES]
        return super().change_view(request, object_id, form_url, extra_context=context)

    def _viewable(self, request: HttpRequest, object_id: str) -> Deployment:
        deployment = get_object_or_404(Deployment, pk=object_id)
        if not self.has_view_or_change_permission(request, deployment):
            raise PermissionDenied
        return deployment

    def metrics_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """The live charts page of one deployment (drawn with uPlot by inference/static/inference/metrics.js):
        the router's series first, then the workers' (per role, or per worker with the page's toggle)."""
        deployment = self._viewable(request, object_id)
        router_charts = [c for c in charts.CHARTS if c["source"] in {"router", "worker"}]
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "original": deployment,
            "title": f"Metrics of {deployment.name}",
            "data_url": reverse("admin:inference_deployment_metrics_data", args=[deployment.pk]),
            "sections": [
                {"title": "Router (as its clients see it)", "charts": router_charts},
                {"title": "Workers", "charts": [c for c in charts.CHARTS if c not in router_charts]},
            ],
            "routers": list(deployment.routers.filter(enabled=True)),
            "roles": WorkerRole.values,
        }
        return TemplateResponse(request, "admin/inference/deployment/metrics.html", context)

    def metrics_data_view(self, request: HttpRequest, object_id: str) -> JsonResponse:
        """JSON of metric_selectors.deployment_metric_series (`?minutes=`, `?role=`, `?max_points=`), staff only."""
        deployment = self._viewable(request, object_id)
        try:
            data = metric_selectors.metric_series_query(deployment, request.GET)
        except metric_selectors.InvalidQuery as exc:
            return JsonResponse({"error": exc.errors}, status=400)
        return JsonResponse(data)  # admin_view() already marks it never_cache: live data
