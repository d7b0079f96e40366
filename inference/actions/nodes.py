"""State changes of the workers of a node: a node given up (offline), silent (unreachable), probed, drained.

(A node's own registration and heartbeat are `nodes.actions`: the lower layer.) The controller's
heartbeat check calls `mark_node_unreachable` for a node whose agent went silent and `report_probe` for
its own /health probes of that node's workers (they serve on without their agent, and are failed over
only when they stop answering); an agent that shuts down, or an operator, calls `mark_node_offline`;
the admin and the API call `drain_node`; an agent that registers its node calls
`place_waiting_deployments`. Each failover is a "recovery" ScaleEvent and a reconcile of the deployments
concerned, sent on commit.
"""
from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from django.db import transaction
from django.db.models import Count
from django.utils import timezone

from inference import jobs
from inference.actions.recovery import (
    LIVE_WORKER_STATUSES,
    clip_error,
    describe_workers,
    record_recovery,
    workers_by_role,
)
from inference.actions.workers import request_stop
from inference.models import (
    ACTIVE_WORKER_STATUSES,
    ROLES,
    Deployment,
    DeploymentStatus,
    Worker,
    WorkerStatus,
)
from nodes.models import Node, NodeStatus

logger = logging.getLogger(__name__)

def mark_node_offline(node: Node, *, reason: str) -> list[Worker]:
    """Give up on a node: OFFLINE, and its live workers STOPPED, to be re-placed (one ScaleEvent per role).

    For an agent that shuts down (its workers stop with it) and for an operator who knows the host is
    gone; a node whose agent merely went silent is `mark_node_unreachable` instead, since its workers
    may serve on. The workers' pids are kept so that the agent, if it comes back, can find the processes
    and drain and stop them (see inference.agent.supervisor). The controller re-places them:
    `reconcile_deployment` is sent for every affected deployment once the transaction commits. Returns
    the workers given up on.
    """
    now = timezone.now()
    with transaction.atomic():
        Node.objects.filter(pk=node.pk).update(status=NodeStatus.OFFLINE)
        node.status = NodeStatus.OFFLINE
        workers = list(Worker.objects.select_for_update().filter(node=node, status__in=LIVE_WORKER_STATUSES))
        Worker.objects.filter(pk__in=[w.pk for w in workers]).update(
            status=WorkerStatus.STOPPED, last_error=clip_error(f"node {node.name} offline: {reason}"), updated_at=now
        )
        for (deployment_id, role), group in workers_by_role(workers).items():
            serving = [w for w in group if w.status in ACTIVE_WORKER_STATUSES]
            if serving:
                record_recovery(
                    deployment_id, role, removed=len(serving),
                    reason=f"failover: node {node.name} offline ({reason}); {describe_workers(serving)} stopped, "
                           "replacements placed on other nodes",
                )
        jobs.reconcile_on_commit(*(w.deployment_id for w in workers))
    logger.warning("node %s offline (%s); %d worker(s) to re-place", node.name, reason, len(workers))
    return workers


def mark_node_unreachable(node: Node, *, reason: str) -> list[Worker]:
    """A node's agent went silent: UNREACHABLE; its workers keep their status and stay in rotation.

    Losing the agent does not stop its workers (they run in sessions of their own), so giving them up
    would take healthy capacity out of rotation and leave their processes running untracked. Instead
    the controller probes their /health itself (`report_probe`) and fails over only those that stop
    answering; a restarted agent re-registers the node (ONLINE) and adopts the rest. Only an ONLINE node
    changes (a DRAINING one stays DRAINING: its workers are being stopped anyway). One ScaleEvent per
    deployment and role with live workers here says so. Returns the node's active workers.
    """
    with transaction.atomic():
        changed = Node.objects.filter(pk=node.pk, status=NodeStatus.ONLINE).update(status=NodeStatus.UNREACHABLE)
        node.refresh_from_db(fields=["status"])
        workers = list(Worker.objects.filter(node=node, status__in=ACTIVE_WORKER_STATUSES).order_by("pk"))
        if changed:
            for (deployment_id, role), group in workers_by_role(workers).items():
                record_recovery(
                    deployment_id, role, removed=0,
                    reason=f"node {node.name} unreachable ({reason}): {describe_workers(group)} kept in rotation "
                           "while their "
                           "/health answers; a restarted agent adopts them",
                )
    if changed:
        logger.warning("node %s unreachable (%s); %d worker(s) kept while healthy", node.name, reason, len(workers))
    return workers


def report_probe(
    worker_id: int, *, health: dict[str, Any] | None, error: str = "", grace_s: float, now: datetime | None = None
) -> str:
    """The controller probed /health of a worker whose agent is silent; act on the answer.

    - a healthy answer: stored (last_health, last_seen); an UNHEALTHY worker is RUNNING (routable) again.
      Returns "healthy".
    - no (healthy) answer: a RUNNING/STARTING worker turns UNHEALTHY at once (routers following the
      database stop sending it requests) and returns "unhealthy"; once nothing has been heard of it for
      `grace_s` (last_seen, or its last status change when it never answered) it is failed over:
      STOPPED with its pid kept (a returning agent reaps the process), a ScaleEvent, and a reconcile that
      places the replacement elsewhere. Returns "failed_over". A PENDING worker (its agent died before
      starting it) is failed over at once.
    Returns "gone" when the worker is no longer active.
    """
    now = now or timezone.now()
    if health is not None and health.get("status") == "healthy":
        Worker.objects.filter(pk=worker_id, status__in=LIVE_WORKER_STATUSES).update(last_health=health, last_seen=now)
        Worker.objects.filter(pk=worker_id, status=WorkerStatus.UNHEALTHY).update(
            status=WorkerStatus.RUNNING, last_error="", updated_at=now
        )
        return "healthy"
    why = error or (f"unhealthy answer: {health}" if health is not None else "no answer")
    with transaction.atomic():
        worker = (
            Worker.objects.select_for_update().select_related("node")
            .filter(pk=worker_id, status__in=ACTIVE_WORKER_STATUSES).first()
        )
        if worker is None:
            return "gone"
        last_sign = worker.last_seen or worker.updated_at
        silent_s = (now - last_sign).total_seconds() if last_sign else float("inf")
        if worker.status != WorkerStatus.PENDING and silent_s < grace_s:
            if worker.status in (WorkerStatus.RUNNING, WorkerStatus.STARTING):
                Worker.objects.filter(pk=worker_id).update(
                    status=WorkerStatus.UNHEALTHY, updated_at=now,
                    last_error=clip_error(f"agent of {worker.node.name} silent; /health probe failed: {why}"),
                )
                # The last sign of life stays last_seen (or, for a worker never seen, the status change).
                if worker.last_seen is None:
                    Worker.objects.filter(pk=worker_id).update(last_seen=last_sign)
            return "unhealthy"
        detail = (
            "never started (its agent went silent first)" if worker.status == WorkerStatus.PENDING
            else f"/health not answering for {silent_s:.0f}s ({why})"
        )
        Worker.objects.filter(pk=worker_id).update(
            status=WorkerStatus.STOPPED, updated_at=now,
            last_error=clip_error(f"failed over: agent of {worker.node.name} silent and the worker {detail}"),
        )
        record_recovery(
            worker.deployment_id, worker.role, removed=1,
            reason=f"failover: {worker.role} worker #{worker.pk} on unreachable node {worker.node.name} {detail}; "
                   "a replacement is placed on another node",
        )
        jobs.reconcile_on_commit(worker.deployment_id)
    logger.warning("worker #%s failed over: %s", worker_id, detail)
    return "failed_over"


def drain_node(node: Node) -> Node:
    """Take a node out of service: no new workers there; its workers drain and stop, replacements go elsewhere.

    RUNNING workers drain first (finish their requests, bounded by AGENT_DRAIN_TIMEOUT_S); workers not
    serving yet (PENDING/STARTING/UNHEALTHY) just stop. The deployments are reconciled on commit, which
    places replacements on other online nodes. `nodes.actions.activate_node` undoes the drain for new placements.
    """
    with transaction.atomic():
        node = Node.objects.select_for_update().get(pk=node.pk)
        if node.status == NodeStatus.ONLINE:
            node.status = NodeStatus.DRAINING
            node.save(update_fields=["status"])
        workers = list(Worker.objects.select_related("node").filter(node=node, status__in=ACTIVE_WORKER_STATUSES))
        for worker in workers:
            request_stop(worker, drain=worker.status == WorkerStatus.RUNNING, reason=f"node {node.name} drained")
        for (deployment_id, role), group in workers_by_role(workers).items():
            record_recovery(
                deployment_id, role, removed=len(group),
                reason=f"re-placement: node {node.name} drained; {describe_workers(group)} stopping, "
                       "replacements placed "
                       "on other nodes",
            )
        jobs.reconcile_on_commit(*(w.deployment_id for w in workers))
    logger.info("node %s draining; %d worker(s) stopping", node.name, len(workers))
    return node


def place_waiting_deployments(node: Node) -> list[int]:
    """A node registered (its agent started): reconcile now each active deployment short of workers.

    Deployments whose workers could not be placed (no node had room, or none was up) would otherwise wait for
    the controller's periodic `reconcile_all`; the reconcile is sent on commit to the controller, which
    places them with the usual rules (on this node or any other). A DRAINING node adds no capacity: nothing
    is sent. Returns the ids of the deployments reconciled.
    """
    if node.status != NodeStatus.ONLINE:
        return []
    waiting = []
    for deployment in Deployment.objects.filter(status=DeploymentStatus.ACTIVE).order_by("pk"):
        counts = dict(
            Worker.objects.filter(deployment=deployment, status__in=ACTIVE_WORKER_STATUSES)
            .values_list("role").annotate(n=Count("pk")).values_list("role", "n")
        )
        if any(counts.get(role, 0) < deployment.replicas(role) for role in ROLES):
            waiting.append(deployment.pk)
    jobs.reconcile_on_commit(*waiting)
    return waiting
