"""The admin console in a real browser: log in, node list, live metric charts, rule edit, scale action.

A live Django server (pytest-django's `live_server`, static files served) runs against the test
database; Debian's headless Chromium drives it through playwright-python. Celery messages are
recorded instead of sent (tests.support.celery_capture), so no controller is needed and nothing is
left in a broker queue. Each step saves a screenshot (see tests/browser/conftest.py for where).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone

from inference import actions
from inference.models import Deployment, ScaleEvent, ScalingRule
from nodes.models import Node
from tests.browser.conftest import CHROMIUM, SKIP_REASON, BrowserSession
from tests.support.celery_capture import SentTasks, sent_tasks  # noqa: F401  (fixture)
from tests.support.control_plane import make_deployment, make_model, make_node, make_worker

pytestmark = [
    pytest.mark.skipif(not CHROMIUM.exists(), reason=SKIP_REASON),
    pytest.mark.timeout(120),
]

USERNAME = "root"
PASSWORD = "browser-test-password"
SAMPLES = 40  # per role, one every SAMPLE_EVERY: ten minutes of the page's default 15-minute window
SAMPLE_EVERY = timedelta(seconds=15)
# The colours metrics.js draws with (prefill and decode lines, scale-event markers).
COLOURS = {"prefill": (0x15, 0x65, 0xC0), "decode": (0xE6, 0x51, 0x00), "event": (0x7B, 0x1F, 0xA2)}
# The metrics page's status line: "updated HH:MM:SS, every 5s" once a refresh has been drawn.
STATUS_JS = "document.getElementById('metrics-status').textContent"

# Per chart, for each of the painted colours: pixel count and horizontal extent (min/max x) on the canvas.
CANVAS_PIXELS_JS = """
(colours) => Array.from(document.querySelectorAll('canvas[data-field]')).map((canvas) => {
  const data = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
  const found = {};
  for (const name of Object.keys(colours)) { found[name] = {count: 0, minX: Infinity, maxX: -Infinity}; }
  let painted = 0;
  for (let i = 0; i < data.length; i += 4) {
    if (data[i + 3] === 0) { continue; }
    painted += 1;
    if (data[i + 3] < 200) { continue; }
    const x = (i / 4) % canvas.width;
    for (const [name, [r, g, b]] of Object.entries(colours)) {
      if (Math.abs(data[i] - r) + Math.abs(data[i + 1] - g) + Math.abs(data[i + 2] - b) < 60) {
        const f = found[name];
        f.count += 1; f.minX = Math.min(f.minX, x); f.maxX = Math.max(f.maxX, x);
      }
    }
  }
  return {field: canvas.dataset.field, width: canvas.width, painted: painted, found: found};
})
"""

# Per chart, the width in pixels of each scale event's label: the horizontal extent of purple pixels in
# the label band at the top of the plot within 30 px of its dashed line (the line's own columns left
# out). A label clipped by the canvas edge is narrower than a whole one.
EVENT_LABELS_JS = """
([r, g, b]) => Array.from(document.querySelectorAll('canvas[data-field]')).map((canvas) => {
  const w = canvas.width, h = canvas.height;
  const data = canvas.getContext('2d').getImageData(0, 0, w, h).data;
  const pixel = (x, y) => data.slice(4 * (y * w + x), 4 * (y * w + x) + 4);
  const isMarker = (x, y) => {
    const p = pixel(x, y);
    return p[3] > 200 && Math.abs(p[0] - r) + Math.abs(p[1] - g) + Math.abs(p[2] - b) < 60;
  };
  const isPurple = (x, y) => {  // label text, antialiased against its halo
    const p = pixel(x, y);
    return p[3] > 100 && p[2] - p[1] > 40 && p[0] - p[1] > 25;
  };
  const lines = [];
  for (let x = 0; x < w; x += 1) {
    let n = 0;
    for (let y = 30; y < h - 30; y += 1) { if (isMarker(x, y)) { n += 1; } }
    if (n > (h - 60) / 4) { lines.push(x); }
  }
  return lines.map((lx) => {
    let minX = Infinity, maxX = -Infinity;
    for (let x = Math.max(lx - 30, 0); x < Math.min(lx + 31, w); x += 1) {
      if (Math.abs(x - lx) <= 1) { continue; }
      for (let y = 8; y < 26; y += 1) {
        if (isPurple(x, y)) { minX = Math.min(minX, x); maxX = Math.max(maxX, x); }
      }
    }
    return maxX >= minX ? maxX - minX + 1 : 0;
  });
})
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
    """Prefill's curve: it starts and ends near `high`, where the decode curve is near its `low`, so
    neither line hides the other's ends (the checks below measure where each line starts and ends)."""
    return _wave(i, low, high, math.pi / 2)


def _decode(i: int, low: float, high: float) -> float:
    """Decode's curve: it starts and ends near `low`."""
    return _wave(i, low, high, -math.pi / 2)


@pytest.fixture
def console(sent_tasks: SentTasks, settings: Any) -> Console:  # noqa: F811
    """A superuser; an online node running a prefill worker; a deployment with a threshold rule, a scale
    event five minutes ago and ten minutes of metric samples for both roles.

    Passwords use a fast hasher: the default one costs a second of CPU per login on a busy machine.
    """
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    get_user_model().objects.create_superuser(USERNAME, "root@example.com", PASSWORD)
    node = make_node(name="gpu-node-1", last_heartbeat=timezone.now(),
                     last_metrics={"cpu_utilization": 0.35, "memory_used_bytes": 6 * 2**30})
    deployment = make_deployment(name="chat", model=make_model(name="smollm2-135m"))
    make_worker(deployment, node, role="prefill", last_seen=timezone.now())
    rule = ScalingRule.objects.create(
        deployment=deployment, name="decode-load-high", kind="threshold", role="decode", threshold=0.7,
        duration_s=60, cooldown_s=300, step=1, breach_started_at=timezone.now(),
    )
    event = actions.scale_deployment(deployment, "prefill", 2, source="threshold", reason="seed: prefill load high")
    assert event is not None
    now = timezone.now()
    ScaleEvent.objects.filter(pk=event.pk).update(created_at=now - timedelta(minutes=5))
    for i in range(SAMPLES):
        at = now - (SAMPLES - 1 - i) * SAMPLE_EVERY
        # Prefill has no ITL and decode no TTFT; the decode workers run on CPU (no GPU utilisation).
        actions.record_metric_sample(
            deployment, "prefill", at=at, workers=2 if at >= now - timedelta(minutes=5) else 1,
            load=_prefill(i, 0.3, 0.9), ttft_s=_prefill(i, 0.08, 0.25), throughput_tps=_prefill(i, 400, 900),
            queue_depth=_prefill(i, 0.5, 6), running=_prefill(i, 1, 4), kv_usage=0.0,
            cpu_utilization=_prefill(i, 0.2, 0.5), gpu_utilization=_prefill(i, 0.4, 0.95),
        )
        actions.record_metric_sample(
            deployment, "decode", at=at, workers=1, load=_decode(i, 0.2, 0.8), itl_s=_decode(i, 0.012, 0.03),
            throughput_tps=_decode(i, 150, 350), queue_depth=_decode(i, 0, 3), running=_decode(i, 2, 8),
            kv_usage=_decode(i, 0.1, 0.6), cpu_utilization=_decode(i, 0.3, 0.85),
        )
    sent_tasks.clear()
    deployment.refresh_from_db()
    return Console(deployment=deployment, node=node, rule=rule)


def _x_on_canvas(t_ms: float, payload: dict[str, Any], width: int) -> float:
    """Where metrics.js puts time `t_ms` on a canvas `width` pixels wide (its PAD: 58 px left, 10 right)."""
    since, now = (datetime.fromisoformat(payload[key]).timestamp() * 1000 for key in ("since", "now"))
    return 58 + (t_ms - since) / (now - since) * (width - 58 - 10)


def _assert_charts_drawn(browser: BrowserSession, payload: dict[str, Any]) -> None:
    """Each chart shows the seeded scale event and, for each role with values of its metric in
    `payload` (the JSON the page drew), a line from that role's first to its last sample's time."""
    charts: list[dict[str, Any]] = browser.page.evaluate(CANVAS_PIXELS_JS, COLOURS)
    fields = [chart["field"] for chart in charts]
    assert set(fields) == set(actions.SERIES_FIELDS) - {"running"} and len(fields) == len(set(fields)), fields
    for chart in charts:
        field, width, found = chart["field"], chart["width"], chart["found"]
        assert chart["painted"] > 2000, f"{field}: canvas nearly blank ({chart['painted']} pixels)"
        assert found["event"]["count"] >= 20, f"{field}: no scale-event marker: {found['event']}"
        for role in ("prefill", "decode"):
            series = payload["series"][role]
            times = [t for t, v in zip(series["t"], series[field], strict=True) if v is not None]
            line = found[role]
            if not times:
                assert line["count"] == 0, f"{field}: a {role} line without {role} data: {line}"
                continue
            assert line["count"] >= 100, f"{field}: {role} line missing: {line}"
            first, last = (_x_on_canvas(t, payload, width) for t in (times[0], times[-1]))
            assert abs(line["maxX"] - last) <= 4, f"{field}: {role} line ends at x={line['maxX']}, not {last:.0f}"
            # Both roles have 1 worker until the prefill scale-up: there decode's line covers prefill's.
            if (field, role) != ("workers", "prefill"):
                assert abs(line["minX"] - first) <= 4, f"{field}: {role} starts at x={line['minX']}, not {first:.0f}"


def test_admin_console_in_chromium(
    browser: BrowserSession, live_server: Any, console: Console, sent_tasks: SentTasks  # noqa: F811
) -> None:
    """Log in, see the node online, watch the charts draw and refresh, edit a rule, scale decode +1."""
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

    with browser.step("metrics"):
        page.goto(f"{base}/admin/inference/deployment/{deployment.pk}/change/")
        with page.expect_response(lambda r: "/metrics/data/" in r.url) as first:
            page.locator(".object-tools").get_by_role("link", name="Metrics").click()
        assert first.value.ok and first.value.json()["series"]["decode"]["t"], "metrics data empty"
        page.wait_for_function(f"{STATUS_JS}.startsWith('updated')")
        replicas = " ".join(page.locator("#metrics-replicas").inner_text().split())
        assert replicas == "prefill: 2 desired [1–4] · decode: 1 desired [1–4] · status active"
        assert "seed: prefill load high" in page.locator("#metrics-events tbody").inner_text()
        _assert_charts_drawn(browser, first.value.json())
        # The page polls: the next refresh comes within its 5-second period and draws again (the status
        # then names a later second).
        status = page.evaluate(STATUS_JS)
        with page.expect_response(lambda r: "/metrics/data/" in r.url, timeout=8_000) as second:
            pass
        assert second.value.ok
        page.wait_for_function(f"{STATUS_JS} !== {status!r}")
        _assert_charts_drawn(browser, second.value.json())
        # Hovering a chart reads out both roles' values at that time.
        load_chart = page.locator("canvas[data-field=load]")
        box = load_chart.bounding_box()
        assert box is not None
        load_chart.hover(position={"x": box["width"] * 0.75, "y": box["height"] / 2})
        tooltip = page.locator("figure:has(canvas[data-field=load]) .metrics-tooltip")
        assert re.fullmatch(r"\d\d:\d\d:\d\d · prefill: \d+% · decode: \d+%", " ".join(tooltip.inner_text().split()))

    rule = console.rule
    with browser.step("rule-edited"):
        page.goto(f"{base}/admin/inference/deployment/{deployment.pk}/change/")
        assert page.input_value("input[name=rules-0-id]") == str(rule.pk)
        assert float(page.input_value("input[name=rules-0-threshold]")) == 0.7
        page.fill("input[name=rules-0-threshold]", "0.85")
        page.click("input[name=_save]")
        page.wait_for_url(f"{base}/admin/inference/deployment/")
        assert "was changed successfully" in (page.locator(".messagelist").text_content() or "")
    rule.refresh_from_db()
    assert rule.threshold == 0.85
    assert rule.breach_started_at is None  # saved through actions.save_rule: a new condition restarts the timer
    deployment.refresh_from_db()
    assert (deployment.prefill_replicas, deployment.decode_replicas) == (2, 1)
    assert ScaleEvent.objects.filter(deployment=deployment).count() == 1  # the edit changed no replicas
    assert sent_tasks.named("reconcile_deployment") == [({"deployment_id": deployment.pk}, None)]  # any save
    sent_tasks.clear()

    with browser.step("scaled-decode"):
        page.goto(f"{base}/admin/inference/deployment/")
        page.check(f"#result_list input.action-select[value='{deployment.pk}']")
        page.select_option("select[name=action]", label="Scale decode +1")
        with page.expect_navigation():
            page.click("#changelist-form button[name=index]")
        message = page.locator(".messagelist").text_content() or ""
        assert f"{deployment.name.capitalize()}: decode 1 → 2." in message  # the admin capitalises messages
        row = page.locator("#result_list tbody tr", has_text=deployment.name)
        assert row.locator("td.field-decode").inner_text() == "2 [1–4] · 0 running"
    deployment.refresh_from_db()
    assert deployment.decode_replicas == 2
    event = ScaleEvent.objects.get(deployment=deployment, role="decode")
    assert (event.from_replicas, event.to_replicas, event.source) == (1, 2, "manual")
    assert event.reason == f"admin action decode +1 by {USERNAME}"
    # The reconcile was enqueued on commit (recorded, not sent: no controller runs here).
    assert sent_tasks.named("reconcile_deployment") == [({"deployment_id": deployment.pk}, None)]

    with browser.step("metrics-after-scale"):
        with page.expect_response(lambda r: "/metrics/data/" in r.url) as data:
            page.goto(f"{base}/admin/inference/deployment/{deployment.pk}/metrics/")
        page.wait_for_function(f"{STATUS_JS}.startsWith('updated')")
        assert "decode: 2 desired [1–4]" in page.locator("#metrics-replicas").inner_text()
        newest = page.locator("#metrics-events tbody tr").first.inner_text()
        assert "decode" in newest and "1 → 2" in newest and "manual" in newest
        _assert_charts_drawn(browser, data.value.json())
        # The new event sits at the right edge: its label ("d→2") is drawn whole (on the line's left),
        # as wide as the older one's ("p→2").
        for widths in browser.page.evaluate(EVENT_LABELS_JS, COLOURS["event"]):
            assert len(widths) == 2 and min(widths) >= 12 and min(widths) >= 0.6 * max(widths), widths

    steps = ["login", "nodes", "metrics", "rule-edited", "scaled-decode", "metrics-after-scale"]
    assert [path.name for path in browser.screenshots] == [
        f"admin-console-{n:02d}-{name}.png" for n, name in enumerate(steps, 1)
    ]
