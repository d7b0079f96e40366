"""The worker page: a Restart button (queues the agent's restart through inference.actions.workers) while the
worker is live, a link to its deployment's charts split per worker, no Save button."""
from __future__ import annotations

from typing import Any

import pytest
from django.contrib.admin.models import LogEntry
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from inference.models import Worker
from tests.support.celery_capture import SentTasks, sent_tasks  # noqa: F401  (fixture)
from tests.support.control_plane import make_deployment, make_node, make_worker

pytestmark = pytest.mark.django_db


@pytest.fixture
def workers() -> tuple[Worker, Worker]:
    deployment = make_deployment(name="chat")
    node = make_node(name="local", last_heartbeat=timezone.now())
    running = make_worker(deployment, node, role="decode", status="running", last_seen=timezone.now())
    failed = make_worker(deployment, node, role="prefill", status="failed", port=2)
    return running, failed


def test_live_worker_page_has_restart_and_charts(client_root: Client, workers: tuple[Worker, Worker]) -> None:
    running, failed = workers
    page = client_root.get(reverse("admin:inference_worker_change", args=[running.pk])).content.decode()
    assert reverse("admin:inference_worker_restart", args=[running.pk]) in page
    assert reverse("admin:inference_deployment_metrics", args=[running.deployment_id]) + "?split=worker" in page
    assert 'name="_save"' not in page
    stopped = client_root.get(reverse("admin:inference_worker_change", args=[failed.pk])).content.decode()
    assert reverse("admin:inference_worker_restart", args=[failed.pk]) not in stopped  # nothing to restart
    assert "?split=worker" in stopped


def test_restart_button_queues_the_agents_restart(
    client_root: Client, workers: tuple[Worker, Worker], sent_tasks: SentTasks,  # noqa: F811
    django_capture_on_commit_callbacks: Any,
) -> None:
    running, failed = workers
    url = reverse("admin:inference_worker_restart", args=[running.pk])
    assert client_root.get(url).status_code == 405
    with django_capture_on_commit_callbacks(execute=True):
        response = client_root.post(url, follow=True)
    page = response.content.decode()
    assert response.redirect_chain[-1][0] == reverse("admin:inference_worker_change", args=[running.pk])
    assert f"Restart of worker #{running.pk} queued for the agent on local" in page
    assert [kw for kw, _ in sent_tasks.named("restart_worker")] == [{"worker_id": running.pk}]
    assert LogEntry.objects.filter(object_id=str(running.pk)).count() == 1  # in the worker's History
    refused = client_root.post(reverse("admin:inference_worker_restart", args=[failed.pk]), follow=True)
    assert "Not restarted: worker #" in refused.content.decode() and "is failed" in refused.content.decode()
