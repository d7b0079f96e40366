"""A node that registers gets the deployments waiting for capacity placed at once (`place_waiting_deployments`):
the reconcile is sent on registration and, run as the controller runs it, places the missing workers there."""
from __future__ import annotations

import pytest

from inference.actions import nodes as node_workers
from inference.controller import reconciler
from inference.models import Worker, WorkerStatus
from nodes import actions as node_actions
from nodes.models import NodeStatus
from nodes.resources import NodeResources
from tests.support.celery_capture import SentTasks, tasks_run_inline  # noqa: F401  (fixture)
from tests.support.control_plane import make_deployment, make_node, make_worker

pytestmark = pytest.mark.django_db

RES = NodeResources(hostname="h1", cpu_count=8, memory_bytes=32 * 2**30, gpus=[], rdma_devices=[], rdma_note="")


def test_registration_places_the_deployments_waiting_for_capacity(
    tasks_run_inline: SentTasks, django_capture_on_commit_callbacks  # noqa: F811
) -> None:
    waiting = make_deployment(prefill_replicas=1, decode_replicas=1)
    assert reconciler.reconcile(waiting).unplaced == {"prefill": 1, "decode": 1}  # no node yet
    elsewhere = make_node(name="busy")
    whole = make_deployment(prefill_replicas=1, decode_replicas=1)
    for role in ("prefill", "decode"):
        make_worker(whole, elsewhere, role=role, status="running")
    make_deployment(status="stopped")
    tasks_run_inline.clear()

    with django_capture_on_commit_callbacks(execute=True):
        node = node_actions.register_node(name="fresh", address="127.0.0.1", resources=RES)
        assert node_workers.place_waiting_deployments(node) == [waiting.pk]
    # Only the deployment short of workers was reconciled, and its workers were placed on the new node.
    assert tasks_run_inline.named("reconcile_deployment") == [({"deployment_id": waiting.pk}, None)]
    placed = Worker.objects.filter(deployment=waiting, status=WorkerStatus.PENDING)
    assert sorted(placed.values_list("role", flat=True)) == ["decode", "prefill"]
    assert set(placed.values_list("node_id", flat=True)) == {node.pk}
    assert sorted(kw["worker_id"] for kw, _ in tasks_run_inline.named("start_worker")) == sorted(
        placed.values_list("pk", flat=True)
    )
    # Once placed, a second registration sends nothing.
    tasks_run_inline.clear()
    with django_capture_on_commit_callbacks(execute=True):
        assert node_workers.place_waiting_deployments(node) == []
    assert tasks_run_inline.calls == []


def test_a_draining_node_that_registers_places_nothing(
    tasks_run_inline: SentTasks, django_capture_on_commit_callbacks  # noqa: F811
) -> None:
    make_deployment(prefill_replicas=1, decode_replicas=1)
    node = make_node(status=NodeStatus.DRAINING)
    with django_capture_on_commit_callbacks(execute=True):
        node = node_actions.register_node(name=node.name, address="127.0.0.1", resources=RES)
        assert node.status == NodeStatus.DRAINING
        assert node_workers.place_waiting_deployments(node) == []
    assert tasks_run_inline.calls == []
