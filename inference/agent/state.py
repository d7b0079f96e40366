"""The supervisor's state: per worker its goal, phase and process (Managed), and what the supervisor's parts
(inference.agent.lifecycle, inference.agent.adoption, inference.agent.supervisor) share.
"""
from __future__ import annotations

import enum
import logging
import subprocess
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from inference.agent.launch import SupervisorConfig, WorkerSpec
from inference.models import Worker

logger = logging.getLogger(__name__)

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


class SupervisorState:
    """What the supervisor's parts (Lifecycle, Adoption, Supervisor) share; Supervisor.__init__ sets it."""

    node_id: int
    config: SupervisorConfig
    _clock: Callable[[], float]
    _lock: threading.RLock
    _procs: dict[int, Managed]
    _wake: threading.Event
    _next_sync: float
    _snapshot: list[tuple[int, Phase, int | None]]
    _closing: bool

    def _load(self, worker_id: int) -> Worker | None:
        return Worker.objects.select_related("deployment__model", "node").filter(pk=worker_id).first()

    def _log_path(self, worker_id: int) -> Path:
        return self.config.log_dir / f"worker-{worker_id}.log"

    def request_start(self, worker_id: int, *, restart: bool = False) -> str:
        """Record the goal RUN for a worker (Supervisor implements it; the sync with the database calls it)."""
        raise NotImplementedError
