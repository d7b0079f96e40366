"""The agent's supervisor: launches worker processes, health-checks, restarts, drains and stops them.

One `Supervisor` per agent process owns the worker processes of its node. Requests (start, stop, drain,
restart) only record a goal and wake the supervisor; `tick()` does all the process work, one worker after
the other, in the supervisor thread. So nothing blocks a Celery task for long, a drain of many seconds
does not stop other workers from being watched, and tests can drive `tick()` by hand.

Per worker, `tick()` moves through these phases (every wait is bounded by a setting):

    BACKOFF --launch--> STARTING --/health ok--> RUNNING --N failed checks--> UNHEALTHY
       ^                    |  (startup timeout: kill)           (unhealthy timeout: kill)
       +---- crash: exit ---+----------------------------------------------------+
    goal DRAIN:  DRAINING until /health shows running == 0 and queue_depth == 0 (or the drain timeout),
                 then STOPPING: SIGTERM, SIGKILL after the stop timeout, report STOPPED.

A crash (the process exited while it should run) is restarted after `backoff_delay(n)` where n counts
the crashes within `restart_window_s`; the (max_restarts + 1)-th crash in the window gives up: FAILED,
and the controller re-places the replica. What happens is reported to the database through
`inference.actions.workers` (conditional updates, so a late report never undoes a controller decision).

Every `sync_interval_s` the supervisor also compares its processes with the database: live workers of
this node that it does not run are started (a lost Celery message), and processes of workers that the
controller gave up on (STOPPED/FAILED, e.g. after this node was marked offline) are stopped.

An agent that dies does not take its workers with it (each runs in a session of its own): while it is
away the controller keeps them in rotation as long as their /health answers (the node is UNREACHABLE),
and `recover()` in the next agent adopts them by pid, port and process start time instead of
restarting them; processes of workers failed over meanwhile are drained and stopped (reaped).
"""
from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from django.db import close_old_connections, connection

from inference.actions import workers as worker_actions
from inference.agent.adoption import Adoption
from inference.agent.launch import SupervisorConfig, WorkerSpec
from inference.agent.lifecycle import Lifecycle
from inference.agent.processes import KILL_GRACE_S, signal_process
from inference.agent.state import Goal, Managed, Phase
from inference.models import ACTIVE_WORKER_STATUSES
from nodes.resources import process_metrics

logger = logging.getLogger(__name__)

class Supervisor(Lifecycle, Adoption):
    """Owns the worker processes of one node (see the module docstring for the life cycle)."""

    def __init__(self, node_id: int, config: SupervisorConfig, *, clock: Callable[[], float] = time.monotonic):
        self.node_id = node_id
        self.config = config
        self._clock = clock
        self._lock = threading.RLock()
        self._procs: dict[int, Managed] = {}
        self._wake = threading.Event()
        self._next_sync = 0.0
        # (worker id, phase, pid) after the last tick: the heartbeat reads it without waiting for a tick.
        self._snapshot: list[tuple[int, Phase, int | None]] = []
        self._closing = False  # set by shutdown(): no new starts, no DB sync
        config.log_dir.mkdir(parents=True, exist_ok=True)

    # ----------------------------------------------------------------------------------- requests
    def request_start(self, worker_id: int, *, restart: bool = False) -> str:
        """Start a live worker of this node (idempotent). Returns what was done, for logs and task results."""
        with self._lock:
            if self._closing:
                return "ignored: the agent is shutting down"
            if worker_id in self._procs:
                return "already managed"
            worker = self._load(worker_id)
            if worker is None or worker.node_id != self.node_id:
                return "not a worker of this node"
            if worker.status not in ACTIVE_WORKER_STATUSES:
                return f"ignored: worker is {worker.status}"
            spec = WorkerSpec.from_worker(worker, self.config.bind_host)
            self._procs[worker_id] = Managed(
                spec=spec, log_path=self._log_path(worker_id), count_next_launch_as_restart=restart
            )
        self._wake.set()
        return "starting"

    def request_stop(self, worker_id: int, *, drain: bool) -> str:
        """Stop a worker; with `drain`, first wait (bounded) until it has no request in flight."""
        with self._lock:
            managed = self._procs.get(worker_id)
            if managed is None:
                # Nothing runs here for it (never started, or already gone): it is stopped.
                worker_actions.report_stopped(worker_id)
                return "not running; marked stopped"
            serving = managed.phase in (Phase.RUNNING, Phase.UNHEALTHY, Phase.DRAINING)
            if managed.goal != Goal.STOP:
                managed.goal = Goal.DRAIN if drain and serving else Goal.STOP
        self._wake.set()
        return "draining" if managed.goal == Goal.DRAIN else "stopping"

    def request_restart(self, worker_id: int) -> str:
        """Restart a worker's process now (stop without drain, start again; counts as a restart)."""
        with self._lock:
            managed = self._procs.get(worker_id)
            if managed is None:
                return self.request_start(worker_id, restart=True)
            if managed.goal in (Goal.STOP, Goal.DRAIN):
                return f"ignored: worker is being stopped ({managed.goal})"
            managed.goal = Goal.RESTART
            managed.count_next_launch_as_restart = True
        self._wake.set()
        return "restarting"

    # ---------------------------------------------------------------------------------- inspection
    def managed(self) -> dict[int, Managed]:
        """A snapshot of the managed workers (tests and the heartbeat read it)."""
        with self._lock:
            return dict(self._procs)

    def process_stats(self) -> dict[str, Any]:
        """Per worker id: phase, pid and the process's RSS/CPU (for Node.last_metrics), as of the last tick."""
        stats: dict[str, Any] = {}
        for wid, phase, pid in self._snapshot:
            entry: dict[str, Any] = {"phase": str(phase), "pid": pid}
            if pid is not None:
                entry.update(process_metrics(pid) or {})
            stats[str(wid)] = entry
        return stats

    # -------------------------------------------------------------------------------------- loop
    def run(self, stop: threading.Event) -> None:
        """Tick until `stop` is set (the supervisor thread's body)."""
        try:
            while not stop.is_set():
                close_old_connections()  # a DB restart must not kill the agent's thread
                try:
                    self.tick()
                except Exception:  # noqa: BLE001  one bad tick (DB down, ...) must not end supervision
                    logger.exception("supervisor tick failed")
                self._wake.wait(self.config.health_interval_s)
                self._wake.clear()
        finally:
            connection.close()

    def tick(self) -> None:
        """One pass over every managed worker (launch, health-check, drain, stop), then maybe a DB sync."""
        with self._lock:
            for managed in list(self._procs.values()):
                try:
                    self._step(managed)
                except Exception:  # noqa: BLE001  one worker's trouble must not starve the others
                    logger.exception("supervising worker #%s failed", managed.spec.worker_id)
            if not self._closing and self._clock() >= self._next_sync:
                self._next_sync = self._clock() + self.config.sync_interval_s
                self.sync_with_db()
            self._snapshot = [(wid, m.phase, m.pid) for wid, m in self._procs.items()]

    def wait_until(self, predicate: Callable[[], bool], timeout: float, interval: float = 0.2) -> bool:
        """Tick until `predicate()` holds or `timeout` passes (tests and shutdown)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.tick()
            if predicate():
                return True
            time.sleep(interval)
        return predicate()

    def shutdown(self, *, stop_workers: bool = True) -> None:
        """Stop every worker (SIGTERM, then SIGKILL after the stop timeout), bounded; or just let go of them."""
        with self._lock:
            self._closing = True
        if not stop_workers:
            with self._lock:
                self._procs.clear()
            return
        with self._lock:
            for managed in self._procs.values():
                managed.goal = Goal.STOP
        limit = self.config.stop_timeout_s + KILL_GRACE_S + 1.0
        if not self.wait_until(lambda: not self._procs, timeout=limit):
            with self._lock:
                for managed in self._procs.values():
                    if managed.pid is not None:
                        signal_process(managed.pid, signal.SIGKILL)
                self._procs.clear()
