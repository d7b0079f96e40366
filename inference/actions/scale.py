"""State changes of the inference app: scaling, deployment and rule saves, metric samples.

The admin, the REST API, Celery tasks and consumers call these functions instead of saving models
themselves, so that every replica change is locked, bounded, recorded as a ScaleEvent and followed
by a reconcile of the deployment, whoever asked for it. Reads (metric series, who holds a role's
replicas) are in inference.selectors.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from inference.models import (
    Deployment,
    MetricSample,
    RouterSample,
    ScaleEvent,
    ScaleOverride,
    ScaleSource,
    ScalingRule,
    WorkerRole,
    WorkerSample,
    WorkerStatus,
)

logger = logging.getLogger(__name__)

ROLES: tuple[str, ...] = tuple(WorkerRole.values)

# Deployment fields that a save must not silently revert when the caller did not change them:
# the autoscaler may have moved them between the caller's read and its save.
_REPLICA_FIELDS = {f"{role}_replicas" for role in ROLES}


class DeploymentInUse(Exception):
    """A deployment cannot be deleted while it still has live workers (they would be orphaned)."""


def validate_role(role: str) -> str:
    """Return `role` if it is a worker role, else raise ValueError naming the valid ones."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    return role


def _validate_source(source: str) -> str:
    if source not in ScaleSource.values:
        raise ValueError(f"source must be one of {', '.join(ScaleSource.values)}, got {source!r}")
    return source


def _enqueue_reconcile(deployment_id: int) -> None:
    """Ask the controller to reconcile a deployment's workers with its desired replicas.

    Runs after the commit so the controller reads the new desired counts. The task module belongs
    to the controller; it is imported here, lazily, so that this module imports without it.
    """
    try:
        from inference.tasks import reconcile_deployment
    except ModuleNotFoundError as exc:
        if exc.name not in {"inference.tasks"}:
            raise  # a broken import inside inference.tasks must surface, not be mistaken for absence
        logger.warning(
            "inference.tasks is not installed: deployment %s was saved but no reconcile was enqueued",
            deployment_id,
        )
        return
    try:
        reconcile_deployment.delay(deployment_id=deployment_id)
    except Exception:
        # The desired state is committed; a broker outage must not turn a saved change into an
        # error page. The controller's periodic reconcile picks the change up later.
        logger.exception("could not enqueue reconcile_deployment for deployment %s", deployment_id)


def _on_commit_reconcile(deployment_id: int) -> None:
    transaction.on_commit(lambda: _enqueue_reconcile(deployment_id))


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
    _validate_source(source)
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
        _on_commit_reconcile(locked.pk)
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

    Carries the rule, so the API (409) and the admin can name it and say how to override it.
    """

    def __init__(self, rule: ScalingRule, role: str, requested: int, held: int) -> None:
        from inference.selectors import window_text  # selectors imports this module's models only

        self.rule, self.role, self.requested, self.held = rule, role, requested, held
        super().__init__(
            f"schedule rule '{rule.name}' ({window_text(rule)}) holds {role} replicas at {held}; a manual "
            f"scale to {requested} would be reverted at its next evaluation. Ask for an override with an "
            "end time (override_until or override_minutes), or disable the rule."
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
    from inference.selectors import active_override, schedule_rule_holding

    validate_role(role)
    _validate_source(source)
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
    from inference.selectors import active_override, schedule_rule_holding

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


def manual_scale_by(
    deployment: Deployment,
    role: str,
    delta: int,
    *,
    source: str,
    actor: str,
    reason: str,
    override_until: datetime | None = None,
    now: datetime | None = None,
) -> ScaleEvent | None:
    """An operator's "one more / one fewer" (the admin actions), refused if a schedule rule would revert it.

    Raises ScheduleConflict (nothing changed) unless `override_until` asks for an override.
    """
    with transaction.atomic():
        current = Deployment.objects.select_for_update().get(pk=deployment.pk).replicas(role)
        override = plan_manual_scale(
            deployment, role, current + delta, source=source, actor=actor, reason=reason,
            override_until=override_until, now=now,
        )  # fmt: skip
        return scale_deployment(
            deployment, role, current + delta, source=source, reason=reason + override_note(override)
        )


def save_deployment(
    deployment: Deployment,
    *,
    changed_fields: Iterable[str] | None = None,
    source: str = "manual",
    reason: str = "",
) -> list[ScaleEvent]:
    """Create or update a deployment (already validated by its form or serializer).

    `changed_fields` names the fields the caller meant to change (None: all of them). Replica counts
    the caller did not change keep their current database value, so an admin form opened before an
    autoscale does not revert it; a replica count outside new min/max bounds is clamped into them.
    Every replica change, creation included (from 0), is recorded as a ScaleEvent, and a reconcile
    is enqueued on commit. Returns the events recorded. An operator's edit (source manual or api) of
    a replica count that an active schedule rule holds elsewhere raises ScheduleConflict and saves
    nothing (the rule would silently revert it); an active override takes the new count instead.
    """
    _validate_source(source)
    changed = None if changed_fields is None else set(changed_fields)
    events: list[ScaleEvent] = []
    with transaction.atomic():
        before: dict[str, int] = {role: 0 for role in ROLES}
        creating = deployment.pk is None
        if not creating:
            locked = Deployment.objects.select_for_update().get(pk=deployment.pk)
            before = {role: locked.replicas(role) for role in ROLES}
            for field in _REPLICA_FIELDS:
                if changed is not None and field not in changed:
                    setattr(deployment, field, getattr(locked, field))
        notes: dict[str, str] = {}
        for role in ROLES:
            low, high = deployment.bounds(role)
            want = deployment.replicas(role)
            if not low <= want <= high:
                clamped = min(max(want, low), high)
                notes[role] = f" (clamped {want} to {clamped} by {role} bounds [{low}, {high}])"
                setattr(deployment, f"{role}_replicas", clamped)
        if not creating and source in (ScaleSource.MANUAL, ScaleSource.API):
            for role in ROLES:
                if deployment.replicas(role) != before[role]:
                    plan_manual_scale(deployment, role, deployment.replicas(role), source=source, actor="",
                                      reason=reason)
        deployment.save()
        base = reason.strip() or ("deployment created" if creating else "deployment edited")
        for role in ROLES:
            after = deployment.replicas(role)
            if after != before[role]:
                events.append(
                    ScaleEvent.objects.create(
                        deployment=deployment,
                        role=role,
                        from_replicas=before[role],
                        to_replicas=after,
                        source=source,
                        reason=base + notes.get(role, ""),
                    )
                )
        # Any saved change (replicas, flags, status) may need workers started, restarted or stopped.
        _on_commit_reconcile(deployment.pk)
    return events


def live_worker_count(deployment: Deployment) -> int:
    """Workers of the deployment that are not stopped or failed (they own processes on nodes)."""
    return int(deployment.workers.exclude(status__in=[WorkerStatus.STOPPED, WorkerStatus.FAILED]).count())


def delete_deployment(deployment: Deployment) -> None:
    """Delete a deployment that has no live workers; raise DeploymentInUse otherwise.

    Deleting the rows of running workers would leave their processes running with nobody to stop
    them, so a deployment is stopped (status "stopped", the controller drains its workers) first.
    """
    with transaction.atomic():
        locked = Deployment.objects.select_for_update().get(pk=deployment.pk)
        live = live_worker_count(locked)
        if live:
            raise DeploymentInUse(
                f"deployment {locked.name} still has {live} live worker(s); set its status to stopped "
                "and wait for the workers to stop before deleting it"
            )
        locked.delete()


# Fields whose change makes a threshold rule's ongoing breach meaningless.
_RULE_CONDITION_FIELDS = {"kind", "role", "threshold", "comparison", "duration_s", "enabled", "deployment"}


def save_rule(rule: ScalingRule, *, changed_fields: Iterable[str] | None = None) -> ScalingRule:
    """Create or update a scaling rule (already validated with its `clean()`).

    When the rule's condition changes, its breach timer restarts: a breach measured against the
    old threshold must not trigger the new rule early.
    """
    changed = None if changed_fields is None else set(changed_fields)
    if rule.pk is not None and (changed is None or changed & _RULE_CONDITION_FIELDS):
        rule.breach_started_at = None
        rule.observations = []  # its window too (a changed kind reads another unit)
    rule.save()
    return rule


def update_rule(rule: ScalingRule, changes: Mapping[str, Any]) -> ScalingRule:
    """Apply `changes` to a rule, validate it (model `clean()` included) and save it.

    Raises django.core.exceptions.ValidationError naming the fields at fault.
    """
    for field, value in changes.items():
        setattr(rule, field, value)
    rule.full_clean()
    return save_rule(rule, changed_fields=changes.keys())


def create_deployment(**fields: Any) -> Deployment:
    """Create a deployment from model field values, validated (`full_clean`), with its ScaleEvents.

    Raises django.core.exceptions.ValidationError naming the fields at fault.
    """
    deployment = Deployment(**fields)
    deployment.full_clean()
    save_deployment(deployment, source="manual", reason="deployment created")
    return deployment


def record_metric_sample(
    deployment: Deployment | int,
    role: str,
    *,
    at: datetime | None = None,
    workers: int = 0,
    load: float = 0.0,
    ttft_s: float | None = None,
    itl_s: float | None = None,
    throughput_tps: float = 0.0,
    queue_depth: float = 0.0,
    running: float = 0.0,
    kv_usage: float = 0.0,
    cpu_utilization: float | None = None,
    gpu_utilization: float | None = None,
    rss_bytes: int | None = None,
    gpu_memory_bytes: int | None = None,
    kv_transfer_bytes_per_s: float | None = None,
    kv_transfer_s: float | None = None,
    prefix_cache_hit_ratio: float | None = None,
) -> MetricSample:
    """Store one role-level metrics sample of a deployment (timestamped now unless `at` is given)."""
    validate_role(role)
    deployment_id = deployment if isinstance(deployment, int) else deployment.pk
    return MetricSample.objects.create(
        deployment_id=deployment_id,
        role=role,
        at=at or timezone.now(),
        workers=workers,
        load=load,
        ttft_s=ttft_s,
        itl_s=itl_s,
        throughput_tps=throughput_tps,
        queue_depth=queue_depth,
        running=running,
        kv_usage=kv_usage,
        cpu_utilization=cpu_utilization,
        gpu_utilization=gpu_utilization,
        rss_bytes=rss_bytes,
        gpu_memory_bytes=gpu_memory_bytes,
        kv_transfer_bytes_per_s=kv_transfer_bytes_per_s,
        kv_transfer_s=kv_transfer_s,
        prefix_cache_hit_ratio=prefix_cache_hit_ratio,
    )


def record_worker_samples(samples: Iterable[WorkerSample]) -> int:
    """Store per-worker samples (built by the collector) in one statement; returns how many."""
    rows = list(samples)
    for row in rows:
        validate_role(row.role)
    WorkerSample.objects.bulk_create(rows)
    return len(rows)


def record_router_sample(sample: RouterSample) -> RouterSample:
    """Store one router sample (built by the collector)."""
    sample.save()
    return sample


def prune_metric_samples(older_than: timedelta | None = None) -> int:
    """Delete metric samples (per role, per worker, router) older than `older_than` (default:
    settings.METRICS_RETENTION_HOURS).

    Returns how many were deleted. The sample models have no dependants: one DELETE statement each.
    """
    if older_than is None:
        older_than = timedelta(hours=settings.METRICS_RETENTION_HOURS)
    cutoff = timezone.now() - older_than
    deleted = 0
    for model in (MetricSample, WorkerSample, RouterSample):
        count, _ = model.objects.filter(at__lt=cutoff).delete()
        deleted += int(count)
    return deleted
