"""A stacked bar chart of per-minute counts as inline SVG, for the API key usage page (no script needed)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

WIDTH = 720
HEIGHT = 160
_COLORS = {
    "requests": "#417690", "errors": "#ba2121", "rejected": "#e6a117",
    "prompt_tokens": "#6f9fbf", "completion_tokens": "#2d5d7b",
}


def bar_chart(rows: Sequence[dict[str, Any]], series: Sequence[str], title: str) -> SafeString:
    """One bar per minute of `rows` (dicts with `at` and the `series` counts), the series stacked."""
    if not rows:
        return format_html('<p class="usage-empty">{}</p>', f"No {title} recorded in this window.")
    peak = max(sum(int(row[name] or 0) for name in series) for row in rows) or 1
    step = WIDTH / len(rows)
    bars: list[tuple[Any, ...]] = []
    for i, row in enumerate(rows):
        bottom = float(HEIGHT)
        for name in series:
            value = int(row[name] or 0)
            if not value:
                continue
            height = HEIGHT * value / peak
            bottom -= height
            bars.append((f"{i * step:.1f}", f"{bottom:.1f}", f"{max(step - 1, 1):.1f}", f"{height:.1f}",
                         _COLORS.get(name, "#888"), f"{row['at']:%H:%M} {name}: {value:,}"))
    body = format_html_join(
        "", '<rect x="{}" y="{}" width="{}" height="{}" fill="{}"><title>{}</title></rect>', bars
    )
    legend = format_html_join(
        " ", '<span class="usage-key" style="border-color:{}">{}</span>',
        ((_COLORS.get(name, "#888"), name.replace("_", " ")) for name in series),
    )
    return format_html(
        '<figure class="usage-chart" data-series="{}"><figcaption>{} (peak {}) {}</figcaption>'
        '<svg viewBox="0 0 {} {}" width="100%" height="{}" role="img" aria-label="{}">{}</svg></figure>',
        ",".join(series), title, f"{peak:,}", legend, WIDTH, HEIGHT, HEIGHT, title, body,
    )
