"""Hosts of the platform: the lower layer, which `inference` (deployments, workers, controller, agent) builds on."""
from __future__ import annotations

from django.db import models


class NodeStatus(models.TextChoices):
    """Whether a host's agent is alive and the host takes new workers."""

    ONLINE = "online", "Online"
    DRAINING = "draining", "Draining"
    # The agent went silent (no heartbeat within NODE_HEARTBEAT_TIMEOUT_S) but its workers may well be
    # serving: they stay in rotation while their own /health answers the controller, no new workers are
    # placed here, and a restarted agent adopts them (see inference.actions.nodes.mark_node_unreachable).
    UNREACHABLE = "unreachable", "Unreachable"
    OFFLINE = "offline", "Offline"  # the agent shut down (or an operator gave up on the host): workers re-placed


class Node(models.Model):
    """A host running an agent (`python manage.py agent`), with the resources it registered."""

    name = models.SlugField(max_length=100, unique=True)
    hostname = models.CharField(max_length=255, blank=True)
    address = models.CharField(max_length=255, help_text="address routers and peers reach this host at")
    status = models.CharField(max_length=16, choices=NodeStatus.choices, default=NodeStatus.ONLINE)
    cpu_count = models.PositiveIntegerField(default=0)
    memory_bytes = models.BigIntegerField(default=0)
    gpus = models.JSONField(default=list, blank=True, help_text="[{index, name, memory_bytes}]")
    rdma_devices = models.JSONField(default=list, blank=True)
    rdma_note = models.CharField(max_length=255, blank=True, help_text="why RDMA is unusable, if it is")
    labels = models.JSONField(default=dict, blank=True)
    port_range_start = models.PositiveIntegerField(default=30000)
    port_range_end = models.PositiveIntegerField(default=30999)
    allow_cpu_oversubscription = models.BooleanField(
        default=False,
        help_text="let the controller place workers on CPUs other workers of this host already use "
        "(otherwise a worker only starts where its threads get CPUs of their own)",
    )
    last_heartbeat = models.DateTimeField(null=True, blank=True)
    last_metrics = models.JSONField(default=dict, blank=True, help_text="host CPU/memory at the last heartbeat")
    registered_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def queue_name(self) -> str:
        """The Celery queue this node's agent consumes."""
        return f"node.{self.name}"
