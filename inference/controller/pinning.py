"""CPU pinning overlaps: live workers on one node pinned to shared CPUs (`Worker.cpu_ids`).

The controller places workers on disjoint CPU ranges while a node has room, and overlaps them only
when it must (a full node that allows oversubscription, or workers placed by hand). Two workers
sharing a CPU halve each other's speed, so the admin warns about every overlap it finds.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from inference.models import Worker, WorkerStatus
from nodes.models import Node

# Statuses whose process exists (or is about to): their pinning is in force.
PINNED_STATUSES = [s for s in WorkerStatus.values if s not in (WorkerStatus.STOPPED, WorkerStatus.FAILED)]


@dataclass(frozen=True)
class CpuOverlap:
    """Two workers of one node pinned to some of the same CPUs."""

    node_name: str
    first: int  # worker ids, first < second
    second: int
    cpus: tuple[int, ...]
    oversubscription_allowed: bool

    def describe(self) -> str:
        """One line for an admin warning."""
        cpus = ", ".join(str(c) for c in self.cpus)
        allowed = " (oversubscription is allowed on this node)" if self.oversubscription_allowed else ""
        return f"node {self.node_name}: workers {self.first} and {self.second} are both pinned to CPU {cpus}{allowed}"


def cpu_overlaps(workers: Iterable[Worker]) -> list[CpuOverlap]:
    """Every pair of the given workers on one node whose `cpu_ids` intersect (stopped/failed ones
    are skipped). `node` should be select_related: its name and oversubscription flag are read."""
    by_node: dict[int, list[Worker]] = {}
    for worker in workers:
        if worker.status in PINNED_STATUSES and worker.cpu_ids:
            by_node.setdefault(worker.node_id, []).append(worker)
    found: list[CpuOverlap] = []
    for group in by_node.values():
        group.sort(key=lambda w: w.pk)
        for i, first in enumerate(group):
            mine = {int(c) for c in first.cpu_ids}
            for second in group[i + 1:]:
                shared = mine & {int(c) for c in second.cpu_ids}
                if shared:
                    found.append(CpuOverlap(first.node.name, first.pk, second.pk, tuple(sorted(shared)),
                                            bool(first.node.allow_cpu_oversubscription)))
    return found


def live_cpu_overlaps() -> list[CpuOverlap]:
    """The overlaps among all workers whose pinning is in force, as cpu_overlaps finds them, from the
    columns read (id, node, CPUs) without building a model per worker: the workers and nodes lists compute
    this on every view (at 1,000 workers the model rows with their nodes cost ~30 ms a view; the health and
    metrics blobs, read before, a second). The overlapping nodes' names are read last, few if any."""
    rows = Worker.objects.filter(status__in=PINNED_STATUSES).order_by("node_id", "id")
    users: dict[tuple[int, int], list[int]] = {}  # (node, cpu) -> its workers, in id order
    for pk, node_id, cpus in rows.values_list("id", "node_id", "cpu_ids"):
        for cpu in {int(c) for c in cpus or ()}:
            users.setdefault((node_id, cpu), []).append(pk)
    shared: dict[tuple[int, int, int], list[int]] = {}  # (node, first, second) -> their common CPUs
    for (node_id, cpu), pks in users.items():
        for i, first in enumerate(pks):
            for second in pks[i + 1:]:
                shared.setdefault((node_id, first, second), []).append(cpu)
    if not shared:
        return []
    nodes = {pk: (name, allowed) for pk, name, allowed in Node.objects.filter(pk__in={n for n, _, _ in shared})
             .values_list("pk", "name", "allow_cpu_oversubscription")}  # fmt: skip
    return [CpuOverlap(nodes[node_id][0], first, second, tuple(sorted(cpus)), bool(nodes[node_id][1]))
            for (node_id, first, second), cpus in sorted(shared.items())]


def overlapping_worker_ids(overlaps: Iterable[CpuOverlap]) -> set[int]:
    """Ids of the workers involved in any of `overlaps`."""
    return {w for o in overlaps for w in (o.first, o.second)}
