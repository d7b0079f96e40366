"""`python manage.py agent`: the per-host agent (register, supervise workers, heartbeat, node queue).

    python manage.py agent --name gpu-01 --address 10.0.0.5 [--port-range 30000-30999] [--heartbeat 2]
        [--roles prefill] [--label zone=a] [--bind-host 0.0.0.0] [--keep-workers]

In one process: registers/updates the Node with the detected resources; recovers the node's workers
(adopts processes still running, relaunches lost ones, drains and stops orphans of replaced workers);
runs the supervisor thread and the heartbeat thread; and, in the main thread, a Celery worker consuming
ONLY the queue node.<name> (threads pool, small concurrency: the tasks just hand requests to the
supervisor). Once it has recovered them, it reconciles at once the deployments waiting for capacity (they
are placed without waiting for the controller's periodic reconcile). On SIGTERM/SIGINT it marks the node
OFFLINE so the controller re-places its workers, stops them (SIGTERM, then SIGKILL) and exits; a signal
while it starts (before its Celery worker handles them) is remembered (inference.agent.stop_signals): it
still recovers the node's workers and then stops them, instead of dying and leaving them running. With
--keep-workers the processes are left running for the next agent to adopt. An agent killed outright
(SIGKILL, OOM) leaves its workers serving: the controller marks the node UNREACHABLE and keeps them in
rotation while their /health answers (inference.controller).
"""
from __future__ import annotations

import logging
import os
import re
import signal
import socket
import threading
from argparse import ArgumentParser
from pathlib import Path
from typing import Any

from celery.platforms import EX_OK
from celery.worker import state as celery_worker_state
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import connections

from config.celery import app
from inference.actions import nodes as node_workers
from inference.agent import stop_signals
from inference.agent.heartbeat import run_heartbeat
from inference.agent.launch import SupervisorConfig
from inference.agent.runtime import set_supervisor
from inference.agent.supervisor import Supervisor
from inference.models import WorkerRole
from nodes import actions as node_actions
from nodes.models import Node
from nodes.resources import detect_resources

logger = logging.getLogger("inference.agent")

# Joining the supervisor and heartbeat threads at shutdown: each waits at most one interval.
THREAD_JOIN_TIMEOUT_S = 15.0


def parse_port_range(value: str) -> tuple[int, int]:
    """"30000-30999" → (30000, 30999); CommandError when malformed."""
    match = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", value)
    if not match:
        raise CommandError(f"--port-range {value!r}: expected START-END, e.g. 30000-30999")
    start, end = int(match.group(1)), int(match.group(2))
    if not 1 <= start <= end <= 65535:
        raise CommandError(f"--port-range {value!r}: need 1 <= START <= END <= 65535")
    return start, end


def parse_labels(roles: str | None, pairs: list[str]) -> dict[str, Any]:
    """Node labels from --roles and --label KEY=VALUE flags."""
    labels: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise CommandError(f"--label {pair!r}: expected KEY=VALUE")
        labels[key.strip()] = value.strip()
    if roles:
        names = [r.strip() for r in roles.split(",") if r.strip()]
        unknown = [r for r in names if r not in WorkerRole.values]
        if unknown or not names:
            raise CommandError(f"--roles {roles!r}: roles are {', '.join(WorkerRole.values)}")
        labels["roles"] = names
    return labels


class Command(BaseCommand):
    """Run this host's agent until SIGTERM/SIGINT."""

    help = "Run the agent of this host: registers the node, supervises its workers, consumes queue node.<name>."

    def add_arguments(self, parser: ArgumentParser) -> None:
        """Flags of the agent."""
        parser.add_argument("--name", required=True, help="node name (a slug, unique in the platform)")
        parser.add_argument("--address", required=True, help="address routers and peers reach this host at")
        parser.add_argument("--port-range", default="30000-30999", help="ports for workers (HTTP and KV)")
        parser.add_argument("--heartbeat", type=float, default=None,
                            help="seconds between heartbeats (default AGENT_HEARTBEAT_INTERVAL_S)")
        parser.add_argument("--bind-host", default=None,
                            help="address workers listen on (default: --address)")
        parser.add_argument("--roles", default=None, help="only place these roles here, e.g. prefill or decode")
        parser.add_argument("--label", action="append", default=[], help="node label KEY=VALUE (repeatable)")
        parser.add_argument("--concurrency", type=int, default=4, help="Celery threads for node tasks")
        parser.add_argument("--log-dir", default=None, help="worker logs (default AGENT_LOG_DIR/<name>)")
        parser.add_argument("--keep-workers", action="store_true",
                            help="on exit leave the workers running (the next agent adopts them)")
        parser.add_argument("--loglevel", default="INFO", help="log level of the agent and its Celery worker")

    def handle(self, *args: Any, **options: Any) -> None:
        """Register, recover, start the threads, consume the node queue; clean up on the way out."""
        name: str = options["name"]
        if not re.fullmatch(r"[-a-zA-Z0-9_]+", name):
            raise CommandError(f"--name {name!r}: use letters, digits, '-' and '_' only")
        port_range = parse_port_range(options["port_range"])
        labels = parse_labels(options["roles"], options["label"])
        heartbeat_s = float(options["heartbeat"] or settings.AGENT_HEARTBEAT_INTERVAL_S)
        if heartbeat_s <= 0:
            raise CommandError("--heartbeat must be > 0")
        if heartbeat_s * 2 > float(settings.NODE_HEARTBEAT_TIMEOUT_S):
            logger.warning("--heartbeat %.1fs is over half of NODE_HEARTBEAT_TIMEOUT_S (%.1fs): the node may "
                           "flap offline", heartbeat_s, settings.NODE_HEARTBEAT_TIMEOUT_S)

        # A stop signal from here until Celery handles its own is remembered (manage.py installed this already).
        stop_signals.install()
        # One line per health check and scrape would drown the agent's own log.
        logging.getLogger("httpx").setLevel(logging.WARNING)
        resources = detect_resources()
        node = node_actions.register_node(
            name=name, address=options["address"], resources=resources, port_range=port_range, labels=labels
        )
        logger.info("agent %s: %s", name, resources.to_dict())
        log_dir = Path(options["log_dir"]) if options["log_dir"] else Path(settings.AGENT_LOG_DIR) / name
        supervisor = Supervisor(
            node.pk, SupervisorConfig.from_settings(log_dir=log_dir, bind_host=options["bind_host"])
        )
        set_supervisor(supervisor)
        stop = threading.Event()
        threads: list[threading.Thread] = []
        try:
            # Inside the try: whatever happens from here on (a stop signal included), the workers this agent
            # adopts are stopped on the way out, unless --keep-workers.
            supervisor.recover()
            if stop_signals.requested():
                logger.info("agent %s: stop signal during start-up; stopping", name)
                return
            # Capacity came (back): deployments waiting for it are placed now, not at the next periodic reconcile.
            waiting = node_workers.place_waiting_deployments(node)
            if waiting:
                logger.info("agent %s: deployments waiting for capacity reconciled: %s", name, waiting)
            threads = [
                threading.Thread(target=supervisor.run, args=(stop,), name="supervisor", daemon=True),
                threading.Thread(
                    target=run_heartbeat, args=(node.pk,), name="heartbeat", daemon=True,
                    kwargs={"interval_s": heartbeat_s, "stop": stop, "supervisor": supervisor,
                            # The node row was deleted: exit (the service manager restarts and re-registers us).
                            "on_node_missing": lambda: os.kill(os.getpid(), signal.SIGTERM)},
                ),
            ]
            for thread in threads:
                thread.start()
            # A signal before Celery's handlers replace ours: Celery's warm-shutdown flag, which its consumer
            # loop checks first thing (set at once when the signal came already).
            stop_signals.on_request(lambda: setattr(celery_worker_state, "should_stop", EX_OK))
            self._consume(node, options)
        finally:
            stop.set()
            for thread in threads:
                thread.join(THREAD_JOIN_TIMEOUT_S)
            keep = bool(options["keep_workers"])
            if not keep:
                # First, so the controller re-places the workers at once (reconcile is sent on commit).
                node = Node.objects.filter(pk=node.pk).first() or node
                node_workers.mark_node_offline(node, reason="agent shut down")
            supervisor.shutdown(stop_workers=not keep)
            set_supervisor(None)
            connections.close_all()
            logger.info("agent %s stopped", name)

    def _consume(self, node: Node, options: dict[str, Any]) -> None:
        """Run a Celery worker on queue node.<name> only, in this thread, until a shutdown signal."""
        connections.close_all()  # the worker's threads open their own connections
        worker = app.Worker(
            hostname=f"agent.{node.name}@{socket.gethostname()}",
            queues=[node.queue_name],
            pool="threads",
            concurrency=max(1, int(options["concurrency"])),
            loglevel=options["loglevel"],
            # Node tasks are few and independent: no startup sync with other workers, no gossip.
            without_mingle=True,
            without_gossip=True,
            prefetch_multiplier=1,
        )
        worker.start()
