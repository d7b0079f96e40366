"""inference.selectors.worker_series: the per-worker series are drawn for the most loaded workers only, averaged
by the database into bounded time buckets, so the series endpoint's answer does not grow with the worker count."""
from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from inference.models import WorkerSample
from inference.models.samples import WorkerSampleRollup
from inference.selectors import metrics as metric_selectors
from inference.selectors import worker_series
from tests.support.control_plane import make_deployment

pytestmark = pytest.mark.django_db


def _samples(deployment: Any, workers: int, seconds: int, step: int = 5, first_id: int = 1) -> None:
    """`seconds` of raw samples every `step` s for `workers` decode workers; worker i's load is i / 1000
    and alternates with +0.5 (so a bucket of several samples averages to i / 1000 + 0.25)."""
    now = timezone.now()
    WorkerSample.objects.bulk_create(
        WorkerSample(deployment=deployment, worker_id=first_id + i, name=f"decode #{first_id + i} @ n1:{31000 + i}",
                     role="decode", url=f"http://10.0.0.1:{31000 + i}", at=now - timedelta(seconds=s),
                     load=(first_id + i) / 1000 + (0.5 if (s // step) % 2 else 0.0), rss_bytes=2**28)
        for i in range(workers) for s in range(0, seconds, step)
    )  # fmt: skip


def test_the_most_loaded_workers_are_drawn_and_the_total_is_said() -> None:
    deployment = make_deployment()
    _samples(deployment, workers=30, seconds=120)
    data = metric_selectors.deployment_metric_series(deployment, timedelta(minutes=5), "decode", max_workers=5)
    json.dumps(data)
    assert data["workers_total"] == 30 and data["max_workers"] == 5
    # Loads grow with the id: the five most loaded are 26-30, listed by name.
    assert sorted(w["id"] for w in data["workers"]) == [26, 27, 28, 29, 30]
    assert [w["name"] for w in data["workers"]] == sorted(w["name"] for w in data["workers"])
    worker = data["workers"][0]
    assert worker["url"].startswith("http://10.0.0.1:") and worker["role"] == "decode"
    assert len(worker["t"]) == 24 and worker["rss_bytes"] == [2**28] * 24  # 2 minutes every 5 s: a point each


def test_the_answer_is_bounded_whatever_the_worker_count() -> None:
    small, large = make_deployment(), make_deployment()
    _samples(small, workers=20, seconds=60)
    _samples(large, workers=200, seconds=60, first_id=1000)
    sizes = [len(json.dumps(metric_selectors.metric_series_query(d, {"minutes": "5"}))) for d in (small, large)]
    assert sizes[1] < sizes[0] * 1.1  # 20 workers drawn of each; ten times the workers, not ten times the bytes
    assert metric_selectors.metric_series_query(large, {"minutes": "5"})["workers_total"] == 200


def test_long_windows_are_averaged_by_the_database_into_few_points() -> None:
    deployment = make_deployment()
    _samples(deployment, workers=2, seconds=3600)  # 720 samples each
    data = metric_selectors.deployment_metric_series(deployment, timedelta(hours=1), "decode", max_points=600)
    for worker in data["workers"]:
        assert 100 <= len(worker["t"]) <= worker_series.WORKER_MAX_POINTS + 1
        assert worker["t"] == sorted(worker["t"])
        # Each bucket holds 3-4 samples of alternating load: its mean lies between the two values.
        base = worker["id"] / 1000
        assert all(base + 0.1 < value < base + 0.4 for value in worker["load"][1:-1])
        assert worker["rss_bytes"] == pytest.approx([2**28] * len(worker["t"]))


def test_a_window_without_raw_samples_ranks_by_its_minute_rollups() -> None:
    deployment = make_deployment()
    now = timezone.now()
    WorkerSampleRollup.objects.bulk_create(
        WorkerSampleRollup(deployment=deployment, worker_id=w, name=f"decode #{w}", role="decode", resolution_s=60,
                           at=now - timedelta(hours=5, minutes=m), samples=12, load=w / 10)
        for w in range(1, 6) for m in range(30)
    )  # fmt: skip
    data = metric_selectors.deployment_metric_series(deployment, timedelta(hours=6), "decode", max_workers=2)
    assert data["workers_total"] == 5 and sorted(w["id"] for w in data["workers"]) == [4, 5]
    assert data["workers"][0]["load"][0] == pytest.approx(0.4)


def test_max_workers_parameter() -> None:
    deployment = make_deployment()
    _samples(deployment, workers=3, seconds=30)
    assert len(metric_selectors.metric_series_query(deployment, {"max_workers": "2"})["workers"]) == 2
    none = metric_selectors.metric_series_query(deployment, {"max_workers": "0"})
    assert none["workers"] == [] and none["workers_total"] == 3
    assert len(metric_selectors.metric_series_query(deployment, {"max_workers": "99999"})["workers"]) == 3
    with pytest.raises(metric_selectors.InvalidQuery) as bad:
        metric_selectors.metric_series_query(deployment, {"max_workers": "all"})
    assert set(bad.value.errors) == {"max_workers"}
