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

import contextlib
import enum
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
from django.conf import settings
from django.db import close_old_connections, connection

from inference.actions import recovery
from inference.actions import workers as worker_actions
from inference.models import ACTIVE_WORKER_STATUSES, Worker, WorkerRole, WorkerStatus
from inference.server.args import ServerArgs
from nodes.resources import forget_process, process_metrics

logger = logging.getLogger(__name__)

# Bytes of a worker's log quoted in last_error when it crashes: enough for a Python traceback.
LOG_TAIL_BYTES = 2000
# After SIGKILL a process normally disappears at once; one stuck in the kernel is given up on after this.
KILL_GRACE_S = 5.0
# Slack when comparing a process's start time with the one recorded at launch.
START_TIME_TOLERANCE_S = 0.5


def backoff_delay(crashes: int, base_s: float, max_s: float) -> float:
    """Seconds to wait before restarting after the `crashes`-th crash in the window: base * 2^(n-1), capped."""
    if crashes <= 0:
        return 0.0
    # The exponent is capped so that a large count cannot overflow the float.
    return float(min(max_s, base_s * (2 ** min(crashes - 1, 30))))


@dataclass
class SupervisorConfig:
    """Timeouts, backoff and paths of a supervisor (defaults from the AGENT_* settings)."""

    log_dir: Path
    bind_host: str | None = None  # address workers listen on; None: the node's address
    health_interval_s: float = 2.0
    health_timeout_s: float = 2.0
    health_failures: int = 3  # consecutive failed checks before RUNNING turns UNHEALTHY
    startup_timeout_s: float = 180.0
    unhealthy_timeout_s: float = 30.0
    backoff_base_s: float = 1.0
    backoff_max_s: float = 60.0
    max_restarts: int = 5
    restart_window_s: float = 600.0
    stop_timeout_s: float = 10.0
    drain_timeout_s: float = 120.0
    sync_interval_s: float = 5.0
    python: str = sys.executable

    @classmethod
    def from_settings(cls, **overrides: Any) -> SupervisorConfig:
        """A config from Django settings; keyword arguments win."""
        values: dict[str, Any] = {
            "log_dir": Path(settings.AGENT_LOG_DIR),
            "health_interval_s": settings.AGENT_HEALTH_INTERVAL_S,
            "health_timeout_s": settings.AGENT_HEALTH_TIMEOUT_S,
            "health_failures": settings.AGENT_HEALTH_FAILURES,
            "startup_timeout_s": settings.AGENT_STARTUP_TIMEOUT_S,
            "unhealthy_timeout_s": settings.AGENT_UNHEALTHY_TIMEOUT_S,
            "backoff_base_s": settings.AGENT_RESTART_BACKOFF_S,
            "backoff_max_s": settings.AGENT_RESTART_BACKOFF_MAX_S,
            "max_restarts": settings.AGENT_MAX_RESTARTS,
            "restart_window_s": settings.AGENT_RESTART_WINDOW_S,
            "stop_timeout_s": settings.AGENT_STOP_TIMEOUT_S,
            "drain_timeout_s": settings.AGENT_DRAIN_TIMEOUT_S,
            "sync_interval_s": settings.AGENT_SYNC_INTERVAL_S,
        }
        values.update(overrides)
        return cls(**values)


@dataclass(frozen=True)
class WorkerSpec:
    """Everything needed to launch one worker process (built from its Worker row)."""

    worker_id: int
    role: str
    model_path: str
    model_name: str
    host: str
    port: int
    kv_port: int | None
    context_length: int
    batch_size: int
    block_size: int
    cpu_ids: tuple[int, ...]
    num_threads: int
    max_sequence_length: int | None
    gpu_ids: tuple[int, ...]
    kv_transport: str = "tcp"
    rdma_device: str | None = None

    @classmethod
    def from_worker(cls, worker: Worker, bind_host: str | None = None) -> WorkerSpec:
        """The launch spec of a Worker (with deployment, model and node loaded)."""
        deployment = worker.deployment
        model_path = Path(deployment.model.path)
        if not model_path.is_absolute():
            # Model paths are stored relative to the checkout, which is the same on every node.
            model_path = Path(settings.BASE_DIR) / model_path
        cpu_ids = tuple(int(c) for c in worker.cpu_ids or [])
        rdma = deployment.kv_transport == "rdma"
        return cls(
            worker_id=worker.pk,
            role=worker.role,
            model_path=str(model_path),
            model_name=deployment.model.name,
            host=bind_host or worker.node.address,
            port=worker.port,
            kv_port=worker.kv_port,
            context_length=deployment.context_length,
            batch_size=deployment.batch_size,
            block_size=deployment.block_size,
            cpu_ids=cpu_ids,
            num_threads=len(cpu_ids) or max(1, deployment.threads_per_worker),
            max_sequence_length=deployment.max_sequence_length,
            gpu_ids=tuple(int(g) for g in worker.gpu_ids or []),
            kv_transport="rdma" if rdma else "tcp",
            rdma_device=(worker.node.rdma_devices or [None])[0] if rdma else None,
        )

    def server_args(self) -> ServerArgs:
        """The worker's configuration as the worker itself parses it (inference.server.args)."""
        return ServerArgs.with_defaults(
            model_path=self.model_path,
            service_type=self.role,
            host=self.host,
            port=self.port,
            context_length=self.context_length,
            batch_size=self.batch_size,
            block_size=self.block_size,
            num_threads=self.num_threads,
            served_model_name=self.model_name,
            kv_transport=self.kv_transport,
            # The controller hands out contiguous CPU ranges: the worker pins [base, base + threads).
            base_cpu_id=self.cpu_ids[0] if self.cpu_ids else None,
            max_sequence_length=self.max_sequence_length or None,
            # Only decode workers listen for KV writes; 0 lets one pick a free port (its /info says which).
            kv_port=self.kv_port if self.role == WorkerRole.DECODE and self.kv_port else 0,
            rdma_device=self.rdma_device,
        )

    def command(self, python: str = sys.executable) -> list[str]:
        """The worker's command line: `python -m inference.launch_server` with ServerArgs.to_argv()."""
        return [python, "-m", "inference.launch_server", *self.server_args().to_argv()]

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """The worker's environment: the agent's, with CUDA_VISIBLE_DEVICES from gpu_ids ("" = CPU only)."""
        env = dict(os.environ if base is None else base)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in self.gpu_ids)
        env["PYTHONUNBUFFERED"] = "1"
        # The worker is not a Django process; settings of the agent must not leak into it.
        env.pop("DJANGO_SETTINGS_MODULE", None)
        return env

    @property
    def probe_host(self) -> str:
        """Where the agent reaches the worker: loopback when it listens on every address."""
        if self.host in ("0.0.0.0", ""):
            return "127.0.0.1"
        if self.host == "::":
            return "::1"
        return self.host

    @property
    def base_url(self) -> str:
        """The worker's HTTP base URL as the agent reaches it."""
        host = f"[{self.probe_host}]" if ":" in self.probe_host else self.probe_host
        return f"http://{host}:{self.port}"


class Goal(enum.StrEnum):
    """What the agent was asked to do with a worker."""

    RUN = "run"
    DRAIN = "drain"
    STOP = "stop"
    RESTART = "restart"


class Phase(enum.StrEnum):
    """Where a worker's process is (the agent's view; the database status follows it)."""

    BACKOFF = "backoff"  # no process; (re)launch at next_start_at
    STARTING = "starting"
    RUNNING = "running"
    UNHEALTHY = "unhealthy"
    DRAINING = "draining"
    STOPPING = "stopping"  # SIGTERM sent


@dataclass
class Managed:
    """The supervisor's record of one worker."""

    spec: WorkerSpec
    log_path: Path
    goal: Goal = Goal.RUN
    phase: Phase = Phase.BACKOFF
    popen: subprocess.Popen[bytes] | None = None
    adopted: psutil.Process | None = None  # a process started by an earlier agent (not our child)
    pid: int | None = None
    launches: int = 0
    count_next_launch_as_restart: bool = False
    next_start_at: float = 0.0
    launched_at: float = 0.0
    crashes: deque[float] = field(default_factory=deque)
    health_failures: int = 0
    unhealthy_since: float | None = None
    drain_deadline: float | None = None
    term_sent_at: float | None = None
    kill_sent: bool = False
    kv_port_reported: bool = False
    last_health: dict[str, Any] = field(default_factory=dict)


def probe_json(url: str, timeout: float) -> dict[str, Any] | None:
    """GET a worker endpoint; its JSON object, or None on any error or non-200 answer."""
    try:
        response = httpx.get(url, timeout=timeout)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    try:
        body = response.json()
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def is_idle(health: Mapping[str, Any]) -> bool:
    """Whether a worker has nothing in flight: no running sequence, nothing queued, no KV block held.

    running == 0 and queue_depth == 0 is the drain condition; kv_usage == 0 is checked too because a
    decode worker's requests that reserved blocks and wait for their prompt KV from a prefill worker
    appear in neither count (the engine's `num_reserved`), yet stopping the worker would fail them.
    """
    try:
        return (
            int(health.get("running", 0)) == 0
            and int(health.get("queue_depth", 0)) == 0
            and float(health.get("kv_usage", 0.0) or 0.0) == 0.0
        )
    except (TypeError, ValueError):
        return False


def port_free(host: str, port: int) -> bool:
    """Whether a worker could bind host:port now (SO_REUSEADDR, as uvicorn binds)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def process_start_time(pid: int) -> float | None:
    """The process's start time in epoch seconds as the OS reports it (None when it is gone)."""
    try:
        return float(psutil.Process(pid).create_time())
    except (psutil.Error, OSError):
        return None


def worker_process_matches(pid: int, port: int, started_at: float | None = None) -> bool:
    """Whether `pid` is a live launch_server process serving `port`, started at `started_at` when known.

    All three are checked because a pid alone may have been reused by an unrelated process since the
    worker ran (after a reboot, say); the start time also tells apart a later launch_server on that port.
    """
    return process_mismatch(pid, port, started_at) is None


def process_mismatch(pid: int, port: int, started_at: float | None = None) -> str | None:
    """Why `pid` is not the worker's process (see `worker_process_matches`), or None when it is."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return "the process is a zombie"
        cmdline = proc.cmdline()
        created = proc.create_time()
    except (psutil.Error, OSError) as exc:
        return f"no such process ({type(exc).__name__})"
    # create_time is derived from boot time and clock ticks: equal for one process, to well under this.
    if started_at is not None and abs(created - started_at) > START_TIME_TOLERANCE_S:
        return f"started at {created:.3f}, not {started_at:.3f}"
    if "inference.launch_server" not in cmdline:
        return "not a launch_server process"
    try:
        if cmdline[cmdline.index("--port") + 1] == str(port):
            return None
    except (ValueError, IndexError):
        return "no --port on its command line"
    return f"it serves another port than {port}"


def signal_process(pid: int, sig: int) -> None:
    """Send `sig` to the worker's process group (it leads its own session), else to the process itself."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        pass
    except PermissionError:
        logger.warning("no permission to signal pid %s", pid)


def log_tail(path: Path, limit: int = LOG_TAIL_BYTES) -> str:
    """The last `limit` bytes of a log file as text ("" when missing)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - limit))
            return fh.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


class Supervisor:
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

    # ------------------------------------------------------------------------------ recovery/sync
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

    # ------------------------------------------------------------------------------- state machine
    def _step(self, m: Managed) -> None:
        now = self._clock()
        wid = m.spec.worker_id
        if m.phase == Phase.STOPPING:
            self._step_stopping(m, now)
            return
        if m.goal in (Goal.STOP, Goal.RESTART):
            if self._alive(m):
                self._begin_stop(m, now, report=m.goal == Goal.STOP)
            elif m.goal == Goal.RESTART:
                m.goal = Goal.RUN
                self._launch(m, now)
            else:
                self._forget(m, error=None)
            return
        if m.goal == Goal.DRAIN:
            self._step_draining(m, now)
            return
        if m.phase == Phase.BACKOFF:
            if now >= m.next_start_at:
                self._launch(m, now)
            return
        code = self._exit_code(m)
        if code is not None:
            self._crashed(m, now, f"worker process exited with code {code}")
            return
        health = probe_json(m.spec.base_url + "/health", self.config.health_timeout_s)
        if health is not None and health.get("status") == "healthy":
            m.health_failures = 0
            m.unhealthy_since = None
            m.last_health = health
            kv_port = None
            if m.spec.role == WorkerRole.DECODE and not m.kv_port_reported:
                info = probe_json(m.spec.base_url + "/info", self.config.health_timeout_s) or {}
                if isinstance(info.get("kv_port"), int):
                    kv_port = int(info["kv_port"])
                    m.kv_port_reported = True
            running = worker_actions.report_healthy(wid, health=health, kv_port=kv_port)
            if m.phase != Phase.RUNNING:
                logger.info("worker #%s healthy on %s (pid %s)", wid, m.spec.base_url, m.pid)
            m.phase = Phase.RUNNING
            if not running:
                # DRAINING/STOPPING/STOPPED in the database: the next sync turns that into our goal.
                self._next_sync = 0.0
            return
        m.health_failures += 1
        why = "health check failed" if health is None else f"unhealthy answer: {health}"
        if m.phase == Phase.STARTING:
            if now - m.launched_at > self.config.startup_timeout_s:
                self._kill_now(m.pid, m.popen)
                self._crashed(m, now, f"not healthy within {self.config.startup_timeout_s:.0f}s of its start")
        elif m.phase == Phase.RUNNING and m.health_failures >= self.config.health_failures:
            m.phase = Phase.UNHEALTHY
            m.unhealthy_since = now
            logger.warning("worker #%s unhealthy: %s", wid, why)
            worker_actions.report_unhealthy(wid, error=f"{why} ({m.health_failures} times in a row)")
        elif m.phase == Phase.UNHEALTHY and m.unhealthy_since is not None:
            if now - m.unhealthy_since > self.config.unhealthy_timeout_s:
                self._kill_now(m.pid, m.popen)
                self._crashed(m, now, f"unhealthy for over {self.config.unhealthy_timeout_s:.0f}s: {why}")

    def _step_draining(self, m: Managed, now: float) -> None:
        wid = m.spec.worker_id
        if not self._alive(m):
            self._forget(m, error=None)
            return
        if m.phase != Phase.DRAINING:
            m.phase = Phase.DRAINING
            m.drain_deadline = now + self.config.drain_timeout_s
            m.health_failures = 0
            worker_actions.report_draining(wid)
            logger.info("worker #%s draining (at most %.0fs)", wid, self.config.drain_timeout_s)
        health = probe_json(m.spec.base_url + "/health", self.config.health_timeout_s)
        if health is None:
            m.health_failures += 1
        else:
            m.health_failures = 0
            m.last_health = health
        if health is not None and is_idle(health):
            logger.info("worker #%s drained", wid)
        elif m.drain_deadline is not None and now >= m.drain_deadline:
            logger.warning("worker #%s still busy after the drain timeout; stopping it anyway", wid)
        elif m.health_failures >= self.config.health_failures:
            logger.warning("worker #%s does not answer while draining; stopping it", wid)
        else:
            return
        self._begin_stop(m, now, report=True)

    def _step_stopping(self, m: Managed, now: float) -> None:
        sent = m.term_sent_at if m.term_sent_at is not None else now
        if not self._alive(m):
            if m.goal == Goal.RESTART:
                m.goal = Goal.RUN
                m.phase = Phase.BACKOFF
                self._launch(m, now)
            else:
                self._forget(m, error=None)
            return
        if not m.kill_sent and now - sent > self.config.stop_timeout_s:
            logger.warning("worker #%s ignored SIGTERM for %.0fs; SIGKILL", m.spec.worker_id, now - sent)
            if m.pid is not None:
                signal_process(m.pid, signal.SIGKILL)
            m.kill_sent = True
        elif m.kill_sent and now - sent > self.config.stop_timeout_s + KILL_GRACE_S:
            self._forget(m, error=f"process {m.pid} survived SIGKILL; given up on")

    # -------------------------------------------------------------------------------------- helpers
    def _launch(self, m: Managed, now: float) -> None:
        wid = m.spec.worker_id
        worker = self._load(wid)
        if worker is None or worker.status not in ACTIVE_WORKER_STATUSES:
            self._forget(m, error=None)
            return
        m.spec = WorkerSpec.from_worker(worker, self.config.bind_host)  # pick up edited deployment flags
        if not port_free(m.spec.host, m.spec.port):
            self._crashed(m, now, f"port {m.spec.host}:{m.spec.port} is in use")
            return
        cmd = m.spec.command(self.config.python)
        with open(m.log_path, "ab") as log:
            log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} launching: {' '.join(cmd)}\n".encode())
            log.flush()
            try:
                popen = subprocess.Popen(
                    cmd, cwd=settings.BASE_DIR, env=m.spec.env(), stdin=subprocess.DEVNULL, stdout=log,
                    stderr=subprocess.STDOUT,
                    # Its own session: the agent's terminal signals do not reach it, and stopping it can
                    # signal the whole group.
                    start_new_session=True,
                )
            except OSError as exc:
                self._crashed(m, now, f"cannot launch the worker: {exc}")
                return
        restart = m.count_next_launch_as_restart or m.launches > 0
        m.popen, m.pid, m.adopted = popen, popen.pid, None
        m.launches += 1
        m.count_next_launch_as_restart = False
        m.phase = Phase.STARTING
        m.launched_at = now
        m.health_failures = 0
        m.unhealthy_since = None
        m.term_sent_at = None
        m.kill_sent = False
        m.kv_port_reported = m.spec.kv_port is not None
        logger.info("worker #%s launched (pid %s): %s", wid, popen.pid, " ".join(cmd))
        started_at = process_start_time(popen.pid)
        if not worker_actions.report_launched(wid, pid=popen.pid, restart=restart, started_at=started_at):
            # Given up on while we launched it (e.g. the node was marked offline): undo.
            m.goal = Goal.STOP

    def _crashed(self, m: Managed, now: float, error: str) -> None:
        wid = m.spec.worker_id
        window = self.config.restart_window_s
        m.crashes.append(now)
        while m.crashes and now - m.crashes[0] > window:
            m.crashes.popleft()
        if m.pid is not None:
            forget_process(m.pid)
        m.popen, m.pid, m.adopted = None, None, None
        tail = log_tail(m.log_path)
        detail = f"{error}\n--- last lines of {m.log_path} ---\n{tail}" if tail else error
        if len(m.crashes) > self.config.max_restarts:
            logger.error("worker #%s: %s; %d crashes within %.0fs, giving up", wid, error, len(m.crashes), window)
            worker_actions.report_failed(
                wid, error=f"gave up after {len(m.crashes)} crashes within {window:.0f}s; last: {detail}"
            )
            del self._procs[wid]
            return
        delay = backoff_delay(len(m.crashes), self.config.backoff_base_s, self.config.backoff_max_s)
        m.phase = Phase.BACKOFF
        m.next_start_at = now + delay
        m.count_next_launch_as_restart = True
        logger.warning("worker #%s: %s; restarting in %.1fs (crash %d of at most %d in %.0fs)",
                       wid, error, delay, len(m.crashes), self.config.max_restarts, window)
        worker_actions.report_crashed(
            wid, error=f"{detail}\nrestart in {delay:.1f}s (crash {len(m.crashes)}, at most "
                       f"{self.config.max_restarts} restarts within {window:.0f}s)"
        )

    def _begin_stop(self, m: Managed, now: float, *, report: bool) -> None:
        if m.pid is not None:
            signal_process(m.pid, signal.SIGTERM)
        m.phase = Phase.STOPPING
        m.term_sent_at = now
        m.kill_sent = False
        if report:
            worker_actions.report_stopping(m.spec.worker_id)

    def _forget(self, m: Managed, *, error: str | None) -> None:
        """The worker's process is gone on purpose: report STOPPED and stop tracking it."""
        if m.pid is not None:
            forget_process(m.pid)
        worker_actions.report_stopped(m.spec.worker_id, error=error)
        self._procs.pop(m.spec.worker_id, None)
        logger.info("worker #%s stopped", m.spec.worker_id)

    def _alive(self, m: Managed) -> bool:
        return m.pid is not None and self._exit_code(m) is None

    def _exit_code(self, m: Managed) -> int | str | None:
        """None while the process runs; its exit code (or a note for an adopted process) once it is gone."""
        if m.popen is not None:
            return m.popen.poll()
        if m.pid is None or m.adopted is None:
            return "no process"
        try:
            if m.adopted.is_running() and m.adopted.status() != psutil.STATUS_ZOMBIE:
                return None
        except psutil.Error:
            pass
        return "unknown (adopted process)"

    def _kill_now(self, pid: int | None, popen: subprocess.Popen[bytes] | None = None) -> None:
        """SIGKILL a process and wait (bounded) until it is gone (reaped, when it is our child)."""
        if pid is None:
            return
        signal_process(pid, signal.SIGKILL)
        if popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(timeout=KILL_GRACE_S)
            return
        deadline = time.monotonic() + KILL_GRACE_S
        while time.monotonic() < deadline:
            if not psutil.pid_exists(pid) or _is_zombie(pid):
                return
            time.sleep(0.05)

    def _load(self, worker_id: int) -> Worker | None:
        return Worker.objects.select_related("deployment__model", "node").filter(pk=worker_id).first()

    def _log_path(self, worker_id: int) -> Path:
        return self.config.log_dir / f"worker-{worker_id}.log"


def _is_zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True
