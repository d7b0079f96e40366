"""A worker whose KV pool does not fit its node's memory (host_memory.py: the workers already there claimed
it) is FAILED at its first launch with that reason, not restarted in a crash loop."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
from django.utils import timezone

from inference.actions import workers as worker_actions
from inference.agent.lifecycle import LAUNCH_HEADER, POOL_TOO_SMALL_LINE, Lifecycle, memory_refusal
from inference.agent.state import Managed
from inference.agent.supervisor import Supervisor
from inference.engine.host_memory import CLAIMS_DIR_ENV, HOST_MEMORY_ENV
from inference.engine.memory import POOL_TOO_SMALL_PREFIX
from inference.models import ScaleEvent, Worker, WorkerStatus
from inference.server.errors import EXIT_KV_POOL_TOO_SMALL
from tests.support.control_plane import make_deployment, make_model, make_node, make_worker
from tests.support.processes import build_kernels_once, free_port

from .test_supervisor import config

pytestmark = pytest.mark.django_db


def test_refusal_line_matches_the_engine_and_only_the_last_launch_counts() -> None:
    """The agent's marker is what launch_server prints for KVPoolTooSmall; an earlier launch's refusal in
    the same log does not make a later crash a refusal."""
    assert POOL_TOO_SMALL_LINE == "error: " + POOL_TOO_SMALL_PREFIX
    refused = f"{LAUNCH_HEADER}2026 launching: x\nloading\n{POOL_TOO_SMALL_LINE}--kv-cache-memory (default) leaves 0 B"
    assert memory_refusal(refused) == POOL_TOO_SMALL_PREFIX + "--kv-cache-memory (default) leaves 0 B"
    assert memory_refusal(refused + f"{LAUNCH_HEADER}2026 launching: x\nTraceback: boom\n") is None
    assert memory_refusal("error: cannot load the model from --model-path x\n") is None
    assert memory_refusal("") is None


def test_the_exit_code_decides_and_the_log_line_explains(tmp_path: Path) -> None:
    """Exit code EXIT_KV_POOL_TOO_SMALL is a refusal, its message from the log (or a plain one when the log
    lost it); exit 1 is a crash even with a refusal line in the log (a retry may fit); an adopted process,
    whose code is unknown, is judged by its log line."""
    log = tmp_path / "w.log"
    log.write_text(f"{LAUNCH_HEADER}2026 launching: x\n{POOL_TOO_SMALL_LINE}--kv-cache-memory leaves 0 B\n")
    m = Managed(spec=None, log_path=log)  # type: ignore[arg-type]
    refuse = Lifecycle._memory_refusal
    assert refuse(None, m, EXIT_KV_POOL_TOO_SMALL) == POOL_TOO_SMALL_PREFIX + "--kv-cache-memory leaves 0 B"  # type: ignore[arg-type]
    assert refuse(None, m, 1) is None  # type: ignore[arg-type]
    assert refuse(None, m, "unknown (adopted process)") == POOL_TOO_SMALL_PREFIX + "--kv-cache-memory leaves 0 B"  # type: ignore[arg-type]
    log.write_text("")
    assert "exit code 75" in str(refuse(None, m, EXIT_KV_POOL_TOO_SMALL))  # type: ignore[arg-type]
    assert refuse(None, m, "unknown (adopted process)") is None  # type: ignore[arg-type]


def test_worker_that_does_not_fit_fails_at_once(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real tiny-model worker on a node whose memory is already claimed (a simulated host of 0 bytes):
    one launch, then FAILED with the worker's own message, a recovery event, and no restart."""
    build_kernels_once()
    monkeypatch.setenv(CLAIMS_DIR_ENV, str(tmp_path / "claims"))  # the worker inherits the agent's environment
    monkeypatch.setenv(HOST_MEMORY_ENV, "0")
    dep = make_deployment(model=make_model(path=str(tiny_model_dir)), context_length=256, batch_size=4,
                          threads_per_worker=1)
    node = make_node(address="127.0.0.1", last_heartbeat=timezone.now())
    worker = make_worker(dep, node, role="prefill", port=free_port(), status="pending", pid=None, cpu_ids=[0])
    crashes: list[str] = []
    real_crashed = worker_actions.report_crashed

    def crashed(worker_id: int, *, error: str) -> bool:
        crashes.append(error)
        return real_crashed(worker_id, error=error)

    monkeypatch.setattr(worker_actions, "report_crashed", crashed)
    sup = Supervisor(node.pk, config(tmp_path / "logs", backoff_base_s=0.1, max_restarts=3))
    started = time.monotonic()
    assert sup.request_start(worker.pk) == "starting"
    ok = sup.wait_until(lambda: Worker.objects.get(pk=worker.pk).status == WorkerStatus.FAILED, timeout=120)
    failed = Worker.objects.get(pk=worker.pk)
    assert ok, failed.last_error
    first_line = failed.last_error.splitlines()[0]
    assert first_line.startswith(f"not restarted (exit code {EXIT_KV_POOL_TOO_SMALL}): KV pool too small: ")
    assert "--kv-cache-memory (default: 40% of the memory available and not claimed" in first_line
    assert failed.restarts == 0 and failed.pid is None and not crashes and not sup.managed()
    event = ScaleEvent.objects.filter(deployment=dep, source="recovery").latest("pk")
    # The recovery event names the cause (not "repeated crashes": it never crashed twice).
    want = f"failover: prefill worker #{worker.pk} does not fit its node's memory (not restarted"
    assert event.reason.startswith(want), event.reason
    assert "repeated crashes" not in event.reason
    assert time.monotonic() - started < 120
