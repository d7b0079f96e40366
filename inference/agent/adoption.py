"""The supervisor after a restart and every sync interval: adopt running workers, reap orphans, and align
with the database.

`recover()` (at agent start) adopts the processes of this node's live workers by pid, port and process
start time instead of restarting them (they run in sessions of their own and served on while the agent
was away), and drains and stops the processes of workers failed over meanwhile (reaped). A process whose
pid was never recorded (its agent was killed mid-launch) is found by the marker in its environment: it
is recorded and adopted when its worker has no other, stopped otherwise.
`sync_with_db()` starts live workers nobody runs (a lost Celery message) and stops the processes of
workers the controller gave up on.
"""
from __future__ import annotations

import contextlib
import logging

import psutil

from inference.actions import recovery
from inference.actions import workers as worker_actions
from inference.agent.launch import WORKER_MARKER_ENV, WorkerSpec, parse_marker, worker_marker
from inference.agent.processes import (
    marked_worker_processes,
    process_mismatch,
    process_start_time,
    terminate,
)
from inference.agent.state import Goal, Managed, Phase, SupervisorState
from inference.models import ACTIVE_WORKER_STATUSES, Worker, WorkerStatus
from nodes.models import Node

logger = logging.getLogger(__name__)


class Adoption(SupervisorState):
    """The supervisor's adoption of running workers after a restart and its sync with the database."""

    def recover(self) -> dict[str, list[int]]:
        """At agent start: adopt live worker processes of this node, restart lost ones, reap orphans.

        A worker whose process still runs (same pid, launch_server on the same port, same start time) is
        adopted, not restarted: it keeps serving (a ScaleEvent records the adoption); a live worker whose
        process is gone is launched again (counted as a restart); the process of a worker the controller
        gave up on (failed over while this node's agent was silent, and replaced) is an orphan: drained
        (its requests in flight finish) and stopped, recorded as a reap. A process launched by an agent
        killed before it recorded the pid is found by its marker first (`_claim_unrecorded`). Returns the
        worker ids per outcome ("unrecorded_stopped": the pids of unrecorded processes stopped).
        """
        outcome: dict[str, list[int]] = {"adopted": [], "relaunched": [], "reaped": [], "stopped": []}
        outcome["unrecorded_stopped"] = self._claim_unrecorded()
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

    def _claim_unrecorded(self) -> list[int]:
        """Find this node's worker processes whose pid the database does not hold, before adopting by pid.

        An agent killed between launching a worker and recording its pid (report_launched) leaves a process
        nobody knows: the next agent would launch the worker again (its port taken: a crash loop, FAILED) and
        the process would outlive the platform. Each process carries its worker's marker in its environment
        (launch.worker_marker). The one serving a live worker whose recorded process is gone is recorded as
        that worker's (as the killed agent would have: STARTING) and adopted below; any other (its worker
        stopped, failed or deleted, or it duplicates a recorded live process) is stopped. Returns the pids
        stopped.
        """
        node_name = Node.objects.filter(pk=self.node_id).values_list("name", flat=True).first()
        mine = [
            (value, ref[1], proc) for value, proc in marked_worker_processes(WORKER_MARKER_ENV)
            if (ref := parse_marker(value)) is not None and ref[0] == node_name
        ]
        if not mine:
            return []
        rows = {
            w.pk: w for w in Worker.objects.select_related("node").filter(
                node_id=self.node_id, pk__in={worker_id for _, worker_id, _ in mine}
            )
        }
        stopped: list[int] = []
        for value, worker_id, proc in mine:
            worker = rows.get(worker_id)
            if worker is not None and worker_marker(worker) != value:
                continue  # another platform's worker of the same node name and id: not ours to touch
            if worker is not None and worker.pid == proc.pid:
                continue  # recorded: recover() adopts or reaps it by pid
            recorded_alive = worker is not None and worker.pid is not None and process_mismatch(
                worker.pid, worker.port, worker.process_started_at
            ) is None
            if (
                worker is not None
                and worker.status in ACTIVE_WORKER_STATUSES
                and not recorded_alive
                and process_mismatch(proc.pid, worker.port) is None
            ):
                started_at = process_start_time(proc.pid)
                if worker_actions.report_launched(
                    worker.pk, pid=proc.pid, restart=worker.pid is not None, started_at=started_at
                ):
                    logger.info("worker #%s: its process %s was launched but not recorded; recorded now",
                                worker.pk, proc.pid)
                    worker.pid, worker.process_started_at = proc.pid, started_at
                    continue
            logger.warning("stopping process %s of worker %s: not the recorded process of a live worker",
                           proc.pid, value)
            terminate(proc, self.config.stop_timeout_s)
            stopped.append(proc.pid)
        return stopped

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
