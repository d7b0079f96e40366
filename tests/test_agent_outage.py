"""An agent SIGKILLed while its workers are healthy: no request fails, and its successor adopts the workers.

Real processes on three network namespaces (the `tests/test_multihost.py` platform: controller + router on
one "host", a prefill agent and a decode agent on the others). A load runs through the managed router
while the decode host's agent is SIGKILLed. Its worker keeps running (it lives in a session of its own);
the controller marks the node UNREACHABLE once the heartbeat is NODE_HEARTBEAT_TIMEOUT_S late, probes the
worker's /health itself and keeps it RUNNING, so the router never loses it: every request of the load
succeeds. A new agent on that host then adopts the worker: same pid, no restart, a ScaleEvent "adopted".
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.test_multihost import LIVE, Platform, agent_command, running_platform, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# Short enough that the node turns UNREACHABLE while the load runs, long against a 1 s heartbeat.
HEARTBEAT_TIMEOUT_S = 6


class Load:
    """Threads sending /generate through the router back to back; every answer (or error) is kept."""

    def __init__(self, url: str, threads: int = 3) -> None:
        self.url = url
        self.results: list[tuple[float, int | str]] = []  # (time, HTTP status or transport error)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def _run(self, index: int) -> None:
        with httpx.Client(timeout=60) as client:
            n = 0
            while not self._stop.is_set():
                n += 1
                try:
                    response = client.post(self.url + "/generate", json={
                        "prompt": f"outage drill {index} {n}", "max_tokens": 8, "temperature": 0})
                    outcome: int | str = response.status_code
                except httpx.HTTPError as exc:
                    outcome = f"{type(exc).__name__}: {exc}"
                with self._lock:
                    self.results.append((time.monotonic(), outcome))

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(90)

    def count(self) -> int:
        with self._lock:
            return len(self.results)

    def failures(self) -> list[tuple[float, int | str]]:
        with self._lock:
            return [r for r in self.results if r[1] != 200]


def test_agent_sigkill_loses_no_request_and_the_next_agent_adopts(tmp_path: Path, log_dir: Path,
                                                                   tiny_model_dir: Path) -> None:
    overrides = {"NODE_HEARTBEAT_TIMEOUT_S": str(HEARTBEAT_TIMEOUT_S)}
    with running_platform(tmp_path, log_dir, overrides) as plat:
        _drill(plat, tiny_model_dir)


def _drill(plat: Platform, tiny_model_dir: Path) -> None:
    rid = plat.lab.prefix
    name = f"{rid}-outage"
    api = plat.api
    assert api is not None
    router = plat.start("router", "ctl", [
        sys.executable, "-m", "inference.launch_router", "--deployment", name, "--listen-port", "8000",
        "--host", plat.lab.addresses["ctl"]])
    router.wait_http(plat.router_url + "/health", timeout=90)

    def node(short: str) -> dict[str, Any]:
        nodes = {n["name"]: n for n in api.get("/api/nodes/").json()["results"]}
        return dict(nodes[f"{rid}-{short}"])

    # Both hosts registered first: a deployment created before its nodes exist is only placed by the next
    # periodic reconcile (every 30 s), which the test would wait out for nothing.
    wait_for("both agents online", lambda: all(node(n)["status"] == "online" for n in ("pre", "dec")), 90,
             plat.procs)
    model = api.post("/api/models/", json={"name": name, "source": "tiny", "path": str(tiny_model_dir)})
    assert model.status_code == 201, model.text
    created = api.post("/api/deployments/", json={
        "name": name, "model": model.json()["id"], "prefill_replicas": 1, "decode_replicas": 1,
        "context_length": 256, "batch_size": 4, "block_size": 16,
    })
    assert created.status_code == 201, created.text
    deployment_id = created.json()["id"]

    def running() -> dict[str, dict[str, Any]] | None:
        workers = {w["role"]: w for w in plat.workers(deployment_id) if w["status"] == "running"}
        return workers if set(workers) == {"prefill", "decode"} else None

    before = wait_for("1 prefill + 1 decode worker RUNNING", running, 240, plat.procs)["decode"]

    def generated() -> bool:
        return httpx.post(plat.router_url + "/generate", json={"prompt": "warm", "max_tokens": 4},
                          timeout=60).status_code == 200

    wait_for("a generation through the router", generated, 90, plat.procs, interval=1.0)

    agent = next(p for p in plat.procs if p.name == "agent-dec")
    others = [p for p in plat.procs if p is not agent]

    with Load(plat.router_url) as load:
        wait_for("load flowing", lambda: load.count() >= 3, 60, others)
        os.kill(agent.popen.pid, signal.SIGKILL)  # the agent only: its worker runs in a session of its own
        killed_at = time.monotonic()
        agent.popen.wait(timeout=10)
        wait_for("the decode node UNREACHABLE", lambda: node("dec")["status"] == "unreachable",
                 HEARTBEAT_TIMEOUT_S + 30, others)
        unreachable_after = time.monotonic() - killed_at
        # Two more probe rounds (every 5 s) with the node unreachable and the load still running.
        time.sleep(12)
        during = [w for w in plat.workers(deployment_id) if w["id"] == before["id"]][0]
        served = load.count()
    failures = load.failures()
    assert not failures, f"{len(failures)} of {len(load.results)} requests failed after the agent was killed " \
                         f"(node unreachable after {unreachable_after:.1f}s): {failures[:10]}"
    assert served >= 10, f"only {served} requests went through during the drill"
    assert during["status"] == "running" and during["pid"] == before["pid"], during
    assert len([w for w in plat.workers(deployment_id) if w["status"] in LIVE]) == 2  # nothing re-placed
    events = api.get("/api/events/", params={"deployment": deployment_id}).json()["results"]
    assert any(e["source"] == "recovery" and "unreachable" in e["reason"] for e in events), events

    # A new agent on the decode host adopts the running worker instead of restarting it.
    successor = plat.start("agent-dec-2", "dec", agent_command(rid, "dec", plat.lab.addresses["dec"], "decode"))
    others.append(successor)
    wait_for("the decode node ONLINE again", lambda: node("dec")["status"] == "online", 90, others)

    def adopted() -> list[dict[str, Any]] | None:
        found = api.get("/api/events/", params={"deployment": deployment_id}).json()["results"]
        hits = [e for e in found if e["source"] == "recovery" and e["reason"].startswith("adopted")]
        return hits or None

    [event] = wait_for("a ScaleEvent recording the adoption", adopted, 60, others)
    assert f"#{before['id']}" in event["reason"] and f"pid {before['pid']}" in event["reason"]
    after = [w for w in plat.workers(deployment_id) if w["id"] == before["id"]][0]
    assert after["pid"] == before["pid"] and after["restarts"] == before["restarts"], after
    assert after["status"] == "running"
    wait_for("generation after the adoption", generated, 60, others, interval=1.0)
