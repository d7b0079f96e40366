"""Celery tasks of the controller, on the default queue "control" (CELERY_TASK_DEFAULT_QUEUE).

Thin wrappers: the work is in inference.controller (reconcile, placement, heartbeats),
inference.scaling.rules, inference.metrics.collector and inference.actions (scale, prune).
Celery beat runs the periodic ones (`python manage.py setup_schedules` creates their PeriodicTasks).
"""
from __future__ import annotations

import logging
from typing import Any

from celery import Task, shared_task

from inference.actions import scale as scale_actions
from inference.actions import workers as worker_actions
from inference.controller import heartbeats, reconciler
from inference.metrics import collector, downsampling
from inference.models import Deployment
from inference.scaling import rules as scaling_rules

logger = logging.getLogger(__name__)


@shared_task(name="inference.tasks.reconcile_deployment", ignore_result=True)
def reconcile_deployment(*, deployment_id: int) -> dict[str, Any]:
    """Start missing and drain surplus workers of one deployment."""
    return reconciler.reconcile(deployment_id).as_dict()


@shared_task(name="inference.tasks.reconcile_all", ignore_result=True)
def reconcile_all() -> int:
    """Reconcile every deployment (periodic safety net for lost messages and offline nodes)."""
    return len(reconciler.reconcile_all())


# Its outcome (the ScaleEvent id, or the error) is stored by the task itself for GET /api/tasks/{id}/:
# jobs sends every task with ignore_result (a sender that asks for results subscribes to them, and Celery's
# Redis result consumer never recovers from a broker restart), which also stops Celery storing it.
@shared_task(name="inference.tasks.scale_deployment_task", bind=True, ignore_result=True)
def scale_deployment_task(
    self: Task, *, deployment_id: int, role: str, source: str, reason: str, replicas: int | None = None,
    delta: int | None = None,
) -> int | None:
    """Set a role's desired replicas to `replicas`, or change them by `delta` (read under the lock); clamped
    to min/max and recorded as a ScaleEvent. Returns the event id (None: nothing changed), also stored
    under the task's id with the error if it fails."""
    try:
        event_id = _scale(deployment_id=deployment_id, role=role, source=source, reason=reason,
                          replicas=replicas, delta=delta)
    except Exception as exc:
        if self.request.id:
            self.backend.mark_as_failure(self.request.id, exc)
        raise
    if self.request.id:
        self.backend.mark_as_done(self.request.id, event_id)
    return event_id


def _scale(
    *, deployment_id: int, role: str, source: str, reason: str, replicas: int | None, delta: int | None
) -> int | None:
    deployment = Deployment.objects.filter(pk=deployment_id).first()
    if deployment is None:
        logger.warning("scale_deployment_task: deployment #%s no longer exists", deployment_id)
        return None
    if delta is not None:
        event = scale_actions.scale_deployment_by(deployment, role, delta, source=source, reason=reason)
    elif replicas is not None:
        event = scale_actions.scale_deployment(deployment, role, replicas, source=source, reason=reason)
    else:
        logger.warning("scale_deployment_task for deployment #%s names neither replicas nor delta", deployment_id)
        return None
    return event.pk if event is not None else None


@shared_task(name="inference.tasks.evaluate_scaling_rules", ignore_result=True)
def evaluate_scaling_rules() -> int:
    """Evaluate threshold and schedule rules; returns how many scale events they recorded."""
    return len(scaling_rules.evaluate_all())


@shared_task(name="inference.tasks.collect_metrics", ignore_result=True)
def collect_metrics() -> int:
    """Scrape RUNNING workers and record per-role MetricSamples; returns how many samples."""
    return collector.collect()


@shared_task(name="inference.tasks.check_node_heartbeats", ignore_result=True)
def check_node_heartbeats() -> list[str]:
    """Mark silent nodes UNREACHABLE and probe their workers (only those that stop answering are
    re-placed); returns the names of the nodes newly unreachable."""
    return [node.name for node in heartbeats.check_node_heartbeats()]


@shared_task(name="inference.tasks.prune_workers", ignore_result=True)
def prune_workers() -> int:
    """Delete stopped/failed Worker rows older than WORKER_RETENTION_HOURS; returns how many."""
    return worker_actions.prune_stopped_workers()


@shared_task(name="inference.tasks.prune_metrics", ignore_result=True)
def prune_metrics() -> int:
    """Roll up the closed minutes and hours of per-worker samples, then delete samples and rollups past
    their retention (inference.metrics.downsampling); returns how many rows were deleted."""
    downsampling.downsample()
    return downsampling.prune()
