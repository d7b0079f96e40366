"""Metric sample pages in units: latencies in ms, ratios as percentages, bytes in binary units, times to the
second, the router's per-worker shares as a table; read-only (no Save)."""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from inference.actions import samples as sample_actions
from inference.admin.samples import SampleQuerySet
from inference.models import MetricSample, RouterEndpoint, RouterSample, WorkerSample
from tests.support.control_plane import make_deployment

pytestmark = pytest.mark.django_db


@pytest.fixture
def samples() -> None:
    deployment = make_deployment(name="chat")
    sample_actions.record_metric_sample(
        deployment, "decode", load=0.8123456789, itl_s=0.0234567891234, throughput_tps=123.456789, queue_depth=2,
        kv_usage=0.4567, cpu_utilization=0.91234, rss_bytes=25276203008,
    )  # fmt: skip
    WorkerSample.objects.create(
        deployment=deployment, worker_id=1, name="chat-decode-1", role="decode", at=timezone.now(), load=0.5,
        rss_bytes=734003200, kv_transfer_bytes_per_s=1468006.4, request_share=0.5, prefix_cache_hit_ratio=0.25,
    )  # fmt: skip
    router = RouterEndpoint.objects.create(deployment=deployment, url="http://127.0.0.1:8000")
    RouterSample.objects.create(
        deployment=deployment, router=router, at=timezone.now(), requests_per_s=12.3456, error_rate=0.0123,
        dispatch_p50_s=0.000412, dispatch_p90_s=0.00123, ttft_p90_s=0.2345,
        worker_share={"decode": {"http://127.0.0.1:30001": 0.75, "http://127.0.0.1:30002": 0.25}},
    )  # fmt: skip


def test_lists_show_units(client_root: Client, samples: None) -> None:
    roles = client_root.get(reverse("admin:inference_metricsample_changelist")).content.decode()
    for text in ("0.81", "23.5 ms", "123 tok/s", "45.7 %", "91.2 %", "23.5 GiB"):
        assert text in roles, text
    assert "25276203008" not in roles and "0.8123456789" not in roles
    workers = client_root.get(reverse("admin:inference_workersample_changelist")).content.decode()
    for text in ("700.0 MiB", "1.4 MiB/s", "50.0 %", "25.0 %"):
        assert text in workers, text
    routers = client_root.get(reverse("admin:inference_routersample_changelist")).content.decode()
    for text in ("12.3 req/s", "1.2 %", "0.4 ms", "1.2 ms", "234 ms"):
        assert text in routers, text


def test_detail_pages_are_read_only_tables(client_root: Client, samples: None) -> None:
    sample = RouterSample.objects.get()
    page = client_root.get(reverse("admin:inference_routersample_change", args=[sample.pk])).content.decode()
    assert 'class="json-table"' in page and "75.0 %" in page and "http://127.0.0.1:30001" in page
    assert 'name="_save"' not in page and "{&quot;decode" not in page
    metric = MetricSample.objects.get()
    page = client_root.get(reverse("admin:inference_metricsample_change", args=[metric.pk])).content.decode()
    assert "23.5 GiB" in page and 'name="_save"' not in page


@pytest.mark.parametrize("spread", [
    [timedelta(0)], [timedelta(hours=h) for h in (0, 20, 30, 75)], [timedelta(days=d) for d in (0, 3, 40, 41, 70)],
])  # fmt: skip
def test_date_drill_down_finds_the_days_and_months_that_hold_samples(spread: list[timedelta]) -> None:
    """SampleQuerySet's probes give what QuerySet.datetimes' DISTINCT gives, in the current time zone."""
    deployment = make_deployment()
    start = timezone.now() - timedelta(days=80)
    for gap in spread:
        WorkerSample.objects.create(deployment=deployment, worker_id=1, name="w", role="decode", at=start + gap)
    probed = SampleQuerySet(WorkerSample)
    for kind in ("day", "month"):
        assert list(probed.datetimes("at", kind)) == list(WorkerSample.objects.datetimes("at", kind)), kind
    assert list(probed.datetimes("at", "year")) == list(WorkerSample.objects.datetimes("at", "year"))
    assert list(SampleQuerySet(WorkerSample).filter(role="prefill").datetimes("at", "day")) == []


def test_role_filter_offers_every_role(client_root: Client, samples: None) -> None:
    page = client_root.get(reverse("admin:inference_workersample_changelist")).content.decode()
    for role in ("prefill", "decode", "both"):
        assert f'href="?role__exact={role}">{role}</a>' in page, role
    only = client_root.get(reverse("admin:inference_workersample_changelist") + "?role__exact=prefill")
    assert only.status_code == 200 and "chat-decode-1" not in only.content.decode()
    assert "chat-decode-1" in client_root.get(reverse("admin:inference_workersample_changelist")).content.decode()
