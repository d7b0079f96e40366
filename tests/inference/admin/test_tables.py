"""Node and worker pages: JSON blobs as tables in units, memory in binary units, the worker page read-only."""
from __future__ import annotations

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from inference.admin.tables import format_value, json_table
from tests.support.control_plane import make_deployment, make_node, make_worker

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize(
    ("key", "value", "text"),
    [
        ("rss_bytes", 25276203008, "23.5 GiB"),
        ("gpu_memory_bytes", 0, "0 B"),
        ("kv_transfer_bytes_per_s", 1.4 * 2**20, "1.4 MiB/s"),
        ("kv_usage", 0.125, "12.5 %"),
        ("cpu_utilization", 1.0, "100.0 %"),
        ("memory_percent", 41.25, "41.2 %"),
        ("ttft_s", 0.0123, "12 ms"),
        ("uptime_s", 3725, "1 h 02 min"),
        ("time", 1764806400.25, "2025-12-04 00:00:00"),  # settings.TIME_ZONE is UTC
        ("started_at", 12.0, "12"),  # not an epoch time: shown as it is
        ("running", 3, "3"),
        ("tokens", 1234567, "1 234 567"),
        ("p90", 0.123456789, "0.1235"),
        ("status", "healthy", "healthy"),
        ("anything", None, "–"),
    ],
)
def test_values_are_shown_in_the_unit_their_key_names(key: str, value: object, text: str) -> None:
    assert format_value(key, value) == text


def test_nested_objects_are_nested_tables_and_text_is_escaped() -> None:
    html = str(json_table({"workers": {"7": {"rss_bytes": 2**30}}, "note": "<script>", "load_avg": [0.5, 0.25]}))
    assert html.count('<table class="json-table">') == 3
    assert "<th scope=\"row\">rss_bytes</th><td>1.0 GiB</td>" in html
    assert "&lt;script&gt;" in html and "<script>" not in html
    assert "<td>0.5, 0.25</td>" in html
    assert json_table({}) == "–"


def test_node_and_worker_pages_show_tables_and_the_worker_page_has_no_save(client_root: Client) -> None:
    node = make_node(last_heartbeat=timezone.now(), memory_bytes=16 * 2**30,
                     last_metrics={"cpu_utilization": 0.35, "memory_used_bytes": 6 * 2**30})
    worker = make_worker(make_deployment(), node, last_health={"status": "healthy", "kv_usage": 0.25, "running": 2})
    node_page = client_root.get(reverse("admin:nodes_node_change", args=[node.pk])).content.decode()
    assert "16.0 GiB (17 179 869 184 bytes)" in node_page
    assert "<td>35.0 %</td>" in node_page and "<td>6.0 GiB</td>" in node_page
    assert 'name="_save"' in node_page  # labels and ports stay editable
    worker_page = client_root.get(reverse("admin:inference_worker_change", args=[worker.pk])).content.decode()
    assert "<td>25.0 %</td>" in worker_page and "<td>healthy</td>" in worker_page
    assert 'name="_save"' not in worker_page and "View worker" in worker_page
