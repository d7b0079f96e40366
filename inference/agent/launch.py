"""How the agent launches a worker: its process's argv and environment (WorkerSpec, from the Worker row and
the deployment's flags), the supervisor's settings (SupervisorConfig) and the restart backoff.
"""
from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.conf import settings

from inference.models import Worker, WorkerRole
from inference.models.deployments import Speculative
from inference.server.args import ServerArgs

logger = logging.getLogger(__name__)

# The environment variable naming a worker process's worker (`worker_marker`): set from the exec on, so an
# agent killed before it recorded a launched process's pid still lets the next agent find that process.
WORKER_MARKER_ENV = "PLATFORM_WORKER"


def worker_marker(worker: Worker) -> str:
    """"<node name>/<worker id>/<created_at epoch seconds>": one worker row of one platform (the creation
    time to the microsecond tells apart rows of the same id in other platforms' databases on the host)."""
    return f"{worker.node.name}/{worker.pk}/{worker.created_at.timestamp():.6f}"


def parse_marker(value: str) -> tuple[str, int] | None:
    """(node name, worker id) of a worker_marker() value; None when it is not one."""
    parts = value.split("/")
    if len(parts) != 3 or not parts[1].isdigit():
        return None
    return parts[0], int(parts[1])


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
    speculative: str | None = None
    num_speculative_tokens: int | None = None
    marker: str = ""  # worker_marker(), in the process's environment as WORKER_MARKER_ENV

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
        # Only workers that decode speculate (a prefill worker samples one token per prompt).
        speculates = deployment.speculative != Speculative.OFF and worker.role != WorkerRole.PREFILL
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
            speculative=deployment.speculative if speculates else None,
            num_speculative_tokens=deployment.num_speculative_tokens if speculates else None,
            marker=worker_marker(worker),
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
            speculative=self.speculative,
            num_speculative_tokens=self.num_speculative_tokens if self.speculative else None,
        )

    def command(self, python: str = sys.executable) -> list[str]:
        """The worker's command line: `python -m inference.launch_server` with ServerArgs.to_argv()."""
        return [python, "-m", "inference.launch_server", *self.server_args().to_argv()]

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """The worker's environment: the agent's, with CUDA_VISIBLE_DEVICES from gpu_ids ("" = CPU only) and
        the worker's marker (WORKER_MARKER_ENV)."""
        env = dict(os.environ if base is None else base)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in self.gpu_ids)
        env["PYTHONUNBUFFERED"] = "1"
        if self.marker:
            env[WORKER_MARKER_ENV] = self.marker
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
