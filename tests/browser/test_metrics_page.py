"""The metrics page's fixes in a real browser: every y axis is as wide as its labels (the KV transfer axis cut
"1.4 MiB/s" to ".4 MiB/s"), the GPU charts say "no GPU" instead of an empty chart labelled "0.5 B" while no
worker reports a GPU and come back once one does, the CPU chart says it measures the pinned cores, and the
page fits 1,400 px.

As in test_admin_console.py: pytest-django's live server on the test database, Debian's headless Chromium
through playwright-python; the charts are checked on what uPlot holds (window.metricsCharts).
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone

from inference.actions import samples as sample_actions
from inference.models import Deployment
from tests.browser.conftest import CHROMIUM, SKIP_REASON, BrowserSession
from tests.browser.test_scale_controls import PASSWORD, USERNAME, assert_fits, log_in
from tests.support.control_plane import make_deployment, make_model

pytestmark = [
    pytest.mark.skipif(not CHROMIUM.exists(), reason=SKIP_REASON),
    pytest.mark.timeout(180),
]

STATUS_JS = "document.getElementById('metrics-status').textContent"
# Per drawn chart: the y axis's width against its widest label plus its ticks and gap (css px), and the labels.
AXES_JS = """() => Object.entries(window.metricsCharts).filter(([id, u]) => !u.root.parentElement.hidden)
  .map(([id, u]) => {
    const axis = u.axes[1];
    u.ctx.font = axis.font[0];
    const ratio = window.devicePixelRatio || 1;
    const labels = (axis._values || []).filter((v) => v);
    const widest = Math.max(0, ...labels.map((v) => u.ctx.measureText(v).width / ratio));
    return {id, size: axis._size, needed: widest + axis.ticks.size + axis.gap, labels};
  })"""
NO_GPU_JS = """() => Array.from(document.querySelectorAll('figure[data-needs-gpu]')).map((f) => [
  f.dataset.chart, !f.querySelector('.metrics-no-gpu').hidden, !f.querySelector('.metrics-plot').hidden])"""
MIB = 1024 * 1024


@pytest.fixture
def cpu_only(settings: Any) -> Deployment:
    """A superuser (fast hasher) and ten minutes of samples of CPU workers: KV transfers about 1.4 MiB/s, no
    GPU field."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    get_user_model().objects.create_superuser(USERNAME, "root@example.com", PASSWORD)
    deployment = make_deployment(name="chat", model=make_model(name="smollm2-135m"))
    now = timezone.now()
    for i in range(40):
        at = now - timedelta(seconds=15 * (39 - i))
        for role in ("prefill", "decode"):
            sample_actions.record_metric_sample(
                deployment, role, at=at, workers=1, load=0.3 + i / 100, cpu_utilization=0.97,
                rss_bytes=(700 + i) * MIB, kv_transfer_bytes_per_s=(1.2 + i / 100) * MIB,
            )  # fmt: skip
    return deployment


def test_metrics_page_axes_gpu_and_cpu(browser: BrowserSession, live_server: Any, cpu_only: Deployment) -> None:
    page = browser.page
    base = live_server.url
    url = f"{base}/admin/inference/deployment/{cpu_only.pk}/metrics/"

    with browser.step("cpu-only"):
        log_in(browser, base)
        page.goto(url)
        page.wait_for_function(f"{STATUS_JS}.startsWith('updated')")
        assert page.evaluate(NO_GPU_JS) == [["gpu_utilization", True, False], ["gpu_memory", True, False]]
        cpu = page.locator("figure[data-chart=cpu_utilization] figcaption").inner_text()
        assert "pinned cores" in cpu and "every process" in cpu

    with browser.step("axes-fit-their-labels"):
        axes = page.evaluate(AXES_JS)
        kv = next(a for a in axes if a["id"] == "kv_transfer")
        assert any(label.endswith("MiB/s") and label[0].isdigit() for label in kv["labels"]), kv
        short = [a for a in axes if a["size"] < a["needed"]]
        assert not short, f"y axes narrower than their labels: {short}"

    with browser.step("page-fits"):
        assert_fits(browser, base, f"/admin/inference/deployment/{cpu_only.pk}/metrics/")

    with browser.step("gpu-reported"):
        page.goto(url)
        page.wait_for_function(f"{STATUS_JS}.startsWith('updated')")
        refreshes = page.evaluate("document.getElementById('metrics-app').dataset.refreshes")
        sample_actions.record_metric_sample(
            cpu_only, "decode", workers=1, load=0.5, gpu_utilization=0.8, gpu_memory_bytes=3 * 1024 * MIB,
        )  # fmt: skip
        page.wait_for_function(
            f"document.getElementById('metrics-app').dataset.refreshes !== {refreshes!r}", timeout=15_000
        )
        assert page.evaluate(NO_GPU_JS) == [["gpu_utilization", False, True], ["gpu_memory", False, True]]
        gpu_axis = next(a for a in page.evaluate(AXES_JS) if a["id"] == "gpu_memory")
        assert gpu_axis["size"] >= gpu_axis["needed"] and any("GiB" in label for label in gpu_axis["labels"])


def test_metrics_page_draws_the_most_loaded_workers_and_says_so(
    browser: BrowserSession, live_server: Any, cpu_only: Deployment
) -> None:
    """25 workers with samples: the per-worker charts draw the server's 20 most loaded, and the page says
    that the per-role lines cover all 25."""
    from inference.models import WorkerSample

    now = timezone.now()
    WorkerSample.objects.bulk_create(
        WorkerSample(deployment=cpu_only, worker_id=w, name=f"decode #{w} @ n1:{31000 + w}", role="decode",
                     url=f"http://10.0.0.1:{31000 + w}", at=now - timedelta(seconds=s), load=w / 100)
        for w in range(1, 26) for s in range(0, 60, 5)
    )  # fmt: skip
    page = browser.page
    base = live_server.url
    with browser.step("per-worker"):
        log_in(browser, base)
        page.goto(f"{base}/admin/inference/deployment/{cpu_only.pk}/metrics/?split=worker")
        page.wait_for_function(f"{STATUS_JS}.startsWith('updated')")
        note = page.locator("#metrics-workers-drawn")
        assert note.is_visible() and "the 20 most loaded of 25 workers" in note.inner_text()
        labels = page.evaluate("window.metricsCharts.load.series.slice(1).map((s) => s.label)")
        assert sorted(labels) == sorted(f"decode #{w} @ n1:{31000 + w}" for w in range(6, 26))
