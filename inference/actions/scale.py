"""Replica changes: every change of a deployment's desired replicas, whoever asks for it.

`scale_deployment` (and `scale_deployment_by`) lock the deployment, clamp to the role's [min, max],
record a ScaleEvent and enqueue a reconcile on commit: the scaling rules, the controller's tasks and
the deployment saves all go through it. An operator's manual scale (admin action or
`POST /api/deployments/{id}/scale/`) goes through `request_manual_scale`: checked against the schedule
rules (`plan_manual_scale`: refused with ScheduleConflict unless it asks for an override), then queued
for the controller (inference.tasks.scale_deployment_task), which applies it with `scale_deployment`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import transaction
from django.utils import timezone

from inference import jobs
from inference.models import (
    Deployment,
    ScaleEvent,
    ScaleOverride,
    ScaleSource,
    ScalingRule,
    validate_role,
)
from inference.selectors.schedules import active_override, schedule_rule_holding, window_text

logger = logging.getLogger(__name__)

def validate_source(source: str) -> str:
    """Return `source` if it is a ScaleSource value, else raise ValueError naming the valid ones."""
    if source not in ScaleSource.values:
        raise ValueError(f"source must be one of {', '.join(ScaleSource.values)}, got {source!r}")
    return source


def scale_deployment(
    deployment: Deployment,
    role: str,
    replicas: int,
    *,
    source: str,
    reason: str,
    rule: ScalingRule | None = None,
) -> ScaleEvent | None:
    """Set a role's desired replicas, clamped to the deployment's [min, max] for that role.

    Returns the ScaleEvent recorded, or None when the (clamped) count equals the current one, in
    which case nothing is written. The row is locked while it is read and written so concurrent
    scalers (rules, admin, API) each see the other's result; a reconcile is enqueued on commit.
    """
    validate_role(role)
    validate_source(source)
    field = f"{role}_replicas"
    with transaction.atomic():
        locked = Deployment.objects.select_for_update().get(pk=deployment.pk)
        low, high = locked.bounds(role)
        target = min(max(int(replicas), low), high)
        current = locked.replicas(role)
        # Keep the caller's instance in step with the database either way.
        setattr(deployment, field, current)
        if target == current:
            return None
        setattr(locked, field, target)
        locked.save(update_fields=[field, "updated_at"])
        text = reason.strip() or f"{source} scale"
        if target != replicas:
            text += f" (requested {replicas}, clamped to {target} by {role} bounds [{low}, {high}])"
        event = ScaleEvent.objects.create(
            deployment=locked,
            role=role,
            from_replicas=current,
            to_replicas=target,
            source=source,
            rule=rule,
            reason=text,
        )
        jobs.reconcile_on_commit(locked.pk)
    setattr(deployment, field, target)
    deployment.updated_at = locked.updated_at
    logger.info("scaled %s %s %s -> %s (%s): %s", locked.name, role, current, target, source, text)
    return event


def scale_deployment_by(
    deployment: Deployment,
    role: str,
    delta: int,
    *,
    source: str,
    reason: str,
    rule: ScalingRule | None = None,
) -> ScaleEvent | None:
    """Add `delta` (may be negative) to a role's desired replicas, reading the count under the lock.

    Unlike `scale_deployment(d, role, d.replicas(role) + delta)`, the base count is the one in the
    database, not a possibly stale instance's.
    """
    validate_role(role)
    with transaction.atomic():
        current = Deployment.objects.select_for_update().get(pk=deployment.pk).replicas(role)
        return scale_deployment(deployment, role, current + delta, source=source, reason=reason, rule=rule)


# The longest override a manual scale may ask for: past a week, disabling the rule says it better.
MAX_OVERRIDE = timedelta(days=7)


class ScheduleConflict(Exception):
    """A manual scale that an active schedule rule would revert at its next evaluation.

    Carries the rule, so the API (409) and the admin can name it and say how to override it. `requested`
    is the count asked for, `held` the rule's (both within the role's bounds).
    """

    def __init__(self, rule: ScalingRule, role: str, requested: int, held: int) -> None:
        self.rule, self.role, self.requested, self.held = rule, role, requested, held
        super().__init__(
            f"schedule rule '{rule.name}' ({window_text(rule)}) holds {role} replicas at {held}; a manual "
            f"scale to {requested} would be reverted at its next evaluation. Ask for an override with an "
            "end time (override_until or override_minutes), or disable the rule."
        )


class ReplicasOutOfBounds(ValueError):
    """A manual scale to a count outside the role's [min, max]: refused rather than clamped silently."""

    def __init__(self, role: str, requested: int, low: int, high: int) -> None:
        self.role, self.requested, self.low, self.high = role, requested, low, high
        super().__init__(
            f"{role} replicas must be within the deployment's {role} bounds [{low}, {high}], got {requested}; "
            f"change {role}_min / {role}_max on the deployment first"
        )


def plan_manual_scale(
    deployment: Deployment,
    role: str,
    replicas: int,
    *,
    source: str,
    actor: str,
    reason: str = "",
    override_until: datetime | None = None,
    now: datetime | None = None,
) -> ScaleOverride | None:
    """Decide whether a manual scale of `role` to `replicas` may go ahead; record an override if asked.

    Call inside the transaction that applies (or queues) the scale, so a refused scale leaves nothing.
    - An active override of the role takes the new count (and `override_until`, if given): the
      operator's explicit intent continues rather than being set back by the override itself.
    - `override_until` given: a ScaleOverride holds the role at the (clamped) count until then,
      naming the schedule rule it overrides (if one holds the role now).
    - Else, an active schedule rule whose (clamped) target differs from the (clamped) request raises
      ScheduleConflict: the rule would silently revert the change at its next evaluation.
    Returns the override in force for the role after the call, or None.
    """
    validate_role(role)
    validate_source(source)
    now = now or timezone.now()
    if override_until is not None and not now < override_until <= now + MAX_OVERRIDE:
        raise ValueError(f"override_until must be in the future and at most {MAX_OVERRIDE.days} days ahead")
    locked = Deployment.objects.select_for_update().get(pk=deployment.pk)
    low, high = locked.bounds(role)
    target = min(max(int(replicas), low), high)
    override = active_override(locked, role, now)
    if override is not None:
        override.replicas = target
        override.ends_at = override_until or override.ends_at
        override.save(update_fields=["replicas", "ends_at"])
        return override
    rule = schedule_rule_holding(locked, role, now)
    if override_until is not None:
        return ScaleOverride.objects.create(
            deployment=locked, role=role, replicas=target, ends_at=override_until, rule=rule,
            source=source, created_by=actor, reason=reason.strip(),
        )  # fmt: skip
    conflict = _conflict_with(rule, locked, role, target)
    if conflict is not None:
        raise conflict
    return None


def _conflict_with(rule: ScalingRule | None, deployment: Deployment, role: str, target: int) -> ScheduleConflict | None:
    """The conflict between a schedule rule holding `role` and a manual count `target` (both clamped)."""
    if rule is None or rule.target_replicas is None:
        return None
    low, high = deployment.bounds(role)
    held = min(max(rule.target_replicas, low), high)
    return ScheduleConflict(rule, role, target, held) if held != target else None


def replica_edit_conflict(deployment: Deployment, role: str, replicas: int,
                          now: datetime | None = None) -> ScheduleConflict | None:
    """The conflict an edit of `role`'s replica count to `replicas` would meet, or None (read-only).

    None when an override is active for the role (the edit continues the operator's intent) or no
    schedule rule holds it; used by the admin form to refuse the edit before saving.
    """
    now = now or timezone.now()
    if deployment.pk is None or active_override(deployment, role, now) is not None:
        return None
    low, high = deployment.bounds(role)
    target = min(max(int(replicas), low), high)
    return _conflict_with(schedule_rule_holding(deployment, role, now), deployment, role, target)


def override_note(override: ScaleOverride | None) -> str:
    """What a ScaleEvent's reason says about the override a manual scale made or continued."""
    if override is None:
        return ""
    overridden = f" of schedule rule '{override.rule.name}'" if override.rule is not None else ""
    return f" (override #{override.pk}{overridden} until {override.ends_at.isoformat(timespec='seconds')})"


@dataclass(frozen=True)
class ScaleRequest:
    """A manual scale queued for the controller: the role's count now and the (clamped) count asked for."""

    role: str
    current: int
    target: int
    task_id: str
    override: ScaleOverride | None

    @property
    def changes(self) -> bool:
        """Whether the controller will change anything (False: the bounds keep the count where it is)."""
        return self.target != self.current


def request_manual_scale(
    deployment: Deployment,
    role: str,
    *,
    replicas: int | None = None,
    delta: int | None = None,
    source: str,
    actor: str,
    reason: str,
    override_until: datetime | None = None,
    now: datetime | None = None,
) -> ScaleRequest:
    """An operator's scale of `role` (to `replicas`, or by `delta`), checked now and queued for the controller.

    The admin's actions and `POST /api/deployments/{id}/scale/` both go through here. A `replicas` outside
    the role's [min, max] raises ReplicasOutOfBounds (a `delta` past a bound stops at it). In one transaction:
    the scale is checked against the schedule rules (`plan_manual_scale`: ScheduleConflict, nothing
    changed, unless `override_until` asks for an override, which is recorded) and
    inference.tasks.scale_deployment_task is sent (`jobs.send`); the controller applies it with
    `scale_deployment`, which clamps and records the ScaleEvent. A `delta` is applied to the count the
    task reads under its lock, so two quick "+1" are two more replicas. Raises jobs.JobNotQueued (and
    rolls back the override) when the broker does not take the message.
    """
    if (replicas is None) == (delta is None):
        raise ValueError("give either replicas or delta")
    validate_role(role)
    with transaction.atomic():
        locked = Deployment.objects.select_for_update().get(pk=deployment.pk)
        current = locked.replicas(role)
        low, high = locked.bounds(role)
        if replicas is not None and not low <= int(replicas) <= high:
            raise ReplicasOutOfBounds(role, int(replicas), low, high)
        wanted = int(replicas) if replicas is not None else current + int(delta or 0)
        override = plan_manual_scale(
            locked, role, wanted, source=source, actor=actor, reason=reason, override_until=override_until, now=now,
        )  # fmt: skip
        kwargs: dict[str, Any] = {
            "deployment_id": locked.pk, "role": role, "source": source, "reason": reason + override_note(override),
        }  # fmt: skip
        if delta is not None:
            kwargs["delta"] = int(delta)
        else:
            kwargs["replicas"] = int(wanted)
        task_id = jobs.send(jobs.SCALE_DEPLOYMENT, **kwargs)
    return ScaleRequest(role, current, min(max(wanted, low), high), task_id, override)
