"""Admin pages and REST list endpoints timed as an operator opens them: Django's test Client, logged in as
a superuser, against the real database (no test transaction, no cache), p50/p95 over `repeats` requests
after one unmeasured request each, with a day's history beside the workers (add_history)."""
from __future__ import annotations

import time
from datetime import time as dt_time
from datetime import timedelta
from typing import Any

from django.contrib.auth import get_user_model
from django.test import Client
from django.utils import timezone

from bench.common import percentile
from inference.models import Deployment, MetricSample, RouterEndpoint, ScaleEvent, ScalingRule

SUPERUSER = "sim-bench-admin"


HISTORY_EVENTS = 30


def add_history(deployment: Deployment) -> None:
    """What a deployment that has run for a day shows besides its workers: two scaling rules, two routers
    and HISTORY_EVENTS scale events by its rules (the page lists the newest 20), and the collector's per-role
    samples of the last hour (one per role every 5 s), which the charts' per-role lines read."""
    now = timezone.now()
    hot = ScalingRule.objects.create(deployment=deployment, name="hot", kind="threshold", role="decode",
                                     threshold=0.8)  # fmt: skip
    night = ScalingRule.objects.create(deployment=deployment, name="night", kind="schedule", role="decode",
                                       start_time=dt_time(22), end_time=dt_time(6), target_replicas=2,
                                       enabled=False)  # fmt: skip
    for k in range(2):
        RouterEndpoint.objects.create(deployment=deployment, url=f"http://127.0.0.{k + 2}:9")
    ScaleEvent.objects.bulk_create(
        ScaleEvent(deployment=deployment, role="decode", from_replicas=900 + k, to_replicas=901 + k,
                   source="rule", rule=hot if k % 2 else night, reason=f"history {k}")
        for k in range(HISTORY_EVENTS)
    )  # fmt: skip
    workers = deployment.workers.filter(status="running").count()
    MetricSample.objects.bulk_create(
        MetricSample(deployment=deployment, role=role, at=now - timedelta(seconds=s), workers=workers,
                     load=0.5, throughput_tps=30.0 * workers, itl_s=0.02, ttft_s=0.1, rss_bytes=2**28 * workers)
        for role in ("prefill", "decode") for s in range(0, 3600, 5)
    )  # fmt: skip


def pages(deployment: Deployment) -> dict[str, str]:
    """The measured pages by name."""
    d = deployment.pk
    return {
        "admin deployment page": f"/admin/inference/deployment/{d}/change/",
        "admin workers list": "/admin/inference/worker/",
        "admin workers of the deployment": f"/admin/inference/worker/?deployment__id__exact={d}",
        "admin nodes list": "/admin/nodes/node/",
        "admin worker samples list": "/admin/inference/workersample/",
        "api workers": f"/api/workers/?deployment={d}",
        "api nodes": "/api/nodes/",
        "api deployments": "/api/deployments/",
        "api events": f"/api/events/?deployment={d}",
        # The charts' series: every worker's points before (11.5 MB for 5 minutes at 1,000 workers); the 20
        # most loaded workers' now (inference.selectors.worker_series).
        "api metrics 5 min": f"/api/deployments/{d}/metrics/?minutes=5&role=decode",
        "api metrics 60 min": f"/api/deployments/{d}/metrics/?minutes=60",
    }


def measure(deployment: Deployment, *, repeats: int) -> dict[str, dict[str, Any]]:
    """Status, bytes and p50/p95 in ms per page (a page that does not answer 200 is reported, not timed)."""
    user_model = get_user_model()
    user = user_model.objects.filter(username=SUPERUSER).first()
    if user is None:
        user = user_model.objects.create_superuser(SUPERUSER, "sim@example.com", None)
    client = Client()
    client.force_login(user)
    out: dict[str, dict[str, Any]] = {}
    try:
        for name, url in pages(deployment).items():
            first = client.get(url)
            times, cpu = [], []
            for _ in range(repeats if first.status_code == 200 else 0):
                start, cpu_start = time.perf_counter(), time.thread_time()
                client.get(url)
                times.append((time.perf_counter() - start) * 1000)
                cpu.append((time.thread_time() - cpu_start) * 1000)
            # Wall time waits for PostgreSQL and for the other jobs on a loaded machine; the thread's CPU
            # is what the page costs the web process.
            out[name] = {"url": url, "status": first.status_code, "bytes": len(first.content),
                         "p50_ms": percentile(times, 50), "p95_ms": percentile(times, 95) or 0.0,
                         "cpu_p50_ms": percentile(cpu, 50), "cpu_p95_ms": percentile(cpu, 95) or 0.0}
    finally:
        user.delete()
    return out
