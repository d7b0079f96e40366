"""`manage.py agent` with real processes: a SIGTERM while the agent starts still stops the workers it takes
over, and a node that registers gets the deployments waiting for capacity placed at once.

The managed platform on 127.0.0.1 (tests/support/managed_platform.py: private PostgreSQL and Redis, the
controller, the router for the REST API, agents) with a deployment of the tiny model (1 prefill + 1 decode).
The agent is SIGKILLed (its workers serve on) and a new one started; that one gets SIGTERM as soon as it
handles the signal (`manage.py agent` installs the handler before Django is set up; at most 0.5 s after
its start in any case). Before the fix the default action ended it during Django's set-up and both
workers outlived the platform. Then a third agent registers the node again: the deployment, unplaced
while the node was OFFLINE, is reconciled by its registration, not by the controller's 30 s reconcile_all.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.support.managed_platform import ManagedPlatform

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SIGTERM_BIT = 1 << (signal.SIGTERM - 1)


def handles_sigterm(pid: int) -> bool:
    """Whether the process has a handler for SIGTERM (SigCgt in /proc/<pid>/status)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(caught, 16) & SIGTERM_BIT)


def worker_pids(plat: ManagedPlatform) -> list[int]:
    """Live launch_server processes of this platform (they carry its environment)."""
    pids = []
    for pid in plat.platform_pids():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"inference.launch_server" in cmdline:
            pids.append(pid)
    return sorted(pids)


def test_sigterm_while_the_agent_starts_stops_its_workers_and_registration_places_waiting_work(
    tmp_path: Path, log_dir: Path, tiny_model_dir: Path
) -> None:
    plat = ManagedPlatform(log_dir / f"agent-start-{int(time.time())}", tmp_path / "var")
    left: list[int] = [-1]
    try:
        plat.start_services()
        plat.start_controller()
        plat.start_agent()
        plat.start_router("agentstart")
        dep = plat.create_deployment("agentstart", tiny_model_dir, 1, 1)
        first = plat.wait_for("1 prefill + 1 decode RUNNING", lambda: plat.running(dep, 1, 1), 300)
        assert sorted(w["pid"] for w in first) == worker_pids(plat)

        plat.kill("agent")  # SIGKILL: the workers serve on without their agent
        assert worker_pids(plat) == sorted(w["pid"] for w in first)
        second = plat.start_agent("agent-2")
        started = time.monotonic()
        while not handles_sigterm(second.popen.pid) and time.monotonic() - started < 0.5:
            time.sleep(0.005)
        os.kill(second.popen.pid, signal.SIGTERM)
        code = second.popen.wait(timeout=90)
        assert code == 0, second.log()[-3000:]
        assert "stop signal during start-up" in second.log() or " ready." in second.log(), second.log()[-3000:]
        # It stopped the workers it took over, and said so: nothing of the deployment runs, nothing is live.
        assert worker_pids(plat) == [], second.log()[-3000:]
        assert plat.node()["status"] == "offline"
        assert all(w["status"] in ("stopped", "failed") for w in plat.workers(dep))

        # The node registers again: its registration reconciles the deployment, which is placed on it.
        third = plat.start_agent("agent-3")
        again = plat.wait_for("1 prefill + 1 decode RUNNING again", lambda: plat.running(dep, 1, 1), 300)
        assert f"deployments waiting for capacity reconciled: [{dep}]" in third.log()
        live = [w for w in plat.workers(dep) if w["status"] not in ("stopped", "failed")]
        assert sorted(w["id"] for w in live) == sorted(w["id"] for w in again)  # no duplicate
        assert not {w["id"] for w in again} & {w["id"] for w in first}
        assert sorted(w["pid"] for w in again) == worker_pids(plat)
    finally:
        left = plat.close()
    assert left == []
