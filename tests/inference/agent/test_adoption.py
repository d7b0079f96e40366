"""An agent killed while it launches a worker: the next agent finds the process by the marker in its
environment (inference.agent.launch.worker_marker), adopts it once, and stops it with the platform.

Real processes: the first supervisor launches a tiny-model worker through its own launch path and "dies"
right after the fork, before it records the pid (report_launched raises a BaseException there, which no
tick catches, and the supervisor is abandoned without shutdown, as a SIGKILL would leave it). The
supervisor is driven by hand (`tick()` in the test thread), as in test_supervisor.py.
"""
from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest
from django.utils import timezone

from inference.agent import lifecycle
from inference.agent.launch import WORKER_MARKER_ENV, worker_marker
from inference.agent.processes import is_zombie, marked_worker_processes
from inference.agent.supervisor import Supervisor
from inference.models import Worker, WorkerStatus
from tests.inference.agent.test_supervisor import config, fresh, kill_leftovers, pending_tiny_decode, status
from tests.support.control_plane import make_deployment, make_model, make_node, make_worker
from tests.support.processes import free_port

pytestmark = pytest.mark.django_db


class AgentKilled(BaseException):
    """The agent died here (a BaseException: the supervisor's tick catches only Exception)."""


def gone(pid: int) -> bool:
    return not psutil.pid_exists(pid) or is_zombie(pid)


def processes_of(worker: Worker) -> list[int]:
    """The live launch_server processes carrying the worker's marker."""
    marker = worker_marker(Worker.objects.select_related("node").get(pk=worker.pk))
    return sorted(p.pid for value, p in marked_worker_processes(WORKER_MARKER_ENV) if value == marker)


def launch_and_die(sup: Supervisor, worker: Worker, monkeypatch: pytest.MonkeyPatch) -> subprocess.Popen[bytes]:
    """Start the worker through `sup` and kill the "agent" between the fork and the pid's record."""

    def killed(*args: object, **kwargs: object) -> bool:
        raise AgentKilled

    monkeypatch.setattr(lifecycle.worker_actions, "report_launched", killed)
    assert sup.request_start(worker.pk) == "starting"
    with pytest.raises(AgentKilled):
        sup.tick()
    monkeypatch.undo()
    popen = sup.managed()[worker.pk].popen
    assert popen is not None and popen.poll() is None
    return popen


def sleeper(marker: str, port: int) -> subprocess.Popen[bytes]:
    """A process that looks like a worker to the scan (launch_server and --port on its command line) and
    carries `marker`; it only sleeps."""
    import os

    return subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)", "inference.launch_server", "--port", str(port)],
        env={**os.environ, WORKER_MARKER_ENV: marker}, start_new_session=True,
    )


def test_worker_launched_by_an_agent_killed_before_recording_it_is_adopted_once_and_stopped(
    tiny_model_dir: Path, log_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    decode = pending_tiny_decode(tiny_model_dir)
    node = decode.node
    first = Supervisor(node.pk, config(log_dir / f"agent-{uuid.uuid4().hex[:6]}"))
    orphan = launch_and_die(first, decode, monkeypatch)
    second: Supervisor | None = None
    try:
        assert fresh(decode).pid is None and status(decode) == WorkerStatus.PENDING  # nothing recorded

        second = Supervisor(node.pk, config(log_dir / f"agent-{uuid.uuid4().hex[:6]}"))
        outcome = second.recover()
        assert outcome["adopted"] == [decode.pk] and outcome["relaunched"] == [], outcome
        assert outcome["unrecorded_stopped"] == []
        recorded = fresh(decode)
        assert recorded.pid == orphan.pid and recorded.process_started_at is not None
        assert recorded.status == WorkerStatus.STARTING and recorded.restarts == 0
        ok = second.wait_until(lambda: status(decode) == WorkerStatus.RUNNING, timeout=150)
        assert ok, fresh(decode).last_error
        # Not lost, not duplicated: the one process launched by the killed agent serves the worker.
        assert fresh(decode).pid == orphan.pid and processes_of(decode) == [orphan.pid]

        second.shutdown()
        orphan.wait(timeout=30)
        assert processes_of(decode) == [] and status(decode) == WorkerStatus.STOPPED
    finally:
        kill_leftovers(orphan.pid)
        orphan.wait(timeout=10)
        if second is not None:
            second.shutdown(stop_workers=False)


def test_unrecorded_processes_of_stopped_or_duplicated_workers_are_stopped_and_others_left_alone(
    tmp_path: Path,
) -> None:
    dep = make_deployment(model=make_model(path=str(tmp_path)))
    node = make_node(address="127.0.0.1", last_heartbeat=timezone.now())
    given_up = make_worker(dep, node, role="decode", port=free_port(), status="stopped", pid=None)
    running = make_worker(dep, node, role="prefill", port=free_port(), status="running", pid=None)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        stale = sleeper(worker_marker(given_up), given_up.port)
        recorded = sleeper(worker_marker(running), running.port)
        duplicate = sleeper(worker_marker(running), running.port)
        # The same node name and worker id in another platform's database (another creation time).
        foreign_marker = worker_marker(running).rsplit("/", 1)[0] + "/12.000000"
        foreign = sleeper(foreign_marker, running.port)
        procs = [stale, recorded, duplicate, foreign]
        started = psutil.Process(recorded.pid).create_time()
        Worker.objects.filter(pk=running.pk).update(pid=recorded.pid, process_started_at=started)

        sup = Supervisor(node.pk, config(tmp_path / "agent", stop_timeout_s=2.0))
        outcome = sup.recover()
        assert sorted(outcome["unrecorded_stopped"]) == sorted([stale.pid, duplicate.pid])
        assert outcome["adopted"] == [running.pk]
        assert stale.wait(timeout=10) is not None and duplicate.wait(timeout=10) is not None
        assert recorded.poll() is None and foreign.poll() is None
        assert fresh(running).pid == recorded.pid
        sup.shutdown(stop_workers=False)
    finally:
        for proc in procs:
            kill_leftovers(proc.pid)
            proc.wait(timeout=10)
