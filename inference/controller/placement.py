"""Placement: where a deployment's new worker goes (node, ports, CPUs, GPUs), and the scale event it carries out.

Placement (`place_worker`): every registered node is considered, and a node fits when it is ONLINE with a
heartbeat younger than NODE_HEARTBEAT_TIMEOUT_S, accepts the role (`labels["roles"]`, set by `agent
--roles`), has RDMA devices when the deployment wants RDMA, had no FAILED worker of this deployment+role
within CONTROLLER_FAILURE_COOLDOWN_S (a crash-looping replica is not put back on the node that just gave
up on it), has a free port in its range (two for decode: HTTP and KV), and has CPUs for the worker's
threads: `threads_per_worker` contiguous CPU ids (clipped to the host's CPU count) that no live worker of
the node (DRAINING included: its process still runs) is pinned to. A worker is never started on CPUs
another worker uses, since a third worker on two busy CPUs slows every request of the host, unless the
node allows it (`Node.allow_cpu_oversubscription`, off by default, set in the node admin or with `PATCH
/api/nodes/{id}/`); then its range overlaps first the other role's CPUs as little as possible, then any
worker's. Among the nodes that fit: one that needs no oversubscription first; then a node labelled for
the role; prefill prefers nodes with a free GPU and decode nodes without GPUs (the guide's split: prefill
on GPU, decode on CPU); then the node with the fewest replicas of this deployment+role (spread), then the
most free CPUs. Prefill ranges grow from CPU 0 upwards and decode ranges from the last CPU downwards, so
on a shared host the two roles end up on different cores. GPUs: a prefill worker gets one free GPU of its
node if there is one; decode workers run on CPU (CUDA_VISIBLE_DEVICES="").

Scale events (`placement_cause`): each worker placed is linked to the ScaleEvent it carries out
(`ScaleEvent.placed_workers`): the role's latest event after its previous placement that asked for
more workers (a scale-out, or a failover that gave workers up). When there is none, the workers are
re-placements of workers lost some other way (a node set OFFLINE by hand, a worker FAILED after a crash
loop, a drained node, a worker stopped by hand): a ScaleEvent with source "recovery" says so. The
event's `time_to_run_s` is filled in when the last of its workers reports RUNNING
(inference.actions.workers.report_healthy), which is how long the scale-out or failover took to serve.

A replica that no node fits stays missing (the next reconcile tries again) and is recorded as a
ScaleEvent flagged `refused`, with the source of the scale it could not carry out ("recovery" when none
asked: the controller restoring the desired count), whose reason names each node considered and why it
was refused ("no free CPUs ...", "no free port ...", "role not accepted ...",
"heartbeat stale ...", "offline", ...). Reconciles run every few seconds, so the event is written once:
again only when the reason or the counts change, a worker of the deployment+role was placed since, or
another scale change of the role was recorded since. Placements are serialised across reconciles (a
PostgreSQL advisory lock held to the end of the reconcile's transaction), because two deployments placed
at once would otherwise both see the same CPUs as free; ports are also protected by a unique constraint.

The normal start-up order records nothing: `make up` starts the controller before the agent, so its
first reconciles find no node registered (or the node OFFLINE since the last `make down`, or its
heartbeat stale). While every node is in such a state ("waiting for an agent") and the controller
process started less than CONTROLLER_STARTUP_GRACE_S ago (default 60 s), the refusal is only logged;
past that, an agent that never came is recorded as any other refusal.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from inference.actions import recovery
from inference.models import (
    Deployment,
    ScaleEvent,
    ScaleSource,
    Worker,
    WorkerRole,
    WorkerStatus,
)
from nodes.models import Node, NodeStatus

logger = logging.getLogger(__name__)

# Placement retries when another reconcile took the chosen port between our read and our insert.
PLACEMENT_ATTEMPTS = 3
# pg_advisory_xact_lock key serialising placements (any constant the platform uses for nothing else).
PLACEMENT_LOCK_ID = 0x706C6163  # "plac"


# How the reasons of "no node fits" events start (placements never carry those events out).
REFUSED_PREFIX = "placement refused"
# When this controller process started (this module is loaded by its first reconcile at the latest):
# refusals that only say "no agent yet" are not recorded within CONTROLLER_STARTUP_GRACE_S of it.
CONTROLLER_STARTED_AT = timezone.now()


@dataclass
class Placement:
    """Where a new worker goes: its node, HTTP port, KV port (decode), CPU ids and GPU ids."""

    node: Node
    port: int
    kv_port: int | None
    cpu_ids: list[int]
    gpu_ids: list[int]


def node_roles(node: Node) -> set[str] | None:
    """Roles a node accepts from its labels (`roles`: list or comma-separated string); None = any."""
    roles = (node.labels or {}).get("roles")
    if isinstance(roles, str):
        roles = [r.strip() for r in roles.split(",") if r.strip()]
    if not roles:
        return None
    return {str(r) for r in roles}


# What placement reads of a live worker (not its health and metrics blobs, kilobytes each).
_PLACEMENT_FIELDS = ("id", "node_id", "deployment_id", "role", "port", "kv_port", "cpu_ids", "gpu_ids", "status")


def live_workers_by_node() -> dict[int, list[Worker]]:
    """Every live worker by node id, in one query: a query per node cost 100 per placement at 100 nodes.

    A caller placing several workers in one transaction (reconcile) reads it once and passes it to each
    place_worker_explained, which adds what it places: the placement lock, held to the transaction's end,
    keeps other placements out meanwhile (a worker that stops meanwhile only keeps its ports taken). So the
    lock is taken first: read before it, the workers another reconcile is placing would be missed."""
    _serialise_placements()
    by_node: dict[int, list[Worker]] = {}
    for worker in Worker.objects.filter(status__in=recovery.LIVE_WORKER_STATUSES).only(*_PLACEMENT_FIELDS):
        by_node.setdefault(worker.node_id, []).append(worker)
    return by_node


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
    # Workers pinned per CPU (of the other role; of either role), as prefix sums: a span's cost is two
    # subtractions. Summing each span cost 0.1-0.3 s per placement on 100 nodes of 256 CPUs (25,600 spans).
    other = [0] * (total + 1)
    both = [0] * (total + 1)
    for worker in live:
        for cpu in worker.cpu_ids or []:
            c = int(cpu)
            if 0 <= c < total:
                both[c + 1] += 1
                if worker.role != role:
                    other[c + 1] += 1
    for c in range(total):
        other[c + 1] += other[c]
        both[c + 1] += both[c]
    starts = range(0, total - threads + 1)
    if role == WorkerRole.DECODE:
        starts = starts[::-1]  # decode fills from the top, prefill from the bottom
    best, best_cost = starts[0], None
    for base in starts:
        end = base + threads
        cost = (other[end] - other[base], both[end] - both[base])
        if best_cost is None or cost < best_cost:  # strictly less: the first of equal costs is the role's end
            best, best_cost = base, cost
            if cost == (0, 0):
                break  # nothing beats a free span
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


def busy_cpus(node: Node, live: Sequence[Worker]) -> set[int]:
    """The node's CPU ids that live workers are pinned to."""
    return {int(c) for w in live for c in (w.cpu_ids or []) if 0 <= int(c) < max(1, node.cpu_count)}


@dataclass
class PlacementPlan:
    """The outcome of considering every node for one new worker: where it goes, or why nowhere."""

    placement: Placement | None
    # (node name, why it was refused), in node-name order; the nodes that fitted are not listed.
    refusals: list[tuple[str, str]] = field(default_factory=list)

    def explain(self) -> str:
        """The refusals as one line: "a: no free CPUs (...); b: offline" ("no nodes registered" if none)."""
        if not self.refusals:
            return "no nodes registered"
        return "; ".join(f"{name}: {why}" for name, why in self.refusals)


def _refusal(
    node: Node, deployment: Deployment, role: str, *, now: datetime, failed: set[int]
) -> str | None:
    """Why `node` cannot take a worker of `deployment`/`role` before its resources are looked at."""
    if node.status != NodeStatus.ONLINE:
        return str(node.status)  # "offline" or "draining"
    timeout = float(settings.NODE_HEARTBEAT_TIMEOUT_S)
    if node.last_heartbeat is None:
        return "heartbeat stale (never sent one)"
    if node.last_heartbeat < now - timedelta(seconds=timeout):
        return f"heartbeat stale (none within {timeout:g}s)"
    accepted = node_roles(node)
    if accepted is not None and role not in accepted:
        return f"role not accepted (takes {', '.join(sorted(accepted))})"
    if deployment.kv_transport == "rdma" and not node.rdma_devices:
        return "no RDMA devices"
    if node.pk in failed:
        cooldown = float(settings.CONTROLLER_FAILURE_COOLDOWN_S)
        return f"a {role} worker of this deployment failed here within {cooldown:g}s"
    return None


def plan_placement_explained(
    deployment: Deployment, role: str, *, now: datetime | None = None, live: dict[int, list[Worker]] | None = None
) -> PlacementPlan:
    """Choose a node, ports, CPUs and GPUs for a new worker (no database write), saying why nodes were refused.

    `live`: the live workers by node (live_workers_by_node) when the caller has them; read here otherwise."""
    now = now or timezone.now()
    failed = recently_failed_nodes(deployment, role, now)
    plan = PlacementPlan(placement=None)
    candidates: list[tuple[tuple[Any, ...], Placement]] = []
    live_by_node = live_workers_by_node() if live is None else live
    for node in Node.objects.order_by("name").defer("last_metrics"):
        why = _refusal(node, deployment, role, now=now, failed=failed)
        if why is not None:
            plan.refusals.append((node.name, why))
            continue
        here = live_by_node.get(node.pk, [])
        port_count = 2 if role == WorkerRole.DECODE else 1
        ports = free_ports(node, here, port_count)
        if ports is None:
            plan.refusals.append(
                (node.name, f"no free port (needs {port_count} in {node.port_range_start}-{node.port_range_end})")
            )
            continue
        cpus = choose_cpus(node.cpu_count, deployment.threads_per_worker, role, here)
        busy = busy_cpus(node, here)
        total = max(1, node.cpu_count)
        oversubscribes = bool(busy & set(cpus))  # choose_cpus takes a free range whenever there is one
        if oversubscribes and not node.allow_cpu_oversubscription:
            plan.refusals.append(
                (node.name, f"no free CPUs (needs {len(cpus)} contiguous, {total - len(busy)} of {total} free; "
                            "oversubscription not allowed)")
            )
            continue
        gpus = choose_gpus(node, role, here)
        replicas_here = sum(1 for w in here if w.deployment_id == deployment.pk and w.role == role)
        if role == WorkerRole.PREFILL:
            device_pref = 0 if gpus else (1 if not node.gpus else 2)  # free GPU, CPU host, full GPU host
        else:
            device_pref = 0 if not node.gpus else 1  # keep GPU hosts for prefill
        explicit = 0 if node_roles(node) is not None else 1  # a node labelled for this role beats a generic one
        key = (oversubscribes, explicit, device_pref, replicas_here, len(busy) - total, len(here), node.name)
        placement = Placement(
            node=node, port=ports[0], kv_port=ports[1] if len(ports) > 1 else None, cpu_ids=cpus, gpu_ids=gpus
        )
        candidates.append((key, placement))
    if candidates:
        plan.placement = min(candidates, key=lambda item: item[0])[1]
    return plan


def plan_placement(deployment: Deployment, role: str, *, now: datetime | None = None) -> Placement | None:
    """Choose a node, ports, CPUs and GPUs for a new worker (no database write); None if no node fits."""
    return plan_placement_explained(deployment, role, now=now).placement


def _serialise_placements() -> None:
    """Hold the placement lock until the current transaction ends (PostgreSQL; SQLite serialises writers).

    CPU ranges have no database constraint (unlike ports), so without it two reconciles of different
    deployments could both read the same CPUs as free and pin a worker each to them.
    """
    if connection.vendor == "postgresql" and connection.in_atomic_block:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [PLACEMENT_LOCK_ID])


def place_worker_explained(
    deployment: Deployment, role: str, *, now: datetime | None = None, live: dict[int, list[Worker]] | None = None
) -> tuple[Worker | None, PlacementPlan]:
    """Create a PENDING worker of `deployment`/`role` on a node that fits; the plan says why when none does.

    The caller sends the start request (`inference.actions.workers.request_start`), normally on commit.
    `live` (live_workers_by_node, read in this transaction) saves reading every live worker again: the
    new worker is added to it.
    """
    _serialise_placements()
    plan = PlacementPlan(placement=None)
    for attempt in range(PLACEMENT_ATTEMPTS):
        plan = plan_placement_explained(deployment, role, now=now, live=live)
        placement = plan.placement
        if placement is None:
            return None, plan
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
            if live is not None:  # someone placed outside the lock (SQLite, a hand-made row): read again
                live.clear()
                live.update(live_workers_by_node())
            continue
        if live is not None:
            live.setdefault(placement.node.pk, []).append(worker)
        logger.info("placed %s %s worker #%s on %s:%s (CPUs %s, GPUs %s)", deployment.name, role, worker.pk,
                    placement.node.name, placement.port, placement.cpu_ids, placement.gpu_ids)
        return worker, plan
    return None, PlacementPlan(placement=None, refusals=plan.refusals + [("*", "ports taken meanwhile")])


def place_worker(deployment: Deployment, role: str, *, now: datetime | None = None) -> Worker | None:
    """Create a PENDING worker of `deployment`/`role` on a node that fits; None when none does."""
    return place_worker_explained(deployment, role, now=now)[0]


def waiting_for_agents(plan: PlacementPlan) -> bool:
    """Whether the plan failed only because no agent is up yet: no node registered, or each one offline
    or with a stale heartbeat (a draining node or one short of resources is a real refusal)."""
    return all(why == NodeStatus.OFFLINE or why.startswith("heartbeat stale") for _, why in plan.refusals)


def in_startup_grace(now: datetime) -> bool:
    """Whether this controller process started less than CONTROLLER_STARTUP_GRACE_S before `now`."""
    grace = settings.CONTROLLER_STARTUP_GRACE_S
    return timedelta(0) <= now - CONTROLLER_STARTED_AT < timedelta(seconds=grace)


def record_unplaced(
    deployment: Deployment, role: str, *, active: int, desired: int, plan: PlacementPlan,
    cause: ScaleEvent | None = None, now: datetime | None = None,
) -> ScaleEvent | None:
    """Record that `desired - active` workers of the role could not be placed, once per distinct reason.

    Written as a ScaleEvent flagged `refused`, with the source of `cause` (the scale it could not carry
    out; "recovery" without one), naming every node considered and why it was refused. None when the
    role's latest ScaleEvent already says exactly this and no worker of the role was placed since (the
    reconcile loop would otherwise write one per round), and during the controller's start-up while no
    agent is up yet (module docstring). Call with `deployment` locked.
    """
    reason = (
        f"{REFUSED_PREFIX}: {desired - active} {role} worker(s) not placed ({active} of {desired} running "
        f"or starting); nodes considered: {plan.explain()}"
    )
    if waiting_for_agents(plan) and in_startup_grace(now or timezone.now()):
        logger.info("%s: %s (the controller is starting: waiting for agents to register)", deployment.name, reason)
        return None
    last = ScaleEvent.objects.filter(deployment=deployment, role=role).order_by("-created_at", "-pk").first()
    if (
        last is not None
        and last.refused
        and (last.reason, last.from_replicas, last.to_replicas) == (reason, active, desired)
        and not Worker.objects.filter(deployment=deployment, role=role, created_at__gt=last.created_at).exists()
    ):
        return None
    event = ScaleEvent.objects.create(
        deployment=deployment,
        role=role,
        from_replicas=active,
        to_replicas=desired,
        source=cause.source if cause is not None else ScaleSource.RECOVERY,
        refused=True,
        reason=reason,
    )
    logger.warning("%s: %s", deployment.name, reason)
    return event


# ------------------------------------------------------------------------------------------ scale events
def placement_cause(deployment: Deployment, role: str) -> ScaleEvent | None:
    """The ScaleEvent that new workers of the role carry out (module docstring); None when none asked."""
    last_placed = (
        Worker.objects.filter(deployment=deployment, role=role)
        .order_by("-created_at").values_list("created_at", flat=True).first()
    )
    events = ScaleEvent.objects.filter(deployment=deployment, role=role, refused=False)
    if last_placed is not None:
        events = events.filter(created_at__gt=last_placed)
    for event in events.order_by("-created_at", "-pk")[:20]:
        if event.source == ScaleSource.RECOVERY:
            if event.from_replicas > event.to_replicas:  # a failover gave workers up
                return event
        elif event.to_replicas > event.from_replicas:  # a scale-out
            return event
    return None


def record_replacement(
    deployment: Deployment, role: str, worker: Worker, *, active: int, desired: int
) -> ScaleEvent | None:
    """A "recovery" ScaleEvent for a worker placed where no event asked for one (a re-placement).

    Only when a worker of the role ended (STOPPED, FAILED, or on its way there) since the role's previous
    placement, other than by a scale-down: the first start of a deployment, or replicas raised without
    an event, are no recovery. None otherwise.
    """
    previous = (
        Worker.objects.filter(deployment=deployment, role=role).exclude(pk=worker.pk)
        .order_by("-created_at").values_list("created_at", flat=True).first()
    )
    if previous is None:
        return None
    ended = Worker.objects.filter(
        deployment=deployment, role=role, updated_at__gte=previous,
        status__in=[WorkerStatus.STOPPED, WorkerStatus.FAILED, WorkerStatus.STOPPING, WorkerStatus.DRAINING],
    ).exclude(last_error__startswith="scale-down")
    if not ended.exists():
        return None
    return ScaleEvent.objects.create(
        deployment=deployment, role=role, from_replicas=active, to_replicas=desired, source=ScaleSource.RECOVERY,
        reason=f"re-placement: {role} worker(s) placed on {worker.node.name} to restore {desired} replicas "
               f"({active} active): workers lost without a failover event (failed, stopped or drained)",
    )
