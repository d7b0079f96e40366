"""Admin of the inference app: pages render, scale actions record events, metrics page and its JSON."""
from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth import get_user_model
from django.contrib.staticfiles import finders
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from inference.actions import samples as sample_actions
from inference.actions import scale as scale_actions
from inference.models import Deployment, MetricSample, ScaleEvent, ScalingRule
from inference.selectors import charts
from tests.support.celery_capture import SentTasks, tasks_run_inline  # noqa: F401  (fixture)
from tests.support.control_plane import make_deployment, make_model, make_node, make_worker

pytestmark = pytest.mark.django_db

MODELS = ["model", "deployment", "scalingrule", "scaleevent", "metricsample", "workersample", "routersample"]


@pytest.fixture
def populated() -> Deployment:
    """A deployment with a rule, a worker, an event and metric samples, so every page has rows."""
    deployment = make_deployment(name="chat")
    ScalingRule.objects.create(deployment=deployment, name="hot", kind="threshold", role="decode", threshold=0.7)
    make_worker(deployment, make_node(last_heartbeat=timezone.now()), last_error="Traceback\nboom")
    scale_actions.scale_deployment(deployment, "decode", 2, source="manual", reason="seed")
    sample_actions.record_metric_sample(deployment, "decode", itl_s=0.02, throughput_tps=50, gpu_utilization=0.6)
    return deployment


def _management(prefix: str, total: int = 0, initial: int = 0) -> dict[str, Any]:
    return {
        f"{prefix}-TOTAL_FORMS": str(total),
        f"{prefix}-INITIAL_FORMS": str(initial),
        f"{prefix}-MIN_NUM_FORMS": "0",
        f"{prefix}-MAX_NUM_FORMS": "1000",
    }


def _deployment_form(deployment: Deployment, **changes: Any) -> dict[str, Any]:
    """POST data of the deployment change form, with its inlines' management forms."""
    data: dict[str, Any] = {}
    for field in [
        "name", "status", "router_policy", "kv_transport", "prefill_replicas", "prefill_min", "prefill_max",
        "decode_replicas", "decode_min", "decode_max", "both_replicas", "both_min", "both_max", "context_length",
        "batch_size", "block_size", "threads_per_worker", "kv_token_weight", "kv_load_weight", "local_prefill_tokens",
        "speculative",
    ]:  # fmt: skip
        data[field] = getattr(deployment, field)
    data["model"] = deployment.model_id
    data["max_sequence_length"] = deployment.max_sequence_length or ""
    data["num_speculative_tokens"] = deployment.num_speculative_tokens or ""
    for role in ("prefill", "decode", "both"):  # the hidden inputs holding the counts the page showed
        data[f"initial-{role}_replicas"] = deployment.replicas(role)
    data.update(_management("rules"))
    data.update(_management("routers"))
    data.update(_management("workers"))
    data.update(_management("scale_events", total=3, initial=3))  # as the page had rendered it
    data.update(changes)
    return data


@pytest.mark.parametrize("model", MODELS)
def test_changelists_render(client_root: Client, populated: Deployment, model: str) -> None:
    response = client_root.get(reverse(f"admin:inference_{model}_changelist"))
    assert response.status_code == 200


def test_change_pages_render(client_root: Client, populated: Deployment) -> None:
    client = client_root
    for model, obj in [
        ("model", populated.model),
        ("deployment", populated),
        ("scalingrule", populated.rules.get()),
        ("scaleevent", ScaleEvent.objects.first()),
        ("metricsample", MetricSample.objects.first()),
    ]:
        response = client.get(reverse(f"admin:inference_{model}_change", args=[obj.pk]))
        assert response.status_code == 200, model
    for model in ["model", "deployment", "scalingrule"]:
        assert client.get(reverse(f"admin:inference_{model}_add")).status_code == 200
    # History is recorded, not typed in.
    assert client.get(reverse("admin:inference_scaleevent_add")).status_code == 403
    assert client.get(reverse("admin:inference_metricsample_add")).status_code == 403


def test_deployment_page_shows_rules_workers_events_and_metrics_link(
    client_root: Client, populated: Deployment
) -> None:
    url = reverse("admin:inference_deployment_change", args=[populated.pk])
    page = client_root.get(url).content.decode()
    assert "decode load above 0.70 for 1 min" in page and 'name="rules-0-threshold"' not in page  # rules in words
    assert "Recent scale events" in page and "seed" in page
    assert "Live workers" in page and "healthy · queue 1 · running 2" in page
    assert 'name="initial-decode_replicas" value="2"' in page  # what the page showed, for changed_data
    assert reverse("admin:inference_deployment_metrics", args=[populated.pk]) in page


def test_deployment_list_shows_replicas_and_running(client_root: Client, populated: Deployment) -> None:
    page = client_root.get(reverse("admin:inference_deployment_changelist")).content.decode()
    assert "2 [1–4] · 0 running" in page  # decode: desired 2, no running decode worker
    assert "1 [1–4] · 1 running" in page  # prefill: the running prefill worker


@pytest.mark.parametrize(
    ("action", "role", "start", "expected"),
    [
        ("scale_prefill_up", "prefill", 1, 2),
        ("scale_prefill_down", "prefill", 2, 1),
        ("scale_decode_up", "decode", 3, 4),
        ("scale_decode_down", "decode", 3, 2),
    ],
)
def test_scale_actions(
    client_root: Client, tasks_run_inline: SentTasks, action: str, role: str, start: int, expected: int  # noqa: F811
) -> None:
    """The admin queues the scale for the controller, as the API does; the controller's task applies it."""
    deployment = make_deployment(**{f"{role}_replicas": start})
    response = client_root.post(
        reverse("admin:inference_deployment_changelist"),
        {"action": action, "_selected_action": [deployment.pk]},
        follow=True,
    )
    assert response.status_code == 200
    deployment.refresh_from_db()
    assert deployment.replicas(role) == expected
    event = ScaleEvent.objects.get(deployment=deployment)
    assert (event.role, event.from_replicas, event.to_replicas, event.source) == (role, start, expected, "manual")
    assert "root" in event.reason
    assert f"queued: {role} {start} → {expected}" in response.content.decode()
    [entry] = LogEntry.objects.filter(object_id=str(deployment.pk))  # the deployment's History
    assert entry.change_message.startswith(f"{deployment.name}: queued: {role} {start} → {expected}")
    assert [kw for kw, _ in tasks_run_inline.named("scale_deployment_task")] == [
        {"deployment_id": deployment.pk, "role": role, "delta": expected - start, "source": "manual",
         "reason": f"admin action {role} {expected - start:+d} by root"}
    ]  # fmt: skip


def test_scale_action_at_bound_records_nothing(client_root: Client, tasks_run_inline: SentTasks) -> None:  # noqa: F811
    deployment = make_deployment(decode_replicas=4, decode_max=4)
    response = client_root.post(
        reverse("admin:inference_deployment_changelist"),
        {"action": "scale_decode_up", "_selected_action": [deployment.pk]},
        follow=True,
    )
    assert "stays at 4" in response.content.decode()
    assert not ScaleEvent.objects.exists()


def test_change_form_keeps_a_concurrent_autoscale(client_root: Client, populated: Deployment) -> None:
    """The form still says decode=2 but the autoscaler moved it to 3: saving the batch size keeps 3."""
    form = _deployment_form(populated, batch_size=8)
    scale_actions.scale_deployment(populated, "decode", 3, source="threshold", reason="load")
    # events arrived meanwhile:
    scale_actions.scale_deployment(populated, "prefill", 2, source="threshold", reason="load")
    response = client_root.post(reverse("admin:inference_deployment_change", args=[populated.pk]), form)
    assert response.status_code == 302, response.context["adminform"].form.errors if response.context else ""
    fresh = Deployment.objects.get(pk=populated.pk)
    assert (fresh.batch_size, fresh.decode_replicas, fresh.prefill_replicas) == (8, 3, 2)


def test_change_form_replica_edit_is_a_manual_scale_event(
    client_root: Client, populated: Deployment
) -> None:
    form = _deployment_form(populated, prefill_replicas=3)
    response = client_root.post(reverse("admin:inference_deployment_change", args=[populated.pk]), form)
    assert response.status_code == 302
    event = ScaleEvent.objects.filter(deployment=populated, role="prefill").get()
    assert (event.from_replicas, event.to_replicas, event.source) == (1, 3, "manual")
    assert "admin" in event.reason


def test_change_form_replica_edit_inside_a_schedule_window_is_refused_naming_the_rule(
    client_root: Client, populated: Deployment
) -> None:
    """Regression: the edit saved, and the schedule rule set the count back at its next run, silently."""
    from inference.selectors.schedules import local_time

    now = timezone.now()
    ScalingRule.objects.create(
        deployment=populated, name="night", kind="schedule", role="prefill", target_replicas=1,
        start_time=local_time(now - timedelta(hours=1)), end_time=local_time(now + timedelta(hours=1)),
    )  # fmt: skip
    url = reverse("admin:inference_deployment_change", args=[populated.pk])
    refused = client_root.post(url, _deployment_form(populated, prefill_replicas=3))
    assert refused.status_code == 200  # re-rendered with the error on the field
    assert "schedule rule &#x27;night&#x27;" in refused.content.decode()
    assert Deployment.objects.get(pk=populated.pk).prefill_replicas == 1
    assert not ScaleEvent.objects.filter(deployment=populated, role="prefill").exists()
    # Other fields still save; the held count is no conflict.
    saved = client_root.post(url, _deployment_form(populated, batch_size=8))
    assert saved.status_code == 302


def test_change_form_validates_bounds_and_leaves_rules_alone(client_root: Client, populated: Deployment) -> None:
    url = reverse("admin:inference_deployment_change", args=[populated.pk])
    bad_bounds = client_root.post(url, _deployment_form(populated, prefill_min=3, prefill_max=2))
    assert bad_bounds.status_code == 200  # re-rendered with the error
    assert "prefill_min (3) exceeds prefill_max (2)" in bad_bounds.content.decode()

    # Rules are edited on their own page, with their kind's form (tests/inference/admin/test_rule_forms.py):
    # a rules formset posted with the deployment changes nothing.
    rule = populated.rules.get()
    form = _deployment_form(populated)
    form.update(_management("rules", total=1, initial=1))
    form.update({"rules-0-id": rule.pk, "rules-0-deployment": populated.pk, "rules-0-threshold": "0.9"})
    assert client_root.post(url, form).status_code == 302
    rule.refresh_from_db()
    assert rule.threshold == 0.7


def test_deployment_with_live_workers_cannot_be_deleted(client_root: Client, populated: Deployment) -> None:
    response = client_root.get(reverse("admin:inference_deployment_delete", args=[populated.pk]))
    assert response.status_code == 403


def test_metrics_page_and_json(client_root: Client, populated: Deployment) -> None:
    page = client_root.get(reverse("admin:inference_deployment_metrics", args=[populated.pk]))
    assert page.status_code == 200
    html = page.content.decode()
    for chart in charts.CHARTS:  # a figure per chart, uPlot and its CSS served from here (no CDN)
        assert f'data-chart="{chart["id"]}"' in html
    assert "inference/metrics.js" in html and "//cdn" not in html and "https://" not in html
    assert "inference/vendor/uplot/uPlot.iife.min.js" in html and "inference/vendor/uplot/uPlot.min.css" in html
    for static in ["inference/metrics.js", "inference/metrics.css", "inference/vendor/uplot/uPlot.iife.min.js",
                   "inference/vendor/uplot/uPlot.min.css", "inference/vendor/uplot/LICENSE"]:
        assert finders.find(static), static
    assert "No router of this deployment is registered" in html

    data_url = reverse("admin:inference_deployment_metrics_data", args=[populated.pk])
    assert data_url in html
    response = client_root.get(data_url + "?minutes=5")
    assert response.status_code == 200 and "no-store" in response["Cache-Control"]
    data = response.json()
    assert data["series"]["decode"]["itl_s"] == [0.02]
    assert data["series"]["decode"]["gpu_utilization"] == [0.6]
    assert data["series"]["prefill"]["t"] == []
    assert data["deployment"]["replicas"]["decode"]["desired"] == 2
    assert [e["reason"] for e in data["events"]] == ["seed"]
    assert data["charts"] == charts.CHARTS and data["workers"] == [] and data["router"]["t"] == []
    bad = client_root.get(data_url + "?minutes=abc")
    assert bad.status_code == 400 and "minutes" in bad.json()["error"]
    missing = reverse("admin:inference_deployment_metrics_data", args=[999999])
    assert client_root.get(missing).status_code == 404


def test_metrics_json_is_admin_only(populated: Deployment) -> None:
    data_url = reverse("admin:inference_deployment_metrics_data", args=[populated.pk])
    anonymous = Client().get(data_url)
    assert anonymous.status_code == 302 and "/admin/login/" in anonymous["Location"]
    user = get_user_model().objects.create_user("plain", password=None)
    client = Client()
    client.force_login(user)
    assert client.get(data_url).status_code == 302  # not staff: sent to the admin login
    staff = get_user_model().objects.create_user("staff", password=None, is_staff=True)
    client.force_login(staff)
    assert client.get(data_url).status_code == 403  # staff without the deployment view permission


def test_model_with_deployments_shows_count(client_root: Client) -> None:
    model = make_model(name="smol")
    make_deployment(model=model)
    page = client_root.get(reverse("admin:inference_model_changelist")).content.decode()
    assert "smol" in page and 'class="field-deployment_count">1<' in page


def test_routers_are_registered_on_the_deployment_page(client_root: Client, populated: Deployment) -> None:
    """The router the metrics collector scrapes is added in the deployment's "routers" inline."""
    form = _deployment_form(populated)
    form.update({"routers-TOTAL_FORMS": "1", "routers-0-url": "http://127.0.0.1:8000", "routers-0-enabled": "on"})
    response = client_root.post(reverse("admin:inference_deployment_change", args=[populated.pk]), form)
    assert response.status_code == 302, response.context["adminform"].form.errors if response.context else ""
    assert list(populated.routers.values_list("url", "enabled")) == [("http://127.0.0.1:8000", True)]
    page = client_root.get(reverse("admin:inference_deployment_metrics", args=[populated.pk]))
    assert "No router of this deployment is registered" not in page.content.decode()


def test_deployment_page_queries_do_not_grow_with_workers_events_or_routers(client_root: Client) -> None:
    """The page's statements are the same for a small and a busier deployment: the inlines join what each
    row shows (an event's rule and deployment, a worker's node, a rule's or router's deployment) and the scale
    controls read both roles at once; an event inline that re-sliced its queryset per row made 3 per event."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from inference.models import RouterEndpoint

    def statements(workers: int, events: int, routers: int, rules: int) -> int:
        deployment = make_deployment(decode_max=100)
        for i in range(rules):
            rule = ScalingRule.objects.create(deployment=deployment, name=f"hot{i}", kind="threshold", role="decode")
        node = make_node(last_heartbeat=timezone.now())
        for i in range(workers):
            make_worker(deployment, node, role="decode", status="running" if i % 3 else "unhealthy")
        for i in range(events):
            ScaleEvent.objects.create(deployment=deployment, role="decode", from_replicas=i, to_replicas=i + 1,
                                      source="rule", rule=rule, reason=f"event {i}")
        for i in range(routers):
            RouterEndpoint.objects.create(deployment=deployment, url=f"http://10.0.0.{i + 1}:8000")
        url = reverse("admin:inference_deployment_change", args=[deployment.pk])
        client_root.get(url)  # the session and the content types are cached after the first request
        with CaptureQueriesContext(connection) as queries:
            page = client_root.get(url)
        assert page.status_code == 200 and (events == 0 or f"event {events - 1}" in page.content.decode())
        return len(queries)

    small = statements(workers=1, events=1, routers=1, rules=1)
    assert statements(workers=12, events=25, routers=3, rules=4) == small


def test_change_form_sets_the_router_settings_and_both_replicas(client_root: Client, populated: Deployment) -> None:
    page = client_root.get(reverse("admin:inference_deployment_change", args=[populated.pk])).content.decode()
    for field in ("kv_token_weight", "kv_load_weight", "local_prefill_tokens", "both_replicas"):
        assert f'name="{field}"' in page
    url = reverse("admin:inference_deployment_change", args=[populated.pk])
    bad = client_root.post(url, _deployment_form(populated, kv_load_weight=-1))
    assert bad.status_code == 200 and "kv_load_weight" in bad.context["adminform"].form.errors
    form = _deployment_form(populated, kv_token_weight=2.5, kv_load_weight=16, local_prefill_tokens=32, both_max=2)
    response = client_root.post(url, form)
    assert response.status_code == 302, response.context["adminform"].form.errors if response.context else ""
    fresh = Deployment.objects.get(pk=populated.pk)
    assert (fresh.kv_token_weight, fresh.kv_load_weight, fresh.local_prefill_tokens, fresh.both_max) == (2.5, 16, 32, 2)


def test_change_form_sets_speculative_decoding(client_root: Client, populated: Deployment) -> None:
    url = reverse("admin:inference_deployment_change", args=[populated.pk])
    page = client_root.get(url).content.decode()
    assert 'name="speculative"' in page and 'name="num_speculative_tokens"' in page
    bad = client_root.post(url, _deployment_form(populated, num_speculative_tokens=4))  # speculative still off
    assert bad.status_code == 200 and "num_speculative_tokens" in bad.context["adminform"].form.errors
    too_many = client_root.post(url, _deployment_form(populated, speculative="ngram", num_speculative_tokens=99))
    assert too_many.status_code == 200 and "num_speculative_tokens" in too_many.context["adminform"].form.errors
    response = client_root.post(url, _deployment_form(populated, speculative="ngram", num_speculative_tokens=3))
    assert response.status_code == 302, response.context["adminform"].form.errors if response.context else ""
    fresh = Deployment.objects.get(pk=populated.pk)
    assert (fresh.speculative, fresh.num_speculative_tokens) == ("ngram", 3)
