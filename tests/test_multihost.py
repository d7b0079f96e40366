"""The whole control plane on three "hosts": network namespaces made by this test.

    root namespace: the test, PostgreSQL and Redis on 127.0.0.1 (exposed to the namespaces through socat
                    forwarders bound to the bridge address: a namespace has its own loopback)
    <id>-ctl:       router (`launch_router --deployment`, also serving the REST API) + controller (+ beat)
    <id>-pre:       `manage.py agent --roles prefill`     <id>-dec: `manage.py agent --roles decode`

Without DATABASE_URL/REDIS_URL the processes share a SQLite file and the filesystem Celery broker in a
temporary PLATFORM_VAR_DIR instead (the filesystem is not namespaced). With them, the test creates its own
PostgreSQL database (dropped afterwards) and its own control queue name on Redis, so it never meets
another run's data. The test talks to the platform only over HTTP: the REST API with a token, and the
router's /generate.

Scenario: a deployment (tiny model, 1 prefill + 2 decode) created through the REST API is placed by the
controller on the right hosts and started by their agents; a generation goes through the router of the
managed deployment; a decode worker killed with SIGKILL is restarted by its agent; a schedule rule scales
decode 2 → 1 (drained, stopped) and generation still works. Skipped only where `ip netns add` is not
permitted.
"""
from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from tests.support.netns import NetnsLab, NetnsUnavailable
from tests.support.processes import ROOT, NotReady, Proc, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

LIVE = {"pending", "starting", "running", "unhealthy"}


def free_port_on(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])


def wait_for(what: str, check: Callable[[], Any], timeout: float, procs: list[Proc], interval: float = 0.5) -> Any:
    """Poll `check()` until it returns something truthy; fail the test with the processes' logs otherwise."""
    try:
        return wait_until(what, check, timeout, procs, interval=interval)
    except NotReady as exc:
        pytest.fail(str(exc))


def agent_command(rid: str, name: str, address: str, role: str) -> list[str]:
    """`manage.py agent` of the host `name` (node `<rid>-<name>`), taking only `role` workers."""
    return [sys.executable, "manage.py", "agent", "--name", f"{rid}-{name}", "--address", address, "--roles", role,
            "--port-range", "31000-31099", "--heartbeat", "1"]


class Platform:
    """The processes, addresses and API client of one multi-host run."""

    def __init__(self, lab: NetnsLab, env: dict[str, str], log_dir: Path) -> None:
        self.lab = lab
        self.env = env
        self.log_dir = log_dir
        self.procs: list[Proc] = []
        self.api: httpx.Client | None = None
        self.router_url = ""

    def start(self, name: str, namespace: str, args: list[str]) -> Proc:
        proc = Proc(name, self.lab.cmd(namespace, args), self.log_dir, self.env)
        self.procs.append(proc)
        return proc

    def manage(self, *args: str) -> str:
        """Run `manage.py ARGS` in the root namespace against the platform's database; its stdout."""
        result = subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, capture_output=True, text=True,
                                env={**os.environ, **self.env}, timeout=180)
        assert result.returncode == 0, f"manage.py {args[0]} failed:\n{result.stdout}\n{result.stderr}"
        return result.stdout

    def workers(self, deployment_id: int) -> list[dict[str, Any]]:
        assert self.api is not None
        response = self.api.get("/api/workers/", params={"deployment": deployment_id, "limit": 100})
        response.raise_for_status()
        return list(response.json()["results"])

    def generate(self, prompt: str) -> dict[str, Any]:
        response = httpx.post(self.router_url + "/generate", json={"prompt": prompt, "max_tokens": 8,
                                                                   "temperature": 0}, timeout=60)
        assert response.status_code == 200, response.text
        return dict(response.json())

    def stop_all(self) -> None:
        """SIGTERM everything (agents stop their workers), bounded; the lab's teardown kills what is left."""
        for proc in reversed(self.procs):
            if proc.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + 25
        while time.monotonic() < deadline and any(p.alive() for p in self.procs):
            time.sleep(0.2)
        for proc in self.procs:
            proc.stop()


def _database_env(lab: NetnsLab, rid: str, log_dir: Path, tmp: Path) -> tuple[dict[str, str], Callable[[], None]]:
    """Environment pointing the processes at this run's database and broker; and its cleanup."""
    env: dict[str, str] = {"PLATFORM_VAR_DIR": str(tmp / "var"), "PLATFORM_CONTROL_QUEUE": f"control-{rid}",
                           "PLATFORM_TIME_ZONE": "UTC"}
    cleanups: list[Callable[[], None]] = []
    database_url = os.environ.get("DATABASE_URL", "")
    if database_url:
        import psycopg

        parts = urlsplit(database_url)
        port = free_port_on(lab.root_address)
        lab.forward(port, f"{parts.hostname or '127.0.0.1'}:{parts.port or 5432}", log_dir / "socat-postgres.log")
        name = f"platform_{rid}"
        admin = parts._replace(path="/postgres").geturl()
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')

        def drop() -> None:
            with psycopg.connect(admin, autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

        cleanups.append(drop)
        netloc = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
        env["DATABASE_URL"] = parts._replace(netloc=f"{netloc}{lab.root_address}:{port}", path=f"/{name}").geturl()
    else:
        env["DATABASE_URL"] = ""  # SQLite in PLATFORM_VAR_DIR
    redis_url = os.environ.get("REDIS_URL", "")
    if redis_url:
        parts = urlsplit(redis_url)
        port = free_port_on(lab.root_address)
        lab.forward(port, f"{parts.hostname or '127.0.0.1'}:{parts.port or 6379}", log_dir / "socat-redis.log")
        netloc = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
        env["REDIS_URL"] = parts._replace(netloc=f"{netloc}{lab.root_address}:{port}").geturl()
    else:
        env["REDIS_URL"] = ""  # filesystem broker in PLATFORM_VAR_DIR

    def cleanup() -> None:
        for step in cleanups:
            with contextlib.suppress(Exception):
                step()

    return env, cleanup


@pytest.fixture
def platform(tmp_path: Path, log_dir: Path) -> Iterator[Platform]:
    """Three namespaces, a migrated database with an API token, controller and agents running."""
    with running_platform(tmp_path, log_dir) as plat:
        yield plat


@contextlib.contextmanager
def running_platform(tmp_path: Path, log_dir: Path, env_overrides: dict[str, str] | None = None) -> Iterator[Platform]:
    """The `platform` fixture's body; `env_overrides` change the processes' settings (e.g. timeouts)."""
    lab = NetnsLab()
    rid = lab.prefix
    run_logs = log_dir / rid
    run_logs.mkdir(parents=True, exist_ok=True)
    cleanup: Callable[[], None] = lambda: None  # noqa: E731
    plat: Platform | None = None
    try:
        try:
            ctl_ip = lab.add("ctl")
        except NetnsUnavailable as exc:
            pytest.skip(f"network namespaces are not available here: {exc}")
        pre_ip, dec_ip = lab.add("pre"), lab.add("dec")
        env, cleanup = _database_env(lab, rid, run_logs, tmp_path)
        env.update({
            "AGENT_LOG_DIR": str(run_logs / "workers"),
            "AGENT_HEALTH_INTERVAL_S": "0.5",
            "AGENT_SYNC_INTERVAL_S": "2",
            "AGENT_RESTART_BACKOFF_S": "0.5",
            "AGENT_STOP_TIMEOUT_S": "5",
            "AGENT_DRAIN_TIMEOUT_S": "30",
            "NODE_HEARTBEAT_TIMEOUT_S": "20",
            "CUDA_VISIBLE_DEVICES": "",
            "PLATFORM_SHARED_SECRET": f"mh-{secrets.token_hex(8)}",
            "DJANGO_ALLOWED_HOSTS": "*",
            **(env_overrides or {}),
        })
        plat = Platform(lab, env, run_logs)
        plat.manage("migrate", "--noinput", "-v", "0")
        out = plat.manage("shell", "-c", (
            "from django.contrib.auth.models import User\n"
            "from rest_framework.authtoken.models import Token\n"
            "user = User.objects.create_superuser('mh', 'mh@example.com', 'not-used-pw-1')\n"
            "print('TOKEN=' + Token.objects.create(user=user).key)\n"
        ))
        token = next(line.split("=", 1)[1] for line in out.splitlines() if line.startswith("TOKEN="))
        py = sys.executable
        plat.start("controller", "ctl", [py, "manage.py", "controller", "--concurrency", "4"])
        for name, ip, role in (("pre", pre_ip, "prefill"), ("dec", dec_ip, "decode")):
            plat.start(f"agent-{name}", name, agent_command(rid, name, ip, role))
        plat.router_url = f"http://{ctl_ip}:8000"
        plat.api = httpx.Client(base_url=plat.router_url, headers={"Authorization": f"Token {token}"}, timeout=30)
        yield plat
    finally:
        if plat is not None:
            if plat.api is not None:
                plat.api.close()
            plat.stop_all()
        lab.teardown()
        cleanup()


def test_deployment_across_three_hosts(platform: Platform, tiny_model_dir: Path) -> None:
    plat = platform
    rid = plat.lab.prefix
    deployment_name = f"{rid}-tiny"
    py = sys.executable
    # The router (REST API + managed generation) follows the deployment from the database.
    router = plat.start("router", "ctl", [py, "-m", "inference.launch_router", "--deployment", deployment_name,
                                          "--listen-port", "8000", "--host", plat.lab.addresses["ctl"]])
    router.wait_http(plat.router_url + "/health", timeout=90)
    api = plat.api
    assert api is not None

    # Both agents registered their nodes with the resources they found.
    def nodes_online() -> dict[str, dict[str, Any]] | None:
        nodes = {n["name"]: n for n in api.get("/api/nodes/").json()["results"]}
        mine = {k: v for k, v in nodes.items() if k.startswith(rid)}
        return mine if len(mine) == 2 and all(n["status"] == "online" for n in mine.values()) else None

    nodes = wait_for("both agents online", nodes_online, 90, plat.procs)
    pre_node, dec_node = nodes[f"{rid}-pre"], nodes[f"{rid}-dec"]
    assert pre_node["address"] == plat.lab.addresses["pre"] and pre_node["cpu_count"] >= 1
    assert pre_node["labels"]["roles"] == ["prefill"] and dec_node["labels"]["roles"] == ["decode"]
    assert pre_node["rdma_devices"] or pre_node["rdma_note"]

    # A deployment created through the REST API.
    model = api.post("/api/models/", json={"name": f"{rid}-tiny", "source": "tiny", "path": str(tiny_model_dir)})
    assert model.status_code == 201, model.text
    created = api.post("/api/deployments/", json={
        "name": deployment_name, "model": model.json()["id"], "prefill_replicas": 1, "prefill_min": 1,
        "prefill_max": 2, "decode_replicas": 2, "decode_min": 1, "decode_max": 3, "context_length": 256,
        "batch_size": 4, "block_size": 16,
    })
    assert created.status_code == 201, created.text
    deployment_id = created.json()["id"]

    def placed_and_running() -> list[dict[str, Any]] | None:
        live = [w for w in plat.workers(deployment_id) if w["status"] in LIVE]
        running = [w for w in live if w["status"] == "running"]
        roles = sorted(w["role"] for w in running)
        return running if len(live) == 3 and roles == ["decode", "decode", "prefill"] else None

    running = wait_for("1 prefill + 2 decode workers RUNNING", placed_and_running, 240, plat.procs)
    for worker in running:
        expected = pre_node if worker["role"] == "prefill" else dec_node
        assert worker["node"] == expected["id"], worker  # prefill on the prefill host, decode on the decode host
        assert urlsplit(worker["url"]).hostname == expected["address"]

    # A generation through the router of the managed deployment.
    def generated() -> dict[str, Any] | None:
        response = httpx.post(plat.router_url + "/generate", timeout=60,
                              json={"prompt": "Hello from three hosts", "max_tokens": 8, "temperature": 0})
        return dict(response.json()) if response.status_code == 200 else None

    body = wait_for("a generation through the router", generated, 90, plat.procs, interval=1.0)
    assert body["usage"]["completion_tokens"] >= 1 and body["tokens"]
    # The pair that served it: the prefill host's worker and one of the decode host's.
    assert plat.lab.addresses["pre"] in str(body["prefill"]), body
    assert plat.lab.addresses["dec"] in str(body["decode"]), body

    # SIGKILL one decode worker: its agent restarts it.
    victim = next(w for w in running if w["role"] == "decode")
    os.kill(victim["pid"], signal.SIGKILL)

    def restarted() -> dict[str, Any] | None:
        worker = next(w for w in plat.workers(deployment_id) if w["id"] == victim["id"])
        ok = worker["status"] == "running" and worker["restarts"] == 1 and worker["pid"] != victim["pid"]
        return worker if ok else None

    again = wait_for("the killed decode worker restarted", restarted, 180, plat.procs)
    assert again["node"] == dec_node["id"] and again["port"] == victim["port"]
    wait_for("generation after the restart", generated, 90, plat.procs, interval=1.0)

    # A schedule rule (its window is now) scales decode 2 → 1: one decode drains and stops.
    now = datetime.now(UTC)
    rule = api.post("/api/rules/", json={
        "deployment": deployment_id, "name": "night", "kind": "schedule", "role": "decode",
        "start_time": (now - timedelta(minutes=1)).strftime("%H:%M:%S"),
        "end_time": (now + timedelta(hours=3)).strftime("%H:%M:%S"), "target_replicas": 1,
    })
    assert rule.status_code == 201, rule.text

    def scaled_down() -> list[dict[str, Any]] | None:
        events = api.get("/api/events/", params={"deployment": deployment_id}).json()["results"]
        scheduled = [e for e in events if e["source"] == "schedule"]
        decode = [w for w in plat.workers(deployment_id) if w["role"] == "decode"]
        live = [w for w in decode if w["status"] in LIVE]
        stopped = [w for w in decode if w["status"] == "stopped"]
        return scheduled if scheduled and len(live) == 1 and len(stopped) == 1 else None

    [event] = wait_for("the schedule rule scaling decode to 1", scaled_down, 120, plat.procs)
    assert (event["role"], event["from_replicas"], event["to_replicas"]) == ("decode", 2, 1)
    assert event["rule"] == rule.json()["id"] and "night" in event["reason"]
    deployment = api.get(f"/api/deployments/{deployment_id}/").json()
    assert deployment["decode_replicas"] == 1
    wait_for("generation after the scale-down", generated, 90, plat.procs, interval=1.0)
