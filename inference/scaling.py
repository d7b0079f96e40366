"""Scaling rules: threshold rules react to load, schedule rules hold replicas in a time window.

Load of a role (`role_load`)
    For each RUNNING worker of the deployment and role whose last health report (`Worker.last_health`,
    written by its agent every few seconds and by `collect_metrics`) is younger than
    SCALING_HEALTH_MAX_AGE_S: `(running + queue_depth) / batch_size`, capped at LOAD_CAP = 1.0; the
    role's load is the mean over those workers. So load is the fraction of the role's batch capacity in
    demand: 0.0 idle, 1.0 every batch full (requests queued beyond a full batch also read 1.0, so one
    worker with a long queue cannot outweigh the others). The guide's rules "prefill load > 0.8 → add
    prefill", "decode load > 0.7 → add decode" are threshold rules on this number. None (no rule fires)
    when no RUNNING worker has a recent report.

Threshold rules (`evaluate_threshold_rule`)
    The breach (`load > threshold` for comparison "above", `<` for "below") must persist: its start is
    kept in `breach_started_at` and the rule fires once `duration_s` has passed since then (0: at once).
    Firing adds `step` (negative removes) to the desired replicas via `inference.actions.scale_deployment`
    (source "threshold"), which clamps to the deployment's min/max; at the bound nothing changes and no
    event is recorded (the breach stays, so the rule fires as soon as the bound moves). After firing the
    rule waits `cooldown_s` (from `last_triggered_at`) and the breach timer restarts, so the next step
    needs a fresh `duration_s` of breach measured with the new workers. Any return inside the threshold
    resets the breach timer.

Schedule rules (`evaluate_schedule_rules`)
    Inside `[start_time, end_time)` in settings.TIME_ZONE (the window wraps midnight when end < start,
    e.g. 22:00–07:00; start == end is an empty window) the rule holds `target_replicas` (clamped to
    min/max) via `scale_deployment` (source "schedule"): whenever the desired replicas differ, they are
    set back. A manual scale that the rule would revert is refused (409 in the API, an error in the
    admin; `inference.actions.ScheduleConflict`) unless it asks for an override (below). When several
    schedule rules of a role are active, the one whose window started most recently wins. While a
    schedule rule holds a role, that role's threshold rules are paused (their breach timers reset), so
    the two never fight. When the window ends nothing is restored: the replicas stay where the schedule
    left them. To go back to a day-time value, add a second schedule rule for the rest of the day,
    e.g. "night" 22:00–07:00 decode = 1 and "day" 07:00–22:00 decode = 3.

Overrides (`ScaleOverride`)
    An operator's explicit count for a role with an end time (`override_until` / `override_minutes` on
    `POST /api/deployments/{id}/scale/`, or the admin). While one is active it holds the role at its
    replicas (set back like a schedule rule would) and the role's schedule and threshold rules are
    paused; when it ends, the rules take over again at their next evaluation.

Every change goes through `scale_deployment`, which records a ScaleEvent with the reason built here.
`evaluate_all()` runs every enabled rule; Celery beat calls it (inference.tasks.evaluate_scaling_rules).
"""
from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from inference import actions
from inference.models import (
    Comparison,
    Deployment,
    DeploymentStatus,
    RuleKind,
    ScaleEvent,
    ScaleOverride,
    ScaleSource,
    ScalingRule,
)
from inference.selectors import (  # noqa: F401  (in_window, local_time, minutes_since_start: this module's API)
    active_override,
    active_schedule_rule,
    in_window,
    local_time,
    minutes_since_start,
    window_text,
)
from nodes.models import Worker, WorkerStatus

logger = logging.getLogger(__name__)

LOAD_CAP = 1.0


# ----------------------------------------------------------------------------------------------- load
def worker_load(health: Mapping[str, object], batch_size: int) -> float | None:
    """One worker's load from its /health answer: (running + queue_depth) / batch_size, capped at LOAD_CAP."""
    try:
        demand = float(health.get("running", 0) or 0) + float(health.get("queue_depth", 0) or 0)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return min(LOAD_CAP, max(0.0, demand / max(1, batch_size)))


def role_load(deployment: Deployment, role: str, *, now: datetime | None = None) -> float | None:
    """Mean load of the role's RUNNING workers with a recent health report; None when there is none."""
    now = now or timezone.now()
    fresh_after = now - timedelta(seconds=float(settings.SCALING_HEALTH_MAX_AGE_S))
    healths = Worker.objects.filter(
        deployment=deployment, role=role, status=WorkerStatus.RUNNING, last_seen__gte=fresh_after
    ).values_list("last_health", flat=True)
    loads = [x for x in (worker_load(h or {}, deployment.batch_size) for h in healths) if x is not None]
    if not loads:
        return None
    return sum(loads) / len(loads)


# ------------------------------------------------------------------------------------------- schedules
def evaluate_schedule_rules(
    deployment: Deployment, role: str, rules: Sequence[ScalingRule], now: datetime
) -> tuple[ScalingRule | None, ScaleEvent | None]:
    """Hold the target of the active schedule rule (if any); returns (active rule, event recorded)."""
    rule = active_schedule_rule(rules, now)
    if rule is None or rule.target_replicas is None or rule.start_time is None or rule.end_time is None:
        return None, None
    low, high = deployment.bounds(role)
    target = min(max(rule.target_replicas, low), high)
    if deployment.replicas(role) == target:
        return rule, None
    reason = f"schedule rule '{rule.name}': {window_text(rule)} holds {role} replicas at {rule.target_replicas}"
    event = actions.scale_deployment(
        deployment, role, rule.target_replicas, source=str(ScaleSource.SCHEDULE), reason=reason, rule=rule
    )
    if event is not None:
        ScalingRule.objects.filter(pk=rule.pk).update(last_triggered_at=now)
        rule.last_triggered_at = now
    return rule, event


def hold_override(deployment: Deployment, role: str, override: ScaleOverride) -> ScaleEvent | None:
    """Keep the role at the override's replicas (set back if something else moved them)."""
    if deployment.replicas(role) == override.replicas:
        return None
    overridden = f", overriding schedule rule '{override.rule.name}'" if override.rule is not None else ""
    reason = (
        f"override #{override.pk} by {override.created_by or 'an operator'} holds {role} replicas at "
        f"{override.replicas} until {override.ends_at.isoformat(timespec='seconds')}{overridden}"
    )
    return actions.scale_deployment(deployment, role, override.replicas, source=override.source, reason=reason)


# ------------------------------------------------------------------------------------------ thresholds
def breached(rule: ScalingRule, load: float) -> bool:
    """Whether `load` is on the rule's wrong side of its threshold."""
    if rule.threshold is None:
        return False
    if rule.comparison == Comparison.BELOW:
        return load < rule.threshold
    return load > rule.threshold


def evaluate_threshold_rule(rule: ScalingRule, load: float | None, now: datetime) -> ScaleEvent | None:
    """Advance one threshold rule's breach timer with the current load; fire it when due (see module doc)."""
    deployment = rule.deployment
    if load is None or not breached(rule, load):
        if rule.breach_started_at is not None:
            ScalingRule.objects.filter(pk=rule.pk).update(breach_started_at=None)
            rule.breach_started_at = None
        return None
    if rule.breach_started_at is None:
        ScalingRule.objects.filter(pk=rule.pk).update(breach_started_at=now)
        rule.breach_started_at = now
    lasted = (now - rule.breach_started_at).total_seconds()
    if lasted < rule.duration_s:
        return None
    if rule.last_triggered_at is not None and (now - rule.last_triggered_at).total_seconds() < rule.cooldown_s:
        return None
    current = deployment.replicas(rule.role)
    word = "below" if rule.comparison == Comparison.BELOW else "above"
    reason = (
        f"threshold rule '{rule.name}': {rule.role} load {load:.2f} {word} {rule.threshold:g} "
        f"for {lasted:.0f}s (duration {rule.duration_s}s); step {rule.step:+d}"
    )
    event = actions.scale_deployment(
        deployment, rule.role, current + rule.step, source=str(ScaleSource.THRESHOLD), reason=reason, rule=rule
    )
    if event is not None:
        # The next step needs a fresh breach of `duration_s`, after the cooldown.
        ScalingRule.objects.filter(pk=rule.pk).update(last_triggered_at=now, breach_started_at=None)
        rule.last_triggered_at, rule.breach_started_at = now, None
    return event


# ---------------------------------------------------------------------------------------------- driver
def evaluate_deployment(deployment: Deployment, rules: Sequence[ScalingRule], now: datetime) -> list[ScaleEvent]:
    """Evaluate one deployment's enabled rules, role by role (schedules first: they pause thresholds)."""
    events: list[ScaleEvent] = []
    by_role: dict[str, list[ScalingRule]] = defaultdict(list)
    for rule in rules:
        by_role[rule.role].append(rule)
    for role, role_rules in sorted(by_role.items()):
        with transaction.atomic():
            # Lock the deployment's rules: two overlapping evaluations must not both fire one rule.
            locked = list(
                ScalingRule.objects.select_for_update().select_related("deployment")
                .filter(pk__in=[r.pk for r in role_rules], enabled=True).order_by("name")
            )
            deployment.refresh_from_db()
            for rule in locked:
                rule.deployment = deployment  # one instance, so a change by one rule is seen by the next
            thresholds = [r for r in locked if r.kind == RuleKind.THRESHOLD]
            override = active_override(deployment, role, now)
            if override is not None:
                # The operator's explicit count wins over every rule of the role until it ends.
                event = hold_override(deployment, role, override)
                holder: object = override
            else:
                holder, event = evaluate_schedule_rules(
                    deployment, role, [r for r in locked if r.kind == RuleKind.SCHEDULE], now
                )
            if event is not None:
                events.append(event)
            if holder is not None:
                for rule in thresholds:  # paused while the schedule holds the role
                    evaluate_threshold_rule(rule, None, now)
                continue
            if not thresholds:
                continue
            load = role_load(deployment, role, now=now)
            for rule in thresholds:
                event = evaluate_threshold_rule(rule, load, now)
                if event is not None:
                    events.append(event)
    return events


def evaluate_all(*, now: datetime | None = None) -> list[ScaleEvent]:
    """Evaluate every enabled rule of every active deployment; returns the ScaleEvents recorded."""
    now = now or timezone.now()
    rules = list(
        ScalingRule.objects.select_related("deployment")
        .filter(enabled=True, deployment__status=DeploymentStatus.ACTIVE)
        .order_by("deployment_id", "name")
    )
    per_deployment: dict[int, list[ScalingRule]] = defaultdict(list)
    deployments: dict[int, Deployment] = {}
    for rule in rules:
        per_deployment[rule.deployment_id].append(rule)
        deployments[rule.deployment_id] = rule.deployment
    events: list[ScaleEvent] = []
    for deployment_id, deployment_rules in per_deployment.items():
        try:
            events += evaluate_deployment(deployments[deployment_id], deployment_rules, now)
        except Exception:  # noqa: BLE001  one broken deployment must not stop the others' scaling
            logger.exception("evaluating the scaling rules of deployment #%s failed", deployment_id)
    return events
