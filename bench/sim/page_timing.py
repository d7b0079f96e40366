"""Admin pages and REST list endpoints timed as an operator opens them: Django's test Client, logged in as
a superuser, against the real database (no test transaction, no cache), p50/p95 over `repeats` requests
after one unmeasured request each, with a day's history beside the workers (add_history).

Alone, on the rows a `bench.sim.control_plane --keep` run left (one fresh process; bench/sim/page_ab.py
alternates it between two source trees):

    .venv/bin/python -m bench.sim.page_timing --prefix cp1234 --repeats 20 [--web-gc] [--pages NAME,...]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import time as dt_time
from datetime import timedelta
from typing import Any

if __name__ == "__main__":  # alone: set Django up before the models are imported
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    os.environ.setdefault("DJANGO_ALLOWED_HOSTS", "*")
    import django

    django.setup()

from django.contrib.auth import get_user_model  # noqa: E402  (Django set up first when run alone)
from django.test import Client  # noqa: E402
from django.utils import timezone  # noqa: E402

from bench.common import percentile  # noqa: E402
from inference.models import Deployment, MetricSample, RouterEndpoint, ScaleEvent, ScalingRule  # noqa: E402

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


@contextmanager
def full_collections() -> Iterator[list[float]]:
    """The duration in ms of each generation-2 garbage collection while inside (gc.callbacks)."""
    pauses: list[float] = []
    started = [0.0]

    def callback(phase: str, info: dict[str, Any]) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append((time.perf_counter() - started[0]) * 1000)

    gc.callbacks.append(callback)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(callback)


def measure(deployment: Deployment, *, repeats: int, names: list[str] | None = None,
            web_gc: bool = False) -> dict[str, dict[str, Any]]:
    """Status, bytes and p50/p95 in ms per page (a page that does not answer 200 is reported, not timed), and
    the full garbage collections during its timed requests. `names`: the pages measured (default all).
    `web_gc`: the garbage collector set as the web process sets it (config/web_gc.py)."""
    if web_gc:
        from config.web_gc import tune_web_gc

        tune_web_gc()
    user_model = get_user_model()
    user = user_model.objects.filter(username=SUPERUSER).first()
    if user is None:
        user = user_model.objects.create_superuser(SUPERUSER, "sim@example.com", None)
    client = Client()
    client.force_login(user)
    out: dict[str, dict[str, Any]] = {}
    try:
        for name, url in pages(deployment).items():
            if names is not None and name not in names:
                continue
            first = client.get(url)
            times, cpu = [], []
            with full_collections() as pauses:
                for _ in range(repeats if first.status_code == 200 else 0):
                    start, cpu_start = time.perf_counter(), time.thread_time()
                    client.get(url)
                    times.append((time.perf_counter() - start) * 1000)
                    cpu.append((time.thread_time() - cpu_start) * 1000)
            # Wall time waits for PostgreSQL and for the other jobs on a loaded machine; the thread's CPU
            # is what the page costs the web process.
            out[name] = {"url": url, "status": first.status_code, "bytes": len(first.content),
                         "p50_ms": percentile(times, 50), "p95_ms": percentile(times, 95) or 0.0,
                         "cpu_p50_ms": percentile(cpu, 50), "cpu_p95_ms": percentile(cpu, 95) or 0.0,
                         "wall_ms": times, "cpu_ms": cpu, "full_gc_ms": pauses}
    finally:
        user.delete()
    return out


def main(argv: list[str] | None = None) -> int:
    """Time the pages of a kept run's deployment in this process; print the result as JSON."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prefix", required=True, help="the prefix a `control_plane --keep` run printed (cp + 4 hex)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--pages", default=None, help="comma-separated page names (default: all; see pages())")
    p.add_argument("--web-gc", action="store_true", help="set the garbage collector as config/web_gc.py does")
    args = p.parse_args(argv)
    deployment = Deployment.objects.filter(name=f"{args.prefix}-dep").first()
    if deployment is None:
        p.error(f"--prefix {args.prefix!r}: no deployment {args.prefix}-dep (run control_plane --keep first)")
    names = [n.strip() for n in args.pages.split(",")] if args.pages else None
    unknown = sorted(set(names or ()) - set(pages(deployment)))
    if unknown or args.repeats < 1:
        p.error(f"unknown pages {unknown} (known: {sorted(pages(deployment))}), or --repeats < 1")
    json.dump(measure(deployment, repeats=args.repeats, names=names, web_gc=args.web_gc), sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
