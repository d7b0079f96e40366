"""CPU pinning overlaps: live workers on one node pinned to shared CPUs (`Worker.cpu_ids`).

The controller places workers on disjoint CPU ranges while a node has room, and overlaps them only
when it must (a full node that allows oversubscription, or workers placed by hand). Two workers
sharing a CPU halve each other's speed, so the admin warns about every overlap it finds.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from inference.models import Worker, WorkerStatus

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
    """The overlaps among all workers whose pinning is in force (one query, of the columns read: the
    workers list computes this on every view, and the health and metrics blobs of 1,000 workers and
    their nodes cost it a second of CPU)."""
    workers = Worker.objects.filter(status__in=PINNED_STATUSES).select_related("node")
    return cpu_overlaps(workers.only("id", "status", "cpu_ids", "node__name", "node__allow_cpu_oversubscription"))


def overlapping_worker_ids(overlaps: Iterable[CpuOverlap]) -> set[int]:
    """Ids of the workers involved in any of `overlaps`."""
    return {w for o in overlaps for w in (o.first, o.second)}
