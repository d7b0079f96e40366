"""Scaling rules: threshold and SLO rules react to readings over a window, schedule rules hold replicas.

Readings (inference.scaling.signals)
    Threshold rules read the role's load: decode `(running + queue_depth) / batch_size`; prefill the
    largest of its batch fill, its busy ratio and its queueing wait (pending prompt tokens over the
    tokens/s it sustains, against SCALING_PREFILL_WAIT_TARGET_S), each capped at 1.0 and averaged over
    the role's workers. The guide's rules "prefill load > 0.8 → add prefill", "decode load > 0.7 → add
    decode" are threshold rules on this number. SLO rules read the p90 of TTFT (seconds; the rule adds
    prefill workers) or ITL (milliseconds; it adds decode workers) over the decode workers' last 30 s.

Threshold and SLO rules (`evaluate_windowed_rule`)
    Each evaluation appends the rule's reading (None when no worker reported) to its window
    (`ScalingRule.observations`) and judges the window of `duration_s` as a whole
    (inference.scaling.window: at least SCALING_WINDOW_SHARE of the readings breach, and the readings
    cover the window), so one missing or dissenting reading does not reset a sustained breach.
    `breach_started_at` shows the first breaching reading of a window that breaches but is not full
    yet. Firing adds `step` (negative removes) to the desired replicas via
    `inference.actions.scale.scale_deployment` (source "threshold" or "slo"), which clamps to the
    deployment's min/max; at the bound nothing changes and no event is recorded. After firing the
    rule waits `cooldown_s` (from `last_triggered_at`), and its window restarts: the next step needs a
    fresh `duration_s` of readings with the new workers (so does every rule of a role after any change
    of its replicas, whoever made it).

Schedule rules (`evaluate_schedule_rules`)
    Inside `[start_time, end_time)` in settings.TIME_ZONE (the window wraps midnight when end < start,
    e.g. 22:00–07:00; start == end is an empty window) the rule holds `target_replicas` (clamped to
    min/max) via `scale_deployment` (source "schedule"): whenever the desired replicas differ, they are
    set back. A manual scale that the rule would revert is refused (409 in the API, an error in the
    admin; `inference.actions.scale.ScheduleConflict`) unless it asks for an override (below). When several
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
from collections.abc import Sequence
from datetime import datetime

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from inference.actions import scale as scale_actions
from inference.models import (
    SLO_ROLES,
    Comparison,
    Deployment,
    DeploymentStatus,
    RuleKind,
    ScaleEvent,
    ScaleOverride,
    ScaleSource,
    ScalingRule,
)
from inference.scaling.signals import role_latency_p90, role_load
from inference.scaling.window import dump_readings, judge, keep_recent, load_readings
from inference.selectors.schedules import active_override, active_schedule_rule, window_text

logger = logging.getLogger(__name__)

WINDOWED_KINDS = (RuleKind.THRESHOLD, RuleKind.TTFT_SLO, RuleKind.ITL_SLO)
# Sources that change a role's desired replicas: after one, every rule of the role starts a fresh window.
CHANGE_SOURCES = (ScaleSource.MANUAL, ScaleSource.API, ScaleSource.THRESHOLD, ScaleSource.SCHEDULE, ScaleSource.SLO)


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
    event = scale_actions.scale_deployment(
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
    return scale_actions.scale_deployment(deployment, role, override.replicas, source=override.source, reason=reason)


# ------------------------------------------------------------------------------------------ windows
def breached(rule: ScalingRule, value: float) -> bool:
    """Whether a reading is on the rule's wrong side of its threshold (SLO rules: above the target)."""
    if rule.threshold is None:
        return False
    if rule.kind == RuleKind.THRESHOLD and rule.comparison == Comparison.BELOW:
        return value < rule.threshold
    return value > rule.threshold


def reading(rule: ScalingRule, deployment: Deployment, now: datetime) -> float | None:
    """The rule's current reading in its own unit: load, TTFT p90 in s, ITL p90 in ms (None: no data)."""
    if rule.kind == RuleKind.TTFT_SLO:
        return role_latency_p90(deployment, "ttft", now=now)
    if rule.kind == RuleKind.ITL_SLO:
        itl = role_latency_p90(deployment, "itl", now=now)
        return itl * 1000.0 if itl is not None else None
    return role_load(deployment, rule.role, now=now)


def _save_window(rule: ScalingRule, **fields: object) -> None:
    ScalingRule.objects.filter(pk=rule.pk).update(**fields)
    for name, value in fields.items():
        setattr(rule, name, value)


def pause_rule(rule: ScalingRule) -> None:
    """A schedule or override holds the role: forget the window (it restarts when the hold ends)."""
    if rule.observations or rule.breach_started_at is not None:
        _save_window(rule, observations=[], breach_started_at=None)


def _describe(rule: ScalingRule, value: float | None) -> str:
    shown = "none" if value is None else f"{value:.2f}"
    if rule.kind == RuleKind.TTFT_SLO:
        return f"SLO rule '{rule.name}': TTFT p90 {shown}s above the {rule.threshold:g}s target"
    if rule.kind == RuleKind.ITL_SLO:
        return f"SLO rule '{rule.name}': ITL p90 {shown}ms above the {rule.threshold:g}ms target"
    word = "below" if rule.comparison == Comparison.BELOW else "above"
    return f"threshold rule '{rule.name}': {rule.role} load {shown} {word} {rule.threshold:g}"


def evaluate_windowed_rule(
    rule: ScalingRule, value: float | None, now: datetime, *, since: datetime | None = None
) -> ScaleEvent | None:
    """Add the reading to the rule's window, judge the window, fire when due (see module doc).

    `since`: the role's last replica change; readings before it do not count.
    """
    gap_s = float(settings.SCALING_WINDOW_GAP_S)
    readings = keep_recent(load_readings(rule.observations) + [(now, value)], now=now, keep_s=rule.duration_s)
    bounds = [b for b in (since, rule.last_triggered_at) if b is not None]
    verdict = judge(
        readings, now=now, duration_s=rule.duration_s, after=max(bounds) if bounds else None,
        breached=lambda v: breached(rule, v), share=float(settings.SCALING_WINDOW_SHARE), gap_s=gap_s,
    )
    _save_window(rule, observations=dump_readings(readings),
                 breach_started_at=verdict.first_breach_at if verdict.breaches else None)
    if not verdict.fires:
        return None
    if rule.last_triggered_at is not None and (now - rule.last_triggered_at).total_seconds() < rule.cooldown_s:
        return None
    deployment = rule.deployment
    reason = (
        f"{_describe(rule, value)} over {rule.duration_s}s ({verdict.describe()} breaching); step {rule.step:+d}"
    )
    source = ScaleSource.SLO if rule.kind in SLO_ROLES else ScaleSource.THRESHOLD
    event = scale_actions.scale_deployment(
        deployment, rule.role, deployment.replicas(rule.role) + rule.step, source=str(source), reason=reason,
        rule=rule,
    )
    if event is not None:
        # The next step needs a fresh window of readings with the new workers, after the cooldown.
        _save_window(rule, last_triggered_at=now, breach_started_at=None)
    return event


def last_change(deployment: Deployment, role: str, now: datetime) -> datetime | None:
    """When the role's desired replicas last changed before `now` (its latest ScaleEvent from a scaler)."""
    return (
        ScaleEvent.objects.filter(
            deployment=deployment, role=role, source__in=CHANGE_SOURCES, refused=False, created_at__lte=now
        )
        .order_by("-created_at").values_list("created_at", flat=True).first()
    )


# ---------------------------------------------------------------------------------------------- driver
def evaluate_deployment(deployment: Deployment, rules: Sequence[ScalingRule], now: datetime) -> list[ScaleEvent]:
    """Evaluate one deployment's enabled rules, role by role (schedules first: they pause the others)."""
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
            windowed = [r for r in locked if r.kind in WINDOWED_KINDS]
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
                for rule in windowed:  # paused while the schedule or override holds the role
                    pause_rule(rule)
                continue
            since = last_change(deployment, role, now) if windowed else None
            for rule in windowed:
                event = evaluate_windowed_rule(rule, reading(rule, deployment, now), now, since=since)
                if event is not None:
                    events.append(event)
                    since = now  # the next rule of the role judges readings with the new count only
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
