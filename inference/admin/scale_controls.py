"""The deployment page's scale controls: per role, the desired replicas with their bounds, a form posting to
`<id>/scale/`, and (when a schedule rule or an override holds the role) the override fields.

The view calls the action the REST API calls (`scale_actions.request_manual_scale`, source "manual"), so
a scale from this page is checked against the schedule rules, queued for the controller and recorded as
a ScaleEvent the same way; the message says what will happen ("queued: prefill 1 → 2"), and the scale
(or the refusal) is written to the deployment's History (Django's LogEntry).
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db.models import Count
from django.http import HttpRequest, HttpResponse, HttpResponseNotAllowed, HttpResponseRedirect
from django.shortcuts import get_object_or_404
from django.urls import reverse
from django.utils import timezone

from inference import jobs
from inference.actions import scale as scale_actions
from inference.models import Deployment, RuleKind, ScaleOverride, ScalingRule, WorkerRole, WorkerStatus
from inference.selectors.schedules import active_overrides, active_schedule_rule, window_text

MAX_OVERRIDE_MINUTES = int(scale_actions.MAX_OVERRIDE.total_seconds() // 60)


class ScaleForm(forms.Form):
    """One role's scale: the count (checked against the role's bounds by the action), a reason, and an
    optional override end (for N minutes, or until a time) when a schedule rule holds the role."""

    role = forms.ChoiceField(choices=WorkerRole.choices, widget=forms.HiddenInput)
    replicas = forms.IntegerField(min_value=0, max_value=10_000)
    reason = forms.CharField(required=False, max_length=1000)
    override_minutes = forms.IntegerField(
        required=False, min_value=1, max_value=MAX_OVERRIDE_MINUTES,
        help_text=f"hold this count against the scaling rules for N minutes (at most {MAX_OVERRIDE_MINUTES})",
    )  # fmt: skip
    override_until = forms.DateTimeField(
        required=False, help_text="or until this time (YYYY-MM-DD HH:MM, in the platform's time zone)",
    )  # fmt: skip

    def clean(self) -> dict[str, Any]:
        """At most one override end; resolved into `override_until`."""
        data = super().clean() or {}
        minutes, until = data.get("override_minutes"), data.get("override_until")
        if minutes and until:
            raise forms.ValidationError("give the override's minutes or its end time, not both")
        if minutes:
            data["override_until"] = timezone.now() + timedelta(minutes=minutes)
        return data


@dataclass
class RolePanel:
    """What the page shows for one role: counts, bounds, who holds it, and its form."""

    role: str
    desired: int
    low: int
    high: int
    running: int
    rule: ScalingRule | None
    override: ScaleOverride | None
    form: ScaleForm

    @property
    def rule_window(self) -> str:
        """The holding schedule rule's window with its time zone ("" when none holds the role)."""
        return window_text(self.rule) if self.rule is not None else ""

    @property
    def held(self) -> bool:
        """Whether a schedule rule or an override holds the role: the override fields are shown."""
        return self.rule is not None or self.override is not None


def role_panels(deployment: Deployment, now: datetime | None = None) -> list[RolePanel]:
    """The scale controls of the deployment page, one per role (three queries for both roles: the running
    counts, the schedule rules, the overrides)."""
    now = now or timezone.now()
    running = dict(
        deployment.workers.filter(status=WorkerStatus.RUNNING).values("role").annotate(n=Count("pk"))
        .values_list("role", "n")
    )  # fmt: skip
    schedules = list(
        ScalingRule.objects.filter(deployment=deployment, kind=RuleKind.SCHEDULE, enabled=True).order_by("name")
    )
    overrides = {o.role: o for o in active_overrides(deployment, now)}
    panels = []
    for role in WorkerRole.values:
        low, high = deployment.bounds(role)
        form = ScaleForm(initial={"role": role, "replicas": deployment.replicas(role)}, prefix=role)
        form.fields["replicas"].widget.attrs.update({"min": low, "max": high})
        rule = active_schedule_rule([r for r in schedules if r.role == role], now)
        panels.append(RolePanel(
            role, deployment.replicas(role), low, high, running.get(role, 0), rule, overrides.get(role), form,
        ))  # fmt: skip
    return panels


def scale_view(model_admin: admin.ModelAdmin, request: HttpRequest, object_id: str) -> HttpResponse:
    """POST of one role's scale form: queue it through request_manual_scale, say what happens, log it."""
    if request.method != "POST":
        return HttpResponseNotAllowed(["POST"])
    deployment = get_object_or_404(Deployment, pk=object_id)
    if not model_admin.has_change_permission(request, deployment):
        raise PermissionDenied
    back = HttpResponseRedirect(reverse("admin:inference_deployment_change", args=[deployment.pk]) + "#scale")
    role = request.POST.get("role", "")
    form = ScaleForm(request.POST, prefix=role if role in WorkerRole.values else None)
    if not form.is_valid():
        errors = "; ".join(f"{field}: {' '.join(msgs)}" for field, msgs in form.errors.items())
        model_admin.message_user(request, f"{deployment.name}: not scaled: {errors}", messages.ERROR)
        return back
    data = form.cleaned_data
    role = data["role"]
    actor = str(request.user)
    reason = data["reason"].strip() or f"scaled from the deployment page by {actor}"
    try:
        queued = scale_actions.request_manual_scale(
            deployment, role, replicas=data["replicas"], source="manual", actor=actor, reason=reason,
            override_until=data.get("override_until"),
        )  # fmt: skip
    except scale_actions.ScheduleConflict as exc:
        model_admin.message_user(request, f"{deployment.name}: not scaled: {conflict_text(exc)}", messages.ERROR)
        return back
    except (scale_actions.ReplicasOutOfBounds, ValueError) as exc:
        model_admin.message_user(request, f"{deployment.name}: not scaled: {exc}", messages.ERROR)
        return back
    except jobs.JobNotQueued as exc:
        model_admin.message_user(request, f"{deployment.name}: not scaled: {exc}", messages.ERROR)
        return back
    text = queued_message(deployment, queued)
    model_admin.log_change(request, deployment, f"{text} Reason: {reason}")
    model_admin.message_user(request, text, messages.SUCCESS if queued.changes else messages.WARNING)
    return back


def conflict_text(exc: scale_actions.ScheduleConflict) -> str:
    """A schedule conflict in the page's words (the action's message names the API's fields)."""
    return (
        f"schedule rule '{exc.rule.name}' ({window_text(exc.rule)}) holds {exc.role} replicas at {exc.held}; a "
        f"scale to {exc.requested} would be reverted at its next evaluation. To scale anyway, give an override "
        "(for N minutes or until a time, with a reason) in the role's scale form, or disable the rule."
    )


def queued_message(deployment: Deployment, queued: scale_actions.ScaleRequest) -> str:
    """What a queued manual scale will do, in the words of the page's messages and History."""
    override = ""
    if queued.override is not None:
        ends = timezone.localtime(queued.override.ends_at).strftime("%Y-%m-%d %H:%M:%S")
        override = f" Held against the scaling rules until {ends} (override #{queued.override.pk})."
    if not queued.changes:
        low, high = deployment.bounds(queued.role)
        return f"{deployment.name}: {queued.role} stays at {queued.current} (bounds [{low}, {high}]).{override}"
    return (
        f"{deployment.name}: queued: {queued.role} {queued.current} → {queued.target}; the controller applies it "
        f"within seconds and the outcome shows under recent scale events.{override}"
    )
