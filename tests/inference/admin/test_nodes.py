"""Admin of nodes and workers: live status lists, drain and restart actions, read-only workers."""
from __future__ import annotations

from datetime import timedelta
from typing import Any
from unittest import mock

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from inference.models import Worker
from nodes.models import Node
from tests.support.control_plane import make_deployment, make_node, make_worker

pytestmark = pytest.mark.django_db


@pytest.fixture
def cluster() -> dict[str, Any]:
    """A fresh node with a GPU and host metrics, a silent one, and workers in several states."""
    fresh = make_node(
        name="gpu-1",
        last_heartbeat=timezone.now(),
        gpus=[{"index": 0, "name": "NVIDIA H200", "memory_bytes": 141 * 2**30}],
        rdma_devices=[{"name": "mlx5_0"}],
        last_metrics={"cpu_utilization": 0.25, "memory_used_bytes": 4 * 2**30, "load_avg": [1.5, 1.0, 0.5]},
    )
    silent = make_node(name="cpu-1", last_heartbeat=timezone.now() - timedelta(minutes=5), rdma_note="no ibverbs")
    deployment = make_deployment(name="chat")
    running = make_worker(deployment, fresh, role="decode", last_seen=timezone.now())
    failed = make_worker(deployment, silent, status="failed", last_error="RuntimeError: out of memory\ntrace")
    return {"fresh": fresh, "silent": silent, "running": running, "failed": failed}


def test_node_list_shows_live_status(client_root: Client, cluster: dict[str, Any]) -> None:
    response = client_root.get(reverse("admin:nodes_node_changelist"))
    assert response.status_code == 200
    page = response.content.decode()
    assert "gpu-1" in page and "cpu-1" in page
    assert "1 × NVIDIA H200" in page and "mlx5_0" in page and "no ibverbs" in page
    assert "8 CPUs, 25% busy, load 1.5" in page
    assert "16.0 GiB (25% used)" in page
    assert "5m ago" in page  # the silent node's heartbeat age, shown stale
    assert "no recent heartbeat" in page
    assert f'?node__id__exact={cluster["fresh"].pk}">1</a>' in page  # live workers on gpu-1
    assert f'?node__id__exact={cluster["silent"].pk}">0</a>' in page  # the failed one does not count
    assert "inference/autorefresh.js" in page


def test_worker_list_shows_health_and_errors(client_root: Client, cluster: dict[str, Any]) -> None:
    response = client_root.get(reverse("admin:inference_worker_changelist"))
    assert response.status_code == 200
    page = response.content.decode()
    running = cluster["running"]
    assert f"http://127.0.0.1:{running.port}" in page
    assert "healthy · queue 1 · running 2 · KV 10% · CPU 50%" in page
    assert "RuntimeError: out of memory" in page
    assert "4242" in page  # pid


def test_change_pages_render(client_root: Client, cluster: dict[str, Any]) -> None:
    assert client_root.get(reverse("admin:nodes_node_change", args=[cluster["fresh"].pk])).status_code == 200
    assert client_root.get(reverse("admin:inference_worker_change", args=[cluster["running"].pk])).status_code == 200
    assert client_root.get(reverse("admin:nodes_node_add")).status_code == 200
    # Workers are placed by the controller; a live one's row cannot be deleted.
    assert client_root.get(reverse("admin:inference_worker_add")).status_code == 403
    assert client_root.get(reverse("admin:inference_worker_delete", args=[cluster["running"].pk])).status_code == 403
    assert client_root.get(reverse("admin:inference_worker_delete", args=[cluster["failed"].pk])).status_code == 200


def test_drain_node_action(client_root: Client, cluster: dict[str, Any]) -> None:
    node = cluster["fresh"]
    response = client_root.post(
        reverse("admin:nodes_node_changelist"), {"action": "drain_nodes", "_selected_action": [node.pk]}, follow=True
    )
    assert response.status_code == 200
    assert f"Draining {node.name}." in response.content.decode()
    assert Node.objects.get(pk=node.pk).status == "draining"
    assert Worker.objects.get(pk=cluster["running"].pk).status == "draining"


def test_restart_worker_action_calls_nodes_actions(client_root: Client, cluster: dict[str, Any]) -> None:
    worker = cluster["running"]
    with mock.patch("inference.actions.workers.restart_worker") as restart:
        response = client_root.post(
            reverse("admin:inference_worker_changelist"),
            {"action": "restart_workers", "_selected_action": [worker.pk]},
            follow=True,
        )
    assert response.status_code == 200
    restart.assert_called_once()
    assert restart.call_args.args[0].pk == worker.pk
    assert f"Restarting worker(s) {worker.pk}." in response.content.decode()


def test_restart_worker_action_sends_to_the_agent(
    client_root: Client, cluster: dict[str, Any], django_capture_on_commit_callbacks: Any
) -> None:
    """The real inference.actions.workers.restart_worker: a live worker gets a message on commit, a failed one
    an error."""
    running, failed = cluster["running"], cluster["failed"]
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        response = client_root.post(
            reverse("admin:inference_worker_changelist"),
            {"action": "restart_workers", "_selected_action": [running.pk, failed.pk]},
            follow=True,
        )
    page = response.content.decode()
    assert f"Restarting worker(s) {running.pk}." in page
    assert f"Could not restart worker {failed.pk}" in page
    assert len(callbacks) == 1


def test_activate_node_action_undoes_a_drain(client_root: Client, cluster: dict[str, Any]) -> None:
    node, other = cluster["fresh"], cluster["silent"]
    Node.objects.filter(pk=node.pk).update(status="draining")
    response = client_root.post(
        reverse("admin:nodes_node_changelist"),
        {"action": "activate_nodes", "_selected_action": [node.pk, other.pk]},
        follow=True,
    )
    page = response.content.decode()
    # (the admin capitalises the first letter of each message)
    assert f"{node.name} takes new workers again.".capitalize() in page
    assert f"{other.name} is online, not draining.".capitalize() in page
    assert Node.objects.get(pk=node.pk).status == "online"


def test_node_status_is_not_edited_by_hand(client_root: Client, cluster: dict[str, Any]) -> None:
    page = client_root.get(reverse("admin:nodes_node_change", args=[cluster["fresh"].pk])).content.decode()
    assert 'name="status"' not in page  # drain / activate actions change it, with the workers


def test_unreachable_node_is_shown_and_can_be_marked_offline(client_root: Client, cluster: dict[str, Any]) -> None:
    """An UNREACHABLE node (agent silent, workers serving) has its own badge; "Mark offline" gives up on it."""
    node = cluster["fresh"]
    Node.objects.filter(pk=node.pk).update(status="unreachable")
    page = client_root.get(reverse("admin:nodes_node_changelist")).content.decode()
    assert ">Unreachable</span>" in page
    response = client_root.post(
        reverse("admin:nodes_node_changelist"), {"action": "mark_nodes_offline", "_selected_action": [node.pk]},
        follow=True,
    )
    notes = [str(m.message) for m in response.context["messages"]]
    assert notes == [f"{node.name} is offline; 1 worker(s) re-placed elsewhere."]
    assert Node.objects.get(pk=node.pk).status == "offline"
    stopped = Worker.objects.get(pk=cluster["running"].pk)
    assert stopped.status == "stopped" and "marked offline by root" in stopped.last_error
