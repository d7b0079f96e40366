"""`GET /api/tasks/{task_id}/`: the state of the task a scale answered 202 with, from Celery's result
backend (Redis with REDIS_URL, else the embedded file backend)."""
from __future__ import annotations

import uuid
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from config.celery import app
from inference.models import Deployment, ScaleEvent
from tests.support.celery_capture import SentTasks, sent_tasks  # noqa: F401  (fixture)
from tests.support.control_plane import make_deployment

pytestmark = pytest.mark.django_db

SCALE_TASK = "inference.tasks.scale_deployment_task"


@pytest.fixture
def api() -> APIClient:
    user = get_user_model().objects.create_user("tasks-operator", password="x")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    return client


def run_as_the_controller(task_id: str, kwargs: dict[str, Any]) -> Any:
    """What the controller's Celery worker does with the message jobs sent: run the task under the message's
    id with the message's ignore_result (jobs sends every task so), so Celery itself stores nothing and
    the status must come from what the task stores."""
    return app.tasks[SCALE_TASK].apply(kwargs=kwargs, task_id=task_id, ignore_result=True).result


def test_a_queued_scale_is_pending_then_names_its_event(api: APIClient, sent_tasks: SentTasks) -> None:  # noqa: F811
    deployment = make_deployment(decode_replicas=1, decode_max=3)
    queued = api.post(f"/api/deployments/{deployment.pk}/scale/", {"role": "decode", "replicas": 2}, format="json")
    assert queued.status_code == 202, queued.content
    task_id = queued.json()["task_id"]
    status_url = f"/api/tasks/{task_id}/"
    assert queued.json()["task_url"].endswith(status_url)
    try:
        before = api.get(status_url)
        assert before.status_code == 200, before.content
        assert before.json() == {"task_id": task_id, "state": "PENDING", "ready": False, "scale_event": None,
                                 "error": None}  # fmt: skip
        [(name, kwargs, _queue)] = sent_tasks.calls
        assert name == SCALE_TASK
        run_as_the_controller(task_id, kwargs)
        after = api.get(status_url).json()
        event = ScaleEvent.objects.get(deployment=deployment)
        assert after == {"task_id": task_id, "state": "SUCCESS", "ready": True, "scale_event": event.pk,
                         "error": None}  # fmt: skip
        assert Deployment.objects.get(pk=deployment.pk).decode_replicas == 2
    finally:
        app.backend.forget(task_id)


def test_a_failed_task_says_why(api: APIClient) -> None:
    task_id = str(uuid.uuid4())
    deployment = make_deployment()
    try:
        run_as_the_controller(
            task_id, {"deployment_id": deployment.pk, "role": "embed", "source": "api", "reason": "", "replicas": 1}
        )
        body = api.get(f"/api/tasks/{task_id}/").json()
        assert body["state"] == "FAILURE" and body["ready"] is True
        assert body["error"].startswith("ValueError: ") and "embed" in body["error"]
    finally:
        app.backend.forget(task_id)


def test_an_id_that_is_no_task_id_is_404_and_an_unknown_one_pending(api: APIClient) -> None:
    response = api.get("/api/tasks/not-a-task/")
    assert response.status_code == 404 and "task ids are UUIDs" in response.json()["detail"]
    unknown = str(uuid.uuid4())
    assert api.get(f"/api/tasks/{unknown}/").json()["state"] == "PENDING"
    assert APIClient().get(f"/api/tasks/{unknown}/").status_code == 401
