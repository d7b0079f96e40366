"""The supervisor after a restart and every sync interval: adopt running workers, reap orphans, and align
with the database.

`recover()` (at agent start) adopts the processes of this node's live workers by pid, port and process
start time instead of restarting them (they run in sessions of their own and served on while the agent
was away), and drains and stops the processes of workers failed over meanwhile (reaped).
`sync_with_db()` starts live workers nobody runs (a lost Celery message) and stops the processes of
workers the controller gave up on.
"""
from __future__ import annotations

import contextlib
import logging

import psutil

from inference.actions import recovery
from inference.actions import workers as worker_actions
from inference.agent.launch import WorkerSpec
from inference.agent.processes import (
    process_mismatch,
)
from inference.agent.state import Goal, Managed, Phase, SupervisorState
from inference.models import ACTIVE_WORKER_STATUSES, Worker, WorkerStatus

logger = logging.getLogger(__name__)


class Adoption(SupervisorState):
    """The supervisor's adoption of running workers after a restart and its sync with the database."""

    def recover(self) -> dict[str, list[int]]:
        """At agent start: adopt live worker processes of this node, restart lost ones, reap orphans.

        A worker whose process still runs (same pid, launch_server on the same port, same start time) is
        adopted, not restarted: it keeps serving (a ScaleEvent records the adoption); a live worker whose
        process is gone is launched again (counted as a restart); the process of a worker the controller
        gave up on (failed over while this node's agent was silent, and replaced) is an orphan: drained
        (its requests in flight finish) and stopped, recorded as a reap. Returns the worker ids per outcome.
        """
        outcome: dict[str, list[int]] = {"adopted": [], "relaunched": [], "reaped": [], "stopped": []}
        workers = (
            Worker.objects.select_related("deployment__model", "node")
            .filter(node_id=self.node_id)
            .exclude(status__in=recovery.FINAL_WORKER_STATUSES, pid__isnull=True)
        )
        now = self._clock()
        with self._lock:
            for worker in workers:
                mismatch = None if worker.pid is None else process_mismatch(
                    worker.pid, worker.port, worker.process_started_at
                )
                alive = worker.pid is not None and mismatch is None
                if worker.pid is not None and mismatch is not None:
                    # Said once per worker at agent start: the reason a running worker was not adopted.
                    logger.info("worker #%s: pid %s is not its process: %s", worker.pk, worker.pid, mismatch)
                if worker.status in recovery.FINAL_WORKER_STATUSES:
                    if alive and worker.pid is not None:
                        orphan = Managed(
                            spec=WorkerSpec.from_worker(worker, self.config.bind_host),
                            log_path=self._log_path(worker.pk), goal=Goal.DRAIN, phase=Phase.RUNNING,
                            pid=worker.pid, launches=1, launched_at=now,
                        )
                        with contextlib.suppress(psutil.Error):
                            orphan.adopted = psutil.Process(worker.pid)
                        self._procs[worker.pk] = orphan
                        worker_actions.report_reaping(worker.pk, pid=worker.pid, node_name=worker.node.name)
                        outcome["reaped"].append(worker.pk)
                    else:
                        worker_actions.report_stopped(worker.pk)
                    continue
                if not alive and worker.status in (WorkerStatus.DRAINING, WorkerStatus.STOPPING):
                    worker_actions.report_stopped(worker.pk)
                    outcome["stopped"].append(worker.pk)
                    continue
                managed = Managed(
                    spec=WorkerSpec.from_worker(worker, self.config.bind_host), log_path=self._log_path(worker.pk)
                )
                if alive and worker.pid is not None:
                    managed.pid = worker.pid
                    with contextlib.suppress(psutil.Error):
                        # The handle remembers the start time, so a reused pid is not mistaken for it.
                        managed.adopted = psutil.Process(worker.pid)
                    managed.launches = 1
                    managed.launched_at = now
                    managed.kv_port_reported = worker.kv_port is not None
                    managed.phase = Phase.RUNNING if worker.status == WorkerStatus.RUNNING else Phase.STARTING
                    if worker.status == WorkerStatus.DRAINING:
                        managed.goal = Goal.DRAIN
                    elif worker.status == WorkerStatus.STOPPING:
                        managed.goal = Goal.STOP
                    worker_actions.report_adopted(worker.pk, pid=worker.pid, node_name=worker.node.name)
                    outcome["adopted"].append(worker.pk)
                else:
                    managed.count_next_launch_as_restart = worker.pid is not None or worker.restarts > 0
                    outcome["relaunched"].append(worker.pk)
                self._procs[worker.pk] = managed
        if any(outcome.values()):
            logger.info("recovered workers: %s", outcome)
        self._wake.set()
        return outcome

    def sync_with_db(self) -> None:
        """Align with the database: start live workers nobody runs, stop the ones the controller gave up on."""
        rows = dict(
            Worker.objects.filter(node_id=self.node_id)
            .exclude(status__in=recovery.FINAL_WORKER_STATUSES)
            .values_list("pk", "status")
        )
        with self._lock:
            for worker_id, managed in self._procs.items():
                status = rows.get(worker_id)
                if managed.goal not in (Goal.RUN, Goal.RESTART):
                    continue
                if status is None:  # STOPPED/FAILED or deleted
                    logger.info("worker #%s was given up on by the controller; stopping it", worker_id)
                    managed.goal = Goal.STOP
                elif status == WorkerStatus.DRAINING:
                    managed.goal = Goal.DRAIN
                elif status == WorkerStatus.STOPPING:
                    managed.goal = Goal.STOP
            unmanaged = [(wid, status) for wid, status in rows.items() if wid not in self._procs]
        for worker_id, status in unmanaged:
            if status in ACTIVE_WORKER_STATUSES:
                logger.info("worker #%s (%s) is not running here yet; starting it", worker_id, status)
                self.request_start(worker_id)
            else:  # DRAINING/STOPPING without a process here: it is gone
                worker_actions.report_stopped(worker_id)
