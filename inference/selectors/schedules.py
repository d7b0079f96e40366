"""Who holds a role's replica count right now, read by the scaling rules, actions, the REST API and the admin.

An active override (an operator's explicit count with an end time) first, else the active schedule rule,
else nobody (threshold rules and manual scales move it freely); that decides whether a manual scale would be
reverted. Schedule windows are read in settings.TIME_ZONE and may wrap midnight.
"""
from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, time
from zoneinfo import ZoneInfo

from django.conf import settings

from inference.models import (
    Deployment,
    RuleKind,
    ScaleOverride,
    ScalingRule,
)


def local_time(now: datetime) -> time:
    """Wall-clock time of `now` in settings.TIME_ZONE."""
    return now.astimezone(ZoneInfo(settings.TIME_ZONE)).time()


def _minutes(t: time) -> float:
    return t.hour * 60 + t.minute + t.second / 60 + t.microsecond / 60e6


def in_window(start: time, end: time, at: time) -> bool:
    """Whether `at` is in [start, end); the window wraps midnight when end < start; start == end is empty."""
    if start == end:
        return False
    if start < end:
        return start <= at < end
    return at >= start or at < end


def minutes_since_start(start: time, at: time) -> float:
    """Minutes from the window's start to `at`, going forward through midnight if needed."""
    return (_minutes(at) - _minutes(start)) % (24 * 60)


def active_schedule_rule(rules: Sequence[ScalingRule], now: datetime) -> ScalingRule | None:
    """The schedule rule holding a role now: of those whose window contains `now`, the latest started."""
    at = local_time(now)
    active = [
        r for r in rules
        if r.enabled and r.kind == RuleKind.SCHEDULE and r.start_time is not None and r.end_time is not None
        and r.target_replicas is not None and in_window(r.start_time, r.end_time, at)
    ]  # fmt: skip
    if not active:
        return None
    return min(active, key=lambda r: (minutes_since_start(r.start_time, at), r.name))  # type: ignore[arg-type]


def schedule_rule_holding(deployment: Deployment, role: str, now: datetime) -> ScalingRule | None:
    """The enabled schedule rule of the deployment's `role` whose window contains `now`, if any."""
    rules = ScalingRule.objects.filter(deployment=deployment, role=role, kind=RuleKind.SCHEDULE, enabled=True)
    return active_schedule_rule(list(rules.order_by("name")), now)


def active_override(deployment: Deployment, role: str, now: datetime) -> ScaleOverride | None:
    """The override holding the deployment's `role` at `now` (the most recent if several overlap)."""
    return (
        ScaleOverride.objects.select_related("rule")
        .filter(deployment=deployment, role=role, ends_at__gt=now)
        .order_by("-created_at", "-id")
        .first()
    )


def active_overrides(deployment: Deployment, now: datetime) -> list[ScaleOverride]:
    """The deployment's overrides still holding a role at `now`, one per role at most (newest wins)."""
    rows = ScaleOverride.objects.select_related("rule").filter(deployment=deployment, ends_at__gt=now)
    newest: dict[str, ScaleOverride] = {}
    for override in rows.order_by("-created_at", "-id"):
        newest.setdefault(override.role, override)
    return sorted(newest.values(), key=lambda o: o.role)


def window_text(rule: ScalingRule) -> str:
    """A schedule rule's window as people read it, e.g. "22:00–07:00 (Europe/Paris)"."""
    if rule.start_time is None or rule.end_time is None:
        return ""
    return f"{rule.start_time:%H:%M}–{rule.end_time:%H:%M} ({settings.TIME_ZONE})"
