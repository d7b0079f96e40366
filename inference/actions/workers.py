"""State changes of workers: what views, the admin, tasks, the controller and agents call.
(A node's workers given up, probed or drained: inference.actions.nodes; a node's own registration and
heartbeat: `nodes.actions`, the lower layer.)

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
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from inference import jobs
from inference.actions.recovery import (
    FINAL_WORKER_STATUSES,
    LIVE_WORKER_STATUSES,
    clip_error,
    record_recovery,
)
from inference.models import ACTIVE_WORKER_STATUSES, FailureCause, ScaleEvent, Worker, WorkerStatus
from nodes.models import NodeStatus

logger = logging.getLogger(__name__)

# ------------------------------------------------------------------------------- control-side requests
def request_start(worker: Worker) -> None:
    """Ask the worker's agent to start it (sent on commit; the agent ignores it unless the worker is live)."""
    _send_to_node(worker, jobs.START_WORKER, worker_id=worker.pk)


def request_stop(worker: Worker, *, drain: bool, reason: str = "") -> None:
    """Take a worker out of service and ask its agent to stop it, draining it first when `drain`.

    The status changes now (DRAINING, or STOPPING without drain), so routers following the database stop
    sending it new requests at once and the controller no longer counts it as a replica. A PENDING
    worker's agent may not have it yet; it is told anyway so that a start racing with this stop is undone.
    """
    status = WorkerStatus.DRAINING if drain else WorkerStatus.STOPPING
    fields: dict[str, Any] = {"status": status, "updated_at": timezone.now()}
    if reason:
        fields["last_error"] = clip_error(reason)
    Worker.objects.filter(pk=worker.pk, status__in=LIVE_WORKER_STATUSES).update(**fields)
    worker.status = status
    _send_to_node(worker, jobs.STOP_WORKER, worker_id=worker.pk, drain=drain)


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
    _send_to_node(worker, jobs.RESTART_WORKER, worker_id=worker.pk)


def prune_stopped_workers(older_than: timedelta | None = None, *, now: datetime | None = None) -> int:
    """Delete STOPPED and FAILED workers unchanged for `older_than` (default WORKER_RETENTION_HOURS).

    Returns how many rows were deleted. Their processes are gone; their metric history stays (worker
    samples name the worker instead of referencing it) and so do the ScaleEvents that placed them.
    Live workers are never touched, however old.
    """
    if older_than is None:
        older_than = timedelta(hours=settings.WORKER_RETENTION_HOURS)
    cutoff = (now or timezone.now()) - older_than
    stale = Worker.objects.filter(status__in=FINAL_WORKER_STATUSES, updated_at__lt=cutoff)
    count = stale.count()
    if count:
        stale.delete()
        logger.info("pruned %d stopped/failed worker row(s) unchanged since %s", count, cutoff.isoformat())
    return count


def _send_to_node(worker: Worker, task: str, **kwargs: Any) -> None:
    """Send the agent task `task` (a jobs name) to the worker's node queue once the transaction commits."""
    jobs.enqueue(task, queue=worker.node.queue_name, **kwargs)


# ------------------------------------------------------------------------------------- agent reports
def report_launched(worker_id: int, *, pid: int, restart: bool, started_at: float | None = None) -> bool:
    """The agent started the worker's process: STARTING with its pid; `restart` counts one more restart.

    `started_at` is the process's start time as the OS reports it (psutil's create_time), stored so a
    later agent can tell the process from another that reused the pid. Only a live worker
    (PENDING/STARTING/RUNNING/UNHEALTHY) moves; False means the worker was given up on meanwhile and
    the agent should stop the process again.
    """
    fields: dict[str, Any] = {
        "status": WorkerStatus.STARTING, "pid": pid, "process_started_at": started_at, "updated_at": timezone.now()
    }
    if restart:
        fields["restarts"] = F("restarts") + 1
    return bool(Worker.objects.filter(pk=worker_id, status__in=ACTIVE_WORKER_STATUSES).update(**fields))


def report_healthy(worker_id: int, *, health: dict[str, Any], kv_port: int | None = None) -> bool:
    """A health check passed: store it; PENDING/STARTING/UNHEALTHY become RUNNING (routable).

    A DRAINING or STOPPING worker keeps its status (only its health is stored). `kv_port` is the decode
    worker's KV port from /info. Returns whether the worker is RUNNING now.
    """
    now = timezone.now()
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
    now = now or timezone.now()
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
    fields: dict[str, Any] = {
        "status": WorkerStatus.UNHEALTHY, "last_error": clip_error(error), "updated_at": timezone.now()
    }
    if health is not None:
        fields["last_health"] = health
    return bool(
        Worker.objects.filter(pk=worker_id, status__in=[WorkerStatus.STARTING, WorkerStatus.RUNNING]).update(**fields)
    )


def report_crashed(worker_id: int, *, error: str) -> bool:
    """The process exited unexpectedly and will be restarted after a backoff: UNHEALTHY, no pid."""
    return bool(
        Worker.objects.filter(pk=worker_id, status__in=ACTIVE_WORKER_STATUSES).update(
            status=WorkerStatus.UNHEALTHY, pid=None, last_error=clip_error(error), updated_at=timezone.now()
        )
    )


def report_draining(worker_id: int) -> bool:
    """The agent started draining the worker (the controller usually set DRAINING already)."""
    return bool(
        Worker.objects.filter(pk=worker_id, status__in=ACTIVE_WORKER_STATUSES).update(
            status=WorkerStatus.DRAINING, updated_at=timezone.now()
        )
    )


def report_stopping(worker_id: int) -> bool:
    """The agent sent SIGTERM to the worker's process."""
    return bool(
        Worker.objects.filter(pk=worker_id, status__in=LIVE_WORKER_STATUSES).update(
            status=WorkerStatus.STOPPING, updated_at=timezone.now()
        )
    )


def report_stopped(worker_id: int, *, error: str | None = None) -> bool:
    """The worker's process is gone as requested: STOPPED without pid (a FAILED worker only loses its pid)."""
    now = timezone.now()
    fields: dict[str, Any] = {"status": WorkerStatus.STOPPED, "pid": None, "updated_at": now}
    if error is not None:
        fields["last_error"] = clip_error(error)
    changed = Worker.objects.filter(pk=worker_id).exclude(status=WorkerStatus.FAILED).update(**fields)
    Worker.objects.filter(pk=worker_id, status=WorkerStatus.FAILED).update(pid=None, updated_at=now)
    return bool(changed)


def report_failed(worker_id: int, *, error: str, cause: FailureCause = FailureCause.CRASH_LOOP) -> bool:
    """The agent gave up on the worker (`cause`: too many crashes in the window, or its KV pool does not
    fit the node's memory): FAILED, then the controller re-places the replica (avoiding this node for a
    while, see inference.controller); the recovery event names the cause."""
    with transaction.atomic():
        worker = Worker.objects.filter(pk=worker_id).exclude(status=WorkerStatus.STOPPED).first()
        if worker is None:
            return False
        Worker.objects.filter(pk=worker_id).update(
            status=WorkerStatus.FAILED, pid=None, last_error=clip_error(error), updated_at=timezone.now()
        )
        if worker.status in ACTIVE_WORKER_STATUSES:
            first_line = error.splitlines()[0] if error else "no error text"
            record_recovery(
                worker.deployment_id, worker.role, removed=1,
                reason=f"failover: {worker.role} worker #{worker_id} {cause.value} "
                       f"({first_line}); a replacement is placed, avoiding its node for a while",
            )
        jobs.reconcile_on_commit(worker.deployment_id)
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
