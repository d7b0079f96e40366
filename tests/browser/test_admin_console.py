"""The admin console in a real browser: log in, node list, live metric charts, rule edit, scale action.

A live Django server (pytest-django's `live_server`, static files served) runs against the test
database; Debian's headless Chromium drives it through playwright-python. Celery messages are
recorded instead of sent (tests.support.celery_capture), so no controller is needed and nothing is
left in a broker queue. Each step saves a screenshot (see tests/browser/conftest.py for where).

The metrics page is checked on what its chart library holds, not on pixels: after traffic through a
real router process (over stand-in workers) and two runs of the metrics collector, the uPlot
instances (window.metricsCharts) must hold router overhead, error rate and per-worker series with
values, within the page's time window, and keep them through the page's auto-refresh.
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone

from inference import jobs
from inference.actions import samples as sample_actions
from inference.actions import scale as scale_actions
from inference.metrics import collector
from inference.models import Deployment, RouterEndpoint, ScaleEvent, ScalingRule, Worker
from inference.selectors import charts as chart_specs
from nodes.models import Node
from tests.browser.conftest import CHROMIUM, SKIP_REASON, BrowserSession
from tests.inference.router.stand_ins import Cluster
from tests.support.celery_capture import SentTasks, capture, sent_tasks  # noqa: F401  (fixture)
from tests.support.control_plane import make_deployment, make_model, make_node, make_worker
from tests.support.processes import start_router

pytestmark = [
    pytest.mark.skipif(not CHROMIUM.exists(), reason=SKIP_REASON),
    pytest.mark.timeout(180),
]

USERNAME = "root"
PASSWORD = "browser-test-password"
SAMPLES = 40  # per role, one every SAMPLE_EVERY: ten minutes of the page's default 15-minute window
SAMPLE_EVERY = timedelta(seconds=15)
OK_REQUESTS = 10  # through the router, then one that fails on every decode worker
# The metrics page's status line: "updated HH:MM:SS, every 5s" once a refresh has been drawn.
STATUS_JS = "document.getElementById('metrics-status').textContent"

# What the page's uPlot instances hold, by chart id: their series' labels (x first), their data
# (x in seconds, then one array per line; a point a line lacks reads null) and the x scale's range.
CHARTS_JS = """
() => Object.fromEntries(Object.entries(window.metricsCharts || {}).map(([id, u]) => [id, {
  labels: u.series.slice(1).map((s) => s.label),
  data: u.data.map((column) => Array.from(column, (v) => (v === undefined ? null : v))),
  x: [u.scales.x.min, u.scales.x.max],
}]))
"""


@dataclass
class Console:
    """The rows the browser test works on."""

    deployment: Deployment
    node: Node
    rule: ScalingRule


def _wave(i: int, low: float, high: float, phase: float) -> float:
    """A smooth value between low and high (sample i of SAMPLES), so each chart has a visible shape."""
    return low + (high - low) * (0.5 + 0.5 * math.sin(phase + 2 * math.pi * i / SAMPLES))


def _prefill(i: int, low: float, high: float) -> float:
    return _wave(i, low, high, math.pi / 2)


def _decode(i: int, low: float, high: float) -> float:
    return _wave(i, low, high, -math.pi / 2)


@pytest.fixture
def console(sent_tasks: SentTasks, settings: Any) -> Console:  # noqa: F811
    """A superuser; an online node running a prefill worker; a deployment with a threshold rule, a scale
    event five minutes ago and ten minutes of role-level metric samples.

    Passwords use a fast hasher: the default one costs a second of CPU per login on a busy machine.
    """
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    get_user_model().objects.create_superuser(USERNAME, "root@example.com", PASSWORD)
    node = make_node(name="gpu-node-1", last_heartbeat=timezone.now(),
                     last_metrics={"cpu_utilization": 0.35, "memory_used_bytes": 6 * 2**30})
    deployment = make_deployment(name="chat", model=make_model(name="smollm2-135m"))
    make_worker(deployment, node, role="prefill", last_seen=timezone.now(), port=1)  # nothing listens there
    rule = ScalingRule.objects.create(
        deployment=deployment, name="decode-load-high", kind="threshold", role="decode", threshold=0.7,
        duration_s=60, cooldown_s=300, step=1, breach_started_at=timezone.now(),
    )
    event = scale_actions.scale_deployment(
        deployment, "prefill", 2, source="threshold", reason="seed: prefill load high"
    )
    assert event is not None
    now = timezone.now()
    ScaleEvent.objects.filter(pk=event.pk).update(created_at=now - timedelta(minutes=5))
    for i in range(SAMPLES):
        at = now - (SAMPLES - 1 - i) * SAMPLE_EVERY
        sample_actions.record_metric_sample(
            deployment, "prefill", at=at, workers=2 if at >= now - timedelta(minutes=5) else 1,
            load=_prefill(i, 0.3, 0.9), ttft_s=_prefill(i, 0.08, 0.25), throughput_tps=_prefill(i, 400, 900),
            queue_depth=_prefill(i, 0.5, 6), running=_prefill(i, 1, 4), kv_usage=0.0,
            cpu_utilization=_prefill(i, 0.2, 0.5), gpu_utilization=_prefill(i, 0.4, 0.95),
        )
        sample_actions.record_metric_sample(
            deployment, "decode", at=at, workers=1, load=_decode(i, 0.2, 0.8), itl_s=_decode(i, 0.012, 0.03),
            throughput_tps=_decode(i, 150, 350), queue_depth=_decode(i, 0, 3), running=_decode(i, 2, 8),
            kv_usage=_decode(i, 0.1, 0.6), cpu_utilization=_decode(i, 0.3, 0.85),
        )
    sent_tasks.clear()
    deployment.refresh_from_db()
    return Console(deployment=deployment, node=node, rule=rule)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """Two prefill and two decode stand-in workers (tests/inference/router/stand_ins.py)."""
    stand_ins = Cluster()
    try:
        yield stand_ins
    finally:
        stand_ins.stop()


@pytest.fixture(scope="module")
def router_url(cluster: Cluster, log_dir: Path) -> Iterator[str]:
    """A real router process (static endpoints) in front of the stand-ins."""
    proc, url = start_router(cluster.prefill_urls, cluster.decode_urls, log_dir)
    try:
        yield url
    finally:
        proc.stop()


@pytest.fixture
def traffic(browser: BrowserSession, console: Console, cluster: Cluster, router_url: str) -> list[Worker]:
    """The stand-ins as the deployment's workers (on a second node) and the router registered; the
    collector runs, OK_REQUESTS requests and one failing on both decode workers go through the router,
    and the collector runs again: router, per-worker and per-role samples with values. Returns the
    stand-ins' Worker rows."""
    cluster.reset()
    node = make_node(name="local", last_heartbeat=timezone.now())
    deployment = console.deployment
    workers = [
        make_worker(deployment, node, role=stand_in.role, port=int(stand_in.url.rsplit(":", 1)[1]))
        for stand_in in cluster.all()
    ]
    RouterEndpoint.objects.create(deployment=deployment, url=router_url)
    collector.collect()
    with httpx.Client(base_url=router_url, timeout=30) as client:
        for i in range(OK_REQUESTS):
            assert client.post("/generate", json={"prompt": f"hello {i}", "max_tokens": 4}).status_code == 200
        for stand_in in cluster.decode:
            stand_in.behavior = "http500"
        assert client.post("/generate", json={"prompt": "fails", "max_tokens": 4}).status_code == 502
    cluster.reset()
    collector.collect()
    return workers


def _values(chart: dict[str, Any], label: str) -> list[float]:
    """The non-null values of the line `label` in a chart read by CHARTS_JS."""
    column = chart["data"][1 + chart["labels"].index(label)]
    return [v for v in column if v is not None]


def _assert_charts(browser: BrowserSession, payload: dict[str, Any], workers: list[Worker], split: str) -> None:
    """The uPlot instances hold, for each chart of chart_specs.CHARTS, the lines the payload gives it
    (router fields; workers; roles, or workers when split per worker), over the payload's window,
    with the values of the payload, and the router and per-worker series have values."""
    charts: dict[str, dict[str, Any]] = browser.page.evaluate(CHARTS_JS)
    assert set(charts) == {c["id"] for c in chart_specs.CHARTS}
    since, now = (datetime.fromisoformat(payload[key]).timestamp() for key in ("since", "now"))
    names = [w["name"] for w in payload["workers"]]
    assert sorted(names) == sorted(collector.worker_name(w) for w in workers)  # the sampled workers, by name
    for spec in chart_specs.CHARTS:
        chart = charts[spec["id"]]
        assert chart["x"] == pytest.approx([since, now], abs=0.01), spec["id"]  # the page's window
        if spec["source"] == "router":
            expected = [payload["router_metrics"][f]["label"] for f in spec["fields"]]
        elif spec["source"] == "worker" or (split == "worker" and spec.get("per_worker")):
            expected = names
        else:
            expected = list(payload["series"])
        assert chart["labels"] == expected, spec["id"]
        assert len({len(column) for column in chart["data"]}) == 1, spec["id"]  # aligned columns

    # Router overhead, client latency and error rate, as the router measured them.
    overhead = charts["router_overhead"]
    for label in ("Dispatch p50", "Dispatch p90"):
        values = _values(overhead, label)
        assert values and all(0 < v < 0.25 for v in values), (label, values)
    assert _values(charts["client_ttft"], "Client TTFT p90")
    errors = _values(charts["error_rate"], "Error rate (failed / all)")
    assert errors == pytest.approx([1 / (OK_REQUESTS + 1)]), errors
    assert _values(charts["rejected"], "Rejected (429)") == [0.0]
    # Where prompts were prefilled: each by a prefill worker (the deployment has no local prefill).
    remote = _values(charts["prefill_where"], "Prefilled by a prefill worker")
    assert remote and remote[0] > 0, remote
    assert _values(charts["prefill_where"], "Prefilled on the decode worker") == [0.0]
    # Per worker: each stand-in took half of its role's requests (round robin; the failed request
    # tried both decode workers), and reported its load.
    share = charts["request_share"]
    for name in names:
        assert _values(share, name) == [pytest.approx(0.5)], name
    load = charts["load"]
    if split == "worker":
        for name in names:
            assert _values(load, name), name
    else:
        seeded = payload["series"]["decode"]["load"]
        assert _values(load, "decode") == pytest.approx([v for v in seeded if v is not None])


# Boxes of the page (and the page itself) whose content is wider than the box, with the excess in px.
OVERFLOW_JS = """() => {
  const wide = [];
  const boxes = document.querySelectorAll('.results, .tabular, fieldset.module, .dash-module');
  for (const el of [document.documentElement, ...boxes]) {
    const excess = el.scrollWidth - el.clientWidth;
    if (excess > 0) wide.push(`${el.tagName.toLowerCase()}.${el.className || el.id}: ${excess}`);
  }
  return wide;
}"""


def test_admin_console_in_chromium(
    browser: BrowserSession, live_server: Any, console: Console, traffic: list[Worker],
    sent_tasks: SentTasks, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
) -> None:
    """Log in, see the node online, read the charts' data (per role, per worker) as it refreshes, edit a
    rule, scale decode +1."""
    page = browser.page
    base = live_server.url
    deployment = console.deployment

    with browser.step("login"):
        page.goto(f"{base}/admin/")
        assert "/admin/login/" in page.url
        page.fill("#id_username", USERNAME)
        page.fill("#id_password", PASSWORD)
        page.click("#login-form [type=submit]")
        page.wait_for_url(f"{base}/admin/")
        assert page.locator("#user-tools").inner_text().upper().startswith(f"WELCOME, {USERNAME.upper()}")

    with browser.step("nodes"):
        page.goto(f"{base}/admin/nodes/node/")
        row = page.locator("#result_list tbody tr", has_text=console.node.name)
        assert row.count() == 1
        badge = row.locator("td.field-live_status span")
        assert badge.inner_text() == "Online"
        assert badge.get_attribute("title") == "Online"  # not the stale-heartbeat variant
        assert row.locator("td.field-worker_count").inner_text() == "1"
        assert "8 CPUs, 35% busy" in row.inner_text()
        page.get_by_text(re.compile(r"Refreshing in \d+s")).wait_for()  # autorefresh.js loaded and running

    with browser.step("lists-fit"):
        # Regression: the workers list cut LAST HEALTH off at 1,400 px and the scaling rules table
        # overflowed the deployment page. At the fixture's 1,400 px nothing scrolls sideways.
        worker = Worker.objects.filter(deployment=deployment).order_by("pk").first()
        assert worker is not None
        for path in ("/admin/inference/worker/", "/admin/nodes/node/",
                     f"/admin/inference/deployment/{deployment.pk}/change/",
                     f"/admin/nodes/node/{console.node.pk}/change/", f"/admin/inference/worker/{worker.pk}/change/"):
            page.goto(f"{base}{path}")
            # The admin scrolls wide tables inside their box (`.results`, inline `.tabular`): a column
            # cut off there is as hidden as one past the window's edge.
            overflow = page.evaluate(OVERFLOW_JS)
            assert not overflow, f"{path} does not fit 1,400 px: {overflow}"
        page.goto(f"{base}/admin/inference/worker/")
        assert page.locator("#result_list tbody tr").count() >= 1

    with browser.step("metrics"):
        page.goto(f"{base}/admin/inference/deployment/{deployment.pk}/change/")
        with page.expect_response(lambda r: "/metrics/data/" in r.url) as first:
            page.locator(".object-tools").get_by_role("link", name="Metrics").click()
        payload = first.value.json()
        assert first.value.ok and payload["series"]["decode"]["t"] and payload["router"]["t"], "metrics data empty"
        page.wait_for_function(f"{STATUS_JS}.startsWith('updated')")
        replicas = " ".join(page.locator("#metrics-replicas").inner_text().split())
        assert replicas == "prefill: 2 desired [1–4] · decode: 1 desired [1–4] · status active"
        assert "seed: prefill load high" in page.locator("#metrics-events tbody").inner_text()
        assert page.locator("#metrics-no-router").count() == 0  # a router is registered
        assert page.locator("#metrics-workers-drawn").is_hidden()  # every worker of the deployment is drawn
        _assert_charts(browser, payload, traffic, "role")
        # Hovering a chart: uPlot's legend reads out both roles' values there.
        plot = page.locator("figure[data-chart=load] .u-over")
        box = plot.bounding_box()
        assert box is not None
        plot.hover(position={"x": box["width"] * 0.6, "y": box["height"] / 2})
        legend = page.locator("figure[data-chart=load] .u-legend")
        assert re.search(r"prefill\s*\d+%", legend.inner_text()) and re.search(r"decode\s*\d+%", legend.inner_text())

    with browser.step("metrics-per-worker"):
        page.select_option("#metrics-split", "worker")
        page.wait_for_function(
            "window.metricsCharts.load.series.slice(1).every((s) => s.label !== 'prefill' && s.label !== 'decode')"
        )
        _assert_charts(browser, payload, traffic, "worker")
        # The page polls: the next refresh comes within its 5-second period, and the charts keep their
        # per-worker lines with the new payload's data.
        refreshes = page.evaluate("document.getElementById('metrics-app').dataset.refreshes")
        with page.expect_response(lambda r: "/metrics/data/" in r.url, timeout=8_000) as second:
            pass
        assert second.value.ok
        page.wait_for_function(f"document.getElementById('metrics-app').dataset.refreshes !== {refreshes!r}")
        _assert_charts(browser, second.value.json(), traffic, "worker")

    rule = console.rule
    with browser.step("rule-edited"):
        # The deployment page lists the rule in words; its own page edits it with the threshold kind's form.
        page.goto(f"{base}/admin/inference/deployment/{deployment.pk}/change/")
        rule_row = page.locator("#rules-group tbody tr", has_text=rule.name)
        assert "decode load above 0.70 for 1 min → +1 decode (cooldown 5 min)" in rule_row.inner_text()
        rule_row.get_by_role("link", name=rule.name).click()
        page.wait_for_url(f"{base}/admin/inference/scalingrule/{rule.pk}/change/")
        assert float(page.input_value("input[name=threshold]")) == 0.7
        page.fill("input[name=threshold]", "0.85")
        page.click("input[name=_save]")
        page.wait_for_url(f"{base}/admin/inference/scalingrule/")
        assert "was changed successfully" in (page.locator(".messagelist").text_content() or "")
    rule.refresh_from_db()
    assert rule.threshold == 0.85
    assert rule.breach_started_at is None  # saved through rule_actions.save_rule: a new condition restarts the timer
    deployment.refresh_from_db()
    assert (deployment.prefill_replicas, deployment.decode_replicas) == (2, 1)
    assert ScaleEvent.objects.filter(deployment=deployment).count() == 1  # the edit changed no replicas
    assert sent_tasks.named("reconcile_deployment") == []  # nor asked the controller for anything
    # The scale action queues scale_deployment_task for the controller, as the REST API does: run it here
    # as the controller would; its reconcile is only recorded (no controller runs here).
    controller = capture(monkeypatch, run_only=(jobs.SCALE_DEPLOYMENT,))

    with browser.step("scaled-decode"):
        page.goto(f"{base}/admin/inference/deployment/")
        page.check(f"#result_list input.action-select[value='{deployment.pk}']")
        page.select_option("select[name=action]", label="Scale decode +1")
        with page.expect_navigation():
            page.click("#changelist-form button[name=index]")
        message = page.locator(".messagelist").text_content() or ""
        # The admin capitalises messages.
        assert f"{deployment.name.capitalize()}: queued: decode 1 → 2;" in message
        row = page.locator("#result_list tbody tr", has_text=deployment.name)
        assert row.locator("td.field-decode").inner_text() == "2 [1–4] · 2 running"
    deployment.refresh_from_db()
    assert deployment.decode_replicas == 2
    event = ScaleEvent.objects.get(deployment=deployment, role="decode")
    assert (event.from_replicas, event.to_replicas, event.source) == (1, 2, "manual")
    assert event.reason == f"admin action decode +1 by {USERNAME}"
    # The scale was queued, then the reconcile enqueued on commit (recorded, not sent).
    assert [kwargs for kwargs, _ in controller.named("scale_deployment_task")] == [
        {"deployment_id": deployment.pk, "role": "decode", "delta": 1, "source": "manual", "reason": event.reason}
    ]
    assert controller.named("reconcile_deployment") == [({"deployment_id": deployment.pk}, None)]

    with browser.step("metrics-after-scale"):
        with page.expect_response(lambda r: "/metrics/data/" in r.url) as data:
            page.goto(f"{base}/admin/inference/deployment/{deployment.pk}/metrics/")
        page.wait_for_function(f"{STATUS_JS}.startsWith('updated')")
        assert "decode: 2 desired [1–4]" in page.locator("#metrics-replicas").inner_text()
        newest = page.locator("#metrics-events tbody tr").first.inner_text()
        assert "decode" in newest and "1 → 2" in newest and "manual" in newest
        _assert_charts(browser, data.value.json(), traffic, "role")
        assert [e["reason"] for e in data.value.json()["events"]][-1] == f"admin action decode +1 by {USERNAME}"

    steps = ["login", "nodes", "lists-fit", "metrics", "metrics-per-worker", "rule-edited", "scaled-decode",
             "metrics-after-scale"]
    assert [path.name for path in browser.screenshots] == [
        f"admin-console-{n:02d}-{name}.png" for n, name in enumerate(steps, 1)
    ]
