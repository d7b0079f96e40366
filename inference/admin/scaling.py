"""Admin of scaling rules and of what scaling records: overrides and scale events (read-only).
"""
from __future__ import annotations

from datetime import datetime
from typing import Any

from django.contrib import admin
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from inference.actions import rules as rule_actions
from inference.admin import rule_forms
from inference.admin.display import (
    ReadOnlyAdmin,
    event_outcome,
    format_duration,
)
from inference.admin.rule_columns import RuleInWords
from inference.models import (
    ScaleEvent,
    ScaleOverride,
    ScalingRule,
)
from inference.selectors import rules as rule_selectors

WINDOW_ROWS = 30  # readings shown on a rule's page (a rule keeps those of its window, one per evaluation)


@admin.register(ScalingRule)
class ScalingRuleAdmin(RuleInWords, admin.ModelAdmin):
    """Scaling rules of all deployments: one form per kind (inference.admin.rule_forms) with only its fields, the
    rule in words naming its signal, and its internal state (window of readings, breach timer) read-only."""

    list_display = ["name", "deployment", "kind_name", "enabled", "condition", "state_now", "last_triggered"]
    list_filter = ["kind", "role", "enabled", "deployment"]
    list_select_related = ["deployment"]
    search_fields = ["name", "deployment__name"]
    readonly_fields = ["condition", "state_now", "breach_started", "last_triggered", "window"]

    def _form_class(self, request: HttpRequest, obj: ScalingRule | None) -> type[rule_forms.RuleForm] | None:
        return rule_forms.form_for(obj.kind if obj is not None else request.GET.get("kind"))

    def get_form(self, request: HttpRequest, obj: ScalingRule | None = None, change: bool = False,
                 **kwargs: Any) -> Any:
        """The form of the rule's kind (on the add page: of `?kind=`)."""
        form = self._form_class(request, obj) or rule_forms.ThresholdRuleForm
        kwargs["form"] = form
        kwargs["fields"] = [*form.Meta.fields, *form.declared_fields]
        return super().get_form(request, obj, change=change, **kwargs)

    def get_fieldsets(self, request: HttpRequest, obj: ScalingRule | None = None) -> Any:
        """The kind's fields; on an existing rule, its state below them (read-only)."""
        form = self._form_class(request, obj) or rule_forms.ThresholdRuleForm
        fields = list(form.Meta.fields)
        if "target_ms" in form.declared_fields:
            fields.insert(fields.index("kind") + 1, "target_ms")
        fieldsets: list[tuple[str | None, dict[str, Any]]] = [(None, {"fields": fields})]
        if obj is not None:
            state = ["condition", "state_now", "last_triggered"]
            if obj.kind != "schedule":
                state[2:2] = ["breach_started", "window"]
            fieldsets.append(("State (kept by the scaling loop, read-only)", {"fields": state}))
        return fieldsets

    def add_view(self, request: HttpRequest, form_url: str = "", extra_context: dict[str, Any] | None = None) -> Any:
        """Without a known `?kind=`: a page choosing the kind first (each kind has its own form)."""
        if rule_forms.form_for(request.GET.get("kind")) is None:
            query = request.GET.copy()
            choices = []
            for kind, title, help_text in rule_forms.ADD_CHOICES:
                query["kind"] = kind
                choices.append({"url": f"?{query.urlencode()}", "title": title, "help": help_text})
            context = {
                **self.admin_site.each_context(request), "opts": self.opts, "title": "Add a scaling rule",
                "choices": choices,
            }  # fmt: skip
            return TemplateResponse(request, "admin/inference/scalingrule/choose_kind.html", context)
        return super().add_view(request, form_url, extra_context)

    @admin.display(description="window breaching since")
    def breach_started(self, rule: ScalingRule) -> str:
        """The first breaching reading of a window that breaches (80 % of its readings) but is not full yet;
        "state now" judges the latest reading alone."""
        return _to_second(rule.breach_started_at) or "the window does not breach (yet)"

    @admin.display(description="last fired", ordering="last_triggered_at")
    def last_triggered(self, rule: ScalingRule) -> str:
        """When the rule last changed the replicas."""
        return _to_second(rule.last_triggered_at) or "never"

    @admin.display(description="window of readings")
    def window(self, rule: ScalingRule) -> SafeString | str:
        """The readings the rule judges (newest first), each in its unit and marked when it breaches."""
        readings = rule_selectors.readings(rule)[::-1][:WINDOW_ROWS]
        if not readings:
            return "no reading yet (the window restarts after any replica change, and while a schedule holds the role)"
        rows = format_html_join(
            "", '<tr class="{}"><td>{}</td><td>{}</td><td>{}</td></tr>',
            ((("breaching" if r.breaching else ""), _to_second(r.at), r.text,
              "breaches" if r.breaching else ("no worker reported" if r.value is None else "")) for r in readings),
        )  # fmt: skip
        head = format_html(
            "<tr><th>time</th><th>{}</th><th></th></tr>", rule_selectors.signal_name(rule)
        )
        return format_html('<table class="json-table rule-window">{}{}</table>', head, rows)

    def save_model(self, request: HttpRequest, obj: ScalingRule, form: Any, change: bool) -> None:
        """Save through rule_actions.save_rule (a changed condition restarts the breach timer)."""
        changed = list(form.changed_data)
        if "target_ms" in changed:
            changed.append("threshold")
        rule_actions.save_rule(obj, changed_fields=changed if change else None)


def _to_second(moment: datetime | None) -> str:
    """A time in the platform's zone to the second ("" for None)."""
    if moment is None:
        return ""
    return f"{timezone.localtime(moment):%Y-%m-%d %H:%M:%S}"


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
