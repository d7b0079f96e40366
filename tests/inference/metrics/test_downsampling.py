"""inference.metrics.downsampling: per-minute and per-hour rollups of worker samples, and retention."""
from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from inference.metrics import downsampling
from inference.models import MetricSample, WorkerSample
from inference.models.samples import WorkerSampleRollup
from tests.support.control_plane import make_deployment

T0 = datetime(2026, 12, 4, 10, 0, tzinfo=UTC)


def _sample(deployment_id: int, worker_id: int, at: datetime, **values: Any) -> WorkerSample:
    return WorkerSample(deployment_id=deployment_id, worker_id=worker_id, name=f"decode #{worker_id}", role="decode",
                        url="http://127.0.0.1:1", at=at, **values)


@pytest.mark.django_db
def test_minutes_then_hours_are_rolled_up_once() -> None:
    deployment = make_deployment()
    rows = []
    # Worker 1: 12 samples a minute for 2 hours (load 0..11 in each minute; rss 100 throughout), plus
    # the minute in progress; worker 2: one sample in the first minute without a load.
    for minute in range(121):
        for i in range(12):
            rows.append(_sample(deployment.pk, 1, T0 + timedelta(minutes=minute, seconds=5 * i),
                                load=float(i), rss_bytes=100))
    rows.append(_sample(deployment.pk, 2, T0 + timedelta(seconds=1), running=3.0))
    WorkerSample.objects.bulk_create(rows)
    now = T0 + timedelta(hours=2, seconds=30)

    result = downsampling.downsample(now)
    assert (result.minute, result.hour) == (120 + 1, 2 + 1)  # the minute in progress waits
    first = WorkerSampleRollup.objects.get(worker_id=1, resolution_s=60, at=T0)
    assert first.samples == 12 and first.load == pytest.approx(5.5) and first.load_max == 11.0
    assert first.rss_bytes == 100 and first.running is None and first.name == "decode #1"
    other = WorkerSampleRollup.objects.get(worker_id=2, resolution_s=60)
    assert other.load is None and other.running == 3.0 and other.samples == 1
    hour = WorkerSampleRollup.objects.get(worker_id=1, resolution_s=3600, at=T0)
    assert hour.samples == 720 and hour.load == pytest.approx(5.5) and hour.load_max == 11.0
    assert WorkerSampleRollup.objects.get(worker_id=2, resolution_s=3600).running == 3.0

    # Again a little later: nothing new is closed, nothing is written twice.
    assert downsampling.downsample(now + timedelta(seconds=20)).minute == 0
    # The minute that was in progress is rolled up once it closes.
    assert downsampling.downsample(now + timedelta(minutes=1)).minute == 1
    assert WorkerSampleRollup.objects.filter(resolution_s=60).count() == 122


@pytest.mark.django_db
def test_prune_keeps_raw_short_and_rollups_long(settings: Any) -> None:
    settings.METRICS_RAW_RETENTION_HOURS = 2
    settings.METRICS_RETENTION_HOURS = 72
    settings.METRICS_ROLLUP_RETENTION_DAYS = 30
    deployment = make_deployment()
    now = T0
    WorkerSample.objects.bulk_create([_sample(deployment.pk, 1, now - timedelta(hours=h)) for h in (1, 3)])
    WorkerSampleRollup.objects.bulk_create([
        WorkerSampleRollup(deployment=deployment, worker_id=1, name="w", role="decode", resolution_s=res, at=now - age)
        for res, age in ((60, timedelta(hours=71)), (60, timedelta(hours=73)),
                         (3600, timedelta(days=29)), (3600, timedelta(days=31)))
    ])  # fmt: skip
    MetricSample.objects.create(deployment=deployment, role="decode", at=now - timedelta(hours=73))

    assert downsampling.prune(now) == 4
    assert [s.at for s in WorkerSample.objects.all()] == [now - timedelta(hours=1)]
    kept = sorted((r.resolution_s, now - r.at) for r in WorkerSampleRollup.objects.all())
    assert kept == [(60, timedelta(hours=71)), (3600, timedelta(days=29))]
    assert not MetricSample.objects.exists()


@pytest.mark.django_db
def test_worker_series_reads_rollups_before_the_raw_samples() -> None:
    from django.utils import timezone

    from inference.selectors.metrics import deployment_metric_series

    deployment = make_deployment()
    now = timezone.now()
    # Raw samples of the last 2 hours (one every 5 minutes, load 0.5), minute rollups (load 0.25) before.
    WorkerSample.objects.bulk_create(
        [_sample(deployment.pk, 1, now - timedelta(minutes=m), load=0.5) for m in range(0, 120, 5)]
    )
    WorkerSampleRollup.objects.bulk_create([
        WorkerSampleRollup(deployment=deployment, worker_id=1, name="decode #1", role="decode", resolution_s=60,
                           at=now - timedelta(minutes=m), samples=12, load=0.25)
        for m in range(120, 360, 10)
    ])  # fmt: skip
    series = deployment_metric_series(deployment, timedelta(hours=6), "decode", max_points=10_000)
    (worker,) = series["workers"]
    loads = worker["load"]
    assert len(loads) == 24 + 24 and loads[:24] == [0.25] * 24 and loads[24:] == [0.5] * 24
    assert worker["t"] == sorted(worker["t"])


@pytest.mark.django_db
def test_sample_lists_count_large_tables_by_the_planners_estimate(monkeypatch: pytest.MonkeyPatch) -> None:
    from django.db import connection

    from inference.admin import samples as sample_admin

    if connection.vendor != "postgresql":
        pytest.skip("the estimate is PostgreSQL's")
    deployment = make_deployment()
    WorkerSample.objects.bulk_create([_sample(deployment.pk, 1, T0 + timedelta(seconds=i)) for i in range(50)])
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE inference_workersample")
        cursor.execute("SELECT reltuples FROM pg_class WHERE oid = 'inference_workersample'::regclass")
        estimate = int(cursor.fetchone()[0])
    unfiltered = WorkerSample.objects.order_by("-at")
    filtered = unfiltered.filter(worker_id=1)
    # A small table is counted exactly; past the threshold the unfiltered list takes the estimate.
    assert sample_admin.EstimatedCountPaginator(unfiltered, 100).count == 50
    monkeypatch.setattr(sample_admin, "EXACT_COUNT_BELOW", 1)
    if estimate >= 1:  # ANALYZE inside the test's transaction sees its rows
        assert sample_admin.EstimatedCountPaginator(unfiltered, 100).count == estimate
    assert sample_admin.EstimatedCountPaginator(filtered, 100).count == 50  # filtered: exact
