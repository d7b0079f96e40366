"""JSON blobs of the node and worker pages (a node's last heartbeat metrics, a worker's last /health) as
readable tables: one row per key, nested objects as nested tables, and each value in its unit (bytes in
GiB/MiB, ratios as percentages, seconds as durations, epoch seconds as timestamps to the second).

The unit is read from the key, as the agents and workers name them: `*_bytes`, `*_ratio`,
`*utilization`/`*usage`/`*_share`/`*hit_rate` (0..1), `*_percent` (0..100), `*_s`, and epoch times
(`*_at`, `time`, `timestamp`, `started`).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from inference.admin.display import format_duration, human_bytes

RATIO_SUFFIXES = ("_ratio", "utilization", "usage", "_share", "hit_rate")
EPOCH_KEYS = ("time", "timestamp", "started", "at")
# Epoch seconds between 2001 and 2286: a number outside is shown as it is.
EPOCH_RANGE = (1e9, 1e10)
MAX_LIST_ITEMS = 20


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def format_value(key: str, value: Any) -> str:
    """One scalar in the unit its key names (module docstring); other values as they are."""
    if value is None:
        return "–"
    if not _is_number(value):
        return str(value)
    name = key.lower()
    number = float(value)
    if name.endswith("_bytes") or name.endswith("bytes_per_s"):
        text = human_bytes(number) if number else "0 B"
        return f"{text}/s" if name.endswith("_per_s") else text
    if name.endswith(RATIO_SUFFIXES):
        return f"{number * 100:.1f} %"
    if name.endswith("_percent") or name.endswith("_pct"):
        return f"{number:.1f} %"
    if (name in EPOCH_KEYS or name.endswith("_at")) and EPOCH_RANGE[0] <= number < EPOCH_RANGE[1]:
        moment = timezone.localtime(datetime.fromtimestamp(number, tz=UTC))
        return moment.strftime("%Y-%m-%d %H:%M:%S")
    if name.endswith("_s") or name.endswith("_seconds"):
        return format_duration(number)
    if isinstance(value, float):
        return f"{number:.4g}"
    return f"{value:,}".replace(",", " ")


def _cell(key: str, value: Any) -> SafeString | str:
    if isinstance(value, Mapping):
        return json_table(value)
    if isinstance(value, Sequence) and not isinstance(value, str):
        items = list(value)
        if items and all(isinstance(item, Mapping) for item in items):
            return format_html_join("", "{}", ((json_table(item),) for item in items[:MAX_LIST_ITEMS]))
        more = f" … (+{len(items) - MAX_LIST_ITEMS})" if len(items) > MAX_LIST_ITEMS else ""
        return ", ".join(format_value(key, item) for item in items[:MAX_LIST_ITEMS]) + more if items else "–"
    return format_value(key, value)


def json_table(data: Any) -> SafeString | str:
    """A JSON object as an HTML table of its keys (sorted) and formatted values; "–" when empty."""
    if not isinstance(data, Mapping) or not data:
        return "–" if not data else str(data)
    rows = format_html_join(
        "", '<tr><th scope="row">{}</th><td>{}</td></tr>', ((key, _cell(str(key), data[key])) for key in sorted(data))
    )
    return format_html('<table class="json-table">{}</table>', rows)
