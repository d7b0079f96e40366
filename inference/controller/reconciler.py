"""The controller: keeps each deployment's workers in line with its desired replicas, and places them.

`reconcile(deployment)` compares, per role, the desired replicas (0 for a stopped deployment) with the
role's *active* workers (PENDING, STARTING, RUNNING, UNHEALTHY; DRAINING and later no longer count):
- missing replicas: `place_worker` creates a PENDING Worker on a node that fits and, on commit, the
  node's agent gets `start_worker` on its queue `node.<name>`;
- surplus replicas: removed in this order: UNHEALTHY first, then not yet serving (PENDING, STARTING),
  then RUNNING ones, least loaded first; RUNNING ones drain (`stop_worker(drain=True)`: no new requests,
  stopped once idle), the others stop at once;
- workers left on an OFFLINE node are given up (STOPPED) and re-placed; workers of an UNREACHABLE node
  (its agent silent) still count: they serve while their /health answers (`check_node_heartbeats`);
- PENDING workers whose agent did not pick them up within CONTROLLER_PENDING_RESEND_S get their start
  request again (agents also pick up their PENDING workers by themselves, see inference.agent.supervisor).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from inference.actions import recovery
from inference.actions import workers as worker_actions
from inference.controller.placement import (
    live_workers_by_node,
    place_worker_explained,
    placement_cause,
    record_replacement,
    record_unplaced,
)
from inference.models import (
    ACTIVE_WORKER_STATUSES,
    ROLES,
    Deployment,
    DeploymentStatus,
    Worker,
    WorkerStatus,
)
from nodes.models import NodeStatus

logger = logging.getLogger(__name__)

# Order in which surplus workers are removed (lower first).
_REMOVAL_RANK = {
    WorkerStatus.UNHEALTHY: 0,
    WorkerStatus.PENDING: 1,
    WorkerStatus.STARTING: 2,
    WorkerStatus.RUNNING: 3,
}


@dataclass
class ReconcileResult:
    """What one reconcile did, per role."""

    deployment_id: int
    started: list[int] = field(default_factory=list)
    draining: list[int] = field(default_factory=list)
    stopped: list[int] = field(default_factory=list)
    unplaced: dict[str, int] = field(default_factory=dict)
    resent: list[int] = field(default_factory=list)
    refused_events: list[int] = field(default_factory=list)  # ScaleEvents recording unplaced workers

    def as_dict(self) -> dict[str, Any]:
        """JSON-safe form (the task's result and log line)."""
        return {
            "deployment_id": self.deployment_id,
            "started": self.started,
            "draining": self.draining,
            "stopped": self.stopped,
            "unplaced": self.unplaced,
            "resent": self.resent,
            "refused_events": self.refused_events,
        }


def _removal_key(worker: Worker) -> tuple[int, int, float, int]:
    health = worker.last_health or {}
    try:
        busy = float(health.get("running", 0)) + float(health.get("queue_depth", 0))
    except (TypeError, ValueError):
        busy = 0.0
    on_draining_node = 0 if worker.node.status != NodeStatus.ONLINE else 1
    return _REMOVAL_RANK.get(WorkerStatus(worker.status), 9), on_draining_node, busy, -worker.pk


def reconcile(deployment: Deployment | int, *, now: datetime | None = None) -> ReconcileResult:
    """Start missing and drain surplus workers of one deployment (see the module docstring)."""
    deployment_id = deployment if isinstance(deployment, int) else deployment.pk
    now = now or timezone.now()
    result = ReconcileResult(deployment_id=deployment_id)
    resend_before = now - timedelta(seconds=float(settings.CONTROLLER_PENDING_RESEND_S))
    with transaction.atomic():
        # One reconcile per deployment at a time (PostgreSQL row lock; SQLite serialises writers anyway).
        locked = Deployment.objects.select_for_update().filter(pk=deployment_id).first()
        if locked is None:
            return result
        for role in ROLES:
            desired = locked.replicas(role) if locked.status == DeploymentStatus.ACTIVE else 0
            workers = list(
                Worker.objects.select_related("node")
                .filter(deployment=locked, role=role, status__in=ACTIVE_WORKER_STATUSES)
                .order_by("pk")
            )
            lost = [w for w in workers if w.node.status == NodeStatus.OFFLINE]
            if lost:
                # mark_node_offline normally did this; a node set OFFLINE by hand leaves them here.
                Worker.objects.filter(pk__in=[w.pk for w in lost]).update(
                    status=WorkerStatus.STOPPED, last_error="node offline; re-placed", updated_at=now
                )
                result.stopped += [w.pk for w in lost]
                workers = [w for w in workers if w not in lost]
                nodes = ", ".join(sorted({w.node.name for w in lost}))
                recovery.record_recovery(
                    locked.pk, role, removed=len(lost),
                    reason=f"failover: node {nodes} offline; {len(lost)} {role} worker(s) "
                           f"({', '.join(f'#{w.pk}' for w in lost)}) stopped, replacements placed on other nodes",
                )
            if len(workers) < desired:
                placed = 0
                cause = placement_cause(locked, role)
                live = live_workers_by_node()  # read once for all the workers placed here
                for _ in range(desired - len(workers)):
                    worker, plan = place_worker_explained(locked, role, now=now, live=live)
                    if worker is None:
                        # Nothing changes until a node frees up: the rest would be refused for the same reason.
                        result.unplaced[role] = desired - len(workers) - placed
                        event = record_unplaced(locked, role, active=len(workers) + placed, desired=desired,
                                                plan=plan, cause=cause, now=now)
                        if event is not None:
                            result.refused_events.append(event.pk)
                        break
                    worker_actions.request_start(worker)
                    result.started.append(worker.pk)
                    placed += 1
                    if cause is None:
                        cause = record_replacement(locked, role, worker, active=len(workers), desired=desired)
                    if cause is not None:
                        cause.placed_workers.add(worker)
            elif len(workers) > desired:
                for worker in sorted(workers, key=_removal_key)[: len(workers) - desired]:
                    drain = worker.status == WorkerStatus.RUNNING
                    worker_actions.request_stop(worker, drain=drain, reason=f"scale-down: {role} replicas → {desired}")
                    (result.draining if drain else result.stopped).append(worker.pk)
                workers = [w for w in workers if w.pk not in result.draining and w.pk not in result.stopped]
            for worker in workers:
                if worker.status == WorkerStatus.PENDING and worker.updated_at < resend_before:
                    Worker.objects.filter(pk=worker.pk).update(updated_at=now)
                    worker_actions.request_start(worker)
                    result.resent.append(worker.pk)
    if result.started or result.draining or result.stopped or result.unplaced:
        logger.info("reconciled deployment #%s: %s", deployment_id, result.as_dict())
    return result


def reconcile_all(*, now: datetime | None = None) -> list[ReconcileResult]:
    """Reconcile every active deployment, and every stopped one that still has live workers."""
    ids = set(Deployment.objects.filter(status=DeploymentStatus.ACTIVE).values_list("pk", flat=True))
    ids |= set(
        Worker.objects.filter(status__in=recovery.LIVE_WORKER_STATUSES).values_list("deployment_id", flat=True)
    )
    results = []
    for deployment_id in sorted(ids):
        try:
            results.append(reconcile(deployment_id, now=now))
        except Exception:  # noqa: BLE001  one broken deployment must not block the others
            logger.exception("reconcile of deployment #%s failed", deployment_id)
    return results
