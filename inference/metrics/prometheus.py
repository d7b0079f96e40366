"""Prometheus file_sd targets from the database: every worker with a process and every router.

`python manage.py prometheus_targets --out platform/prometheus/targets/targets.json` writes them;
Prometheus (platform/prometheus/prometheus.yml) re-reads the file whenever it changes. Each target
carries the labels the Grafana dashboard (platform/grafana/) filters and groups by: `component`
(router or worker), `deployment`, and for workers `role`, `node` and `worker` (the Worker id).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from django.db.models import QuerySet

from inference.models import Deployment, RouterEndpoint, Worker, WorkerStatus

# Workers whose process serves /metrics (STARTING ones are not listening yet; Prometheus would only
# record them as down until the next rewrite).
SCRAPED_WORKER_STATUSES = [WorkerStatus.RUNNING, WorkerStatus.UNHEALTHY, WorkerStatus.DRAINING]


def _host_port(url: str) -> str:
    """host:port of a base URL (a target, in Prometheus's terms); port 80/443 by scheme if absent."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{parts.hostname}:{port}"


def file_sd_targets(deployments: QuerySet[Deployment] | None = None) -> list[dict[str, Any]]:
    """The file_sd target groups: one per worker and one per enabled router, in a stable order."""
    workers = Worker.objects.filter(status__in=SCRAPED_WORKER_STATUSES).select_related("deployment", "node")
    routers = RouterEndpoint.objects.filter(enabled=True).select_related("deployment")
    if deployments is not None:
        workers = workers.filter(deployment__in=deployments)
        routers = routers.filter(deployment__in=deployments)
    groups: list[dict[str, Any]] = []
    for router in routers.order_by("deployment__name", "url"):
        scheme = urlsplit(router.url).scheme or "http"
        groups.append({
            "targets": [_host_port(router.url)],
            "labels": {"component": "router", "deployment": router.deployment.name, "__scheme__": scheme},
        })
    for worker in workers.order_by("deployment__name", "role", "id"):
        groups.append({
            "targets": [f"{worker.node.address}:{worker.port}"],
            "labels": {
                "component": "worker",
                "deployment": worker.deployment.name,
                "role": worker.role,
                "node": worker.node.name,
                "worker": str(worker.pk),
            },
        })
    return groups


def write_file_sd(path: Path, groups: list[dict[str, Any]]) -> None:
    """Write the groups as file_sd JSON atomically (Prometheus never reads a half-written file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(groups, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
