"""inference.selectors: metric series per role, per worker and of the router, as the admin page and API read them."""
from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from inference.actions import samples as sample_actions
from inference.actions import scale as scale_actions
from inference.models import MetricSample, RouterEndpoint, RouterSample, WorkerSample
from inference.selectors import charts
from inference.selectors import metrics as metric_selectors
from tests.support.control_plane import make_deployment

pytestmark = pytest.mark.django_db


def _worker_sample(deployment: Any, worker_id: int, role: str, at: Any, **values: Any) -> WorkerSample:
    return WorkerSample.objects.create(
        deployment=deployment, worker_id=worker_id, name=f"{role} #{worker_id} @ n1:{30000 + worker_id}", role=role,
        url=f"http://10.0.0.1:{30000 + worker_id}", at=at, **values,
    )  # fmt: skip


def test_metric_series_shape_and_filters() -> None:
    deployment = make_deployment()
    other = make_deployment()
    now = timezone.now()
    for i in range(5):
        sample_actions.record_metric_sample(
            deployment, "prefill", at=now - timedelta(seconds=50 - i * 10), load=0.1 * i, ttft_s=0.2,
            throughput_tps=100 + i, queue_depth=i, cpu_utilization=0.5, workers=2, rss_bytes=2**30 + i,
        )  # fmt: skip
    sample_actions.record_metric_sample(deployment, "decode", at=now - timedelta(seconds=5), itl_s=0.03,
                                        gpu_utilization=0.7, kv_transfer_bytes_per_s=5e6,
                                        prefix_cache_hit_ratio=0.25)  # fmt: skip
    # outside the window:
    sample_actions.record_metric_sample(deployment, "decode", at=now - timedelta(hours=2), itl_s=9.9)
    sample_actions.record_metric_sample(other, "decode", at=now, itl_s=5.0)  # another deployment
    scale_actions.scale_deployment(deployment, "decode", 2, source="manual", reason="test")

    data = metric_selectors.deployment_metric_series(deployment, timedelta(minutes=10))
    json.dumps(data)  # JSON-safe
    prefill, decode = data["series"]["prefill"], data["series"]["decode"]
    assert prefill["load"] == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])
    assert prefill["t"] == sorted(prefill["t"])
    assert prefill["throughput_tps"] == [100, 101, 102, 103, 104]
    assert prefill["rss_bytes"] == [2**30 + i for i in range(5)]
    assert prefill["itl_s"] == [None] * 5
    assert decode["itl_s"] == [0.03] and decode["gpu_utilization"] == [0.7]
    assert decode["kv_transfer_bytes_per_s"] == [5e6] and decode["prefix_cache_hit_ratio"] == [0.25]
    for field in charts.SERIES_FIELDS:
        assert field in prefill and field in data["metrics"]
    assert data["deployment"]["replicas"]["decode"] == {"desired": 2, "min": 1, "max": 4}
    assert [(e["role"], e["from"], e["to"]) for e in data["events"]] == [("decode", 1, 2)]
    assert data["workers"] == [] and data["router"]["t"] == []  # nothing collected per worker / router yet

    only_decode = metric_selectors.deployment_metric_series(deployment, now - timedelta(minutes=10), role="decode")
    assert list(only_decode["series"]) == ["decode"]
    with pytest.raises(ValueError):
        metric_selectors.deployment_metric_series(deployment, timedelta(minutes=1), role="gpu")


def test_metric_series_downsamples_long_windows() -> None:
    deployment = make_deployment()
    now = timezone.now()
    MetricSample.objects.bulk_create(
        MetricSample(deployment=deployment, role="decode", at=now - timedelta(seconds=i), load=1.0 if i % 2 else 0.0)
        for i in range(1, 1001)
    )
    data = metric_selectors.deployment_metric_series(deployment, timedelta(seconds=1001), "decode", max_points=50)
    loads = data["series"]["decode"]["load"]
    assert 1 <= len(loads) <= 50
    assert all(0.3 < value < 0.7 for value in loads)  # averages of alternating 0/1


def test_worker_series_one_per_worker_with_names_roles_and_the_role_filter() -> None:
    deployment = make_deployment()
    other = make_deployment()
    now = timezone.now()
    for i in range(3):
        at = now - timedelta(seconds=30 - 10 * i)
        _worker_sample(deployment, 7, "decode", at, load=0.2 * i, rss_bytes=300 * 2**20, request_share=0.5)
        _worker_sample(deployment, 3, "decode", at, load=0.1, gpu_memory_bytes=None, request_share=0.5)
        _worker_sample(deployment, 9, "prefill", at, kv_transfer_bytes_per_s=1000.0 * i, kv_transfer_s=0.004)
    _worker_sample(deployment, 7, "decode", now - timedelta(hours=3), load=0.9)  # outside the window
    _worker_sample(other, 5, "decode", now, load=1.0)  # another deployment

    data = metric_selectors.deployment_metric_series(deployment, timedelta(minutes=10))
    json.dumps(data)
    workers = data["workers"]
    # Prefill first (the roles' order), then by name.
    assert [(w["id"], w["role"]) for w in workers] == [(9, "prefill"), (3, "decode"), (7, "decode")]
    by_id = {w["id"]: w for w in workers}
    assert by_id[7]["name"] == "decode #7 @ n1:30007" and by_id[7]["url"] == "http://10.0.0.1:30007"
    assert by_id[7]["load"] == pytest.approx([0.0, 0.2, 0.4]) and by_id[7]["rss_bytes"] == [300 * 2**20] * 3
    assert by_id[3]["gpu_memory_bytes"] == [None] * 3  # a CPU worker: no GPU memory
    assert by_id[9]["kv_transfer_bytes_per_s"] == [0.0, 1000.0, 2000.0] and by_id[9]["kv_transfer_s"] == [0.004] * 3
    assert by_id[7]["request_share"] == [0.5] * 3
    assert len(by_id[7]["t"]) == 3 and by_id[7]["t"] == sorted(by_id[7]["t"])
    for field in charts.WORKER_FIELDS:
        assert field in by_id[7] and field in data["worker_metrics"]

    decode_only = metric_selectors.deployment_metric_series(deployment, timedelta(minutes=10), role="decode")
    assert [w["id"] for w in decode_only["workers"]] == [3, 7]


def test_router_series_and_several_routers_merged() -> None:
    deployment = make_deployment()
    first = RouterEndpoint.objects.create(deployment=deployment, url="http://10.0.0.1:8000")
    second = RouterEndpoint.objects.create(deployment=deployment, url="http://10.0.0.2:8000")
    now = timezone.now()
    earlier = now - timedelta(seconds=10)
    RouterSample.objects.create(deployment=deployment, router=first, at=earlier, requests_per_s=4.0, error_rate=0.25,
                                rejected_per_s=0.5, dispatch_p50_s=0.001, dispatch_p90_s=0.004, queued=2)
    # Two routers scraped at the same moment: rates add up, the error rate is weighted by requests,
    # latencies are the worse router's.
    RouterSample.objects.create(deployment=deployment, router=first, at=now, requests_per_s=3.0, error_rate=0.0,
                                rejected_per_s=1.0, dispatch_p50_s=0.001, dispatch_p90_s=0.002, ttft_p90_s=0.8,
                                prompt_tokens_per_s=300.0, prompt_cached_ratio=0.9, local_prefills_per_s=2.0,
                                remote_prefills_per_s=1.0)
    RouterSample.objects.create(deployment=deployment, router=second, at=now, requests_per_s=1.0, error_rate=1.0,
                                rejected_per_s=0.0, dispatch_p50_s=0.003, dispatch_p90_s=0.009, ttft_p90_s=None,
                                prompt_tokens_per_s=100.0, prompt_cached_ratio=0.1, local_prefills_per_s=0.0,
                                remote_prefills_per_s=1.0)
    data = metric_selectors.deployment_metric_series(deployment, timedelta(minutes=5))
    router = data["router"]
    assert router["t"] == [int(earlier.timestamp() * 1000), int(now.timestamp() * 1000)]
    assert router["requests_per_s"] == [4.0, 4.0]
    assert router["error_rate"] == pytest.approx([0.25, 0.25])  # (3 × 0 + 1 × 1) / 4
    assert router["rejected_per_s"] == [0.5, 1.0]
    assert router["dispatch_p90_s"] == [0.004, 0.009]
    assert router["ttft_p90_s"] == [None, 0.8]
    assert router["queued"] == [2, None]
    # The cached share of prompt tokens is weighted by each router's prompt tokens: (300 × 0.9 + 100 × 0.1) / 400.
    assert router["prompt_cached_ratio"][0] is None and router["prompt_cached_ratio"][1] == pytest.approx(0.7)
    assert router["prompt_tokens_per_s"] == [None, 400.0]
    assert router["local_prefills_per_s"] == [None, 2.0] and router["remote_prefills_per_s"] == [None, 2.0]
    assert set(charts.ROUTER_FIELDS) <= set(router)


def test_charts_name_fields_that_the_series_have() -> None:
    sources = {"router": charts.ROUTER_FIELDS, "worker": charts.WORKER_FIELDS, "role": charts.SERIES_FIELDS}
    ids = [chart["id"] for chart in charts.CHARTS]
    assert len(ids) == len(set(ids))
    for chart in charts.CHARTS:
        fields = sources[chart["source"]]
        assert chart["fields"] and all(f in fields for f in chart["fields"]), chart
        if chart.get("per_worker"):
            assert all(f in charts.WORKER_FIELDS for f in chart["fields"]), chart
    # What issue 10 asks the page to chart.
    charted = {(c["source"], f) for c in charts.CHARTS for f in c["fields"]}
    for wanted in [("router", "dispatch_p50_s"), ("router", "error_rate"), ("router", "rejected_per_s"),
                   ("router", "ttft_p90_s"), ("router", "itl_p90_s"), ("worker", "request_share"),
                   ("role", "rss_bytes"), ("role", "gpu_memory_bytes"), ("role", "kv_transfer_bytes_per_s"),
                   ("role", "kv_transfer_s"), ("role", "prefix_cache_hit_ratio")]:
        assert wanted in charted, wanted


def test_metric_series_query_parameters(settings: Any) -> None:
    deployment = make_deployment()
    now = timezone.now()
    sample_actions.record_metric_sample(deployment, "decode", at=now - timedelta(minutes=90), load=0.9)
    sample_actions.record_metric_sample(deployment, "decode", at=now - timedelta(minutes=5), load=0.1)
    assert metric_selectors.metric_series_query(deployment, {})["series"]["decode"]["load"] == [0.1]  # default: 60 min
    series = metric_selectors.metric_series_query(deployment, {"minutes": "120"})["series"]
    assert series["decode"]["load"] == [0.9, 0.1]
    settings.METRICS_RETENTION_HOURS = 1
    assert metric_selectors.metric_series_query(deployment, {"minutes": "999999"})["series"]["decode"]["load"] == [0.1]
    assert list(metric_selectors.metric_series_query(deployment, {"role": "decode"})["series"]) == ["decode"]
    with pytest.raises(metric_selectors.InvalidQuery) as bad:
        metric_selectors.metric_series_query(deployment, {"minutes": "soon", "role": "gpu", "max_points": "1\x00"})
    assert set(bad.value.errors) == {"minutes", "role", "max_points"}


def test_prune_removes_old_worker_and_router_samples(settings: Any) -> None:
    deployment = make_deployment()
    router = RouterEndpoint.objects.create(deployment=deployment, url="http://127.0.0.1:8000")
    now = timezone.now()
    for hours in (100, 1):
        at = now - timedelta(hours=hours)
        sample_actions.record_metric_sample(deployment, "decode", at=at)
        _worker_sample(deployment, 1, "decode", at, load=0.5)
        RouterSample.objects.create(deployment=deployment, router=router, at=at, requests_per_s=1.0)
    assert sample_actions.prune_metric_samples(timedelta(hours=50)) == 3
    assert (MetricSample.objects.count(), WorkerSample.objects.count(), RouterSample.objects.count()) == (1, 1, 1)
    settings.METRICS_RETENTION_HOURS = 0.5
    assert sample_actions.prune_metric_samples() == 3
    assert RouterEndpoint.objects.filter(pk=router.pk).exists()  # the router itself stays


def test_the_rest_api_and_the_admin_return_the_same_series(admin_client: Any) -> None:
    """GET /api/deployments/{id}/metrics/ and the admin page's JSON are both metric_series_query."""
    from django.contrib.auth import get_user_model
    from django.urls import reverse
    from rest_framework.authtoken.models import Token
    from rest_framework.test import APIClient

    deployment = make_deployment()
    router = RouterEndpoint.objects.create(deployment=deployment, url="http://127.0.0.1:8000")
    now = timezone.now()
    sample_actions.record_metric_sample(deployment, "decode", at=now, load=0.5)
    _worker_sample(deployment, 4, "decode", now, load=0.5, request_share=1.0)
    RouterSample.objects.create(deployment=deployment, router=router, at=now, dispatch_p50_s=0.001, error_rate=0.0)
    token = Token.objects.create(user=get_user_model().objects.create_user("operator", password=None))
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {token.key}")
    from_api = api.get(f"/api/deployments/{deployment.pk}/metrics/?minutes=5").json()
    from_admin = admin_client.get(
        reverse("admin:inference_deployment_metrics_data", args=[deployment.pk]) + "?minutes=5"
    ).json()
    for data in (from_api, from_admin):
        assert data["router"]["dispatch_p50_s"] == [0.001] and data["router"]["error_rate"] == [0.0]
        assert [(w["id"], w["request_share"]) for w in data["workers"]] == [(4, [1.0])]
        assert data["series"]["decode"]["load"] == [0.5]
    bad = api.get(f"/api/deployments/{deployment.pk}/metrics/?minutes=soon&role=gpu")
    assert bad.status_code == 400 and set(bad.json()) >= {"minutes", "role"}
