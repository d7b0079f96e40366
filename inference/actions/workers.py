"""State changes of workers and of nodes with workers: the one place views, admin, tasks, the controller
and agents call. (A node's own registration and heartbeat are `nodes.actions`: the lower layer.)

Two kinds of callers:
- the control side (REST API, admin, controller) asks for things: `restart_worker`, `drain_node`,
  `request_start`, `request_stop`. These change the database and, once the transaction commits,
  send a Celery task to the node's queue `node.<name>`, where that node's agent acts on it.
- an agent reports what happened to its processes: `report_*` (and `nodes.actions.heartbeat`). Reports are
  conditional updates (`UPDATE ... WHERE status IN (...)`), so a late report can never undo a
  decision taken meanwhile: a health answer does not turn a worker the controller started draining
  back into RUNNING, nor revive one the controller gave up on when its node went offline.
- the controller's heartbeat check: `mark_node_unreachable` for a node whose agent went silent, and
  `report_probe` for its own /health probes of that node's workers (they serve on without their agent,
  and are failed over only when they stop answering).

Every failover (a worker given up and re-placed: its node offline or unreachable and silent, a crash
loop that FAILED it, a drained node), adoption (a restarted agent takes over a running worker) and reap
(an orphaned process of a replaced worker drained and stopped) is recorded as a ScaleEvent with source
"recovery" and its reason (`record_recovery`). When a worker placed for a ScaleEvent reports RUNNING,
the event's time-to-run is filled in (`report_healthy`).
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from inference.agent import tasks as agent_tasks
from inference.models import ACTIVE_WORKER_STATUSES, ScaleEvent, ScaleSource, Worker, WorkerStatus
from nodes.models import Node, NodeStatus

logger = logging.getLogger(__name__)

FINAL_WORKER_STATUSES = [WorkerStatus.STOPPED, WorkerStatus.FAILED]
LIVE_WORKER_STATUSES = [s for s in WorkerStatus.values if s not in FINAL_WORKER_STATUSES]
# last_error is a TextField, but a crash log tail should stay readable in the admin.
MAX_ERROR_CHARS = 4000


def _now() -> datetime:
    return timezone.now()


def _clip(text: str) -> str:
    return text if len(text) <= MAX_ERROR_CHARS else "…" + text[-MAX_ERROR_CHARS:]


def mark_node_offline(node: Node, *, reason: str) -> list[Worker]:
    """Give up on a node: OFFLINE, and its live workers STOPPED, to be re-placed (one ScaleEvent per role).

    For an agent that shuts down (its workers stop with it) and for an operator who knows the host is
    gone; a node whose agent merely went silent is `mark_node_unreachable` instead, since its workers
    may serve on. The workers' pids are kept so that the agent, if it comes back, can find the processes
    and drain and stop them (see inference.agent.supervisor). The controller re-places them:
    `reconcile_deployment` is sent for every affected deployment once the transaction commits. Returns
    the workers given up on.
    """
    now = _now()
    with transaction.atomic():
        Node.objects.filter(pk=node.pk).update(status=NodeStatus.OFFLINE)
        node.status = NodeStatus.OFFLINE
        workers = list(Worker.objects.select_for_update().filter(node=node, status__in=LIVE_WORKER_STATUSES))
        Worker.objects.filter(pk__in=[w.pk for w in workers]).update(
            status=WorkerStatus.STOPPED, last_error=_clip(f"node {node.name} offline: {reason}"), updated_at=now
        )
        for (deployment_id, role), group in _by_role(workers).items():
            serving = [w for w in group if w.status in ACTIVE_WORKER_STATUSES]
            if serving:
                record_recovery(
                    deployment_id, role, removed=len(serving),
                    reason=f"failover: node {node.name} offline ({reason}); {_ids(serving)} stopped, "
                           "replacements placed on other nodes",
                )
        _reconcile_on_commit(w.deployment_id for w in workers)
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
            for (deployment_id, role), group in _by_role(workers).items():
                record_recovery(
                    deployment_id, role, removed=0,
                    reason=f"node {node.name} unreachable ({reason}): {_ids(group)} kept in rotation while their "
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
    now = now or _now()
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
                    last_error=_clip(f"agent of {worker.node.name} silent; /health probe failed: {why}"),
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
            last_error=_clip(f"failed over: agent of {worker.node.name} silent and the worker {detail}"),
        )
        record_recovery(
            worker.deployment_id, worker.role, removed=1,
            reason=f"failover: {worker.role} worker #{worker.pk} on unreachable node {worker.node.name} {detail}; "
                   "a replacement is placed on another node",
        )
        _reconcile_on_commit([worker.deployment_id])
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
        for (deployment_id, role), group in _by_role(workers).items():
            record_recovery(
                deployment_id, role, removed=len(group),
                reason=f"re-placement: node {node.name} drained; {_ids(group)} stopping, replacements placed "
                       "on other nodes",
            )
        _reconcile_on_commit(w.deployment_id for w in workers)
    logger.info("node %s draining; %d worker(s) stopping", node.name, len(workers))
    return node


# ------------------------------------------------------------------------------- control-side requests
def request_start(worker: Worker) -> None:
    """Ask the worker's agent to start it (sent on commit; the agent ignores it unless the worker is live)."""
    _send_to_node(worker, "start_worker", worker_id=worker.pk)


def request_stop(worker: Worker, *, drain: bool, reason: str = "") -> None:
    """Take a worker out of service and ask its agent to stop it, draining it first when `drain`.

    The status changes now (DRAINING, or STOPPING without drain), so routers following the database stop
    sending it new requests at once and the controller no longer counts it as a replica. A PENDING
    worker's agent may not have it yet; it is told anyway so that a start racing with this stop is undone.
    """
    status = WorkerStatus.DRAINING if drain else WorkerStatus.STOPPING
    fields: dict[str, Any] = {"status": status, "updated_at": _now()}
    if reason:
        fields["last_error"] = _clip(reason)
    Worker.objects.filter(pk=worker.pk, status__in=LIVE_WORKER_STATUSES).update(**fields)
    worker.status = status
    _send_to_node(worker, "stop_worker", worker_id=worker.pk, drain=drain)


def restart_worker(worker: Worker) -> None:
    """Ask the worker's agent to restart its process (stop without drain, start again; restarts + 1).

    Raises ValueError when the worker is no longer live (STOPPED/FAILED: scale the deployment instead)
    or its node is OFFLINE (no agent would receive the request).
    """
    worker.refresh_from_db(fields=["status"])
    if worker.status not in ACTIVE_WORKER_STATUSES:
        raise ValueError(f"worker #{worker.pk} is {worker.status}; only a live worker can be restarted")
    if worker.node.status in (NodeStatus.OFFLINE, NodeStatus.UNREACHABLE):
        raise ValueError(f"node {worker.node.name} is {worker.node.status}; its worker cannot be restarted")
    _send_to_node(worker, "restart_worker", worker_id=worker.pk)


def prune_stopped_workers(older_than: timedelta | None = None, *, now: datetime | None = None) -> int:
    """Delete STOPPED and FAILED workers unchanged for `older_than` (default WORKER_RETENTION_HOURS).

    Returns how many rows were deleted. Their processes are gone; their metric history stays (worker
    samples name the worker instead of referencing it) and so do the ScaleEvents that placed them.
    Live workers are never touched, however old.
    """
    if older_than is None:
        older_than = timedelta(hours=settings.WORKER_RETENTION_HOURS)
    cutoff = (now or _now()) - older_than
    stale = Worker.objects.filter(status__in=FINAL_WORKER_STATUSES, updated_at__lt=cutoff)
    count = stale.count()
    if count:
        stale.delete()
        logger.info("pruned %d stopped/failed worker row(s) unchanged since %s", count, cutoff.isoformat())
    return count


def _send_to_node(worker: Worker, task_name: str, **kwargs: Any) -> None:
    """Send the agent task `task_name` (inference.agent.tasks, registered as nodes.tasks.<task_name>) to the
    worker's node queue once the current transaction commits."""
    queue = worker.node.queue_name

    def send() -> None:
        getattr(agent_tasks, task_name).apply_async(kwargs=kwargs, queue=queue)

    transaction.on_commit(send)


def _reconcile_on_commit(deployment_ids: Iterable[int]) -> None:
    """Send reconcile_deployment for each deployment once the transaction commits."""
    ids = sorted(set(deployment_ids))
    if not ids:
        return

    def send() -> None:
        # Imported when sent: inference.tasks imports the controller, which imports this module.
        from inference import tasks

        for deployment_id in ids:
            tasks.reconcile_deployment.delay(deployment_id=deployment_id)

    transaction.on_commit(send)


def _by_role(workers: Iterable[Worker]) -> dict[tuple[int, str], list[Worker]]:
    groups: dict[tuple[int, str], list[Worker]] = {}
    for worker in workers:
        groups.setdefault((worker.deployment_id, worker.role), []).append(worker)
    return groups


def _ids(workers: list[Worker]) -> str:
    return f"{len(workers)} {workers[0].role} worker(s) (" + ", ".join(f"#{w.pk}" for w in workers) + ")"


def record_recovery(deployment_id: int, role: str, *, removed: int, reason: str) -> ScaleEvent:
    """A ScaleEvent (source "recovery") for a failover, adoption or reap of the deployment's `role` workers.

    from/to are the role's active workers before and after (`removed` of them given up, 0 when none
    was: an adoption or a reap changes who runs a worker, not how many run), counted after the caller's
    update, so call it inside the transaction that made the change.
    """
    active = Worker.objects.filter(deployment_id=deployment_id, role=role, status__in=ACTIVE_WORKER_STATUSES).count()
    event = ScaleEvent.objects.create(
        deployment_id=deployment_id, role=role, from_replicas=active + removed, to_replicas=active,
        source=ScaleSource.RECOVERY, reason=_clip(reason),
    )
    logger.info("deployment #%s %s: %s", deployment_id, role, reason)
    return event


# ------------------------------------------------------------------------------------- agent reports
def report_launched(worker_id: int, *, pid: int, restart: bool, started_at: float | None = None) -> bool:
    """The agent started the worker's process: STARTING with its pid; `restart` counts one more restart.

    `started_at` is the process's start time as the OS reports it (psutil's create_time), stored so a
    later agent can tell the process from another that reused the pid. Only a live worker
    (PENDING/STARTING/RUNNING/UNHEALTHY) moves; False means the worker was given up on meanwhile and
    the agent should stop the process again.
    """
    fields: dict[str, Any] = {
        "status": WorkerStatus.STARTING, "pid": pid, "process_started_at": started_at, "updated_at": _now()
    }
    if restart:
        fields["restarts"] = F("restarts") + 1
    return bool(Worker.objects.filter(pk=worker_id, status__in=ACTIVE_WORKER_STATUSES).update(**fields))


def report_healthy(worker_id: int, *, health: dict[str, Any], kv_port: int | None = None) -> bool:
    """A health check passed: store it; PENDING/STARTING/UNHEALTHY become RUNNING (routable).

    A DRAINING or STOPPING worker keeps its status (only its health is stored). `kv_port` is the decode
    worker's KV port from /info. Returns whether the worker is RUNNING now.
    """
    now = _now()
    Worker.objects.filter(pk=worker_id).update(last_health=health, last_seen=now)
    fields: dict[str, Any] = {"status": WorkerStatus.RUNNING, "last_error": "", "updated_at": now}
    if kv_port is not None:
        fields["kv_port"] = kv_port
    promoted = Worker.objects.filter(
        pk=worker_id, status__in=[WorkerStatus.PENDING, WorkerStatus.STARTING, WorkerStatus.UNHEALTHY]
    ).update(**fields)
    if promoted:
        logger.info("worker #%s is running", worker_id)
        fill_time_to_run(worker_id, now=now)
        return True
    return Worker.objects.filter(pk=worker_id, status=WorkerStatus.RUNNING).exists()


def fill_time_to_run(worker_id: int, *, now: datetime | None = None) -> list[ScaleEvent]:
    """The worker runs: fill in `time_to_run_s` of its ScaleEvents whose placed workers all run now.

    Workers of the event still PENDING, STARTING or UNHEALTHY keep it open; ones given up on
    (STOPPED, FAILED, ...) do not. Returns the events filled in.
    """
    now = now or _now()
    filled: list[ScaleEvent] = []
    waiting = [WorkerStatus.PENDING, WorkerStatus.STARTING, WorkerStatus.UNHEALTHY]
    for event in ScaleEvent.objects.filter(placed_workers=worker_id, time_to_run_s__isnull=True):
        if event.placed_workers.filter(status__in=waiting).exists():
            continue
        seconds = max(0.0, (now - event.created_at).total_seconds())
        if ScaleEvent.objects.filter(pk=event.pk, time_to_run_s__isnull=True).update(time_to_run_s=seconds):
            event.time_to_run_s = seconds
            filled.append(event)
            logger.info("scale event #%s: its workers run %.1fs after it", event.pk, seconds)
    return filled


def report_unhealthy(worker_id: int, *, error: str, health: dict[str, Any] | None = None) -> bool:
    """Health checks keep failing while the process lives: RUNNING/STARTING → UNHEALTHY (no traffic)."""
    fields: dict[str, Any] = {"status": WorkerStatus.UNHEALTHY, "last_error": _clip(error), "updated_at": _now()}
    if health is not None:
        fields["last_health"] = health
    return bool(
        Worker.objects.filter(pk=worker_id, status__in=[WorkerStatus.STARTING, WorkerStatus.RUNNING]).update(**fields)
    )


def report_crashed(worker_id: int, *, error: str) -> bool:
    """The process exited unexpectedly and will be restarted after a backoff: UNHEALTHY, no pid."""
    return bool(
        Worker.objects.filter(pk=worker_id, status__in=ACTIVE_WORKER_STATUSES).update(
            status=WorkerStatus.UNHEALTHY, pid=None, last_error=_clip(error), updated_at=_now()
        )
    )


def report_draining(worker_id: int) -> bool:
    """The agent started draining the worker (the controller usually set DRAINING already)."""
    return bool(
        Worker.objects.filter(pk=worker_id, status__in=ACTIVE_WORKER_STATUSES).update(
            status=WorkerStatus.DRAINING, updated_at=_now()
        )
    )


def report_stopping(worker_id: int) -> bool:
    """The agent sent SIGTERM to the worker's process."""
    return bool(
        Worker.objects.filter(pk=worker_id, status__in=LIVE_WORKER_STATUSES).update(
            status=WorkerStatus.STOPPING, updated_at=_now()
        )
    )


def report_stopped(worker_id: int, *, error: str | None = None) -> bool:
    """The worker's process is gone as requested: STOPPED without pid (a FAILED worker only loses its pid)."""
    now = _now()
    fields: dict[str, Any] = {"status": WorkerStatus.STOPPED, "pid": None, "updated_at": now}
    if error is not None:
        fields["last_error"] = _clip(error)
    changed = Worker.objects.filter(pk=worker_id).exclude(status=WorkerStatus.FAILED).update(**fields)
    Worker.objects.filter(pk=worker_id, status=WorkerStatus.FAILED).update(pid=None, updated_at=now)
    return bool(changed)


def report_failed(worker_id: int, *, error: str) -> bool:
    """The agent gave up on the worker (too many crashes in the window): FAILED, then the controller
    re-places the replica (avoiding this node for a while, see inference.controller)."""
    with transaction.atomic():
        worker = Worker.objects.filter(pk=worker_id).exclude(status=WorkerStatus.STOPPED).first()
        if worker is None:
            return False
        Worker.objects.filter(pk=worker_id).update(
            status=WorkerStatus.FAILED, pid=None, last_error=_clip(error), updated_at=_now()
        )
        if worker.status in ACTIVE_WORKER_STATUSES:
            first_line = error.splitlines()[0] if error else "no error text"
            record_recovery(
                worker.deployment_id, worker.role, removed=1,
                reason=f"failover: {worker.role} worker #{worker_id} failed after repeated crashes "
                       f"({first_line}); a replacement is placed, avoiding its node for a while",
            )
        _reconcile_on_commit([worker.deployment_id])
    logger.error("worker #%s failed: %s", worker_id, error.splitlines()[0] if error else "")
    return True


def report_adopted(worker_id: int, *, pid: int, node_name: str) -> bool:
    """A restarted agent took over the worker's running process instead of restarting it (ScaleEvent)."""
    with transaction.atomic():
        worker = Worker.objects.filter(pk=worker_id).exclude(status__in=FINAL_WORKER_STATUSES).first()
        if worker is None:
            return False
        record_recovery(
            worker.deployment_id, worker.role, removed=0,
            reason=f"adopted: the restarted agent of {node_name} took over {worker.role} worker #{worker_id} "
                   f"(pid {pid}, port {worker.port}, {worker.status}) without restarting it",
        )
    return True


def report_reaping(worker_id: int, *, pid: int, node_name: str) -> bool:
    """A restarted agent found the process of a worker already given up on (replaced): it is drained and
    stopped (its status stays final; a ScaleEvent says so)."""
    with transaction.atomic():
        worker = Worker.objects.filter(pk=worker_id, status__in=FINAL_WORKER_STATUSES).first()
        if worker is None:
            return False
        record_recovery(
            worker.deployment_id, worker.role, removed=0,
            reason=f"reap: the restarted agent of {node_name} found orphaned process {pid} of {worker.status} "
                   f"{worker.role} worker #{worker_id} (port {worker.port}); draining and stopping it",
        )
    return True
