"""The controller's heartbeat check: silent nodes become UNREACHABLE and their workers are probed.

`check_node_heartbeats` (Celery beat, inference.tasks.check_node_heartbeats) marks a node whose agent has not
sent a heartbeat for NODE_HEARTBEAT_TIMEOUT_S UNREACHABLE, then probes /health of its workers itself; only
those that stop answering are failed over (inference.actions.nodes.report_probe).
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from typing import Any

import httpx
from django.conf import settings
from django.utils import timezone

from inference.actions import nodes as node_workers
from inference.models import (
    ACTIVE_WORKER_STATUSES,
    Worker,
)
from nodes.models import Node, NodeStatus

logger = logging.getLogger(__name__)

# Threads probing the workers of silent nodes at once; each probe is bounded by AGENT_HEALTH_TIMEOUT_S.
PROBE_THREADS = 16


def _silent_nodes(cutoff: datetime) -> list[Node]:
    """Nodes (not OFFLINE) whose agent sent no heartbeat since `cutoff`, or never sent one."""
    base = Node.objects.exclude(status=NodeStatus.OFFLINE).order_by("name")
    return list(base.filter(last_heartbeat__lt=cutoff)) + list(base.filter(last_heartbeat__isnull=True))


def probe_health(worker: Worker, timeout: float) -> tuple[dict[str, Any] | None, str]:
    """GET the worker's /health (no database access: runs in a thread); (its JSON object, or None, and why)."""
    try:
        response = httpx.get(worker.url + "/health", timeout=timeout)
    except httpx.HTTPError as exc:
        return None, f"{type(exc).__name__}: {exc}"
    if response.status_code != 200:
        return None, f"HTTP {response.status_code}"
    try:
        body = response.json()
    except ValueError:
        return None, "not JSON"
    return (body, "") if isinstance(body, dict) else (None, "not a JSON object")


def probe_workers_of_silent_nodes(nodes: Sequence[Node], *, now: datetime) -> dict[int, str]:
    """Probe /health of the active workers on nodes whose agent is silent; act through
    inference.actions.nodes.report_probe.

    Without an agent nobody else watches these processes: a healthy answer keeps a worker in rotation, a
    failed one takes it out (UNHEALTHY) and, after NODE_HEARTBEAT_TIMEOUT_S without any answer, fails it
    over (STOPPED, ScaleEvent, replacement placed elsewhere). Probes run concurrently, each bounded by
    AGENT_HEALTH_TIMEOUT_S; the database is written from this thread. Returns the outcome per worker id.
    """
    workers = list(
        Worker.objects.select_related("node")
        .filter(node__in=list(nodes), status__in=ACTIVE_WORKER_STATUSES)
        .order_by("pk")
    )
    if not workers:
        return {}
    timeout = float(settings.AGENT_HEALTH_TIMEOUT_S)
    with ThreadPoolExecutor(max_workers=min(PROBE_THREADS, len(workers))) as pool:
        answers = list(pool.map(lambda w: probe_health(w, timeout), workers))
    grace = float(settings.NODE_HEARTBEAT_TIMEOUT_S)
    return {
        worker.pk: node_workers.report_probe(worker.pk, health=health, error=error, grace_s=grace, now=now)
        for worker, (health, error) in zip(workers, answers, strict=True)
    }


def check_node_heartbeats(*, now: datetime | None = None) -> list[Node]:
    """Nodes silent for over NODE_HEARTBEAT_TIMEOUT_S become UNREACHABLE; their workers are probed directly.

    An agent that died leaves its workers running (they are in sessions of their own), so silence alone
    is no reason to drop them: they stay RUNNING and in rotation while their /health answers, and only
    those that stop answering are failed over (`probe_workers_of_silent_nodes`). A restarted agent
    brings the node back ONLINE and adopts them. Returns the nodes that became UNREACHABLE now.
    """
    now = now or timezone.now()
    timeout = float(settings.NODE_HEARTBEAT_TIMEOUT_S)
    silent = _silent_nodes(now - timedelta(seconds=timeout))
    newly: list[Node] = []
    for node in silent:
        if node.status != NodeStatus.ONLINE:
            continue
        seen = f"last heartbeat {node.last_heartbeat:%Y-%m-%d %H:%M:%S}" if node.last_heartbeat else "never seen"
        node_workers.mark_node_unreachable(node, reason=f"no heartbeat for over {timeout:.0f}s ({seen})")
        newly.append(node)
    probe_workers_of_silent_nodes(silent, now=now)
    return newly
