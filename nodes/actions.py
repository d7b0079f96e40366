"""State changes of nodes (hosts) alone: registration, heartbeats, putting a drained node back in service.

`nodes` is the lower layer of the control plane: it knows hosts, not what runs on them, and imports
nothing of `inference`. Everything that concerns workers on a node (draining it, giving it up, failover,
the agent's reports) is in `inference.actions.workers` and `inference.actions.nodes`, which build on these.
"""
from __future__ import annotations

import enum
import logging
from datetime import datetime
from typing import Any

from django.db import transaction
from django.utils import timezone

from nodes.models import Node, NodeStatus
from nodes.resources import NodeResources

logger = logging.getLogger(__name__)


def _now() -> datetime:
    return timezone.now()


def register_node(
    *,
    name: str,
    address: str,
    resources: NodeResources,
    port_range: tuple[int, int] = (30000, 30999),
    labels: dict[str, Any] | None = None,
) -> Node:
    """Create or update the Node an agent runs on, with its detected resources; it is ONLINE afterwards.

    A node that was DRAINING stays DRAINING (an agent restart does not undo an operator's drain).
    `labels` replace the stored labels when given (the agent passes its --roles/--label flags).
    """
    start, end = port_range
    if not 1 <= start <= end <= 65535:
        raise ValueError(f"port range {start}-{end} is not within 1-65535")
    with transaction.atomic():
        node = Node.objects.select_for_update().filter(name=name).first()
        if node is None:
            node = Node(name=name)
        node.address = address
        node.hostname = resources.hostname
        node.cpu_count = resources.cpu_count
        node.memory_bytes = resources.memory_bytes
        node.gpus = resources.gpus
        node.rdma_devices = resources.rdma_devices
        node.rdma_note = resources.rdma_note
        node.port_range_start, node.port_range_end = start, end
        if labels is not None:
            node.labels = labels
        if node.status != NodeStatus.DRAINING:
            node.status = NodeStatus.ONLINE
        node.last_heartbeat = _now()
        node.save()
    logger.info("node %s registered at %s (%d CPUs, %d GPUs)", name, address, node.cpu_count, len(node.gpus))
    return node


class Beat(enum.Enum):
    """What a heartbeat found: the node row gone, the node alive as it was, or the node back ONLINE."""

    GONE = "gone"
    ALIVE = "alive"
    BACK = "back"

    def __bool__(self) -> bool:
        return self is not Beat.GONE


def heartbeat(node_id: int, *, metrics: dict[str, Any] | None = None) -> Beat:
    """An agent is alive: stamp last_heartbeat (and host metrics); an OFFLINE/UNREACHABLE node is ONLINE again.

    Returns `Beat.GONE` (falsy) when the node no longer exists (deleted in the admin): the agent then
    re-registers; `Beat.BACK` when this beat brought the node back ONLINE: its capacity returned, so the
    caller places what waits for it.
    """
    now = _now()
    fields: dict[str, Any] = {"last_heartbeat": now}
    if metrics is not None:
        fields["last_metrics"] = metrics
    updated = Node.objects.filter(pk=node_id).update(**fields)
    if updated:
        came_back = Node.objects.filter(
            pk=node_id, status__in=[NodeStatus.OFFLINE, NodeStatus.UNREACHABLE]
        ).update(status=NodeStatus.ONLINE)
        if came_back:
            logger.info("node #%s is back online", node_id)
            return Beat.BACK
        return Beat.ALIVE
    return Beat.GONE


def activate_node(node: Node) -> Node:
    """Put a DRAINING node back into service (new workers may be placed on it again)."""
    Node.objects.filter(pk=node.pk, status=NodeStatus.DRAINING).update(status=NodeStatus.ONLINE)
    node.refresh_from_db()
    return node
