"""The agent's heartbeat loop: stamps Node.last_heartbeat with host and worker-process metrics."""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from django.db import close_old_connections, connection

from inference.actions import nodes as node_workers
from inference.agent.supervisor import Supervisor
from nodes import actions as node_actions
from nodes.models import Node
from nodes.resources import host_metrics

logger = logging.getLogger(__name__)


def beat_once(node_id: int, supervisor: Supervisor | None) -> node_actions.Beat:
    """Send one heartbeat (host CPU/memory/load plus each worker process's RSS/CPU); `Beat.GONE` (falsy) if
    the node is gone.

    A beat that brings the node back ONLINE (the controller had marked it OFFLINE or UNREACHABLE while its
    agent was cut off) places the deployments waiting for capacity at once, as a registration does: else
    they waited for the controller's periodic reconcile (30 s).
    """
    metrics = host_metrics()
    if supervisor is not None:
        metrics["workers"] = supervisor.process_stats()
    beat = node_actions.heartbeat(node_id, metrics=metrics)
    if beat is node_actions.Beat.BACK:
        node = Node.objects.get(pk=node_id)
        waiting = node_workers.place_waiting_deployments(node)
        if waiting:
            logger.info("node %s back online: deployments waiting for capacity reconciled: %s", node.name, waiting)
    return beat


def run_heartbeat(
    node_id: int,
    *,
    interval_s: float,
    stop: threading.Event,
    supervisor: Supervisor | None = None,
    on_node_missing: Callable[[], None] | None = None,
) -> None:
    """Heartbeat every `interval_s` until `stop` is set; database errors are logged and retried next time."""
    try:
        while not stop.is_set():
            close_old_connections()
            try:
                if not beat_once(node_id, supervisor):
                    logger.error("node #%s no longer exists (deleted?)", node_id)
                    if on_node_missing is not None:
                        on_node_missing()
            except Exception:  # noqa: BLE001  a missed heartbeat is retried; the loop must survive a DB blip
                logger.exception("heartbeat failed")
            stop.wait(interval_s)
    finally:
        connection.close()
