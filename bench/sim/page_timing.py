"""Admin pages and REST list endpoints timed as an operator opens them: Django's test Client, logged in as
a superuser, against the real database (no test transaction, no cache), p50/p95 over `repeats` requests
after one unmeasured request each."""
from __future__ import annotations

import time
from typing import Any

from django.contrib.auth import get_user_model
from django.test import Client

from bench.common import percentile
from inference.models import Deployment

SUPERUSER = "sim-bench-admin"


def pages(deployment: Deployment) -> dict[str, str]:
    """The measured pages by name."""
    d = deployment.pk
    # The charts' series endpoint returns every worker's points: 60 minutes took 31 s at 100 workers
    # (72,000 raw samples), so above 100 workers it is timed over 5 minutes.
    minutes = 60 if deployment.workers.count() <= 100 else 5
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
        f"api metrics {minutes} min": f"/api/deployments/{d}/metrics/?minutes={minutes}&role=decode",
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
            # The series endpoint takes seconds per request at 100 workers: three are enough for it.
            count = min(repeats, 3) if "metrics" in url else repeats
            for _ in range(count if first.status_code == 200 else 0):
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
