"""Admin of scaling rules and of what scaling records: overrides and scale events (read-only).
"""
from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest
from django.utils import timezone
from django.utils.safestring import SafeString

from inference.actions import rules as rule_actions
from inference.admin.display import (
    ReadOnlyAdmin,
    event_outcome,
    format_duration,
)
from inference.models import (
    ScaleEvent,
    ScaleOverride,
    ScalingRule,
)


@admin.register(ScalingRule)
class ScalingRuleAdmin(admin.ModelAdmin):
    """Scaling rules of all deployments."""

    list_display = ["name", "deployment", "kind", "role", "enabled", "condition", "last_triggered_at"]
    list_filter = ["kind", "role", "enabled", "deployment"]
    list_select_related = ["deployment"]
    search_fields = ["name", "deployment__name"]
    readonly_fields = ["breach_started_at", "last_triggered_at"]

    @admin.display(description="condition")
    def condition(self, rule: ScalingRule) -> str:
        """The rule in words."""
        if rule.kind == "threshold":
            return (
                f"load {rule.comparison} {rule.threshold} over {rule.duration_s}s → {rule.step:+d} "
                f"(cooldown {rule.cooldown_s}s)"
            )
        if rule.kind in ("ttft_slo", "itl_slo"):
            what, unit = ("TTFT", "s") if rule.kind == "ttft_slo" else ("ITL", "ms")
            return (
                f"{what} p90 ≤ {rule.threshold:g}{unit}, else {rule.step:+d} {rule.role} after {rule.duration_s}s "
                f"(cooldown {rule.cooldown_s}s)"
            )
        return f"{rule.start_time}–{rule.end_time} → {rule.target_replicas} replicas"

    def save_model(self, request: HttpRequest, obj: ScalingRule, form: Any, change: bool) -> None:
        """Save through rule_actions.save_rule (a changed condition restarts the breach timer)."""
        rule_actions.save_rule(obj, changed_fields=form.changed_data if change else None)


@admin.register(ScaleOverride)
class ScaleOverrideAdmin(ReadOnlyAdmin):
    """Overrides of scaling rules made by manual scales: which role, what count, until when, why."""

    list_display = ["created_at", "deployment", "role", "replicas", "ends_at", "active", "rule", "created_by", "reason"]
    list_filter = ["role", "deployment"]
    list_select_related = ["deployment", "rule"]
    search_fields = ["deployment__name", "reason", "created_by"]

    @admin.display(description="active", boolean=True)
    def active(self, override: ScaleOverride) -> bool:
        """Whether it still holds its role."""
        return bool(override.ends_at > timezone.now())


@admin.register(ScaleEvent)
class ScaleEventAdmin(ReadOnlyAdmin):
    """Every replica change with its source and reason; placements the controller refused are marked so."""

    list_display = [
        "created_at", "deployment", "role", "change", "outcome", "source", "rule", "time_to_run", "reason",
    ]
    list_filter = ["refused", "source", "role", "deployment"]
    list_select_related = ["deployment", "rule"]
    search_fields = ["deployment__name", "reason"]
    date_hierarchy = "created_at"

    @admin.display(description="replicas")
    def change(self, event: ScaleEvent) -> str:
        """from → to."""
        return f"{event.from_replicas} → {event.to_replicas}"

    @admin.display(description="outcome", ordering="refused")
    def outcome(self, event: ScaleEvent) -> SafeString:
        """A red "refused" badge for placements no node could take, else "applied"."""
        return event_outcome(event)

    @admin.display(description="time to run", ordering="time_to_run_s")
    def time_to_run(self, event: ScaleEvent) -> str:
        """Seconds until the workers placed for the event ran; "starting" while they do not yet."""
        if event.refused:
            return "—"
        if event.time_to_run_s is not None:
            return format_duration(event.time_to_run_s)
        return "starting" if event.placed_workers.exists() else "—"
