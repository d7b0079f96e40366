"""The agent's heartbeat (`inference.agent.heartbeat.beat_once`): a beat that brings an OFFLINE node back
places the deployments waiting for capacity at once, as a registration does; a beat of a node that
stayed ONLINE sends nothing, and a deleted node's beat says so."""
from __future__ import annotations

import pytest

from inference.agent.heartbeat import beat_once
from inference.controller import reconciler
from inference.models import Worker, WorkerStatus
from nodes.actions import Beat
from nodes.models import Node, NodeStatus
from tests.support.celery_capture import SentTasks, tasks_run_inline  # noqa: F401  (fixture)
from tests.support.control_plane import make_deployment, make_node

pytestmark = pytest.mark.django_db


def test_a_beat_that_brings_the_node_back_places_the_waiting_deployments(
    tasks_run_inline: SentTasks, django_capture_on_commit_callbacks  # noqa: F811
) -> None:
    node = make_node(name="cut-off", status=NodeStatus.OFFLINE)
    waiting = make_deployment(prefill_replicas=1, decode_replicas=1)
    assert reconciler.reconcile(waiting).unplaced == {"prefill": 1, "decode": 1}  # no node online
    tasks_run_inline.clear()

    with django_capture_on_commit_callbacks(execute=True):
        assert beat_once(node.pk, None) is Beat.BACK
    assert Node.objects.get(pk=node.pk).status == NodeStatus.ONLINE
    assert tasks_run_inline.named("reconcile_deployment") == [({"deployment_id": waiting.pk}, None)]
    placed = Worker.objects.filter(deployment=waiting, status=WorkerStatus.PENDING)
    assert sorted(placed.values_list("role", flat=True)) == ["decode", "prefill"]
    assert set(placed.values_list("node_id", flat=True)) == {node.pk}

    # The next beat finds the node as it was: nothing more is sent.
    tasks_run_inline.clear()
    with django_capture_on_commit_callbacks(execute=True):
        assert beat_once(node.pk, None) is Beat.ALIVE
    assert tasks_run_inline.calls == []


def test_a_deleted_nodes_beat_is_falsy() -> None:
    node = make_node(name="gone")
    Node.objects.filter(pk=node.pk).delete()
    beat = beat_once(node.pk, None)
    assert beat is Beat.GONE and not beat
