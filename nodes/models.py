"""Hosts of the platform and the worker processes placed on them."""
from __future__ import annotations

from django.db import models


class NodeStatus(models.TextChoices):
    """Whether a host's agent is alive and the host takes new workers."""

    ONLINE = "online", "Online"
    DRAINING = "draining", "Draining"
    # The agent went silent (no heartbeat within NODE_HEARTBEAT_TIMEOUT_S) but its workers may well be
    # serving: they stay in rotation while their own /health answers the controller, no new workers are
    # placed here, and a restarted agent adopts them (see nodes.actions.mark_node_unreachable).
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


class WorkerRole(models.TextChoices):
    """The two halves of a disaggregated deployment."""

    PREFILL = "prefill", "Prefill"
    DECODE = "decode", "Decode"


class WorkerStatus(models.TextChoices):
    """Lifecycle of a worker process as its agent reports it."""

    PENDING = "pending", "Pending"  # placed, agent not yet started it
    STARTING = "starting", "Starting"
    RUNNING = "running", "Running"  # healthy: routers send it traffic
    UNHEALTHY = "unhealthy", "Unhealthy"
    DRAINING = "draining", "Draining"  # no new traffic; stopped once idle
    STOPPING = "stopping", "Stopping"
    STOPPED = "stopped", "Stopped"
    FAILED = "failed", "Failed"  # gave up after repeated crashes


ACTIVE_WORKER_STATUSES = [
    WorkerStatus.PENDING,
    WorkerStatus.STARTING,
    WorkerStatus.RUNNING,
    WorkerStatus.UNHEALTHY,
]


class Worker(models.Model):
    """One prefill or decode server process of a deployment, placed on a node."""

    deployment = models.ForeignKey("inference.Deployment", on_delete=models.CASCADE, related_name="workers")
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="workers")
    role = models.CharField(max_length=16, choices=WorkerRole.choices)
    port = models.PositiveIntegerField()
    kv_port = models.PositiveIntegerField(null=True, blank=True)
    pid = models.PositiveIntegerField(null=True, blank=True)
    process_started_at = models.FloatField(
        null=True,
        blank=True,
        help_text="start time of the process (epoch seconds, as the OS reports it): with pid and port it "
        "tells a restarted agent that a running process is this worker's, not a reused pid",
    )
    status = models.CharField(max_length=16, choices=WorkerStatus.choices, default=WorkerStatus.PENDING)
    restarts = models.PositiveIntegerField(default=0)
    cpu_ids = models.JSONField(default=list, blank=True)
    gpu_ids = models.JSONField(default=list, blank=True)
    last_health = models.JSONField(default=dict, blank=True)
    last_metrics = models.JSONField(default=dict, blank=True)
    last_error = models.TextField(blank=True)
    last_seen = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["deployment_id", "role", "id"]
        constraints = [
            models.UniqueConstraint(
                fields=["node", "port"],
                condition=~models.Q(status__in=["stopped", "failed"]),
                name="unique_live_port_per_node",
            )
        ]

    def __str__(self) -> str:
        return f"{self.deployment.name}/{self.role}#{self.pk}@{self.node.name}:{self.port}"

    @property
    def url(self) -> str:
        """Base URL of the worker's HTTP API."""
        return f"http://{self.node.address}:{self.port}"
