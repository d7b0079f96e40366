"""Deployment saves: create, edit and delete, through the admin, the REST API and `bootstrap_demo`.

Every replica change a save makes (creation included, from 0) is a ScaleEvent; replica counts the
caller did not change keep their database value (an autoscale since the form was opened is not
reverted); an operator's edit that an active schedule rule would revert raises ScheduleConflict; a
reconcile is enqueued on commit. A deployment with live workers cannot be deleted.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from django.db import transaction

from inference import jobs
from inference.actions.scale import plan_manual_scale, validate_source
from inference.models import (
    ROLES,
    Deployment,
    ScaleEvent,
    ScaleSource,
    WorkerStatus,
)

logger = logging.getLogger(__name__)

# Deployment fields that a save must not silently revert when the caller did not change them:
# the autoscaler may have moved them between the caller's read and its save.
_REPLICA_FIELDS = {f"{role}_replicas" for role in ROLES}


class DeploymentInUse(Exception):
    """A deployment cannot be deleted while it still has live workers (they would be orphaned)."""


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
    validate_source(source)
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
        jobs.reconcile_on_commit(deployment.pk)
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


def create_deployment(*, source: str = "manual", **fields: Any) -> Deployment:
    """Create a deployment from model field values, validated (`full_clean`), with its ScaleEvents.

    `source`: who creates it (`bootstrap` for the quick start's demo deployment). Raises
    django.core.exceptions.ValidationError naming the fields at fault.
    """
    deployment = Deployment(**fields)
    deployment.full_clean()
    save_deployment(deployment, source=str(source), reason="deployment created")
    return deployment
