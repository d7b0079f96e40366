"""The whole managed platform on 127.0.0.1 over a Redis and a PostgreSQL of its own.

    private PostgreSQL + private Redis (tests/support/private_services.py: restartable)
    `manage.py controller` (Celery worker on the control queue + beat), `manage.py agent` (one node,
    both roles), `python -m inference.launch_router --deployment NAME` (REST API + generation)

The control-plane fault drills (tests/test_control_plane_faults.py) and the soak (bench/soak.py)
restart the private servers and kill the controller or the agent under load; nothing here touches
the machine's shared Redis or PostgreSQL. `ManagedPlatform.close()` stops every process it started
(agent first, so it stops its workers), then the servers, and deletes the database cluster.
"""
from __future__ import annotations

import contextlib
import os
import random
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from tests.support.private_services import PrivatePostgres, PrivateRedis
from tests.support.processes import ROOT, Proc, build_kernels_once, free_port, wait_until

LIVE = {"pending", "starting", "running", "unhealthy"}


class ManagedPlatform:
    """Processes, servers and the API client of one platform on 127.0.0.1."""

    def __init__(self, log_dir: Path, var_dir: Path, env_overrides: dict[str, str] | None = None) -> None:
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: list[Proc] = []
        self.rid = f"cpf{secrets.token_hex(3)}"
        self.redis = PrivateRedis(log_dir)
        self.postgres = PrivatePostgres(log_dir)
        self.api: httpx.Client | None = None
        self.router_url = ""
        self.router_port = free_port()
        first_port = random.Random().randrange(20000, 29900, 100)  # a block of 100 ports for the workers
        self.port_range = f"{first_port}-{first_port + 99}"
        self.env: dict[str, str] = {
            "PLATFORM_VAR_DIR": str(var_dir),
            "PLATFORM_CONTROL_QUEUE": f"control-{self.rid}",
            "PLATFORM_TIME_ZONE": "UTC",
            "AGENT_LOG_DIR": str(log_dir / "workers"),
            "AGENT_HEALTH_INTERVAL_S": "0.5",
            "AGENT_SYNC_INTERVAL_S": "2",
            "AGENT_RESTART_BACKOFF_S": "0.5",
            "AGENT_STOP_TIMEOUT_S": "5",
            "AGENT_DRAIN_TIMEOUT_S": "20",
            "NODE_HEARTBEAT_TIMEOUT_S": "20",
            "CUDA_VISIBLE_DEVICES": "",
            "PLATFORM_SHARED_SECRET": f"cpf-{secrets.token_hex(8)}",
            "DJANGO_ALLOWED_HOSTS": "*",
            **(env_overrides or {}),
        }
        self.node_name = f"{self.rid}-node"

    # ------------------------------------------------------------------ lifecycle

    def start_services(self) -> None:
        """Start Redis and PostgreSQL, create and migrate the database, make an API token (and build the
        engine's kernels first: workers that build them would not be healthy within the agent's wait)."""
        build_kernels_once()
        self.redis.start()
        self.postgres.start()
        self.env["DATABASE_URL"] = self.postgres.create_database("platform")
        self.env["REDIS_URL"] = self.redis.url
        self.manage("migrate", "--noinput", "-v", "0")
        out = self.manage("shell", "-c", (
            "from django.contrib.auth.models import User\n"
            "from rest_framework.authtoken.models import Token\n"
            "user = User.objects.create_superuser('cpf', 'cpf@example.com', 'not-used-pw-1')\n"
            "print('TOKEN=' + Token.objects.create(user=user).key)\n"
        ))
        token = next(line.split("=", 1)[1] for line in out.splitlines() if line.startswith("TOKEN="))
        self.router_url = f"http://127.0.0.1:{self.router_port}"
        self.api = httpx.Client(base_url=self.router_url, headers={"Authorization": f"Token {token}"}, timeout=30)

    def start(self, name: str, args: list[str]) -> Proc:
        proc = Proc(name, args, self.log_dir, self.env)
        self.procs.append(proc)
        return proc

    def start_controller(self, name: str = "controller") -> Proc:
        return self.start(name, [sys.executable, "manage.py", "controller", "--concurrency", "4"])

    def start_agent(self, name: str = "agent") -> Proc:
        return self.start(name, [sys.executable, "manage.py", "agent", "--name", self.node_name, "--address",
                                 "127.0.0.1", "--port-range", self.port_range, "--heartbeat", "1"])

    def start_router(self, deployment: str, name: str = "router") -> Proc:
        proc = self.start(name, [sys.executable, "-m", "inference.launch_router", "--deployment", deployment,
                                 "--listen-port", str(self.router_port), "--host", "127.0.0.1"])
        proc.wait_http(self.router_url + "/health", timeout=90)
        return proc

    def proc(self, name: str) -> Proc:
        """The latest process started under `name`."""
        return [p for p in self.procs if p.name == name][-1]

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signal the process `name` only (not its group: an agent's workers live in sessions of their own
        anyway); waits until it is gone."""
        proc = self.proc(name)
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.popen.pid, sig)
        proc.popen.wait(timeout=30)
        proc.stop()

    def close(self) -> list[int]:
        """Stop everything, bounded: agents (they stop their workers), router and controller, then the servers.

        Returns the processes of the platform still running after the graceful stop (then killed): [] expected.
        """
        if self.api is not None:
            self.api.close()
        order = sorted(self.procs, key=lambda p: 0 if p.name.startswith("agent") else 1)
        for proc in order:
            if proc.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + 25
        while time.monotonic() < deadline and any(p.alive() for p in self.procs):
            time.sleep(0.2)
        left = sorted(set(self.platform_pids()) | {p.popen.pid for p in self.procs if p.alive()})
        for proc in self.procs:
            proc.stop()
        self._kill_leftovers()
        self.redis.stop()
        self.postgres.remove()
        return left

    def _kill_leftovers(self) -> None:
        """Workers of a SIGKILLed agent outlive it by design (sessions of their own): stop any of ours left."""
        for pid in self.platform_pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)

    def platform_pids(self) -> list[int]:
        """Live processes carrying this platform's environment (its secret): its services and workers."""
        marker = self.env["PLATFORM_SHARED_SECRET"].encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            with contextlib.suppress(OSError):
                if marker in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
        return found

    # ------------------------------------------------------------------ control plane

    def manage(self, *args: str) -> str:
        """`manage.py ARGS` against the platform's database; its stdout."""
        result = subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, capture_output=True, text=True,
                                env={**os.environ, **self.env}, timeout=180)
        if result.returncode != 0:
            raise RuntimeError(f"manage.py {args[0]} failed:\n{result.stdout}\n{result.stderr}")
        return result.stdout

    def client(self) -> httpx.Client:
        assert self.api is not None, "start_services() first"
        return self.api

    def create_deployment(self, name: str, model_dir: Path, prefill: int = 1, decode: int = 1) -> int:
        """A deployment of the tiny model; the agent's node first allows CPU oversubscription (a 2-CPU
        machine holds one worker per CPU otherwise, and the drills scale to three or restart workers)."""
        api = self.client()
        node = self.wait_for("the agent's node registered", self.node, 90, watch=self.procs)
        patched = api.patch(f"/api/nodes/{node['id']}/", json={"allow_cpu_oversubscription": True})
        if patched.status_code != 200:
            raise RuntimeError(patched.text)
        model = api.post("/api/models/", json={"name": name, "source": "tiny", "path": str(model_dir)})
        if model.status_code != 201:
            raise RuntimeError(model.text)
        created = api.post("/api/deployments/", json={
            "name": name, "model": model.json()["id"], "prefill_replicas": prefill, "prefill_min": 1,
            "prefill_max": 3, "decode_replicas": decode, "decode_min": 1, "decode_max": 3, "context_length": 256,
            "batch_size": 4, "block_size": 16,
        })
        if created.status_code != 201:
            raise RuntimeError(created.text)
        return int(created.json()["id"])

    def workers(self, deployment_id: int) -> list[dict[str, Any]]:
        response = self.client().get("/api/workers/", params={"deployment": deployment_id, "limit": 100})
        response.raise_for_status()
        return list(response.json()["results"])

    def events(self, deployment_id: int) -> list[dict[str, Any]]:
        response = self.client().get("/api/events/", params={"deployment": deployment_id, "limit": 500})
        response.raise_for_status()
        return list(response.json()["results"])

    def node(self) -> dict[str, Any]:
        nodes = {n["name"]: n for n in self.client().get("/api/nodes/").json()["results"]}
        return dict(nodes[self.node_name])

    def running(self, deployment_id: int, prefill: int, decode: int) -> list[dict[str, Any]] | None:
        """The RUNNING workers when exactly `prefill` + `decode` are live and running, else None."""
        live = [w for w in self.workers(deployment_id) if w["status"] in LIVE]
        running = [w for w in live if w["status"] == "running"]
        roles = sorted(w["role"] for w in running)
        return running if len(live) == len(running) and roles == ["decode"] * decode + ["prefill"] * prefill else None

    def generates(self) -> bool:
        response = httpx.post(self.router_url + "/generate", json={"prompt": "ready?", "max_tokens": 2},
                              timeout=60)
        return response.status_code == 200

    def wait_for(self, what: str, check: Callable[[], Any], timeout: float, interval: float = 0.5,
                 watch: list[Proc] | None = None) -> Any:
        """Poll `check()` until truthy; NotReady when a process of `watch` exits or at `timeout`, with the
        logs of `watch` (default: every process of the platform)."""
        return wait_until(what, check, timeout, watch or [], logs_of=watch or self.procs, interval=interval)
