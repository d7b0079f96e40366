"""Factories for control-plane rows (models, deployments, nodes, workers) used by API/admin/action tests."""
from __future__ import annotations

import itertools
from typing import Any

from inference.models import Deployment, Model, Worker
from nodes.models import Node

_counter = itertools.count(1)


def make_model(**fields: Any) -> Model:
    """A served model row (no checkpoint needed: nothing is started)."""
    n = next(_counter)
    defaults: dict[str, Any] = {"name": f"model-{n}", "source": "tiny", "path": f"model_cache/tiny-{n}"}
    defaults.update(fields)
    return Model.objects.create(**defaults)


def make_deployment(**fields: Any) -> Deployment:
    """A deployment with bounds [1, 4] for both roles unless overridden (saved directly, no events)."""
    n = next(_counter)
    defaults: dict[str, Any] = {"name": f"dep-{n}"}
    defaults.update(fields)
    if "model" not in defaults:
        defaults["model"] = make_model()
    return Deployment.objects.create(**defaults)


def make_node(**fields: Any) -> Node:
    """An online node with 8 CPUs and 16 GiB."""
    n = next(_counter)
    defaults: dict[str, Any] = {
        "name": f"node-{n}",
        "hostname": f"host-{n}",
        "address": "127.0.0.1",
        "cpu_count": 8,
        "memory_bytes": 16 * 2**30,
    }
    defaults.update(fields)
    return Node.objects.create(**defaults)


def make_worker(deployment: Deployment, node: Node, **fields: Any) -> Worker:
    """A running worker of `deployment` on `node` at a fresh port."""
    defaults: dict[str, Any] = {
        "role": "prefill",
        "port": 30000 + next(_counter),
        "status": "running",
        "pid": 4242,
        "last_health": {"status": "healthy", "cpu_utilization": 0.5, "queue_depth": 1, "running": 2, "kv_usage": 0.1},
    }
    defaults.update(fields)
    return Worker.objects.create(deployment=deployment, node=node, **defaults)
