"""The deployment page's scale controls: per role, the count with its bounds, a form that queues the
scale through the action the REST API uses, messages that say what will happen, History entries, and
an override when a schedule rule holds the role."""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.admin.models import LogEntry
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from inference.models import Deployment, ScaleEvent, ScaleOverride, ScalingRule
from inference.selectors import schedules
from tests.support.celery_capture import SentTasks, sent_tasks, tasks_run_inline  # noqa: F401  (fixture)
from tests.support.control_plane import make_deployment

pytestmark = pytest.mark.django_db


def scale(client: Client, deployment: Deployment, role: str, **fields: object) -> str:
    body = {"role": role, **{f"{role}-{k}": v for k, v in {"role": role, **fields}.items()}}
    response = client.post(reverse("admin:inference_deployment_scale", args=[deployment.pk]), body, follow=True)
    assert response.status_code == 200
    assert response.redirect_chain[-1][0].endswith(f"/{deployment.pk}/change/#scale")
    return response.content.decode()


def night_rule(deployment: Deployment) -> ScalingRule:
    now = timezone.now()
    return ScalingRule.objects.create(
        deployment=deployment, name="night", kind="schedule", role="decode",
        start_time=schedules.local_time(now - timedelta(hours=1)),
        end_time=schedules.local_time(now + timedelta(hours=1)), target_replicas=1,
    )  # fmt: skip


def test_the_page_shows_each_roles_count_and_bounds(client_root: Client) -> None:
    deployment = make_deployment(prefill_replicas=1, prefill_max=3, decode_replicas=2, decode_max=4)
    page = client_root.get(reverse("admin:inference_deployment_change", args=[deployment.pk])).content.decode()
    assert 'id="scale-prefill"' in page and 'id="scale-decode"' in page
    assert "desired <strong>1</strong>" in page and "bounds [1–3]" in page
    assert "desired <strong>2</strong>" in page and "bounds [1–4]" in page
    assert "Override the scaling rules" not in page  # no rule holds either role


def test_a_scale_from_the_page_is_queued_applied_and_logged(client_root: Client, tasks_run_inline: SentTasks) -> None:  # noqa: F811
    deployment = make_deployment(prefill_replicas=1, prefill_max=3)
    page = scale(client_root, deployment, "prefill", replicas=2, reason="launch day")
    assert "queued: prefill 1 → 2" in page
    event = ScaleEvent.objects.get(deployment=deployment)
    assert (event.role, event.from_replicas, event.to_replicas, event.source) == ("prefill", 1, 2, "manual")
    assert event.reason == "launch day"
    [entry] = LogEntry.objects.filter(object_id=str(deployment.pk))
    assert "queued: prefill 1 → 2" in entry.change_message and "launch day" in entry.change_message
    history = client_root.get(reverse("admin:inference_deployment_history", args=[deployment.pk])).content.decode()
    assert "queued: prefill 1 → 2" in history


def test_out_of_bounds_is_refused_naming_the_bounds(client_root: Client, sent_tasks: SentTasks) -> None:  # noqa: F811
    deployment = make_deployment(prefill_replicas=1, prefill_max=3)
    page = scale(client_root, deployment, "prefill", replicas=7)
    assert "not scaled: prefill replicas must be within the deployment&#x27;s prefill bounds [1, 3], got 7" in page
    assert sent_tasks.calls == [] and not LogEntry.objects.exists()


def test_a_schedule_rule_holding_the_role_asks_for_an_override(
    client_root: Client, tasks_run_inline: SentTasks  # noqa: F811
) -> None:
    deployment = make_deployment(decode_replicas=1, decode_max=4)
    night_rule(deployment)
    url = reverse("admin:inference_deployment_change", args=[deployment.pk])
    page = client_root.get(url).content.decode()
    assert "Schedule rule “night”" in page and "Override the scaling rules" in page
    refused = scale(client_root, deployment, "decode", replicas=3)
    assert "schedule rule &#x27;night&#x27;" in refused and "a scale to 3 would be reverted" in refused
    assert "give an override" in refused and not ScaleEvent.objects.exists()
    done = scale(client_root, deployment, "decode", replicas=3, reason="launch", override_minutes=30)
    assert "queued: decode 1 → 3" in done and "Held against the scaling rules until" in done
    override = ScaleOverride.objects.get(deployment=deployment)
    assert override.rule is not None and override.rule.name == "night"
    assert (override.replicas, override.reason, override.created_by) == (3, "launch", "root")
    assert 25 * 60 < (override.ends_at - timezone.now()).total_seconds() <= 30 * 60
    assert Deployment.objects.get(pk=deployment.pk).decode_replicas == 3
    assert f"Override #{override.pk} holds decode at 3" in client_root.get(url).content.decode()


def test_the_scale_url_takes_only_post(client_root: Client) -> None:
    deployment = make_deployment()
    assert client_root.get(reverse("admin:inference_deployment_scale", args=[deployment.pk])).status_code == 405
