"""The supervisor's per-worker steps: launch, health watch, crash and backoff, drain, stop.

One `_step` per worker per tick moves it through its phases (see inference.agent.supervisor), reporting
each change through inference.actions.workers.
"""
from __future__ import annotations

import contextlib
import logging
import signal
import subprocess
import time

import psutil
from django.conf import settings

from inference.actions import workers as worker_actions
from inference.agent.launch import WorkerSpec, backoff_delay
from inference.agent.processes import (
    KILL_GRACE_S,
    is_idle,
    is_zombie,
    log_tail,
    port_free,
    probe_json,
    process_start_time,
    signal_process,
)
from inference.agent.state import Goal, Managed, Phase, SupervisorState
from inference.models import ACTIVE_WORKER_STATUSES, FailureCause, WorkerRole
from inference.server.errors import EXIT_KV_POOL_TOO_SMALL
from nodes.resources import forget_process

logger = logging.getLogger(__name__)

# A worker whose KV pool does not fit the node exits with EXIT_KV_POOL_TOO_SMALL, after printing why on its
# log (launch_server prints "error: " and the StartupError; inference.engine.memory.POOL_TOO_SMALL_PREFIX
# begins the message; a test keeps them equal: the agent does not import the engine, which would load torch).
POOL_TOO_SMALL_LINE = "error: KV pool too small: "
LAUNCH_HEADER = "\n=== "  # what _launch writes to the log before each launch


def memory_refusal(log_text: str) -> str | None:
    """The KV-pool refusal line of the last launch in a worker's log (what the event says), None when it
    printed none."""
    last_launch = log_text.rsplit(LAUNCH_HEADER, 1)[-1]
    for line in last_launch.splitlines():
        if line.startswith(POOL_TOO_SMALL_LINE):
            return line.removeprefix("error: ").strip()
    return None


class Lifecycle(SupervisorState):
    """The supervisor's steps of one worker: launch, health watch, crash/backoff, drain and stop."""

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
            refusal = self._memory_refusal(m, code) if m.phase == Phase.STARTING else None
            if refusal is not None:
                self._refused(m, code, refusal)
            else:
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

    def _refused(self, m: Managed, code: int | str, refusal: str) -> None:
        """The worker's KV pool does not fit this node's memory (the workers already here claimed it, or the
        node is too small): a restart here would fail the same way, so FAILED at once and the controller
        places the replica elsewhere (avoiding this node for a while) instead of a crash loop."""
        wid = m.spec.worker_id
        if m.pid is not None:
            forget_process(m.pid)
        m.popen, m.pid, m.adopted = None, None, None
        error = (f"not restarted (exit code {code}): {refusal}\n"
                 f"--- last lines of {m.log_path} ---\n{log_tail(m.log_path)}")
        logger.error("worker #%s: %s", wid, error.splitlines()[0])
        worker_actions.report_failed(wid, error=error, cause=FailureCause.NO_MEMORY)
        del self._procs[wid]

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

    def _memory_refusal(self, m: Managed, code: int | str) -> str | None:
        """Why a starting worker that exited refused to start for lack of memory; None for another exit.
        Its exit code says so; an adopted process's code is unknown, and then its log line does."""
        line = memory_refusal(log_tail(m.log_path))
        if code == EXIT_KV_POOL_TOO_SMALL:
            return line or f"KV pool too small for this node's memory (exit code {code})"
        return line if isinstance(code, str) else None

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
            if not psutil.pid_exists(pid) or is_zombie(pid):
                return
            time.sleep(0.05)
