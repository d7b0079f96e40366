"""The controller: keeps each deployment's workers in line with its desired replicas, and places them.

`reconcile(deployment)` compares, per role, the desired replicas (0 for a stopped deployment) with the
role's *active* workers (PENDING, STARTING, RUNNING, UNHEALTHY; DRAINING and later no longer count):
- missing replicas: `place_worker` creates a PENDING Worker on a node that fits and, on commit, the
  node's agent gets `start_worker` on its queue `node.<name>`;
- surplus replicas: removed in this order: UNHEALTHY first, then not yet serving (PENDING, STARTING),
  then RUNNING ones, least loaded first; RUNNING ones drain (`stop_worker(drain=True)`: no new requests,
  stopped once idle), the others stop at once;
- workers left on an OFFLINE node are given up (STOPPED) and re-placed;
- PENDING workers whose agent did not pick them up within CONTROLLER_PENDING_RESEND_S get their start
  request again (agents also pick up their PENDING workers by themselves, see nodes.agent.supervisor).

Placement (`place_worker`): a node fits when it is ONLINE with a heartbeat younger than
NODE_HEARTBEAT_TIMEOUT_S, accepts the role (`labels["roles"]`, set by `agent --roles`), has RDMA devices
when the deployment wants RDMA, has a free port in its range (two for decode: HTTP and KV), and had no
FAILED worker of this deployment+role within CONTROLLER_FAILURE_COOLDOWN_S (a crash-looping replica is not
put back on the node that just gave up on it). Among those, prefill prefers nodes with a free GPU and decode
nodes without GPUs (the guide's split: prefill on GPU, decode on CPU); then the node with the most free
CPUs, then the one with the fewest replicas of this deployment+role (spread). CPUs: each worker gets
`threads_per_worker` contiguous CPU ids; the range is chosen to overlap first the other role's CPUs as
little as possible, then any worker's; prefill ranges grow from CPU 0 upwards and decode ranges from the
last CPU downwards, so on a shared host the two roles end up on different cores when there are enough.
CPU oversubscription is allowed (ranges then overlap the least used CPUs): a host is never refused for
lack of CPUs, only ranked lower. GPUs: a prefill worker gets one free GPU of its node if there is one;
decode workers run on CPU (CUDA_VISIBLE_DEVICES="").
"""
from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from inference.models import Deployment, DeploymentStatus
from nodes import actions as node_actions
from nodes.models import ACTIVE_WORKER_STATUSES, Node, NodeStatus, Worker, WorkerRole, WorkerStatus

logger = logging.getLogger(__name__)

ROLES: tuple[str, ...] = tuple(WorkerRole.values)
# Placement retries when another reconcile took the chosen port between our read and our insert.
PLACEMENT_ATTEMPTS = 3
# Order in which surplus workers are removed (lower first).
_REMOVAL_RANK = {
    WorkerStatus.UNHEALTHY: 0,
    WorkerStatus.PENDING: 1,
    WorkerStatus.STARTING: 2,
    WorkerStatus.RUNNING: 3,
}


@dataclass
class Placement:
    """Where a new worker goes: its node, HTTP port, KV port (decode), CPU ids and GPU ids."""

    node: Node
    port: int
    kv_port: int | None
    cpu_ids: list[int]
    gpu_ids: list[int]


@dataclass
class ReconcileResult:
    """What one reconcile did, per role."""

    deployment_id: int
    started: list[int] = field(default_factory=list)
    draining: list[int] = field(default_factory=list)
    stopped: list[int] = field(default_factory=list)
    unplaced: dict[str, int] = field(default_factory=dict)
    resent: list[int] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """JSON-safe form (the task's result and log line)."""
        return {
            "deployment_id": self.deployment_id,
            "started": self.started,
            "draining": self.draining,
            "stopped": self.stopped,
            "unplaced": self.unplaced,
            "resent": self.resent,
        }


# ------------------------------------------------------------------------------------------ placement
def node_roles(node: Node) -> set[str] | None:
    """Roles a node accepts from its labels (`roles`: list or comma-separated string); None = any."""
    roles = (node.labels or {}).get("roles")
    if isinstance(roles, str):
        roles = [r.strip() for r in roles.split(",") if r.strip()]
    if not roles:
        return None
    return {str(r) for r in roles}


def schedulable_nodes(now: datetime | None = None) -> list[Node]:
    """ONLINE nodes whose agent sent a heartbeat within NODE_HEARTBEAT_TIMEOUT_S."""
    now = now or timezone.now()
    cutoff = now - timedelta(seconds=float(settings.NODE_HEARTBEAT_TIMEOUT_S))
    return list(Node.objects.filter(status=NodeStatus.ONLINE, last_heartbeat__gte=cutoff).order_by("name"))


def _live_workers(node: Node) -> list[Worker]:
    return list(Worker.objects.filter(node=node, status__in=node_actions.LIVE_WORKER_STATUSES))


def free_ports(node: Node, live: Sequence[Worker], count: int, *, avoid: Iterable[int] = ()) -> list[int] | None:
    """The `count` lowest ports of the node's range that no live worker uses (HTTP or KV), or None."""
    used = {w.port for w in live} | {w.kv_port for w in live if w.kv_port} | set(avoid)
    found: list[int] = []
    for port in range(node.port_range_start, node.port_range_end + 1):
        if port not in used:
            found.append(port)
            if len(found) == count:
                return found
    return None


def choose_cpus(cpu_count: int, threads: int, role: str, live: Sequence[Worker]) -> list[int]:
    """A contiguous range of `threads` CPU ids on a host with `cpu_count` CPUs (see the module docstring)."""
    total = max(1, cpu_count)
    threads = max(1, min(threads, total))
    same: Counter[int] = Counter()
    other: Counter[int] = Counter()
    for worker in live:
        for cpu in worker.cpu_ids or []:
            (same if worker.role == role else other)[int(cpu)] += 1
    starts = list(range(0, total - threads + 1))
    if role == WorkerRole.DECODE:
        starts.reverse()  # decode fills from the top, prefill from the bottom

    def cost(base: int) -> tuple[int, int]:
        span = range(base, base + threads)
        return sum(other[c] for c in span), sum(other[c] + same[c] for c in span)

    best = min(starts, key=cost)  # min() keeps the first of equal costs: the role's preferred end
    return list(range(best, best + threads))


def choose_gpus(node: Node, role: str, live: Sequence[Worker]) -> list[int]:
    """One free GPU of the node for a prefill worker (none for decode, or when all are taken)."""
    if role != WorkerRole.PREFILL or not node.gpus:
        return []
    taken = {int(g) for w in live for g in (w.gpu_ids or [])}
    for gpu in node.gpus:
        index = int(gpu.get("index", -1)) if isinstance(gpu, dict) else int(gpu)
        if index >= 0 and index not in taken:
            return [index]
    return []


def recently_failed_nodes(deployment: Deployment, role: str, now: datetime) -> set[int]:
    """Nodes where a worker of this deployment+role FAILED within CONTROLLER_FAILURE_COOLDOWN_S."""
    since = now - timedelta(seconds=float(settings.CONTROLLER_FAILURE_COOLDOWN_S))
    return set(
        Worker.objects.filter(
            deployment=deployment, role=role, status=WorkerStatus.FAILED, updated_at__gte=since
        ).values_list("node_id", flat=True)
    )


def plan_placement(deployment: Deployment, role: str, *, now: datetime | None = None) -> Placement | None:
    """Choose a node, ports, CPUs and GPUs for a new worker (no database write); None if no node fits."""
    now = now or timezone.now()
    failed = recently_failed_nodes(deployment, role, now)
    candidates: list[tuple[tuple[Any, ...], Placement]] = []
    for node in schedulable_nodes(now):
        accepted = node_roles(node)
        if accepted is not None and role not in accepted:
            continue
        if deployment.kv_transport == "rdma" and not node.rdma_devices:
            continue
        if node.pk in failed:
            continue
        live = _live_workers(node)
        ports = free_ports(node, live, 2 if role == WorkerRole.DECODE else 1)
        if ports is None:
            continue
        cpus = choose_cpus(node.cpu_count, deployment.threads_per_worker, role, live)
        gpus = choose_gpus(node, role, live)
        busy_cpus = {int(c) for w in live for c in (w.cpu_ids or [])}
        free_cpu_count = max(0, node.cpu_count - len(busy_cpus))
        replicas_here = sum(1 for w in live if w.deployment_id == deployment.pk and w.role == role)
        if role == WorkerRole.PREFILL:
            device_pref = 0 if gpus else (1 if not node.gpus else 2)  # free GPU, CPU host, full GPU host
        else:
            device_pref = 0 if not node.gpus else 1  # keep GPU hosts for prefill
        explicit = 0 if accepted is not None else 1  # a node labelled for this role beats a generic one
        key = (explicit, device_pref, replicas_here, -free_cpu_count, len(live), node.name)
        placement = Placement(
            node=node, port=ports[0], kv_port=ports[1] if len(ports) > 1 else None, cpu_ids=cpus, gpu_ids=gpus
        )
        candidates.append((key, placement))
    if not candidates:
        return None
    return min(candidates, key=lambda item: item[0])[1]


def place_worker(deployment: Deployment, role: str, *, now: datetime | None = None) -> Worker | None:
    """Create a PENDING worker of `deployment`/`role` on a node that fits; None when none does.

    The caller sends the start request (`nodes.actions.request_start`), normally on commit.
    """
    for attempt in range(PLACEMENT_ATTEMPTS):
        placement = plan_placement(deployment, role, now=now)
        if placement is None:
            return None
        try:
            with transaction.atomic():  # a savepoint: a lost port race leaves the outer transaction usable
                worker = Worker.objects.create(
                    deployment=deployment,
                    node=placement.node,
                    role=role,
                    port=placement.port,
                    kv_port=placement.kv_port,
                    cpu_ids=placement.cpu_ids,
                    gpu_ids=placement.gpu_ids,
                    status=WorkerStatus.PENDING,
                )
        except IntegrityError:
            logger.info("port %s on %s taken meanwhile (attempt %d)", placement.port, placement.node, attempt + 1)
            continue
        logger.info("placed %s %s worker #%s on %s:%s (CPUs %s, GPUs %s)", deployment.name, role, worker.pk,
                    placement.node.name, placement.port, placement.cpu_ids, placement.gpu_ids)
        return worker
    return None


# ------------------------------------------------------------------------------------------ reconcile
def _removal_key(worker: Worker) -> tuple[int, int, float, int]:
    health = worker.last_health or {}
    try:
        busy = float(health.get("running", 0)) + float(health.get("queue_depth", 0))
    except (TypeError, ValueError):
        busy = 0.0
    on_draining_node = 0 if worker.node.status != NodeStatus.ONLINE else 1
    return _REMOVAL_RANK.get(WorkerStatus(worker.status), 9), on_draining_node, busy, -worker.pk


def reconcile(deployment: Deployment | int, *, now: datetime | None = None) -> ReconcileResult:
    """Start missing and drain surplus workers of one deployment (see the module docstring)."""
    deployment_id = deployment if isinstance(deployment, int) else deployment.pk
    now = now or timezone.now()
    result = ReconcileResult(deployment_id=deployment_id)
    resend_before = now - timedelta(seconds=float(settings.CONTROLLER_PENDING_RESEND_S))
    with transaction.atomic():
        # One reconcile per deployment at a time (PostgreSQL row lock; SQLite serialises writers anyway).
        locked = Deployment.objects.select_for_update().filter(pk=deployment_id).first()
        if locked is None:
            return result
        for role in ROLES:
            desired = locked.replicas(role) if locked.status == DeploymentStatus.ACTIVE else 0
            workers = list(
                Worker.objects.select_related("node")
                .filter(deployment=locked, role=role, status__in=ACTIVE_WORKER_STATUSES)
                .order_by("pk")
            )
            lost = [w for w in workers if w.node.status == NodeStatus.OFFLINE]
            if lost:
                # mark_node_offline normally did this; a node set OFFLINE by hand leaves them here.
                Worker.objects.filter(pk__in=[w.pk for w in lost]).update(
                    status=WorkerStatus.STOPPED, last_error="node offline; re-placed", updated_at=now
                )
                result.stopped += [w.pk for w in lost]
                workers = [w for w in workers if w not in lost]
            if len(workers) < desired:
                for _ in range(desired - len(workers)):
                    worker = place_worker(locked, role, now=now)
                    if worker is None:
                        result.unplaced[role] = result.unplaced.get(role, 0) + 1
                        continue
                    node_actions.request_start(worker)
                    result.started.append(worker.pk)
                if role in result.unplaced:
                    logger.warning("%s: no node fits %d %s worker(s)", locked.name, result.unplaced[role], role)
            elif len(workers) > desired:
                for worker in sorted(workers, key=_removal_key)[: len(workers) - desired]:
                    drain = worker.status == WorkerStatus.RUNNING
                    node_actions.request_stop(worker, drain=drain, reason=f"scale-down: {role} replicas → {desired}")
                    (result.draining if drain else result.stopped).append(worker.pk)
                workers = [w for w in workers if w.pk not in result.draining and w.pk not in result.stopped]
            for worker in workers:
                if worker.status == WorkerStatus.PENDING and worker.updated_at < resend_before:
                    Worker.objects.filter(pk=worker.pk).update(updated_at=now)
                    node_actions.request_start(worker)
                    result.resent.append(worker.pk)
    if result.started or result.draining or result.stopped or result.unplaced:
        logger.info("reconciled deployment #%s: %s", deployment_id, result.as_dict())
    return result


def reconcile_all(*, now: datetime | None = None) -> list[ReconcileResult]:
    """Reconcile every active deployment, and every stopped one that still has live workers."""
    ids = set(Deployment.objects.filter(status=DeploymentStatus.ACTIVE).values_list("pk", flat=True))
    ids |= set(
        Worker.objects.filter(status__in=node_actions.LIVE_WORKER_STATUSES).values_list("deployment_id", flat=True)
    )
    results = []
    for deployment_id in sorted(ids):
        try:
            results.append(reconcile(deployment_id, now=now))
        except Exception:  # noqa: BLE001  one broken deployment must not block the others
            logger.exception("reconcile of deployment #%s failed", deployment_id)
    return results


# ------------------------------------------------------------------------------------------ heartbeats
def check_node_heartbeats(*, now: datetime | None = None) -> list[Node]:
    """Nodes silent for over NODE_HEARTBEAT_TIMEOUT_S go OFFLINE; their workers are given up and re-placed."""
    now = now or timezone.now()
    timeout = float(settings.NODE_HEARTBEAT_TIMEOUT_S)
    cutoff = now - timedelta(seconds=timeout)
    stale = list(
        Node.objects.exclude(status=NodeStatus.OFFLINE).filter(last_heartbeat__lt=cutoff)
    ) + list(Node.objects.exclude(status=NodeStatus.OFFLINE).filter(last_heartbeat__isnull=True))
    for node in stale:
        seen = f"last heartbeat {node.last_heartbeat:%Y-%m-%d %H:%M:%S}" if node.last_heartbeat else "never seen"
        node_actions.mark_node_offline(node, reason=f"no heartbeat for over {timeout:.0f}s ({seen})")
    return stale
