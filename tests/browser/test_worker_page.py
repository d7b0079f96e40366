"""The worker page and the sample lists in a real browser: restart a live worker from its page (the restart is
queued for its node's agent and shows in the page's message and History), follow its Charts link to the
deployment's charts split per worker, and the worker page and the three sample lists (in units) fit 1,400 px.

As in test_admin_console.py: pytest-django's live server on the test database, Debian's headless Chromium
through playwright-python, Celery messages recorded instead of sent.
"""
from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone

from inference.actions import samples as sample_actions
from inference.models import RouterEndpoint, RouterSample, Worker, WorkerSample
from tests.browser.conftest import CHROMIUM, SKIP_REASON, BrowserSession
from tests.browser.test_scale_controls import PASSWORD, USERNAME, assert_fits, log_in
from tests.support.celery_capture import SentTasks, sent_tasks  # noqa: F401  (fixture)
from tests.support.control_plane import make_deployment, make_model, make_node, make_worker

pytestmark = [
    pytest.mark.skipif(not CHROMIUM.exists(), reason=SKIP_REASON),
    pytest.mark.timeout(180),
]


@pytest.fixture
def worker(settings: Any) -> Worker:
    """A superuser (fast hasher), a running decode worker with a health report, and one sample of each kind
    with long floats and byte counts."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    get_user_model().objects.create_superuser(USERNAME, "root@example.com", PASSWORD)
    deployment = make_deployment(name="chat", model=make_model(name="smollm2-135m"))
    node = make_node(name="local", last_heartbeat=timezone.now())
    running = make_worker(
        deployment, node, role="decode", status="running", last_seen=timezone.now(),
        last_health={"status": "healthy", "queue_depth": 0, "running": 1, "kv_usage": 0.123456789,
                     "rss_bytes": 734003200, "uptime_s": 3725.123456},
    )  # fmt: skip
    now = timezone.now()
    sample_actions.record_metric_sample(
        deployment, "decode", load=0.8123456789, itl_s=0.0234567891234, throughput_tps=123.456789,
        kv_usage=0.4567, cpu_utilization=0.91234, rss_bytes=25276203008,
    )  # fmt: skip
    WorkerSample.objects.create(
        deployment=deployment, worker_id=running.pk, name="chat-decode-local-1", role="decode", at=now, load=0.51234,
        queue_depth=1, running=3, kv_usage=0.33333, rss_bytes=734003200, gpu_memory_bytes=None,
        kv_transfer_bytes_per_s=1468006.4, request_share=0.5, prefix_cache_hit_ratio=0.251234,
    )  # fmt: skip
    router = RouterEndpoint.objects.create(deployment=deployment, url="http://127.0.0.1:8000")
    RouterSample.objects.create(
        deployment=deployment, router=router, at=now, requests_per_s=12.3456, error_rate=0.0123,
        rejected_per_s=0.0, dispatch_p50_s=0.000412, dispatch_p90_s=0.00123, ttft_p90_s=0.2345, itl_p90_s=0.0211,
        queued=0, worker_share={"decode": {running.url: 1.0}},
    )  # fmt: skip
    return running


def test_worker_page_restart_and_charts(
    browser: BrowserSession, live_server: Any, worker: Worker, sent_tasks: SentTasks  # noqa: F811
) -> None:
    page = browser.page
    base = live_server.url
    worker_url = f"{base}/admin/inference/worker/{worker.pk}/change/"

    with browser.step("worker-page"):
        log_in(browser, base)
        page.goto(worker_url)
        assert page.locator("input[name=_save]").count() == 0  # read-only
        tools = page.locator(".object-tools")
        assert tools.get_by_role("button", name="Restart").is_visible()
        assert tools.get_by_role("link", name="Charts").is_visible()

    with browser.step("restarted"):
        with page.expect_navigation():
            page.locator(".object-tools").get_by_role("button", name="Restart").click()
        assert page.url == worker_url
        message = page.locator(".messagelist").inner_text()
        assert f"Restart of worker #{worker.pk} queued for the agent on local" in message
    assert [kw for kw, _ in sent_tasks.named("restart_worker")] == [{"worker_id": worker.pk}]

    with browser.step("charts-per-worker"):
        with page.expect_response(lambda r: "/metrics/data/" in r.url) as data:
            page.locator(".object-tools").get_by_role("link", name="Charts").click()
        assert data.value.ok
        assert page.input_value("#metrics-split") == "worker"
        page.wait_for_function(
            "window.metricsCharts && window.metricsCharts.load"
            " && window.metricsCharts.load.series.slice(1).some((s) => s.label === 'chat-decode-local-1')"
        )

    with browser.step("sample-lists"):
        page.goto(f"{base}/admin/inference/metricsample/")
        row = page.locator("#result_list tbody tr").first.inner_text()
        assert "23.5 ms" in row and "45.7 %" in row and "23.5 GiB" in row and "0.8123" not in row
        page.goto(f"{base}/admin/inference/workersample/")
        row = page.locator("#result_list tbody tr").first.inner_text()
        assert "700.0 MiB" in row and "1.4 MiB/s" in row and "25.1 %" in row
        page.goto(f"{base}/admin/inference/routersample/")
        row = page.locator("#result_list tbody tr").first.inner_text()
        assert "12.3 req/s" in row and "0.4 ms" in row and "234 ms" in row

    with browser.step("pages-fit"):
        for path in (f"/admin/inference/worker/{worker.pk}/change/", "/admin/inference/metricsample/",
                     "/admin/inference/workersample/", "/admin/inference/routersample/",
                     f"/admin/inference/routersample/{RouterSample.objects.get().pk}/change/"):  # fmt: skip
            assert_fits(browser, base, path)
