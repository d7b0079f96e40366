"""Moving Worker from `nodes` to `inference` keeps the data of an existing database.

A database at the migrations before the move (nodes.Worker) gets rows through the historical models, is
migrated forward with Django's MigrationExecutor, and the same rows are read back through today's
inference.Worker: ids, fields, node, deployment, the ScaleEvent links, the content type. Then it is
migrated back and forward once more, so the move is reversible too.
"""
from __future__ import annotations

from typing import Any

import pytest
from django.contrib.contenttypes.models import ContentType
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from inference.models import ScaleEvent, Worker
from nodes.models import Node

# The last migrations at which Worker was still a model of the nodes app.
BEFORE_MOVE = [("inference", "0004_scaling_signals"), ("nodes", "0003_worker_process_started_at_node_unreachable")]
# The move itself: later migrations add tables of their own (rollups, API keys), which are not the move's.
AFTER_MOVE = [("inference", "0005_worker_from_nodes"), ("nodes", "0004_worker_moved_to_inference")]


def _migrate(targets: list[tuple[str, str]]) -> Any:
    """Migrate the test database to `targets`; returns the historical apps at that state."""
    executor = MigrationExecutor(connection)
    executor.migrate(targets)
    executor.loader.build_graph()  # the executor's graph is stale after migrating
    return executor.loader.project_state(targets).apps


def _latest() -> list[tuple[str, str]]:
    return MigrationExecutor(connection).loader.graph.leaf_nodes()


def _seed_old(old_apps: Any) -> dict[str, int]:
    """Rows as an existing installation had them: a node, a deployment, two workers, a scale event."""
    model = old_apps.get_model("inference", "Model").objects.create(name="m", source="tiny", path="model_cache/m")
    deployment = old_apps.get_model("inference", "Deployment").objects.create(name="d", model=model)
    node = old_apps.get_model("nodes", "Node").objects.create(name="n1", address="10.0.0.5", cpu_count=8)
    old_worker = old_apps.get_model("nodes", "Worker")
    running = old_worker.objects.create(
        deployment=deployment, node=node, role="decode", port=30001, kv_port=30002, pid=4242, status="running",
        restarts=2, cpu_ids=[2, 3], last_health={"status": "healthy", "queue_depth": 1}, process_started_at=12.5,
    )
    stopped = old_worker.objects.create(
        deployment=deployment, node=node, role="prefill", port=30001, status="stopped", last_error="node offline"
    )
    event = old_apps.get_model("inference", "ScaleEvent").objects.create(
        deployment=deployment, role="decode", from_replicas=0, to_replicas=1, source="manual", reason="seed"
    )
    event.placed_workers.add(running)
    # As before the move: Worker's content type (permissions, admin history) belongs to nodes. The
    # contenttypes app is not migrated back, so its current model is the historical one too.
    ContentType.objects.filter(app_label="inference", model="worker").delete()
    ContentType.objects.get_or_create(app_label="nodes", model="worker")
    return {"running": running.pk, "stopped": stopped.pk, "node": node.pk, "deployment": deployment.pk,
            "event": event.pk}


def _assert_kept(ids: dict[str, int], added: tuple[int, ...] = ()) -> None:
    """Today's models read the rows written before the move (and the workers `added` since)."""
    running = Worker.objects.select_related("node", "deployment").get(pk=ids["running"])
    assert (running.role, running.port, running.kv_port, running.pid, running.status) == (
        "decode", 30001, 30002, 4242, "running"
    )
    assert (running.restarts, running.cpu_ids, running.process_started_at) == (2, [2, 3], 12.5)
    assert running.last_health == {"status": "healthy", "queue_depth": 1}
    assert running.node.pk == ids["node"] and running.node.name == "n1"
    assert running.deployment.pk == ids["deployment"]
    assert Worker.objects.get(pk=ids["stopped"]).last_error == "node offline"
    assert list(Node.objects.get(pk=ids["node"]).workers.order_by("pk").values_list("pk", flat=True)) == sorted(
        [ids["running"], ids["stopped"], *added]
    )
    assert list(ScaleEvent.objects.get(pk=ids["event"]).placed_workers.values_list("pk", flat=True)) == [
        ids["running"]
    ]
    assert ContentType.objects.get_for_model(Worker).app_label == "inference"
    assert not ContentType.objects.filter(app_label="nodes", model="worker").exists()


@pytest.mark.django_db(transaction=True)
def test_existing_database_keeps_its_workers_through_the_move() -> None:
    latest = _latest()
    ids = _seed_old(_migrate(BEFORE_MOVE))
    _migrate(latest)
    _assert_kept(ids)
    # A new worker continues the table's id sequence and keeps the live-port constraint.
    fresh = Worker.objects.create(
        deployment_id=ids["deployment"], node_id=ids["node"], role="prefill", port=30009, status="pending"
    )
    assert fresh.pk > max(ids["running"], ids["stopped"])
    # Backwards and forwards again: the move is a state change only, so the rows survive both ways.
    old_apps = _migrate(BEFORE_MOVE)
    assert old_apps.get_model("nodes", "Worker").objects.count() == 3
    _migrate(latest)
    _assert_kept(ids, added=(fresh.pk,))


@pytest.mark.django_db(transaction=True)
def test_the_move_changes_no_table() -> None:
    """Worker's table is the one the nodes app created; no table was added or dropped by the move."""
    assert Worker._meta.db_table == "nodes_worker"
    _migrate(BEFORE_MOVE)
    with connection.cursor() as cursor:
        before = set(connection.introspection.table_names(cursor))
    _migrate(AFTER_MOVE)
    with connection.cursor() as cursor:
        after = set(connection.introspection.table_names(cursor))
    _migrate(_latest())
    assert before == after and "nodes_worker" in after
