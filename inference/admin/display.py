"""Display helpers shared by the admin pages: status badges, ages, health and resource summaries, CPU
ranges, the list stylesheet, and the read-only base of the history pages.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from django.conf import settings
from django.contrib import admin, messages
from django.http import HttpRequest
from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.text import Truncator

from inference.controller.pinning import CpuOverlap

# The stylesheet that keeps the node and worker lists (and the deployment page's inlines) within the
# window: compact cells, long text cut with an ellipsis and shown whole on hover.
LIST_CSS = "inference/admin_lists.css"
# Characters of a worker's last /health JSON shown in the hover title of its list cell.
HEALTH_TITLE_CHARS = 1500

# Colours of the status badges (the admin's own palette: green, amber, red, grey).
_STATUS_COLOURS: dict[str, str] = {
    # Plain values as keys: NodeStatus and WorkerStatus share some ("draining").
    "online": "#2e7d32",
    "unreachable": "#b26a00",  # agent silent; its workers serve while their /health answers
    "offline": "#c62828",
    "running": "#2e7d32",
    "pending": "#607d8b",
    "starting": "#1565c0",
    "unhealthy": "#c62828",
    "draining": "#b26a00",
    "stopping": "#b26a00",
    "stopped": "#757575",
    "failed": "#c62828",
}


def heartbeat_timeout_s() -> float:
    """Seconds without a heartbeat after which a node's status is shown as stale."""
    return float(getattr(settings, "NODE_HEARTBEAT_TIMEOUT_S", 15.0))


def status_badge(value: str, label: str, *, stale: bool = False) -> SafeString:
    """A coloured badge for a status; a stale one (agent silent) is struck through and greyed."""
    colour = "#9e9e9e" if stale else _STATUS_COLOURS.get(value, "#607d8b")
    title = "no recent heartbeat: the agent may be down" if stale else label
    style = "text-decoration:line-through;" if stale else ""
    return format_html(
        '<span title="{}" style="background:{};color:#fff;padding:1px 6px;border-radius:8px;{}">{}</span>',
        title,
        colour,
        style,
        label,
    )


def age_text(moment: datetime | None, *, stale_after_s: float | None = None) -> SafeString | str:
    """'12s ago' style age of a timestamp, red once older than `stale_after_s`."""
    if moment is None:
        return "never"
    seconds = max((timezone.now() - moment).total_seconds(), 0.0)
    if seconds < 120:
        text = f"{seconds:.0f}s ago"
    elif seconds < 7200:
        text = f"{seconds / 60:.0f}m ago"
    elif seconds < 172800:
        text = f"{seconds / 3600:.0f}h ago"
    else:
        text = f"{seconds / 86400:.0f}d ago"
    if stale_after_s is not None and seconds > stale_after_s:
        return format_html('<span style="color:#c62828;font-weight:bold">{}</span>', text)
    return text


def first_number(data: Mapping[str, Any] | None, *keys: str) -> float | None:
    """The first of `keys` in `data` holding a number (agents and workers name metrics variously)."""
    if not isinstance(data, Mapping):
        return None
    for key in keys:
        value = data.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    return None


def percent(value: float | None) -> str:
    """A ratio (0..1) or a percentage (1..100) shown as a percentage."""
    if value is None:
        return "–"
    return f"{value * 100:.0f}%" if value <= 1.0 else f"{value:.0f}%"


def human_bytes(count: float | None) -> str:
    """Bytes in binary units (GiB, MiB, ...)."""
    if not count:
        return "–"
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{value:.0f} B"
        value /= 1024
    return f"{value:.1f} TiB"


def format_duration(seconds: float | None) -> str:
    """Seconds in the largest fitting units: "850 ms", "12.4 s", "3 min 05 s", "2 h 10 min" ("–" if None)."""
    if seconds is None:
        return "–"
    value = float(seconds)
    if value < 1:
        return f"{value * 1000:.0f} ms"
    if value < 60:
        return f"{value:.1f} s"
    if value < 3600:
        minutes, rest = divmod(round(value), 60)
        return f"{minutes} min {rest:02d} s"
    hours, rest = divmod(round(value) // 60, 60)
    return f"{hours} h {rest:02d} min"


def event_outcome(event: Any) -> SafeString:
    """A ScaleEvent's outcome as a badge: red "refused" (no node could take the workers) or "applied"."""
    if event.refused:
        return format_html(
            '<span class="event-refused" title="{}" style="background:#c62828;color:#fff;padding:1px 6px;'
            'border-radius:8px">refused</span>', "the controller could not place the workers: see the reason",
        )
    return format_html('<span class="event-applied">{}</span>', "applied")


def short_reason(note: str, limit: int = 48) -> str:
    """The headline of a reason for a list column: the text before its first parenthesis, cut at a word
    with an ellipsis past `limit` characters (the full text goes in the cell's title). A plain
    character cut made "No module named 'pyverbs'" read "No module named ", losing the name."""
    headline = note.split(" (", 1)[0].strip() or note.strip()
    return Truncator(headline).chars(limit)


def health_summary(health: Mapping[str, Any] | None) -> str:
    """One line from a worker's last /health answer: status, queue, running, KV usage, CPU/GPU."""
    if not isinstance(health, Mapping) or not health:
        return "–"
    parts = [str(health.get("status", "?"))]
    for key, label in (("queue_depth", "queue"), ("running", "running")):
        value = first_number(health, key)
        if value is not None:
            parts.append(f"{label} {value:g}")
    kv = first_number(health, "kv_usage")
    if kv is not None:
        parts.append(f"KV {percent(kv)}")
    gpu = first_number(health, "gpu_utilization")
    cpu = first_number(health, "cpu_utilization")
    if gpu is not None:
        parts.append(f"GPU {percent(gpu)}")
    elif cpu is not None:
        parts.append(f"CPU {percent(cpu)}")
    return " · ".join(parts)


def health_title(health: Mapping[str, Any] | None) -> str:
    """The whole last /health answer as JSON for a hover title, cut at HEALTH_TITLE_CHARS."""
    if not isinstance(health, Mapping) or not health:
        return ""
    text = json.dumps(health, sort_keys=True, default=str)
    return text if len(text) <= HEALTH_TITLE_CHARS else text[:HEALTH_TITLE_CHARS] + "…"


def cpu_ranges(cpu_ids: list[Any] | None) -> str:
    """CPU ids as compact ranges: [0, 1, 2, 5] -> "0-2,5" ("–" when not pinned)."""
    ids = sorted({int(c) for c in cpu_ids or [] if isinstance(c, int | str) and str(c).lstrip("-").isdigit()})
    if not ids:
        return "–"
    parts: list[str] = []
    start = prev = ids[0]
    for cpu in [*ids[1:], None]:
        if cpu is not None and cpu == prev + 1:
            prev = cpu
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if cpu is not None:
            start = prev = cpu
    return ",".join(parts)


def warn_overlaps(model_admin: admin.ModelAdmin, request: HttpRequest, overlaps: list[CpuOverlap]) -> None:
    """One admin warning per pair of workers pinned to shared CPUs."""
    for overlap in overlaps:
        model_admin.message_user(request, f"CPU pinning overlaps: {overlap.describe()}.", messages.WARNING)


class ReadOnlyAdmin(admin.ModelAdmin):
    """History the platform records: browsable, never typed in or edited."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        """Recorded by the platform only."""
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        """History is not edited."""
        return False
