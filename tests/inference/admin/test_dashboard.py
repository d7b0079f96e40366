"""The admin home as a dashboard: deployments with replicas per role, health, current load, SLO state, recent
events and links; "View site" leads to it."""
from __future__ import annotations

import time
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from inference.actions import samples as sample_actions
from inference.models import Deployment, MetricSample, ScaleEvent, ScalingRule
from inference.selectors import dashboard
from tests.support.control_plane import make_deployment, make_model, make_node, make_worker

pytestmark = pytest.mark.django_db


@pytest.fixture
def admin_client_fast(settings: object) -> Client:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # type: ignore[attr-defined]
    get_user_model().objects.create_superuser("root", "root@example.com", "pw")
    client = Client()
    client.login(username="root", password="pw")
    return client


@pytest.fixture
def demo() -> Deployment:
    """A deployment with 1 prefill running of 1, 1 decode running of 2, an ITL SLO rule breaching and a TTFT
    one met, fresh samples and a refused event."""
    deployment = make_deployment(name="demo", model=make_model(name="smollm2-135m"), decode_replicas=2)
    node = make_node(last_heartbeat=timezone.now())
    make_worker(deployment, node, role="prefill", status="running")
    make_worker(deployment, node, role="decode", status="running", port=2)
    now = time.time()
    ScalingRule.objects.create(deployment=deployment, name="itl", kind="itl_slo", role="decode", threshold=50,
                               observations=[[now - 10, 40.0], [now, 72.5]])
    ScalingRule.objects.create(deployment=deployment, name="ttft", kind="ttft_slo", role="prefill", threshold=2.0,
                               observations=[[now, 0.35]])
    sample_actions.record_metric_sample(deployment, "prefill", load=0.42, queue_depth=3, ttft_s=0.35)
    sample_actions.record_metric_sample(deployment, "decode", load=0.81, queue_depth=0, itl_s=0.0725)
    ScaleEvent.objects.create(deployment=deployment, role="decode", from_replicas=1, to_replicas=2,
                              source="manual", refused=True, reason="placement refused: no free CPUs")
    return deployment


def test_states(demo: Deployment) -> None:
    (state,) = dashboard.deployment_states()
    prefill, decode = state.roles
    assert (prefill.desired, prefill.running, prefill.health) == (1, 1, "ok")
    assert (decode.desired, decode.running, decode.health) == (2, 1, "degraded")
    assert state.health == "degraded"
    assert decode.sample is not None and decode.sample.load == pytest.approx(0.81) and not decode.sample_stale
    slos = {s.rule.name: (s.signal, s.latest, s.target, s.state) for s in state.slos}
    assert slos == {"itl": ("ITL p90", "72 ms", "50 ms", "breaching"),
                    "ttft": ("TTFT p90", "350 ms", "2000 ms", "ok")}


def test_stale_sample_and_down_role(demo: Deployment) -> None:
    MetricSample.objects.filter(deployment=demo).update(at=timezone.now() - timedelta(minutes=10))
    demo.workers.filter(role="decode").update(status="failed")
    (state,) = dashboard.deployment_states()
    assert state.roles[1].sample_stale and state.roles[1].health == "down" and state.health == "down"


def test_home_is_the_dashboard(admin_client_fast: Client, demo: Deployment) -> None:
    page = admin_client_fast.get(reverse("admin:index"))
    assert page.status_code == 200
    html = page.content.decode()
    assert 'id="dashboard-deployments"' in html
    assert reverse("admin:inference_deployment_metrics", args=[demo.pk]) in html  # charts link
    assert "load 0.81" in html and "ITL 72 ms" in html and "TTFT 350 ms" in html
    assert "breaching" in html and "refused" in html and "placement refused: no free CPUs" in html
    assert f'href="{reverse("admin:index")}">View site' in html  # not "/", a 404
    assert "Authentication and Authorization" in html  # the model list is still there


def test_home_without_deployments(admin_client_fast: Client) -> None:
    page = admin_client_fast.get(reverse("admin:index"))
    assert page.status_code == 200 and "No deployment yet" in page.content.decode()
