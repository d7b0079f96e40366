"""What the deployment page shows inside it: its scaling rules (editable), routers, recent scale events
and live workers.
"""
from __future__ import annotations

from django.contrib import admin
from django.db import models
from django.db.models import QuerySet
from django.http import HttpRequest
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString

from inference.admin.display import (
    age_text,
    event_outcome,
    format_duration,
    health_summary,
    status_badge,
)
from inference.admin.readonly_tables import ReadOnlyTableInline, TableFormSet
from inference.admin.rule_columns import RuleInWords
from inference.admin.workers import LiveWorkerInline
from inference.models import (
    RouterEndpoint,
    ScaleEvent,
    ScalingRule,
    Worker,
)

RECENT_EVENTS = 20


class ScalingRuleInline(RuleInWords, ReadOnlyTableInline):
    """The deployment's scaling rules in words (signal, units, state now), each linking to its own page, where
    the form of its kind edits it (inference.admin.rule_forms): one table of every kind's fields showed a
    schedule rule's meaningless step and a threshold rule's empty window times."""

    model = ScalingRule
    verbose_name_plural = "scaling rules (open a rule to edit it)"
    fields = ["rule_name", "kind_name", "enabled", "condition", "state_now", "last_fired"]
    readonly_fields = fields

    @admin.display(description="name")
    def rule_name(self, rule: ScalingRule) -> SafeString:
        """The rule's name, linking to its page (the form of its kind)."""
        url = reverse("admin:inference_scalingrule_change", args=[rule.pk])
        return format_html('<a href="{}" class="rule-link">{}</a>', url, rule.name)

    @admin.display(description="last fired")
    def last_fired(self, rule: ScalingRule) -> str:
        """When the rule last changed the replicas, to the second."""
        if rule.last_triggered_at is None:
            return "never"
        return f"{timezone.localtime(rule.last_triggered_at):%Y-%m-%d %H:%M:%S}"

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        """The rules with their deployment (each row's title names it): joined, not a query each."""
        return super().get_queryset(request).select_related("deployment")


class RouterEndpointInline(admin.TabularInline):
    """The deployment's routers: the metrics collector scrapes each one's /metrics (router series)."""

    model = RouterEndpoint
    extra = 0
    verbose_name_plural = "routers (scraped for the metrics page: overhead, errors, 429s, client latency)"
    fields = ["url", "enabled", "last_scraped_at", "last_error"]
    readonly_fields = ["last_scraped_at", "last_error"]
    formfield_overrides = {models.URLField: {"assume_scheme": "http"}}  # routers are plain http here

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        """The routers with their deployment (each row's title names it): joined, not a query each."""
        return super().get_queryset(request).select_related("deployment")


class RecentEventsFormSet(TableFormSet):
    """The newest events only, read-only."""

    def get_queryset(self) -> QuerySet:
        """The newest RECENT_EVENTS events of the deployment with their rule, evaluated once: each form
        indexes the queryset, and an unevaluated slice queried again per form (then the rule column, and the
        deployment for the row's title and for the rule's name): four queries per event shown."""
        if not hasattr(self, "_recent"):
            joined = super().get_queryset().select_related("deployment", "rule__deployment")
            recent = joined.order_by("-created_at", "-id")[:RECENT_EVENTS]
            len(recent)  # fills its result cache
            self._recent = recent
        return self._recent


class ScaleEventInline(ReadOnlyTableInline):
    """The deployment's most recent scale events, read-only: recorded by inference.actions, never typed in,
    kept as history."""

    model = ScaleEvent
    formset = RecentEventsFormSet
    verbose_name_plural = f"recent scale events (newest {RECENT_EVENTS})"
    fields = [
        "created_at", "role", "from_replicas", "to_replicas", "outcome", "source", "rule", "reason", "time_to_run",
    ]
    readonly_fields = fields

    @admin.display(description="outcome")
    def outcome(self, event: ScaleEvent) -> SafeString:
        """Refused (no node could take the workers) or applied."""
        return event_outcome(event)

    @admin.display(description="time to run")
    def time_to_run(self, event: ScaleEvent) -> str:
        """How long the workers placed for the event took to run."""
        return "–" if event.refused else format_duration(event.time_to_run_s)


class DeploymentWorkerInline(LiveWorkerInline):
    """The deployment's live workers, read-only (the controller places them)."""

    fk_name = "deployment"
    related = ("node",)
    verbose_name_plural = "live workers"
    fields = ["role", "node", "worker_url", "worker_status", "pid", "restarts", "health", "seen"]
    readonly_fields = fields

    @admin.display(description="URL")
    def worker_url(self, worker: Worker) -> str:
        """Base URL of the worker's HTTP API."""
        return worker.url

    @admin.display(description="status")
    def worker_status(self, worker: Worker) -> SafeString:
        """The status as a coloured badge."""
        return status_badge(worker.status, worker.get_status_display())

    @admin.display(description="last health")
    def health(self, worker: Worker) -> str:
        """Summary of the last /health answer."""
        return health_summary(worker.last_health)

    @admin.display(description="last seen")
    def seen(self, worker: Worker) -> SafeString | str:
        """Age of the agent's last report."""
        return age_text(worker.last_seen)
