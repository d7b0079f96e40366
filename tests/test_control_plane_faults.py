"""The control plane's own services fail while streams run: Redis restarted, PostgreSQL restarted, the
controller SIGKILLed. Generation through the router is unaffected, the agent and the controller reconnect
by themselves, and no scale operation or ScaleEvent is lost or applied twice.

Real processes on 127.0.0.1 (tests/support/managed_platform.py): a PostgreSQL cluster and a Redis server
of the test's own (never the machine's shared ones, which other runs use), `manage.py controller`,
`manage.py agent` (one node, both roles) and the managed router (`launch_router --deployment`), with a
deployment of the tiny model (1 prefill + 1 decode) placed and started by them. Each drill runs a
streaming load (`/v1/completions` and `/generate`, both streamed, and a plain `/v1/chat/completions`)
through the router around the fault, then proves the control plane works again end to end: a scale
operation asked through the REST API is applied exactly once (one ScaleEvent, one more or one fewer
worker started and RUNNING or stopped by the agent), and the agent's heartbeat is still landing.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.managed_platform import ManagedPlatform
from tests.support.private_services import ServiceUnavailable
from tests.support.processes import NotReady

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

DEPLOYMENT = "cpf"


def sse_lines(response: httpx.Response) -> Iterator[str]:
    """The body's lines, split at "\n" only (httpx's iter_lines also splits at U+2028 and the other
    str.splitlines separators, which JSON leaves unescaped inside strings: a torn event otherwise)."""
    pending = b""
    for chunk in response.iter_bytes():
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r").decode()
    if pending:
        yield pending.decode()


class StreamLoad:
    """Threads sending streamed and plain requests through the router back to back; every outcome is kept.

    A streamed request counts as "ok" only when it ends with [DONE] and carried no error event.
    """

    KINDS = ("completions-stream", "generate-stream", "chat")

    def __init__(self, url: str, threads: int = 3) -> None:
        self.url = url
        self.results: list[tuple[float, str, str]] = []  # (time, kind, "ok" or what went wrong)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def _one(self, client: httpx.Client, kind: str, text: str) -> str:
        if kind == "chat":
            response = client.post(self.url + "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": text}], "max_tokens": 8, "temperature": 0})
            if response.status_code != 200:
                return f"http {response.status_code}: {response.text[:200]}"
            return "ok" if response.json()["choices"][0]["message"] else "empty answer"
        path = "/v1/completions" if kind == "completions-stream" else "/generate"
        with client.stream("POST", self.url + path, json={
                "prompt": text, "max_tokens": 12, "temperature": 0, "stream": True}) as response:
            if response.status_code != 200:
                return f"http {response.status_code}: {response.read()[:200]!r}"
            for line in sse_lines(response):
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return "ok"
                if json.loads(data).get("error"):
                    return f"stream error: {data[:200]}"
        return "stream ended without [DONE]"

    def _run(self, index: int) -> None:
        with httpx.Client(timeout=60) as client:
            n = 0
            while not self._stop.is_set():
                n += 1
                kind = self.KINDS[(index + n) % len(self.KINDS)]
                try:
                    outcome = self._one(client, kind, f"fault drill {index} {n}")
                except (httpx.HTTPError, ValueError, KeyError) as exc:
                    outcome = f"{type(exc).__name__}: {exc}"
                with self._lock:
                    self.results.append((time.monotonic(), kind, outcome))

    def __enter__(self) -> StreamLoad:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(90)

    def count(self, since: float = 0.0) -> int:
        with self._lock:
            return len([r for r in self.results if r[0] >= since])

    def failures(self) -> list[tuple[float, str, str]]:
        with self._lock:
            return [r for r in self.results if r[2] != "ok"]


class Drill:
    """The platform of this module with the deployment's id and the helpers every drill shares."""

    def __init__(self, plat: ManagedPlatform, deployment_id: int) -> None:
        self.plat = plat
        self.deployment_id = deployment_id

    def decode_count(self) -> int:
        return int(self.plat.client().get(f"/api/deployments/{self.deployment_id}/").json()["decode_replicas"])

    def scale(self, replicas: int) -> httpx.Response:
        return self.plat.client().post(f"/api/deployments/{self.deployment_id}/scale/", json={
            "role": "decode", "replicas": replicas, "reason": f"fault drill to {replicas}"})

    def scale_events(self) -> list[dict[str, Any]]:
        return [e for e in self.plat.events(self.deployment_id) if e["role"] == "decode"]

    def scaled_once(self, replicas: int, events_before: int, timeout: float = 180) -> None:
        """The decode count becomes `replicas` with exactly one new ScaleEvent, and the workers follow."""
        plat = self.plat
        plat.wait_for(f"decode scaled to {replicas}", lambda: self.decode_count() == replicas, 60)
        running = plat.wait_for(f"{replicas} decode worker(s) RUNNING",
                                lambda: plat.running(self.deployment_id, 1, replicas), timeout)
        decode_urls = sorted(w["url"] for w in running if w["role"] == "decode")

        def router_follows() -> bool:  # the router re-read the deployment from the database
            status = plat.client().get("/router/status").json()
            return sorted(e["url"] for e in status["decode"]) == decode_urls

        plat.wait_for("the router's pool equal to the RUNNING decode workers", router_follows, 30)
        new = self.scale_events()[: len(self.scale_events()) - events_before]
        # Events are newest first; an extra event would mean the scale was applied twice.
        assert len(self.scale_events()) == events_before + 1, new
        assert new[0]["to_replicas"] == replicas and new[0]["source"] == "api", new

    def heartbeat_moves(self) -> None:
        """The agent's heartbeat lands again: the node's last_heartbeat advances and it is ONLINE."""
        plat = self.plat
        first = plat.node()["last_heartbeat"]
        plat.wait_for("a new heartbeat", lambda: plat.node()["last_heartbeat"] != first, 30)
        assert plat.node()["status"] == "online"

    def load_survives(self, load: StreamLoad, fault_at: float) -> None:
        failures = load.failures()
        assert not failures, f"{len(failures)} of {len(load.results)} requests failed: {failures[:10]}"
        assert load.count(since=fault_at) >= 5, f"only {load.count(since=fault_at)} requests after the fault"


def group_alive(pgid: int) -> bool:
    """Whether any process of the process group `pgid` still runs."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def drill(tmp_path_factory: pytest.TempPathFactory, log_dir: Path, tiny_model_dir: Path) -> Iterator[Drill]:
    """The managed platform with a placed, RUNNING deployment (1 prefill + 1 decode) answering."""
    try:
        plat = ManagedPlatform(log_dir / "control-plane-faults", tmp_path_factory.mktemp("cpf-var"))
    except ServiceUnavailable as exc:
        pytest.skip(str(exc))
    try:
        plat.start_services()
        plat.start_controller()
        plat.start_agent()
        plat.start_router(DEPLOYMENT)
        deployment_id = plat.create_deployment(DEPLOYMENT, tiny_model_dir)
        plat.wait_for("1 prefill + 1 decode RUNNING", lambda: plat.running(deployment_id, 1, 1), 240,
                      watch=plat.procs)
        plat.wait_for("a generation through the router", plat.generates, 90, interval=1.0, watch=plat.procs)
        yield Drill(plat, deployment_id)
    except NotReady as exc:
        pytest.fail(str(exc))
    finally:
        plat.close()


def test_redis_restart_loses_no_stream_and_scaling_resumes(drill: Drill) -> None:
    plat = drill.plat
    events = len(drill.scale_events())
    with StreamLoad(plat.router_url) as load:
        plat.wait_for("load flowing", lambda: load.count() >= 3, 60)
        fault_at = time.monotonic()
        plat.redis.stop(signal.SIGKILL)
        # The broker is down: a queued scale is refused with 503 (the operator knows it did not happen).
        refused = drill.scale(2)
        assert refused.status_code == 503, refused.text
        time.sleep(3)
        plat.redis.start()  # empty: no persistence
        plat.wait_for("requests after the restart", lambda: load.count(since=time.monotonic() - 1) >= 2, 60)
        # Both Celery workers (controller and agent) reconnect: a scale goes controller -> agent -> RUNNING.
        accepted = plat.wait_for("the scale accepted again", lambda: drill.scale(2).status_code == 202, 60,
                                 interval=1.0)
        assert accepted
        drill.scaled_once(2, events)
        drill.heartbeat_moves()
    drill.load_survives(load, fault_at)
    assert all(p.alive() for p in plat.procs if not p.name.startswith("redis")), "a process died"


def test_postgres_restart_loses_no_stream_and_scaling_resumes(drill: Drill) -> None:
    plat = drill.plat
    start = drill.decode_count()
    events = len(drill.scale_events())
    with StreamLoad(plat.router_url) as load:
        plat.wait_for("load flowing", lambda: load.count() >= 3, 60)
        fault_at = time.monotonic()
        plat.postgres.restart(down_s=3)  # fast shutdown: every connection of every process is cut
        plat.wait_for("requests after the restart", lambda: load.count(since=time.monotonic() - 1) >= 2, 60)
        drill.heartbeat_moves()  # the agent's heartbeat thread reconnected
        target = 1 if start > 1 else 2
        response = plat.wait_for("the scale accepted", lambda: drill.scale(target).status_code == 202, 60,
                                 interval=1.0)
        assert response
        drill.scaled_once(target, events)  # controller tasks reconnected; the agent's sync too
    drill.load_survives(load, fault_at)
    assert all(p.alive() for p in plat.procs if not p.name.startswith(("redis", "postgres"))), "a process died"


def test_controller_sigkill_loses_no_stream_and_no_scale(drill: Drill) -> None:
    plat = drill.plat
    start = drill.decode_count()
    events = len(drill.scale_events())
    with StreamLoad(plat.router_url) as load:
        plat.wait_for("load flowing", lambda: load.count() >= 3, 60)
        fault_at = time.monotonic()
        old_group = plat.proc("controller").popen.pid
        plat.kill("controller")  # the main process only, as the OOM killer would
        # Its embedded beat goes with it: a beat left behind would send every periodic task twice.
        plat.wait_for("the killed controller's beat gone", lambda: not group_alive(old_group), 15)
        # Queued while no controller runs: the broker keeps it for the next one.
        target = 1 if start > 1 else 2
        queued = drill.scale(target)
        assert queued.status_code == 202, queued.text
        time.sleep(3)
        assert drill.decode_count() == start  # nobody applied it yet
        plat.start_controller("controller")
        drill.scaled_once(target, events)
        drill.heartbeat_moves()
    drill.load_survives(load, fault_at)
