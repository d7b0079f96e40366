"""Workers: the prefill and decode server processes of a deployment, placed on nodes.

Worker sits next to Deployment in the `inference` app (it belongs to a deployment and is placed by its
controller) and points down at `nodes.Node`, so the `nodes` app never refers back to `inference`. It
moved here from `nodes`; its table keeps the old name (`nodes_worker`), see migration 0005.
`validate_role` is the one check of a role name that actions and selectors share.
"""
from __future__ import annotations

import enum

from django.db import models

from nodes.models import Node


class WorkerRole(models.TextChoices):
    """The two halves of a disaggregated deployment, and a worker that is both (`--service-type both`:
    it prefills every prompt itself; the router lists it with the decode workers)."""

    PREFILL = "prefill", "Prefill"
    DECODE = "decode", "Decode"
    BOTH = "both", "Prefill + decode"


class WorkerStatus(models.TextChoices):
    """Lifecycle of a worker process as its agent reports it."""

    PENDING = "pending", "Pending"  # placed, agent not yet started it
    STARTING = "starting", "Starting"
    RUNNING = "running", "Running"  # healthy: routers send it traffic
    UNHEALTHY = "unhealthy", "Unhealthy"
    DRAINING = "draining", "Draining"  # no new traffic; stopped once idle
    STOPPING = "stopping", "Stopping"
    STOPPED = "stopped", "Stopped"
    FAILED = "failed", "Failed"  # given up on: repeated crashes, or it does not fit its node


class FailureCause(enum.Enum):
    """Why an agent gave up on a worker (`report_failed`); the value is what its recovery event says.
    (Not stored in a field, so a plain enum rather than `TextChoices`.)"""

    CRASH_LOOP = "failed after repeated crashes"
    NO_MEMORY = "does not fit its node's memory"


ROLES: tuple[str, ...] = tuple(WorkerRole.values)


def validate_role(role: str) -> str:
    """Return `role` if it is a worker role, else raise ValueError naming the valid ones."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    return role


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
        db_table = "nodes_worker"  # the table it had in the nodes app: moving the model kept the data
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
