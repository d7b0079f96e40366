"""What the worker and node actions share: worker status groups, error texts, and the "recovery" ScaleEvent.

Every failover (a worker given up and re-placed: its node offline or unreachable and silent, a crash
loop that FAILED it, a drained node), adoption (a restarted agent takes over a running worker) and reap
(an orphaned process of a replaced worker drained and stopped) is recorded as a ScaleEvent with source
"recovery" and its reason (`record_recovery`).
"""
from __future__ import annotations

import logging
from collections.abc import Iterable

from inference.models import ACTIVE_WORKER_STATUSES, ScaleEvent, ScaleSource, Worker, WorkerStatus

logger = logging.getLogger(__name__)

FINAL_WORKER_STATUSES = [WorkerStatus.STOPPED, WorkerStatus.FAILED]
LIVE_WORKER_STATUSES = [s for s in WorkerStatus.values if s not in FINAL_WORKER_STATUSES]
# last_error is a TextField, but a crash log tail should stay readable in the admin.
MAX_ERROR_CHARS = 4000


def clip_error(text: str) -> str:
    """`text`, or its tail when longer than MAX_ERROR_CHARS (a crash log's end says what happened)."""
    return text if len(text) <= MAX_ERROR_CHARS else "…" + text[-MAX_ERROR_CHARS:]


def workers_by_role(workers: Iterable[Worker]) -> dict[tuple[int, str], list[Worker]]:
    """The workers grouped by (deployment id, role)."""
    groups: dict[tuple[int, str], list[Worker]] = {}
    for worker in workers:
        groups.setdefault((worker.deployment_id, worker.role), []).append(worker)
    return groups


def describe_workers(workers: list[Worker]) -> str:
    """A group of workers of one role as ScaleEvent reasons name it, e.g. '2 decode worker(s) (#4, #5)'."""
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
        source=ScaleSource.RECOVERY, reason=clip_error(reason),
    )
    logger.info("deployment #%s %s: %s", deployment_id, role, reason)
    return event
