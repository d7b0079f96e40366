"""Many simulated agents in one process: real Nodes, the real agent protocol, simulated workers.

    DJANGO_SETTINGS_MODULE=config.settings .venv/bin/python -m bench.sim.agents --nodes 100 \\
        --prefix sim --first-port 40000 --ports-per-node 40 --ready-file /tmp/agents.json

Each simulated node is registered like `manage.py agent` registers one (nodes.actions.register_node,
its own port range on 127.0.0.1), heartbeats with host metrics and per-worker process stats
(nodes.actions.heartbeat), and receives the controller's start/stop/restart tasks on its own Celery
queue `node.<name>` (one Celery worker of this process consumes every node's queue; the tasks are the
real ones of inference.agent.tasks and reach `SimAgents` through the agent runtime). A start launches a
simulated worker (bench.sim.worker, the real answers without a model) on the port the controller placed
it on, probes its /health and /info over HTTP as the supervisor does, and reports through the same
inference.actions.workers calls (launched, then healthy with the decode worker's KV port). The
collector and routers then scrape these workers as real ones. SIGTERM or SIGINT stops the process.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, cast

import httpx
import psutil

from bench.sim.config import SimConfig
from bench.sim.fleet import Fleet

logger = logging.getLogger("bench.sim.agents")

# Simulated hosts: large enough that CPUs never limit placement (the harness measures the controller).
SIM_CPUS = 256
SIM_MEMORY_BYTES = 512 * 2**30
# Bounds of one start (binding the port, probing the new worker) and of a stop.
START_TIMEOUT_S = 10.0


class SimAgents:
    """The agents of many simulated nodes: their supervisor stand-in, one simulated worker per start."""

    def __init__(self, fleet: Fleet, loop: asyncio.AbstractEventLoop, node_ids: dict[int, str]) -> None:
        self.fleet = fleet
        self.loop = loop
        self.node_ids = node_ids  # node id → name, the nodes this process is the agent of
        self.ports: dict[int, int] = {}  # worker id → port its simulated worker listens on
        self.node_of: dict[int, int] = {}  # worker id → its node id
        self._lock = threading.Lock()
        self.http = httpx.Client(timeout=START_TIMEOUT_S, trust_env=False)

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(START_TIMEOUT_S)

    # The three requests of inference.agent.tasks (the real Supervisor's interface).
    def request_start(self, worker_id: int, *, restart: bool = False) -> str:
        """Launch the simulated worker of a live Worker of one of our nodes and report it as the agent does."""
        from inference.actions import workers as worker_actions
        from inference.models import ACTIVE_WORKER_STATUSES, Worker

        worker = Worker.objects.select_related("node").filter(pk=worker_id).first()
        if worker is None or worker.node_id not in self.node_ids:
            return "not a worker of these nodes"
        if worker.status not in ACTIVE_WORKER_STATUSES:
            return f"ignored: worker is {worker.status}"
        with self._lock:
            if worker_id in self.ports:
                return "already managed"
            self.ports[worker_id] = worker.port
            self.node_of[worker_id] = worker.node_id
        try:
            self._run(self.fleet.start_worker(worker.role, worker.port))
        except OSError as exc:
            with self._lock:
                self.ports.pop(worker_id, None)
            worker_actions.report_crashed(worker_id, error=f"port {worker.port}: {exc}")
            return "port taken"
        process = psutil.Process()
        worker_actions.report_launched(worker_id, pid=process.pid, restart=restart, started_at=process.create_time())
        base = f"http://{self.fleet.host}:{worker.port}"
        health = self.http.get(base + "/health").json()
        info = self.http.get(base + "/info").json() if worker.role == "decode" else {}
        worker_actions.report_healthy(worker_id, health=health, kv_port=info.get("kv_port"))
        return "started"

    def request_stop(self, worker_id: int, *, drain: bool) -> str:
        """Stop the simulated worker (a simulated worker has nothing to drain) and report it stopped."""
        from inference.actions import workers as worker_actions

        with self._lock:
            port = self.ports.pop(worker_id, None)
        if port is not None:
            self._run(self.fleet.stop_worker(port))
        worker_actions.report_stopped(worker_id)
        return "stopped"

    def request_restart(self, worker_id: int) -> str:
        """Stop and start again, counting a restart."""
        with self._lock:
            port = self.ports.pop(worker_id, None)
        if port is not None:
            self._run(self.fleet.stop_worker(port))
        return self.request_start(worker_id, restart=True)

    def process_stats(self, node_id: int) -> dict[str, dict[str, Any]]:
        """Per worker id of one node, what a real agent's heartbeat sends (phase, pid, RSS, CPU)."""
        rss = psutil.Process().memory_info().rss
        with self._lock:
            every = list(self.ports)
            ids = [w for w in every if self.node_of.get(w) == node_id]
        return {str(w): {"phase": "running", "pid": os.getpid(), "rss_bytes": rss // max(1, len(every)),
                         "cpu_percent": 0.0, "num_threads": 1} for w in ids}


def register_nodes(
    prefix: str, count: int, first_port: int, ports_per_node: int, first_index: int = 0
) -> dict[int, str]:
    """Register `count` simulated nodes (`<prefix>-<index>` from `first_index`), each with its own port range
    on 127.0.0.1 (by index); node id → name."""
    from nodes import actions as node_actions
    from nodes.resources import NodeResources

    nodes: dict[int, str] = {}
    for i in range(first_index, first_index + count):
        start = first_port + i * ports_per_node
        node = node_actions.register_node(
            name=f"{prefix}-{i:03d}", address="127.0.0.1", port_range=(start, start + ports_per_node - 1),
            resources=NodeResources(hostname=f"{prefix}-{i:03d}", cpu_count=SIM_CPUS, memory_bytes=SIM_MEMORY_BYTES),
            labels={},
        )
        nodes[node.pk] = node.name
    return nodes


def heartbeats(agents: SimAgents, interval_s: float, stop: threading.Event) -> None:
    """Every node's heartbeat each interval, with the host metrics a real agent sends."""
    from django.db import close_old_connections

    from nodes import actions as node_actions
    from nodes.resources import host_metrics

    while not stop.wait(interval_s):
        close_old_connections()
        try:
            host = host_metrics()
            for node_id in agents.node_ids:
                node_actions.heartbeat(node_id, metrics={**host, "workers": agents.process_stats(node_id)})
        except Exception:  # noqa: BLE001  a missed heartbeat is retried, as the real agent does
            logger.exception("heartbeat failed")


def main(argv: list[str] | None = None) -> int:
    """Register the nodes, serve their workers, consume their queues until SIGTERM/SIGINT."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=10)
    p.add_argument("--prefix", default="sim")
    p.add_argument("--first-index", type=int, default=0, help="index of the first node (names and port ranges)")
    p.add_argument("--first-port", type=int, default=40000)
    p.add_argument("--ports-per-node", type=int, default=40)
    p.add_argument("--heartbeat", type=float, default=5.0)
    p.add_argument("--concurrency", type=int, default=8, help="Celery threads taking the node tasks")
    p.add_argument("--ready-file", type=Path, default=None)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if not 1 <= args.nodes <= 1000 or args.ports_per_node < 2:
        p.error("--nodes 1..1000, --ports-per-node >= 2")
    if args.first_port + (args.first_index + args.nodes) * args.ports_per_node > 65535:
        p.error("the nodes' port ranges go past 65535")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    django.setup()
    from django.db import connections

    from config.celery import app
    from inference.agent.runtime import set_supervisor
    from inference.agent.supervisor import Supervisor

    loop = asyncio.new_event_loop()
    fleet = Fleet(SimConfig())
    loop_thread = threading.Thread(target=loop.run_forever, name="fleet", daemon=True)
    loop_thread.start()
    asyncio.run_coroutine_threadsafe(fleet.setup(), loop).result(30)
    node_ids = register_nodes(args.prefix, args.nodes, args.first_port, args.ports_per_node, args.first_index)
    agents = SimAgents(fleet, loop, node_ids)
    set_supervisor(cast(Supervisor, agents))  # the tasks call only its request_* methods
    stop = threading.Event()
    beat = threading.Thread(target=heartbeats, args=(agents, args.heartbeat, stop), name="heartbeat", daemon=True)
    beat.start()
    connections.close_all()
    if args.ready_file is not None:
        tmp = args.ready_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"pid": os.getpid(), "nodes": sorted(node_ids.values())}))
        tmp.replace(args.ready_file)
    worker = app.Worker(
        hostname=f"sim-agents.{args.prefix}-{args.first_index}@{socket.gethostname()}",
        queues=[f"node.{name}" for name in node_ids.values()],
        pool="threads", concurrency=max(1, args.concurrency), loglevel="WARNING",
        without_mingle=True, without_gossip=True, without_heartbeat=True, prefetch_multiplier=4,
    )
    try:
        worker.start()
    finally:
        stop.set()
        beat.join(args.heartbeat + 5)
        if fleet.runner is not None:
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(fleet.runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        connections.close_all()
    time.sleep(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
